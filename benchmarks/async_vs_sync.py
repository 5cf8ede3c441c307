"""Async ÷ sync on the Ray runtime: the same config, same seed and step count, run with
mode = "sync" (k = 0) and with mode = "async" (k = 1 by default), engines and learner each in
their own process. Prints samples/s of each in steady state (after a warm-up of versions, so Ray's
and the models' start-up is not counted), the learner's busy fraction, and the ratios.

    python benchmarks/async_vs_sync.py [--config configs/ray-mooncake.toml] [--steps 60] [--k 1]

The two modes run in `--pairs` interleaved pairs (sync, then async): on a shared 2-core machine one
run's speed drifts by up to 30 % from the next, so one pair decides nothing. Last stdout line: one
JSON object with "figures" (the median pair's async run), "reference" (its sync run) and "ratios":
async_vs_sync (the median pair's; each pair's in async_vs_sync_each; goal >= 1.6 where generation
and training cost about the same) and learner_busy_async (goal >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(config: str, steps: int, overrides: list[str], root: Path) -> dict:
    sets = [f"steps={steps}", f"run_root='{root}'", "telemetry.progress=false", *overrides]
    cmd = [sys.executable, "-m", "baton.cli", "run", config, *[x for s in sets for x in ("--set", s)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def steady_state(summary: dict, warmup: int) -> dict:
    """Figures between version `warmup` and the last one, from the run's metrics."""
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    window = [r for r in records if r["version"] > warmup]
    start = next(r for r in records if r["version"] == warmup)
    wall = window[-1]["t"] - start["t"]
    samples = summary["samples"]["trained"] * len(window) / len(records)
    busy = sum(r["step_s"] for r in window)
    return {
        "samples_per_s": round(samples / wall, 1),
        "learner_busy": round(busy / wall, 3),
        "step_ms": round(1e3 * busy / len(window), 1),
        "version_ms": round(1e3 * wall / len(window), 1),
        "mean_staleness": round(sum(r["staleness_mean"] for r in window) / len(window), 3),
        "reward_end": summary["reward_end"],
        "wall_s": summary["wall_s"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "ray-mooncake.toml"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--pairs", type=int, default=3, help="sync-then-async pairs; the ratio is their median")
    p.add_argument("--set", dest="overrides", action="append", default=["engine.count=1"])
    a = p.parse_args()
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for _ in range(a.pairs):  # interleaved, so drift in the machine's speed hits both modes
            sync = steady_state(run(a.config, a.steps, [*a.overrides, "mode='sync'", "staleness.k=0"], root), a.warmup)
            asyn = steady_state(run(a.config, a.steps, [*a.overrides, "mode='async'", f"staleness.k={a.k}"], root),
                                a.warmup)
            pairs.append((sync, asyn))
    print(
        f"{'pair':5} {'mode':6} {'samples/s':>10} {'learner busy':>13} {'step ms':>8} {'version ms':>11} "
        f"{'staleness':>10}",
        file=sys.stderr,
    )
    for i, pair in enumerate(pairs):
        for name, f in zip(("sync", "async"), pair, strict=True):
            print(
                f"{i:<5} {name:6} {f['samples_per_s']:>10} {f['learner_busy']:>13} {f['step_ms']:>8} "
                f"{f['version_ms']:>11} {f['mean_staleness']:>10}",
                file=sys.stderr,
            )
    ratios = [asyn["samples_per_s"] / sync["samples_per_s"] for sync, asyn in pairs]
    middle = sorted(range(len(pairs)), key=lambda i: ratios[i])[len(pairs) // 2]  # the median pair
    sync, asyn = pairs[middle]
    print(
        json.dumps(
            {
                "benchmark": "async_vs_sync",
                "config": a.config,
                "steps": a.steps,
                "warmup_versions": a.warmup,
                "k": a.k,
                "figures": {"async": asyn, "async_samples_per_s_each": [p[1]["samples_per_s"] for p in pairs]},
                "reference": {"sync": sync, "sync_samples_per_s_each": [p[0]["samples_per_s"] for p in pairs]},
                "ratios": {
                    "async_vs_sync": round(ratios[middle], 3),  # the median pair's
                    "async_vs_sync_each": [round(r, 3) for r in ratios],
                    "learner_busy_async": asyn["learner_busy"],
                    "learner_busy_sync": sync["learner_busy"],
                },
            }
        )
    )


if __name__ == "__main__":
    main()
