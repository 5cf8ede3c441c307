"""Where a run's time goes: a timeline of its first minutes, from what the run folder already records.

- engines: one lane per engine, from generation.jsonl (one record per engine call, written as the call
  ends at `t`): waiting at the gate and for prompts, loading weights (`weights_s`, when recorded),
  generating, storing + sending, laid back to back so the call ends at `t`;
- the learner: one lane from metrics.jsonl (one record per version, written as it ends at `t`): waiting
  for groups (`collect_s`), computing (`step_s`), pushing weights (`push_s`), and the rest of `version_s`
  (checkpoints, ledger) as "other".

Gaps between spans are time the lane recorded nothing for. Times are seconds since the run started.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.telemetry import Panel
from stages.runfiles import read_generation

HORIZON_S = 180.0  # the timeline shows at most the run's first three minutes

ENGINE_PHASES = (("waiting", ("gate_s", "prompts_s")), ("loading weights", ("weights_s",)),
                 ("generating", ("gen_s",)), ("storing + sending", ("put_s", "send_s")))
LEARNER_PHASES = (("waiting", ("collect_s",)), ("computing", ("step_s",)), ("pushing weights", ("push_s",)))

Span = tuple[float, float, str]


def _spans(end: float, phases: Sequence[tuple[str, float]]) -> list[Span]:
    """Phases laid back to back so that the last one ends at `end`; empty phases left out."""
    start = end - sum(duration for _, duration in phases)
    spans = []
    for state, duration in phases:
        if duration > 0:
            spans.append((start, duration, state))
        start += duration
    return spans


def _phases(record: Mapping[str, Any], named: Sequence[tuple[str, Sequence[str]]]) -> list[tuple[str, float]]:
    return [(state, sum(float(record.get(key) or 0.0) for key in keys)) for state, keys in named]


def engine_lanes(calls: Sequence[Mapping[str, Any]]) -> dict[str, list[Span]]:
    lanes: dict[str, list[Span]] = {}
    for call in calls:
        if "t" in call:
            lanes.setdefault(f"engine {call.get('engine', '?')}", []).extend(
                _spans(float(call["t"]), _phases(call, ENGINE_PHASES)))
    return dict(sorted(lanes.items()))


def learner_lane(records: Sequence[Mapping[str, Any]]) -> list[Span]:
    spans: list[Span] = []
    for record in records:
        if "t" not in record or "version_s" not in record:
            continue
        phases = _phases(record, LEARNER_PHASES)
        phases.append(("other", max(0.0, float(record["version_s"]) - sum(d for _, d in phases))))
        spans.extend(_spans(float(record["t"]), phases))
    return spans


def timeline_panel(run_dir: Path | str | None, records: Sequence[Mapping[str, Any]],
                   horizon_s: float = HORIZON_S) -> Panel | None:
    """The timeline of the run's first `horizon_s` seconds (None when nothing was recorded)."""
    lanes = engine_lanes(read_generation(run_dir))
    lanes["learner"] = learner_lane(records)
    ends = [start + duration for spans in lanes.values() for start, duration, _ in spans]
    if not ends:
        return None
    until = min(max(ends), horizon_s)
    shown = {lane: [s for s in spans if s[0] < until] for lane, spans in lanes.items()}
    return Panel(f"where the time goes: the first {until:.3g} s", "timeline", lanes=shown, until=until)
