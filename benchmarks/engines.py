"""Tokens/s of the SGLang engine and of the torch engine on the same tiny model, in one run, and the
time one weight update takes through each SGLang path for the same weights.

Both engines generate batch 64 x 64 new tokens (no stop token, so every row runs its full length)
from the same prompts, through the same `Engine.generate` the producer calls, with per-token
logprobs; each figure is the median of `--repeats` timed calls after one warm-up call. The SGLang
server runs on CPU from `.venv-sglang` (tools/sglang-cpu/install.sh) in float32 with one torch
thread, as `configs/sglang-cpu.toml` runs it (`--threads`, `--dtype` to vary); the torch engine
runs in this process with one thread.
`ratios.sglang_vs_torch` is SGLang's tokens/s over the torch engine's.

Weight updates: the same state dict (a fresh version each time) through `update_weights_from_tensor`,
`_distributed` (gloo) and `_disk`, each wrapped in begin/end, timed from `receive_weights` to the
server confirming the new version (median of `--repeats`).

Prints a table to stderr and, as the last stdout line, one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.data.model import load_model, make_tiny_model  # noqa: E402
from stages.engines.base import SamplingParams  # noqa: E402
from stages.engines.sglang import UPDATE_PATHS, SGLangEngine  # noqa: E402
from stages.engines.torch import TorchEngine  # noqa: E402


async def tokens_per_s(engine, prompts: list[list[int]], params: SamplingParams, repeats: int) -> float:
    await engine.generate(prompts, params)  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        completions = await engine.generate(prompts, params)
        rates.append(sum(len(c.tokens) for c in completions) / (time.perf_counter() - t0))
    return statistics.median(rates)


async def update_seconds(engine: SGLangEngine, model: torch.nn.Module, path: str, repeats: int) -> float:
    engine.update = path
    times = []
    for _ in range(repeats + 1):  # the first one (a warm-up; for gloo it also forms the group) is not counted
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3)
        tensors = {n: t.detach().clone() for n, t in model.state_dict().items()}
        t0 = time.perf_counter()
        await engine.receive_weights(engine.version + 1, tensors)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


async def main(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    folder = make_tiny_model(Path(args.model))
    prompts = [[1, *[(7 * i + j) % 40 + 3 for j in range(8)]] for i in range(args.batch)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    torch_engine = TorchEngine(folder)
    await torch_engine.start()
    torch_rate = await tokens_per_s(torch_engine, prompts, params, args.repeats)
    await torch_engine.stop()

    with tempfile.TemporaryDirectory() as logs:
        engine = SGLangEngine(folder, name="bench", log_dir=logs, threads=args.threads, dtype=args.dtype)
        t0 = time.perf_counter()
        await engine.start()
        ready_s = time.perf_counter() - t0
        try:
            sglang_rate = await tokens_per_s(engine, prompts, params, args.repeats)
            model = load_model(folder)
            updates = {path: await update_seconds(engine, model, path, args.repeats) for path in UPDATE_PATHS}
        finally:
            await engine.stop()
    weight_mib = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    result = {
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "torch_tokens_per_s": round(torch_rate),
        "sglang_tokens_per_s": round(sglang_rate),
        "ratios": {"sglang_vs_torch": round(sglang_rate / torch_rate, 3)},
        "sglang_threads": args.threads,
        "sglang_dtype": args.dtype,
        "sglang_ready_s": round(ready_s, 1),
        "weights_mib": round(weight_mib, 2),
        "update_ms": {path: round(s * 1000, 1) for path, s in updates.items()},
    }
    print(f"{'engine':<10}{'tokens/s':>10}   batch {args.batch} x {args.new_tokens} new tokens", file=sys.stderr)
    print(f"{'torch':<10}{torch_rate:>10.0f}", file=sys.stderr)
    print(f"{'sglang':<10}{sglang_rate:>10.0f}   (x{sglang_rate / torch_rate:.2f})", file=sys.stderr)
    for path, s in updates.items():
        print(f"update_weights_from_{path:<12}{s * 1000:>8.1f} ms for {weight_mib:.2f} MiB", file=sys.stderr)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="runs/models/tiny-qwen2")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the SGLang server")
    parser.add_argument("--dtype", default="float32", help="SGLang server dtype")
    print(json.dumps(anyio.run(main, parser.parse_args())))
