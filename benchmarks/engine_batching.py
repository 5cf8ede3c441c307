"""Continuous batching in the torch engine: N concurrent single-prompt `generate` calls (as the
rollout's episode coroutines make them) against one batched call of the same N prompts.

Both generate N x `--new-tokens` tokens (no stop token, so every row runs its full length) on the
quickstart's tiny model, with the same sampling params; each figure is the median tokens/s of
`--repeats` timed rounds after one warm-up round. The concurrent calls are all started at once and
join one running batch (a call that arrives while the batch decodes joins at the next step).
`ratios.continuous_vs_batched` is the concurrent calls' tokens/s over the batched call's (goal >= 0.8).
A third figure, `mixed_tokens_per_s`, runs the N calls with lengths spread from 1/4 to all of
`--new-tokens`: finished rows leave the batch at once, so the long ones decode in a smaller batch.

Prints a table to stderr and, as the last stdout line, one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.data.model import make_tiny_model  # noqa: E402
from stages.engines.base import SamplingParams  # noqa: E402
from stages.engines.torch import TorchEngine  # noqa: E402


async def batched(engine: TorchEngine, prompts: list[list[int]], params: list[SamplingParams]) -> int:
    """One call of all prompts (every prompt with the first params); tokens generated."""
    return sum(len(c.tokens) for c in await engine.generate(prompts, params[0]))


async def concurrent(engine: TorchEngine, prompts: list[list[int]], params: list[SamplingParams]) -> int:
    """One call per prompt, all at once; tokens generated."""
    counts: list[int] = []

    async def one(prompt: list[int], p: SamplingParams) -> None:
        counts.append(len((await engine.generate([prompt], p))[0].tokens))

    async with anyio.create_task_group() as tg:
        for prompt, p in zip(prompts, params, strict=True):
            tg.start_soon(one, prompt, p)
    return sum(counts)


async def tokens_per_s(run, engine, prompts, params, repeats: int) -> float:
    await run(engine, prompts, params)  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = await run(engine, prompts, params)
        rates.append(tokens / (time.perf_counter() - t0))
    return statistics.median(rates)


async def main(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    folder = make_tiny_model(Path(args.model))
    prompts = [[1, *[(7 * i + j) % 40 + 3 for j in range(8)]] for i in range(args.n)]
    same = [SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)] * args.n
    quarter = max(1, args.new_tokens // 4)
    mixed = [SamplingParams(max_new_tokens=quarter + (args.new_tokens - quarter) * i // max(1, args.n - 1))
             for i in range(args.n)]
    engine = TorchEngine(folder, device=args.device, dtype=args.dtype, max_running=max(args.n, 1))
    await engine.start()
    try:
        batched_rate = await tokens_per_s(batched, engine, prompts, same, args.repeats)
        continuous_rate = await tokens_per_s(concurrent, engine, prompts, same, args.repeats)
        mixed_rate = await tokens_per_s(concurrent, engine, prompts, mixed, args.repeats)
    finally:
        await engine.stop()
    result = {
        "n": args.n,
        "new_tokens": args.new_tokens,
        "device": args.device,
        "dtype": args.dtype,
        "batched_tokens_per_s": round(batched_rate),
        "continuous_tokens_per_s": round(continuous_rate),
        "mixed_tokens_per_s": round(mixed_rate),
        "ratios": {"continuous_vs_batched": round(continuous_rate / batched_rate, 3)},
    }
    print(f"{'mode':<34}{'tokens/s':>10}   {args.n} prompts x {args.new_tokens} new tokens", file=sys.stderr)
    print(f"{'one call of N prompts':<34}{batched_rate:>10.0f}", file=sys.stderr)
    print(f"{'N concurrent single-prompt calls':<34}{continuous_rate:>10.0f}   "
          f"(x{continuous_rate / batched_rate:.2f})", file=sys.stderr)
    print(f"{'  the same, mixed lengths':<34}{mixed_rate:>10.0f}", file=sys.stderr)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=64, help="prompts (concurrent calls)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--model", default="runs/models/tiny-qwen2")
    print(json.dumps(anyio.run(main, parser.parse_args())))
