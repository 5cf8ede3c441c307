"""Bias accounting for GRPO runs: what was trained on vs what was thrown away, by response length
and reward.

Dropping stale groups quietly biases training (long responses take longer, so they are the ones
that go stale; tinker-cookbook PR #822). The ledger (pipeline.ledger) keys every settled sample's
values by its outcome (`trained`, `dropped:stale`, `dropped:filtered`, `regenerated:stale`, ...);
here those values become, per learner step, one entry per outcome:

    {"n": samples, "length_mean": ..., "reward_mean": ..., "length": histogram, "reward": histogram}

A sample some of whose tokens a preempted engine generated and another continued from (stages.rollout.relay)
carries `carried`; an outcome's entry then sums them as `carried_tokens`.

Histograms are sparse and on fixed bins (pipeline.histograms): response length in tokens on
powers of two (0, 1, 2-3, 4-7, ...), reward in bins of 0.1. So per-step entries add up to the run's
(`run_outcomes`), which the summary reports and the report plots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.histograms import Bins, merge
from pipeline.telemetry import Panel

BINS: dict[str, Bins] = {"length": Bins(log2=True), "reward": Bins(width=0.1)}
TITLES = {"length": "response length (tokens, bins 0, 1, 2-3, 4-7 ...)", "reward": "reward (bins of 0.1)"}


def step_outcomes(settled: Mapping[str, Mapping[str, Sequence[float]]]) -> dict[str, dict[str, Any]]:
    """One step's entry per outcome, from `ledger.take_settled()` (outcomes without values are skipped)."""
    entries: dict[str, dict[str, Any]] = {}
    for outcome, named in sorted(settled.items()):
        n = max((len(values) for values in named.values()), default=0)
        if not n:
            continue
        entry: dict[str, Any] = {"n": n}
        for name, bins in BINS.items():
            values = named.get(name)
            if values:
                entry[f"{name}_mean"] = round(sum(values) / len(values), 4)
                entry[name] = bins.count(values)
        if named.get("carried"):
            entry["carried_tokens"] = int(sum(named["carried"]))
        entries[outcome] = entry
    return entries


def run_outcomes(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The sum over a run's metric records of their per-step entries (means weighted by samples)."""
    totals: dict[str, dict[str, Any]] = {}
    for record in records:
        for outcome, entry in (record.get("outcomes") or {}).items():
            total = totals.setdefault(outcome, {"n": 0})
            total["n"] += entry["n"]
            if "carried_tokens" in entry:
                total["carried_tokens"] = total.get("carried_tokens", 0) + entry["carried_tokens"]
            for name in BINS:
                if name in entry:
                    total[f"_{name}_sum"] = total.get(f"_{name}_sum", 0.0) + entry[f"{name}_mean"] * entry["n"]
                    total[name] = merge(total.get(name, {}), entry[name])
    for total in totals.values():
        for name in BINS:
            if f"_{name}_sum" in total:
                total[f"{name}_mean"] = round(total.pop(f"_{name}_sum") / total["n"], 4)
    return dict(sorted(totals.items()))


def outcome_panels(records: Sequence[Mapping[str, Any]]) -> list[Panel]:
    """One report panel per value: its distribution for each outcome, as fractions of that outcome; none
    when every sample was trained (there is nothing to compare)."""
    outcomes = run_outcomes(records)
    if set(outcomes) <= {"trained"}:
        return []
    return [
        Panel(
            f"trained vs dropped: {TITLES[name]}",
            "hist",
            counts={f"{outcome} (n={entry['n']})": entry[name] for outcome, entry in outcomes.items() if name in entry},
        )
        for name in BINS
    ]
