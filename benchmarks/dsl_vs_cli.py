"""The Python DSL against the CLI on the same run: the README's Python quickstart (`Pipeline.run()`) and
`baton run configs/quickstart.toml`, both at `--steps` versions on the same model folder, side by side in one
benchmark run: on the machine as it is ("quiet"), then with both cores saturated by two busy-loop processes
this benchmark starts and kills by pid ("loaded"). Each condition runs `--pairs` interleaved pairs (DSL, then
CLI); `--unprepared` adds a DSL run with `pipeline.process.prepare_process` turned off (the DSL as it ran
before the process was prepared for it) to each pair.

    python benchmarks/dsl_vs_cli.py [--steps 100] [--pairs 1] [--unprepared]

Figures: each run's samples/s (its summary's: trained samples over the run's wall time, start-up included).
Last stdout line: one JSON object with "figures" ({condition: {dsl, cli[, dsl_unprepared]: [samples/s per
pair]}}) and "ratios": dsl_vs_cli_quiet and dsl_vs_cli_loaded (the median pair's DSL over CLI; goal >= 0.9
for both), and with --unprepared dsl_unprepared_vs_cli_*.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOG = "while True: pass"


def dsl_main(model: str, run_root: str, steps: int, prepared: bool) -> None:
    """The README's Python quickstart (in a process of its own), at `steps`; prints its summary."""
    sys.path.insert(0, str(ROOT))
    import pipeline.dsl

    if not prepared:
        pipeline.dsl.prepare_process = lambda: {}
    from buffers import MemoryStore, RefBuffer
    from pipeline import Pipeline
    from policies import MaxStaleness
    from stages import GRPOLearner, Rollout, TorchEngine, make_tiny_model, tasks

    path = make_tiny_model(model)
    pipe = Pipeline(
        name="quickstart",
        producer=Rollout(tasks.ReverseDigits(digits=2), [TorchEngine(path)], tokenizer=path, group_size=8),
        buffer=RefBuffer(MemoryStore(), max_bytes=256 << 20),
        consumer=GRPOLearner(path, lr=4e-4, groups_per_step=16, weights="inproc"),
        staleness=MaxStaleness(k=2, on_stale="drop"),
        steps=steps, run_root=run_root, progress=False,
    )
    print(json.dumps(pipe.run()), flush=True)


def samples_per_s(cmd: list[str], cwd: Path) -> float:
    """The run's samples/s, in an environment without a thread count of its own (as a user's shell)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=1800, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["samples_per_s"]


def pair(root: Path, steps: int, unprepared: bool) -> dict[str, float]:
    """One DSL run, one CLI run (and the unprepared DSL run) on the same model folder."""
    model, runs = root / "tiny-qwen2", root / "runs"
    me = [sys.executable, str(Path(__file__).resolve()), "--dsl", str(model), str(runs), str(steps)]
    figures = {"dsl": samples_per_s(me, root)}
    cli = [sys.executable, "-m", "baton.cli", "run", str(ROOT / "configs" / "quickstart.toml"),
           "--set", f"steps={steps}", "--set", f"model.path='{model}'", "--set", f"run_root='{runs}'",
           "--set", "telemetry.progress=false"]
    figures["cli"] = samples_per_s(cli, ROOT)
    if unprepared:
        figures["dsl_unprepared"] = samples_per_s([*me, "--unprepared"], root)
    return figures


def condition(root: Path, steps: int, pairs: int, unprepared: bool, hogs: int) -> dict[str, list[float]]:
    """`pairs` pairs with `hogs` busy-loop processes running meanwhile (killed by pid at the end)."""
    started = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
    try:
        each = [pair(root, steps, unprepared) for _ in range(pairs)]
    finally:
        for hog in started:
            hog.kill()
            hog.wait()
    return {name: [p[name] for p in each] for name in each[0]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--dsl":
        dsl_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), prepared="--unprepared" not in sys.argv)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--pairs", type=int, default=1)
    p.add_argument("--unprepared", action="store_true", help="also the DSL without prepare_process, per pair")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        figures = {"quiet": condition(root, a.steps, a.pairs, a.unprepared, hogs=0),
                   "loaded": condition(root, a.steps, a.pairs, a.unprepared, hogs=2)}
    ratios = {}
    for name, runs in figures.items():
        for dsl in ("dsl", "dsl_unprepared"):
            if dsl in runs:
                each = [d / c for d, c in zip(runs[dsl], runs["cli"], strict=True)]
                ratios[f"{dsl}_vs_cli_{name}"] = round(statistics.median(each), 3)
        print(f"{name:>7}: " + ", ".join(f"{k} {v} samples/s" for k, v in runs.items()), file=sys.stderr)
    print(json.dumps({"steps": a.steps, "pairs": a.pairs, "figures": figures, "ratios": ratios}), flush=True)


if __name__ == "__main__":
    main()
