"""Tokens/s of the vLLM, SGLang and torch engines side by side on the same tiny model, in one run, the time one
weight update takes into each server, and (`--learn`) each engine's wall time to the quickstart's trailing
reward of 0.8.

The model is the one vLLM's CPU attention can serve (`configs/vllm-cpu.toml`'s: hidden 64, 2 query heads over 1
key/value head, head size 32, tied embedding; random init, made on first use). Every engine generates batch 64 x
64 new tokens (no stop token, so every row runs its full length) from the same prompts, through the same
`Engine.generate` the producer calls, with per-token logprobs; each figure is the median of `--repeats` timed
calls after one warm-up call. The torch engine runs in this process with one thread; the SGLang server
(`.venv-sglang`, tools/sglang-cpu/install.sh) and the vLLM server (`.venv-vllm`, tools/vllm-cpu/install.sh) run
on CPU in float32 with one torch thread, as `configs/sglang-cpu.toml` and `configs/vllm-cpu.toml` run them, one
server at a time (each is stopped before the next starts). `--skip vllm,sglang` leaves engines out (the torch
engine is the reference and always runs). `ratios.vllm_vs_torch` and `ratios.sglang_vs_torch` are tokens/s
over the torch engine's.

Weight updates: the same state dict (a fresh version each time) through SGLang's `update_weights_from_tensor`,
`_distributed` (gloo) and `_disk`, and through vLLM's native update protocol (`baton_shm`, inside
pause(keep) ... resume), timed from `receive_weights` to the engine's return (the server confirmed the new
version and its probe logprobs matched the float32 forward of the tensors sent; median of `--repeats`).

`--learn` instead runs the quickstart on each engine (`baton run configs/vllm-cpu.toml`, its own process, with
only `[engine]` changed: torch in-process, an SGLang server, a vLLM server; same model, task, learner, seed and
staleness bound) until the trailing mean train reward of the last 20 versions reaches 0.8 (or `--budget-s`),
one run at a time, and reports each one's seconds from process start (server start included) and versions to
0.8. `ratios.<engine>_vs_torch_time` is its seconds to 0.8 over the torch engine's (below 1: sooner).

Prints a table to stderr and, as the last stdout line, one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages.data.model import load_model, make_tiny_model  # noqa: E402
from stages.engines.base import SamplingParams  # noqa: E402
from stages.engines.sglang import UPDATE_PATHS, SGLangEngine  # noqa: E402
from stages.engines.torch import TorchEngine  # noqa: E402
from stages.engines.vllm import VLLMEngine  # noqa: E402

SERVERS = ("vllm", "sglang")  # run in this order, one at a time; the torch engine is the reference
MODEL = "runs/models/tiny-qwen2-hd32"  # configs/vllm-cpu.toml's model
LEARN_CONFIG = "configs/vllm-cpu.toml"
LEARN_ENGINES = {  # engine -> the [engine] table its quickstart run uses (the rest of LEARN_CONFIG unchanged)
    "vllm": None,  # the config's own
    "sglang": "engine={kind='sglang', count=1, batch_groups=16, dtype='float32', threads=1}",
    "torch": "engine={kind='torch', batch_groups=16}",
}


async def tokens_per_s(engine, prompts: list[list[int]], params: SamplingParams, repeats: int) -> float:
    await engine.generate(prompts, params)  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        completions = await engine.generate(prompts, params)
        rates.append(sum(len(c.tokens) for c in completions) / (time.perf_counter() - t0))
    return statistics.median(rates)


async def update_seconds(engine, model: torch.nn.Module, repeats: int) -> float:
    """Median seconds of `repeats` pushes of a fresh version (after one uncounted warm-up push: for gloo it also
    forms the group)."""
    times = []
    for _ in range(repeats + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3)
        tensors = {n: t.detach().clone() for n, t in model.state_dict().items()}
        t0 = time.perf_counter()
        await engine.receive_weights(engine.version + 1, tensors)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


async def measure_torch(folder: Path, prompts, params, args) -> dict:
    engine = TorchEngine(folder)
    await engine.start()
    try:
        return {"tokens_per_s": await tokens_per_s(engine, prompts, params, args.repeats)}
    finally:
        await engine.stop()


async def measure_server(kind: str, folder: Path, prompts, params, args, logs: str) -> dict:
    """One server engine: started (timed), its tokens/s, each of its update paths; stopped before returning."""
    if kind == "sglang":
        engine = SGLangEngine(folder, name="bench", log_dir=logs, threads=args.threads, dtype=args.dtype)
        paths = UPDATE_PATHS
    else:
        engine = VLLMEngine(folder, name="bench", log_dir=logs, threads=args.threads, dtype=args.dtype,
                            max_model_len=256)
        paths = ("native",)
    t0 = time.perf_counter()
    await engine.start()
    ready_s = time.perf_counter() - t0
    try:
        rate = await tokens_per_s(engine, prompts, params, args.repeats)
        model = load_model(folder)
        updates = {}
        for path in paths:
            if kind == "sglang":
                engine.update = path
            updates[path] = await update_seconds(engine, model, args.repeats)
    finally:
        await engine.stop()
    return {"tokens_per_s": rate, "ready_s": ready_s, "update_s": updates}


async def throughput(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    folder = make_tiny_model(ROOT / args.model, hidden_size=64, heads=2, kv_heads=1)
    prompts = [[1, *[(7 * i + j) % 40 + 3 for j in range(8)]] for i in range(args.batch)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    figures = {"torch": await measure_torch(folder, prompts, params, args)}
    with tempfile.TemporaryDirectory() as logs:
        for kind in SERVERS:
            if kind not in args.skip:
                figures[kind] = await measure_server(kind, folder, prompts, params, args, logs)
    reference = figures["torch"]["tokens_per_s"]
    weight_mib = sum(t.numel() * t.element_size() for t in load_model(folder).state_dict().values()) / 2**20
    result = {
        "model": args.model, "batch": args.batch, "new_tokens": args.new_tokens,
        "threads": args.threads, "dtype": args.dtype, "weights_mib": round(weight_mib, 2),
        **{f"{k}_tokens_per_s": round(f["tokens_per_s"]) for k, f in figures.items()},
        **{f"{k}_ready_s": round(f["ready_s"], 1) for k, f in figures.items() if "ready_s" in f},
        "update_ms": {f"{k}/{p}": round(s * 1000, 1)
                      for k, f in figures.items() for p, s in f.get("update_s", {}).items()},
        "ratios": {f"{k}_vs_torch": round(f["tokens_per_s"] / reference, 3)
                   for k, f in figures.items() if k != "torch"},
    }
    print(f"{'engine':<10}{'tokens/s':>10}   batch {args.batch} x {args.new_tokens} new tokens", file=sys.stderr)
    for kind, f in figures.items():
        print(f"{kind:<10}{f['tokens_per_s']:>10.0f}   (x{f['tokens_per_s'] / reference:.2f})", file=sys.stderr)
    for name, ms in result["update_ms"].items():
        print(f"update {name:<22}{ms:>8.1f} ms for {weight_mib:.2f} MiB", file=sys.stderr)
    return result


def learn(args: argparse.Namespace) -> dict:
    """Each engine's quickstart run to the target, one at a time (benchmarks/learning.py watches each run), and
    each run's ledger checked (`baton ledger`: every invariant holds)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import learning

    learning.TASKS.update({f"reverse2-{k}": (LEARN_CONFIG, [s] if s else []) for k, s in LEARN_ENGINES.items()})
    watch = argparse.Namespace(steps=args.steps, budget_s=args.budget_s, target=0.8, eval_target=0.8, window=20,
                               after=args.after, correction=None, runtime="local", overrides=[])
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.keep or scratch)
        root.mkdir(parents=True, exist_ok=True)
        for kind in LEARN_ENGINES:
            if kind not in args.skip:
                rows[kind] = learning.run_once(f"reverse2-{kind}", args.seed, 2, watch, root)
                metrics = learning._metrics_file(root, f"reverse2-{kind}-s{args.seed}-k2")
                rows[kind]["ledger_clean"] = ledger_clean(metrics)
                print(json.dumps(rows[kind]), file=sys.stderr)
    seconds = {k: r.get("seconds_to_target") for k, r in rows.items()}
    ratios = {f"{k}_vs_torch_time": round(s / seconds["torch"], 3) if s and seconds.get("torch") else None
              for k, s in seconds.items() if k != "torch"}
    print(f"{'engine':<10}{'s to 0.8':>10}{'versions':>10}{'wall s':>10}  ledger", file=sys.stderr)
    for kind, r in rows.items():
        print(f"{kind:<10}{r.get('seconds_to_target')!s:>10}{r.get('versions_to_target')!s:>10}"
              f"{r.get('wall_s')!s:>10}  {'clean' if r['ledger_clean'] else 'BROKEN'}", file=sys.stderr)
    return {"config": LEARN_CONFIG, "seed": args.seed, "target": "trailing reward (20 versions) >= 0.8",
            "seconds_to_target": seconds,
            "versions_to_target": {k: r.get("versions_to_target") for k, r in rows.items()},
            "rows": rows, "ratios": ratios}


def ledger_clean(metrics: Path | None) -> bool:
    """Whether `baton ledger` finds every invariant of the run's ledger holding (False: no run folder)."""
    if metrics is None:
        return False
    done = subprocess.run([sys.executable, "-m", "baton.cli", "ledger", str(metrics.parent)], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-2000:], file=sys.stderr)
    return done.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each server")
    parser.add_argument("--dtype", default="float32", help="the servers' dtype")
    parser.add_argument("--skip", default="", help="engines to leave out, comma-separated: vllm, sglang")
    parser.add_argument("--learn", action="store_true", help="time to a trailing reward of 0.8 per engine instead")
    parser.add_argument("--seed", type=int, default=0, help="--learn: the runs' seed")
    parser.add_argument("--steps", type=int, default=600, help="--learn: most versions per run")
    parser.add_argument("--budget-s", type=float, default=600.0, help="--learn: most seconds per run")
    parser.add_argument("--after", type=int, default=0, help="--learn: versions a run goes on past the target")
    parser.add_argument("--keep", default=None, help="--learn: a folder that keeps the runs (default: a temporary one)")
    args = parser.parse_args()
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if unknown := args.skip - set(SERVERS):
        parser.error(f"--skip takes {', '.join(SERVERS)} (the torch engine is the reference), got {sorted(unknown)}")
    print(json.dumps(learn(args) if args.learn else anyio.run(throughput, args)))


if __name__ == "__main__":
    main()
