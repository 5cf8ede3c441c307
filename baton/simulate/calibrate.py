"""Calibration from a run folder: a real run's per-stage costs (`MeasuredCosts`) and its own steady-state
figures, which the simulation of the same config is compared against."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from baton.config import ConfigError
from baton.schema import default_of
from baton.simulate.costs import RAY_HOP_S, MeasuredCosts
from baton.simulate.schedule import ObservedSchedule, observe_schedule, phase_figures, phases_of
from pipeline.events import EVENTS_FILE
from stages.learner import GRPOLearner
from stages.runfiles import read_generation, read_jsonl


def steady_window(records: list[dict], warmup: int) -> tuple[list[dict], dict | None]:
    """The records after version `warmup` (clamped to a quarter of the run) and the record they start from."""
    warmup = min(warmup, len(records) // 4)
    if warmup < 1 or len(records) < 2:
        return records, None
    return [r for r in records if r["version"] > warmup], next(r for r in records if r["version"] == warmup)


def steady_figures(records: list[dict], samples_per_version: int, warmup: int, engines: float = 1) -> dict[str, float]:
    """Steady-state figures of per-version records (real or simulated), as benchmarks/async_vs_sync.py
    computes them: samples/s, learner busy fraction, mean staleness, per-version times; engine idle
    fraction when the records carry `engine_busy_s` (cumulative, all engines)."""
    window, start = steady_window(records, warmup)
    t0 = start["t"] if start is not None else 0.0
    wall = window[-1]["t"] - t0
    busy = sum(r["step_s"] for r in window)
    figures = {
        "samples_per_s": round(samples_per_version * len(window) / wall, 2),
        "learner_busy": round(busy / wall, 4),
        "mean_staleness": round(sum(r["staleness_mean"] for r in window) / len(window), 4),
        "step_ms": round(1e3 * busy / len(window), 2),
        "version_ms": round(1e3 * wall / len(window), 2),
    }
    if "engine_busy_s" in window[-1]:
        engine_busy = window[-1]["engine_busy_s"] - (start["engine_busy_s"] if start is not None else 0.0)
        figures["engine_idle"] = round(max(0.0, 1 - engine_busy / (wall * engines)), 4)
    return figures


@dataclass
class Calibration:
    """A real run's measured costs and its own steady-state figures."""

    run_dir: Path
    costs: MeasuredCosts
    measured: dict[str, float]
    engines: int
    config_path: Path
    schedule: ObservedSchedule | None = None  # the fleet's changes and learner restarts, when the run had any


def calibrate(run_dir: str | Path, warmup: int = 10, learners: int = 1) -> Calibration:
    """Read a run folder (metrics.jsonl from the learner, generation.jsonl from the rollout workers,
    config.toml, events.jsonl) and return its per-stage costs over the steady-state window; a run whose
    engines joined or left, or whose learner restarted, also its schedule and its figures per phase
    (`measured["phases"]`).

    Store gets: the learner's `load_s` / `loads` when recorded, else assumed equal to a put per group."""
    run = Path(run_dir)
    records = read_jsonl(run / "metrics.jsonl")
    if len(records) < 4:
        raise ConfigError(f"--calibrate {run}: needs a run folder with metrics.jsonl of at least 4 versions "
                          f"(found {len(records)}); run `baton run CONFIG` first")
    calls = read_generation(run)
    if not calls:
        raise ConfigError(f"--calibrate {run}: no generation.jsonl (engine-call timings): it is written by runs "
                          "of this version of baton; run the config again")
    if "push_s" not in records[0]:
        raise ConfigError(f"--calibrate {run}: metrics.jsonl has no push_s: run the config again with this baton")
    window, start = steady_window(records, warmup)
    t0 = start["t"] if start is not None else 0.0
    steady_calls = [c for c in calls if c["t"] >= t0] or calls
    loads = sum(r.get("loads", 0) for r in window)
    get_s = (sum(r.get("load_s", 0.0) for r in window) / loads if loads
             else sum(c["put_s"] for c in steady_calls) / sum(c["groups"] for c in steady_calls))
    config = tomllib.loads((run / "config.toml").read_text())
    runtime = config.get("runtime", "local")
    engines = len({c["engine"] for c in calls})
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    gps = int(config.get("learner", {}).get("groups_per_step", default_of(GRPOLearner, "groups_per_step")))
    group_size = steady_calls[0].get("group_size", 1)
    samples = summary.get("samples", {}).get("trained", 0) / len(records) if summary else gps * group_size
    costs = MeasuredCosts(steady_calls, window, learners=learners, hop_s=RAY_HOP_S if runtime == "ray" else 0.0,
                          get_s_per_group=get_s)
    measured: dict = steady_figures(records, round(samples), warmup, engines)
    schedule = observe_schedule(read_jsonl(run / EVENTS_FILE), calls, records)
    if schedule is not None:
        steps, restarts = schedule.engine_schedule, schedule.learner_restarts
        measured["phases"] = phase_figures(records, phases_of(steps[0][1], steps, restarts, records[-1]["t"]),
                                           round(samples))
    return Calibration(run, costs, measured, engines, run / "config.toml", schedule)

