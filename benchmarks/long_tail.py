"""Async ÷ sync on a long-tailed multi-turn workload (issue 18's benchmark), both modes in one process.

The workload is configs/agent-feedback.toml (the tiny model learns the digit task from feedback) with
its environment swapped for `benchmarks._long_tail_env:LongTailFeedback`: each episode has a turn
budget drawn heavy-tailed in [1, 16] and each environment step sleeps a heavy-tailed 10 ms to 1 s,
both seeded, so the sync and the async run meet the same sequence of episodes. The same config runs
once with mode = "sync" (k = 0: each version's groups are admitted after the previous step, and the
step waits for its slowest episode) and once with mode = "async" (staleness.k = --k), each for
--steps learner versions, so both train the same number of samples. `batch_groups` (the rollout's
groups' worth of episodes in flight per engine) is raised to (k + 1) * groups_per_step so that in
async mode the staleness gate, not the rollout's room, bounds what is in flight; sync admits one
step's groups whatever it is.

    python benchmarks/long_tail.py [--steps 20] [--k 2] [--warmup 4] [--batch-groups N] [--sglang]

Per mode: trained samples/s in steady state (after --warmup versions), the engine's busy fraction
(`TorchEngine.busy_s`, the decode thread's lifetime, over the run's wall time), the learner's busy
fraction, mean staleness, turns per episode, the reward in the first and last quarter of versions
(equal trained samples in both modes), and the episodes restarted as too stale. Last stdout line:
one JSON object with "figures" and "ratios" (async_vs_sync, goal >= 2.0; engine_busy_async and
engine_busy_sync).

Measured here (2 CPU cores shared with other jobs, so figures move with the load; default flags):
async 44.5 trained samples/s against sync 19.8 (ratio 2.25; 2.44 in a more loaded run), engine busy
0.92 against 0.29, mean staleness 1.43 against 0, reward over the last quarter 0.020 against 0.018.
Async is engine-bound: about two thirds of the decode thread's time is prefill, because every turn
is a new request that prefills the whole conversation again. And it drops about 13 % of what it
generates as stale (groups wait for their slowest episode: 4.0 s median, 10.8 s at most, against
2.9 s per version with k = 2), longer episodes more often; `batch_groups` 16 or 48 made no difference.

`--sglang` (optional, slow on CPU) adds the prefix-cache hit fraction of SGLang with sticky routing
(every turn of an episode to the same server) against round robin: `benchmarks._long_tail_sglang`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks._long_tail_env import LongTailFeedback  # noqa: E402
from benchmarks.async_vs_sync import steady_state  # noqa: E402

BASE_CONFIG = ROOT / "configs" / "agent-feedback.toml"
ENVIRONMENT = "benchmarks._long_tail_env:LongTailFeedback"
MODEL = "runs/models/tiny-qwen2"  # agent-feedback.toml's, made there when missing
GROUPS_PER_STEP = 16  # agent-feedback.toml's learner.groups_per_step


def overrides(args: argparse.Namespace, mode: str, root: Path) -> list[str]:
    """The --set lines of one mode's run: the long-tail environment and limits, the same for both modes
    but for `mode` and `staleness.k`."""
    k = 0 if mode == "sync" else args.k
    return [
        f"steps={args.steps}", f"seed={args.seed}", f"run_root='{root}'", f"model.path='{ROOT / MODEL}'",
        "telemetry.progress=false", "telemetry.log_level='warning'", f"mode='{mode}'", f"staleness.k={k}",
        "task.digits=2", f"environment.kind='{ENVIRONMENT}'", f"environment.seed={args.seed}",
        "environment.max_turns=16", "episode.max_turns=16", "episode.step_timeout_s=10", "episode.timeout_s=600",
        f"engine.batch_groups={args.batch_groups or (args.k + 1) * GROUPS_PER_STEP}",
        f"learner.groups_per_step={GROUPS_PER_STEP}", *args.overrides,
    ]


def run_mode(args: argparse.Namespace, mode: str, root: Path) -> dict:
    """One run in this process; its steady-state figures plus the engine's and the episodes' own."""
    from baton.builder import build_pipeline
    from baton.schema import load_run_config
    from pipeline.telemetry import configure_logging

    cfg = load_run_config(BASE_CONFIG, overrides(args, mode, root))
    configure_logging(cfg.telemetry.log_format, cfg.telemetry.log_level)
    pipeline = build_pipeline(cfg)
    LongTailFeedback.reset()  # both modes meet the same episodes
    summary = pipeline.run()
    engine, stats = pipeline.producer.engines[0], pipeline.producer.stats
    figures = steady_state(summary, args.warmup)
    figures.update(episode_figures(Path(summary["run_dir"])))
    figures.update(
        samples_per_s_whole_run=summary["samples_per_s"],
        engine_busy=round(engine.busy_s / summary["wall_s"], 3),
        engine_interrupted=engine.stats.get("interrupted", 0),
        episodes_restarted=sum(stats.get("episodes_restarted", {}).values()),
        episodes_failed=sum(stats.get("episodes_failed", {}).values()),
        dropped=summary["samples"]["dropped"],
    )
    return figures


def episode_figures(run_dir: Path) -> dict:
    """From metrics.jsonl: turns per episode, the turn budget drawn, and the reward over the first and
    the last quarter of versions; from generation.jsonl: the mean seconds from a group's start to stored."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    quarter = max(1, len(records) // 4)

    def mean(key: str, rows: list[dict]) -> float:
        values = [r[key] for r in rows if key in r]
        return round(sum(values) / len(values), 4) if values else float("nan")

    groups = [json.loads(line) for line in (run_dir / "generation.jsonl").read_text().splitlines()]
    return {
        "turns_mean": mean("turns_mean", records),
        "turn_budget_mean": mean("episode/turn_budget", records),
        "reward_first_quarter": mean("reward", records[:quarter]),
        "reward_last_quarter": mean("reward", records[-quarter:]),
        "turn_score_1_last_quarter": mean("episode/turn_score/1", records[-quarter:]),
        "group_s_mean": round(sum(g["gen_s"] for g in groups) / len(groups), 3),
        "group_s_max": round(max(g["gen_s"] for g in groups), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="learner versions per mode (both train as many samples)")
    p.add_argument("--warmup", type=int, default=4, help="versions left out of the steady-state figures")
    p.add_argument("--k", type=int, default=2, help="the async run's staleness bound (sync is k = 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-groups", type=int, default=0, help="engine.batch_groups (default (k + 1) * 16)")
    p.add_argument("--run-root", default=None, help="keep the run folders here (default: a temporary folder)")
    p.add_argument("--sglang", action="store_true", help="also the SGLang prefix-cache hit fraction (slow)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="more config overrides")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.run_root or tmp)
        sync = run_mode(a, "sync", root)
        asyn = run_mode(a, "async", root)
    result = {
        "benchmark": "long_tail", "steps": a.steps, "warmup_versions": a.warmup, "k": a.k, "seed": a.seed,
        "figures": {"async": asyn}, "reference": {"sync": sync},
        "ratios": {
            "async_vs_sync": round(asyn["samples_per_s"] / sync["samples_per_s"], 3),
            "engine_busy_async": asyn["engine_busy"],
            "engine_busy_sync": sync["engine_busy"],
        },
    }
    if a.sglang:
        from benchmarks._long_tail_sglang import prefix_cache_figures

        result["sglang_prefix_cache"] = prefix_cache_figures(a.seed)
    for name, f in (("sync", sync), ("async", asyn)):
        print(f"{name:6} samples/s {f['samples_per_s']:>7}  engine busy {f['engine_busy']:>6}  learner busy "
              f"{f['learner_busy']:>6}  staleness {f['mean_staleness']:>5}  reward last quarter "
              f"{f['reward_last_quarter']:>7}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
