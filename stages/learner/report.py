"""What the learner stage tells the run about itself: the summary's figures, the progress line's fields
and the report's panels, all from its metric records and the run folder (`stages.runfiles`)."""

from __future__ import annotations

import json
from collections import Counter, deque
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.events import EVENTS_FILE
from pipeline.telemetry import Panel, sliding_rate
from stages.learner.bias import outcome_panels, run_outcomes
from stages.learner.timeline import timeline_panel
from stages.runfiles import read_evaluations


def summary(records: list[dict], run_dir: Path | None = None) -> dict[str, Any]:
    """reward_start / reward_end: mean train reward of the first / last few steps (a quarter of the run,
    at most 5); max_staleness_trained: over every trained group; outcomes: response length and reward of
    the samples trained vs dropped (stages.learner.bias); eval: the first and last evaluation, each tagged
    with the weight version it measured, when the run evaluated."""
    window = max(1, min(5, len(records) // 4))
    mean = lambda rows: round(float(np.mean([r["reward"] for r in rows])), 4) if rows else None  # noqa: E731
    evaluations = read_evaluations(run_dir)
    return {
        "reward_start": mean(records[:window]),
        "reward_end": mean(records[-window:]),
        "max_staleness_trained": max((r["staleness_max"] for r in records), default=None),
        "outcomes": run_outcomes(records),
        **({"eval": {"first": evaluations[0], "last": evaluations[-1]}} if evaluations else {}),
        "learner_restarts": learner_restarts(run_dir),
    }


def learner_restarts(run_dir: Path | None) -> list[dict[str, Any]]:
    """Every restart of the learner's rank group in the run (`stages.learner.restart`), in order: its cause,
    the checkpoint's version, the version it happened at, the versions and trainings rolled back, its seconds."""
    path = Path(run_dir) / EVENTS_FILE if run_dir is not None else None
    if path is None or not path.is_file():
        return []
    events = (json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    keep = ("restart", "cause", "checkpoint", "restored_version", "at_version", "rolled_back_versions",
            "rolled_back_trainings", "seconds")
    return [{k: e.get(k) for k in keep} for e in events if e.get("kind") == "learner.restart"]


class CollapseWatch:
    """Reports `learner.entropy_collapse` (once per run) when entropy is below `warn_entropy_below` while the
    trailing mean reward (last `warn_window` versions) is still below `warn_reward_below`: the policy stopped
    exploring before it learned the task."""

    def __init__(self, spec: Any, ctx: Any) -> None:
        self.spec, self.ctx = spec, ctx
        self.rewards: deque[float] = deque(maxlen=spec.warn_window)
        self.warned = False

    def see(self, version: int, reward: float, entropy: float) -> None:
        spec = self.spec
        self.rewards.append(reward)
        trailing = float(np.mean(self.rewards))
        if not self.warned and entropy < spec.warn_entropy_below and trailing < spec.warn_reward_below:
            self.warned = True
            self.ctx.event("learner.entropy_collapse", version=version, entropy=round(entropy, 4),
                           trailing_reward=round(trailing, 4))


def progress(last: dict | None) -> dict[str, Any]:
    if not last:
        return {}
    return {"reward": last["reward"], "staleness": last["staleness_mean"], "samples/s": last["samples_per_s"]}


def report_panels(records: list[dict], run_dir: Path | None = None) -> list[Panel]:
    """Reward, staleness (integer bins), throughput over a sliding window, the learner's time per
    version, eval metrics (`eval...` keys), the filtered fraction (when anything was filtered), trained
    vs dropped (when anything was dropped) and the timeline of the first minutes (stages.learner.timeline)."""
    stale = Counter(s for r in records for s in r.get("staleness_hist", []))
    evaluations = read_evaluations(run_dir)
    evals = {key: ([e["version"] for e in evaluations], [e[key] for e in evaluations])
             for key in ("eval/reward_mean", "eval/pass_rate")}
    timeline = timeline_panel(run_dir, records)
    return [
        Panel("mean reward per step", "line", x="version", y=["reward"]),
        Panel("staleness of trained groups", "hist", xlabel="staleness (versions behind the learner)",
              counts={"trained groups": {str(k): stale[k] for k in range(max(stale, default=-1) + 1)}}),
        throughput_panel(records),
        Panel("learner time per version (s)", "line", x="version",
              y=["version_s", "step_s", "collect_s", "push_s"]),
        *([Panel("eval at the version measured", "line", series=evals)] if evaluations else []),
        *([Panel("groups without signal: filtered fraction", "line", x="version", y=["filtered_frac"])]
          if any(r.get("filtered_frac") for r in records) else []),
        *outcome_panels(records),
        *([timeline] if timeline is not None else []),
    ]


def throughput_panel(records: list[dict]) -> Panel:
    """Trained samples per second over a sliding window (a tenth of the run, at most 60 s): a stall
    shows as a dip, which a cumulative average hides."""
    rows = [r for r in records if "t" in r and "trained" in (r.get("outcomes") or {})]
    span = rows[-1]["t"] if rows else 0.0
    window_s = min(60.0, span / 10) or 1.0
    ts = [r["t"] for r in rows]
    rates = sliding_rate(ts, [r["outcomes"]["trained"]["n"] for r in rows], window_s)
    return Panel(f"throughput: trained samples/s over the last {window_s:.2g} s", "line",
                 series={"samples/s": (ts, rates)}, xlabel="seconds since the run started")
