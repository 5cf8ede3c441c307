"""Datapath benchmark: encode -> MemoryStore.put -> get -> decode(verify=True), against memcpy.

For rollout batches of about 1, 16 and 64 MiB (tokens int32, logprobs float32, loss_mask uint8,
token_versions int32 per token; rewards float32 and prompt_lens int32 per row; ~1k tokens a row)
it times each phase and, in the same run and interleaved with it, a memcpy of the payload's byte
count into a preallocated, already-touched buffer. Figures are medians over the repeats; the first
(cold) encode of each size, which also allocates the buffer, is reported apart as `encode_cold_s`.

Prints a table to stderr and, as the last line of stdout, one JSON object:
{"benchmark": "datapath", "figures": {...}, "reference": {...}, "ratios": {...}}.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402
import numpy as np  # noqa: E402

from buffers.codec import RolloutBatch, decode, encode  # noqa: E402
from buffers.memory import MemoryStore  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
SIZES_MIB = (1, 16, 64)
REPEATS = {1: 60, 16: 15, 64: 9}
TOKENS_PER_ROW = 1024
BYTES_PER_TOKEN = 4 + 4 + 1 + 4
BYTES_PER_ROW = 8 + 4 + 4
PHASES = ("encode", "put", "get", "decode")


def make_batch(target_bytes: int, rng: np.random.Generator) -> RolloutBatch:
    """A realistic rollout batch whose array data is about `target_bytes`."""
    rows = max(1, round(target_bytes / (TOKENS_PER_ROW * BYTES_PER_TOKEN + BYTES_PER_ROW)))
    lengths = rng.integers(TOKENS_PER_ROW // 2, TOKENS_PER_ROW * 3 // 2, size=rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(offsets[-1])
    return RolloutBatch(
        offsets,
        {
            "tokens": rng.integers(0, 151_000, size=n, dtype=np.int32),
            "logprobs": -rng.exponential(1.0, size=n).astype(np.float32),
            "loss_mask": (rng.random(n) < 0.8).astype(np.uint8),
            "token_versions": np.full(n, 42, dtype=np.int32),
        },
        {
            "rewards": rng.standard_normal(rows).astype(np.float32),
            "prompt_lens": rng.integers(32, 512, size=rows, dtype=np.int32),
        },
        {"group": "g00000042", "run": "bench", "version": 42},
    )


async def measure(size_mib: int, store: MemoryStore, rng: np.random.Generator) -> tuple[dict, dict]:
    batch = make_batch(size_mib * MIB, rng)
    key = f"bench/v00000042/g{size_mib}/0"
    started = time.perf_counter()
    payload = encode(batch)
    cold = time.perf_counter() - started
    nbytes = len(payload)
    del payload
    src = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)
    times: dict[str, list[float]] = {phase: [] for phase in (*PHASES, "total", "memcpy")}
    for _ in range(REPEATS[size_mib]):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        t1 = time.perf_counter()
        times["memcpy"].append(t1 - t0)

        t0 = time.perf_counter()
        payload = encode(batch)
        t1 = time.perf_counter()
        await store.put(key, payload)
        t2 = time.perf_counter()
        got = await store.get(key)
        t3 = time.perf_counter()
        decoded = decode(got, verify=True)
        t4 = time.perf_counter()
        assert decoded.rows == batch.rows and decoded.tokens == batch.tokens
        for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[phase].append(seconds)
        times["total"].append(t4 - t0)
        del payload, got, decoded
        await store.remove(key)
    figures: dict[str, float] = {"payload_bytes": nbytes, "rows": batch.rows, "encode_cold_s": cold}
    for phase in (*PHASES, "total"):
        seconds = statistics.median(times[phase])
        figures[f"{phase}_s"] = seconds
        figures[f"{phase}_gibps"] = nbytes / GIB / seconds
    memcpy_s = statistics.median(times["memcpy"])
    return figures, {"memcpy_s": memcpy_s, "memcpy_gibps": nbytes / GIB / memcpy_s}


def ratio(figures: dict, reference: dict) -> float:
    """Throughput of the whole datapath relative to memcpy (1.0 = as fast as one memcpy)."""
    return figures["total_gibps"] / reference["memcpy_gibps"]


async def main() -> dict:
    rng = np.random.default_rng(0)
    store = MemoryStore("bench")
    figures, reference = {}, {}
    for size in SIZES_MIB:
        gc.collect()
        figures[f"{size}MiB"], reference[f"{size}MiB"] = await measure(size, store, rng)
    await store.close()
    *smaller, largest = figures
    ratios = {"memory_vs_memcpy": ratio(figures[largest], reference[largest])}
    ratios |= {f"memory_vs_memcpy_{label}": ratio(figures[label], reference[label]) for label in smaller}
    return {"benchmark": "datapath", "figures": figures, "reference": reference, "ratios": ratios}


def print_table(result: dict) -> None:
    columns = (*PHASES, "total")
    head = " ".join(f"{c + ' GiB/s':>13}" for c in columns)
    print(f"{'size':>6} {'bytes':>10} {head} {'memcpy GiB/s':>13} {'ratio':>6}", file=sys.stderr)
    for label, figs in result["figures"].items():
        ref = result["reference"][label]
        figs = figs | {"memcpy_gibps": ref["memcpy_gibps"]}
        cells = " ".join(f"{figs[f'{c}_gibps']:>13.2f}" for c in (*columns, "memcpy"))
        print(f"{label:>6} {figs['payload_bytes']:>10} {cells} {ratio(figs, ref):>6.2f}", file=sys.stderr)


if __name__ == "__main__":
    outcome = anyio.run(main)
    print_table(outcome)
    print(json.dumps(outcome))
