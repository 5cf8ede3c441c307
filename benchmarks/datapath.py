"""Datapath benchmark: one rollout batch through every transport baton has, against its reference.

For rollout batches of about 1, 16 and 64 MiB (tokens int32, logprobs float32, loss_mask uint8,
token_versions int32 per token; rewards float32 and prompt_lens int32 per row; ~1k tokens a row)
the same batches go, in one run, through:

1. `memcpy` (reference): the payload's byte count into a preallocated, already-touched buffer,
   interleaved with (2);
2. `memory`: encode_parts -> MemoryStore.put (which joins the parts: the one copy) -> get ->
   decode(verify=True), in this process;
3. `mooncake`: encode_parts(batch, pool=store.pool) (hashes the arrays, copies only the head) ->
   MooncakeStore.put (sends from the arrays where they lie) -> get -> decode(verify=True),
   where this process is a pure client (global_segment_size=0) and a second process
   (`benchmarks/_datapath_peer.py`) holds the only segment, so every byte crosses processes
   (TCP on loopback); interleaved with (4). This is what the producer does (stages.rollout.groups);
4. `raw_mooncake` (reference): `batch_put_from` + `batch_get_into` of the payload's byte count
   from / into buffers that are already registered, on the same client: Mooncake's own speed;
5. `ray_default` (reference): the batch as a dict of torch tensors, `ray.put` here and `ray.get`
   inside a Ray actor (another process), timed from put start until the actor call returns, i.e.
   what Ray users get by default (no RAY_ENABLE_ZERO_COPY_TORCH_TENSORS).

Every key is fresh (as in production, where each batch has its own key); keys are removed
outside the timed region once their read lease (2 s, as the masters baton starts give) expired.
Figures are medians over the repeats, after warm-up rounds; GiB/s = bytes / 2^30 / seconds.
The first (cold) encode of each size, which also allocates the buffer, is reported apart as
`encode_cold_s`.

Prints a table to stderr and, as the last line of stdout, one JSON object:
{"benchmark": "datapath", "figures": {path: {size: ...}}, "reference": {ref: {size: ...}},
 "ratios": {...}} where the unsuffixed ratios are at the largest size and the others carry a
`_<size>` suffix. Flags: --sizes, --repeats, --skip-ray, --skip-mooncake (see --help).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import anyio  # noqa: E402
import numpy as np  # noqa: E402

from buffers.codec import RolloutBatch, decode, encode, encode_parts  # noqa: E402
from buffers.memory import MemoryStore  # noqa: E402
from buffers.mooncake_master import READ_LEASE_MS  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
SIZES_MIB = (1, 16, 64)
REPEATS = {  # per path: {size MiB: repeats}; sizes not listed get the last entry's count
    "memory": {1: 60, 16: 15, 64: 9},
    "mooncake": {1: 60, 16: 20, 64: 15},
    "ray": {1: 20, 16: 10, 64: 8},
}
WARMUP = 3
TOKENS_PER_ROW = 1024
BYTES_PER_TOKEN = 4 + 4 + 1 + 4
BYTES_PER_ROW = 8 + 4 + 4
PHASES = ("encode", "put", "get", "decode")
# 2 GiB: with 1 GiB, on a fresh machine (2026-12-07) the first 64 MiB part a pure client put into the peer's segment
# was refused (-200, no space) though the segment was empty; 2 GiB leaves room for both paths' keys under their leases
SEGMENT_BYTES = 2 << 30
LEASE_TTL_MS = READ_LEASE_MS  # the lease the masters baton starts give (a read must not outlast it on a loaded machine)
PEER = Path(__file__).with_name("_datapath_peer.py")


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


def repeats_for(path: str, size_mib: int, override: int | None) -> int:
    if override is not None:
        return override
    table = REPEATS[path]
    return table.get(size_mib, table[max(table)])


def summarize(times: dict[str, list[float]], nbytes: int, **extra: float) -> dict[str, float]:
    """Medians of every timed phase, in seconds and GiB/s of `nbytes`."""
    out: dict[str, float] = {"payload_bytes": nbytes, **extra}
    for phase, samples in times.items():
        seconds = statistics.median(samples)
        out[f"{phase}_s"] = seconds
        out[f"{phase}_gibps"] = nbytes / GIB / seconds
    return out


def check_decoded(decoded: RolloutBatch, batch: RolloutBatch) -> None:
    assert decoded.rows == batch.rows and decoded.tokens == batch.tokens, "decoded batch differs"


# -- 1 + 2: memcpy and MemoryStore -----------------------------------------------------------------
def make_batches(sizes_mib: list[int]) -> dict[int, tuple[RolloutBatch, np.ndarray, float]]:
    """Per size: the batch, random bytes of its payload's size (the memcpy source), and the
    first (cold) encode's seconds. Drawn in the same order as earlier versions of this benchmark,
    so the batches (66,771,308 payload bytes at 64 MiB) are the same."""
    rng, out = np.random.default_rng(0), {}
    for size in sizes_mib:
        batch = make_batch(size * MIB, rng)
        started = time.perf_counter()
        payload = encode(batch)
        cold = time.perf_counter() - started
        out[size] = (batch, rng.integers(0, 256, size=len(payload), dtype=np.uint8), cold)
        del payload
    return out


async def measure_memory(
    size_mib: int, batch: RolloutBatch, src: np.ndarray, cold: float, repeats: int
) -> tuple[dict, dict]:
    store = MemoryStore("bench")
    key = f"bench/v00000042/g{size_mib}/0"
    nbytes = src.nbytes
    dst = np.ones(nbytes, dtype=np.uint8)
    times: dict[str, list[float]] = {phase: [] for phase in (*PHASES, "total")}
    copies: list[float] = []
    for i in range(WARMUP + repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        t1 = time.perf_counter()
        memcpy_s = t1 - t0

        t0 = time.perf_counter()
        payload, _ = encode_parts(batch)  # as the producer encodes (stages.rollout.groups)
        t1 = time.perf_counter()
        await store.put(key, payload)  # joins the parts into one buffer: the one copy
        t2 = time.perf_counter()
        got = await store.get(key)
        t3 = time.perf_counter()
        decoded = decode(got, verify=True)
        t4 = time.perf_counter()
        check_decoded(decoded, batch)
        del payload, got, decoded
        await store.remove(key)
        if i < WARMUP:
            continue
        copies.append(memcpy_s)
        for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[phase].append(seconds)
        times["total"].append(t4 - t0)
    await store.close()
    figures = summarize(times, nbytes, rows=batch.rows, encode_cold_s=cold)
    return figures, summarize({"total": copies}, nbytes)


# -- 3 + 4: MooncakeStore and raw Mooncake, across two processes ----------------------------------
@contextlib.contextmanager
def mooncake_cluster(log_dir: Path) -> Iterator[str]:
    """A master and a peer process holding the only segment; both stopped (by pid) on exit."""
    from buffers.mooncake_master import MooncakeMaster

    master = MooncakeMaster(lease_ttl_ms=LEASE_TTL_MS, log_path=log_dir / "master.log").start()
    peer: subprocess.Popen | None = None
    try:
        with open(log_dir / "peer.log", "wb") as log:
            peer = subprocess.Popen(
                [sys.executable, str(PEER), master.address, str(SEGMENT_BYTES)],
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
            )  # fmt: skip
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: lines.put(peer.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=60)
        except queue.Empty:
            line = ""
        if not line.startswith("ready"):
            tail = (log_dir / "peer.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the segment peer did not start (exit {peer.poll()}): {tail}")
        yield master.address
    finally:
        if peer is not None and peer.poll() is None:
            peer.terminate()
            try:
                peer.wait(15)
            except subprocess.TimeoutExpired:
                peer.kill()
                peer.wait()
        master.stop()


class Reaper:
    """Removes keys once their read lease has expired, outside the timed region."""

    def __init__(self, store) -> None:
        self.store = store
        self.pending: list[tuple[float, str]] = []

    def add(self, *keys: str) -> None:
        now = time.monotonic()
        self.pending += [(now, key) for key in keys]

    def reap(self, wait: bool = False) -> None:
        from buffers.mooncake import MooncakeLeased

        deadline = time.monotonic() + 10
        while self.pending:
            keep = []
            for since, key in self.pending:
                if time.monotonic() - since < LEASE_TTL_MS / 1000:
                    keep.append((since, key))
                    continue
                try:
                    self.store._remove(key)
                except MooncakeLeased:
                    keep.append((since, key))
            self.pending = keep
            if not wait or time.monotonic() > deadline:
                return
            time.sleep(0.02)


def chunked(key: str, base: int, size: int, chunk: int) -> tuple[list[str], list[int], list[int]]:
    """The keys, pointers and sizes MooncakeStore uses for one object (parts when > chunk)."""
    if size <= chunk:
        return [key], [base], [size]
    parts = -(-size // chunk)
    keys = [f"{key}#p{i:04d}" for i in range(parts)]
    return keys, [base + i * chunk for i in range(parts)], [min(chunk, size - i * chunk) for i in range(parts)]


def record_round(times: dict[str, list[float]], raw_times: dict[str, list[float]], phases: tuple[float, ...],
                 put: float, get: float) -> None:
    """One measured round: the raw put and get, and the store path's phases with their sums."""
    raw_times["put"].append(put)
    raw_times["get"].append(get)
    raw_times["total"].append(put + get)
    for phase, seconds in zip(PHASES, phases, strict=True):
        times[phase].append(seconds)
    times["store"].append(phases[1] + phases[2])
    times["total"].append(sum(phases))


async def measure_mooncake(store, size_mib: int, batch: RolloutBatch, repeats: int, reaper: Reaper):
    client, config, chunk = store._client, store._config, store.settings.chunk_bytes
    started = time.perf_counter()
    payload = encode(batch, pool=store.pool)
    cold = time.perf_counter() - started
    nbytes = len(payload)
    src = store.pool.take(nbytes)  # registered: the raw reference sends from and reads into these
    src[:] = np.frombuffer(payload, dtype=np.uint8)
    dst = store.pool.take(nbytes)
    del payload

    def raw(i: int) -> tuple[float, float]:
        keys, ptrs, sizes = chunked(f"raw/{size_mib}/{i}", src.ctypes.data, nbytes, chunk)
        _, dptrs, _ = chunked("", dst.ctypes.data, nbytes, chunk)
        t0 = time.perf_counter()
        put = client.batch_put_from(keys, ptrs, sizes, config)
        t1 = time.perf_counter()
        got = client.batch_get_into(keys, dptrs, sizes)
        for _ in range(3):  # a read that outlasted its lease (-707, a loaded machine) is read again, as the store does
            if all(n != -707 for n in got):
                break
            got = client.batch_get_into(keys, dptrs, sizes)
        t2 = time.perf_counter()
        assert all(rc == 0 for rc in put), f"raw batch_put_from failed: {put}"
        assert got == sizes, f"raw batch_get_into of {keys} ({sizes} bytes) failed: {got}"
        reaper.add(*keys)
        return t1 - t0, t2 - t1

    async def through_store(i: int) -> tuple[float, ...]:
        key = f"bench/v00000042/g{size_mib}/{i}"
        t0 = time.perf_counter()
        payload, _ = encode_parts(batch, pool=store.pool)  # as the producer encodes (stages.rollout.groups)
        t1 = time.perf_counter()
        await store.put(key, payload)  # sent from the batch's arrays where they lie
        t2 = time.perf_counter()
        got = await store.get(key, size_hint=payload.nbytes)  # as the learner does, from the Ref
        t3 = time.perf_counter()
        decoded = decode(got, verify=True)
        t4 = time.perf_counter()
        check_decoded(decoded, batch)
        del payload, got, decoded
        reaper.add(key)
        return t1 - t0, t2 - t1, t3 - t2, t4 - t3

    times: dict[str, list[float]] = {p: [] for p in (*PHASES, "store", "total")}
    raw_times: dict[str, list[float]] = {"put": [], "get": [], "total": []}
    for i in range(WARMUP + repeats):
        if i % 2:  # alternate the order, so neither path always runs right after the other
            phases = await through_store(i)
            put, get = raw(i)
        else:
            put, get = raw(i)
            phases = await through_store(i)
        if i == 0:
            assert np.array_equal(src, dst), "raw batch_get_into returned other bytes"
        reaper.reap()
        if i >= WARMUP:
            record_round(times, raw_times, phases, put, get)
    reaper.reap(wait=True)
    figures = summarize(times, nbytes, rows=batch.rows, encode_cold_s=cold)
    return figures, summarize(raw_times, nbytes)


async def run_mooncake(batches: dict[int, RolloutBatch], override: int | None) -> tuple[dict, dict]:
    from buffers.mooncake import MooncakeSettings, MooncakeStore

    figures, reference = {}, {}
    with tempfile.TemporaryDirectory(prefix="datapath-") as tmp, mooncake_cluster(Path(tmp)) as address:
        store = MooncakeStore(MooncakeSettings(master_server_address=address, global_segment_size=0))
        try:
            reaper = Reaper(store)
            for size, batch in batches.items():
                gc.collect()
                repeats = repeats_for("mooncake", size, override)
                figures[f"{size}MiB"], reference[f"{size}MiB"] = await measure_mooncake(
                    store, size, batch, repeats, reaper
                )
        finally:
            await store.close()
    return figures, reference


# -- 5: Ray's default path -------------------------------------------------------------------------
def as_tensors(batch: RolloutBatch) -> dict:
    import torch

    tensors = {"offsets": torch.from_numpy(batch.offsets)}
    tensors |= {name: torch.from_numpy(arr) for name, arr in batch.token_fields.items()}
    tensors |= {name: torch.from_numpy(arr) for name, arr in batch.row_fields.items()}
    return {"tensors": tensors, "meta": dict(batch.meta)}


def run_ray(batches: dict[int, RolloutBatch], override: int | None) -> dict:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray listener on 127.0.0.1
    os.environ.pop("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", None)  # the default path
    import ray

    from pipeline.runtime.ray import init_own_cluster

    @ray.remote(num_cpus=1)
    class Getter:
        def __init__(self) -> None:
            import torch

            torch.set_num_threads(1)

        def get(self, refs: list) -> tuple[float, int]:
            t0 = time.perf_counter()
            got = ray.get(refs[0])
            seconds = time.perf_counter() - t0
            return seconds, sum(t.nbytes for t in got["tensors"].values())

    reference = {}
    init_own_cluster(num_cpus=2, log_to_driver=False)  # never a cluster `ray start` left behind
    try:
        getter = Getter.remote()
        for size, batch in batches.items():
            gc.collect()
            payload = as_tensors(batch)
            nbytes = sum(t.nbytes for t in payload["tensors"].values())
            times: dict[str, list[float]] = {"put": [], "actor_get": [], "e2e": []}
            for i in range(WARMUP + repeats_for("ray", size, override)):
                t0 = time.perf_counter()
                ref = ray.put(payload)
                t1 = time.perf_counter()
                actor_get, got = ray.get(getter.get.remote([ref]))
                t2 = time.perf_counter()
                assert got == nbytes, f"the actor got {got} of {nbytes} bytes"
                del ref
                if i >= WARMUP:
                    times["put"].append(t1 - t0)
                    times["actor_get"].append(actor_get)
                    times["e2e"].append(t2 - t0)
            reference[f"{size}MiB"] = summarize(times, nbytes)
        ray.kill(getter)
    finally:
        ray.shutdown()
    return reference


# -- report ----------------------------------------------------------------------------------------
def compute_ratios(figures: dict, reference: dict, labels: list[str]) -> dict[str, float]:
    """Throughput ratios (> 1: the first path is faster); unsuffixed at the largest size."""
    pairs: dict[str, Callable[[str], float | None]] = {}
    memory, mooncake = figures.get("memory", {}), figures.get("mooncake", {})
    memcpy, raw, ray = reference.get("memcpy", {}), reference.get("raw_mooncake", {}), reference.get("ray_default", {})
    if memory:
        pairs["memory_vs_memcpy"] = lambda s: memory[s]["total_gibps"] / memcpy[s]["total_gibps"]
    if mooncake:
        pairs["mooncake_vs_raw_mooncake"] = lambda s: mooncake[s]["store_gibps"] / raw[s]["total_gibps"]
        pairs["mooncake_with_codec_vs_raw_mooncake"] = lambda s: mooncake[s]["total_gibps"] / raw[s]["total_gibps"]
    if mooncake and ray:
        pairs["mooncake_vs_ray_default"] = lambda s: mooncake[s]["total_gibps"] / ray[s]["e2e_gibps"]
        # the ceiling of the ratio above: Mooncake's own put+get, with no store and no codec
        pairs["raw_mooncake_vs_ray_default"] = lambda s: raw[s]["total_gibps"] / ray[s]["e2e_gibps"]
    ratios: dict[str, float] = {}
    for name, fn in pairs.items():
        ratios[name] = fn(labels[-1])
        for label in labels[:-1]:
            ratios[f"{name}_{label}"] = fn(label)
    return ratios


def print_table(result: dict) -> None:
    rows: list[tuple[str, str, int, list[float | None], float]] = []
    figures, reference = result["figures"], result["reference"]

    def cells(figs: dict, names: tuple[str, ...]) -> list[float | None]:
        return [figs.get(f"{n}_gibps") if n else None for n in names]

    sources = [
        ("memcpy", reference.get("memcpy", {}), (None, None, None, None, "total")),
        ("memory", figures.get("memory", {}), (*PHASES, "total")),
        ("raw_mooncake", reference.get("raw_mooncake", {}), (None, "put", "get", None, "total")),
        ("mooncake", figures.get("mooncake", {}), (*PHASES, "total")),
        ("ray_default", reference.get("ray_default", {}), (None, "put", "actor_get", None, "e2e")),
    ]
    labels = list(dict.fromkeys(label for _, by_size, _ in sources for label in by_size))
    for label in labels:
        for name, by_size, names in sources:
            if label in by_size:
                figs = by_size[label]
                total = figs[f"{names[-1]}_s"]
                rows.append((label, name, figs["payload_bytes"], cells(figs, names), total))
    head = " ".join(f"{c + ' GiB/s':>13}" for c in (*PHASES, "total"))
    print(f"{'size':>6} {'path':<13} {'bytes':>10} {head} {'total ms':>9}", file=sys.stderr)
    for label, name, nbytes, values, total in rows:
        text = " ".join(f"{v:>13.2f}" if v is not None else f"{'-':>13}" for v in values)
        print(f"{label:>6} {name:<13} {nbytes:>10} {text} {total * 1e3:>9.2f}", file=sys.stderr)
    if "mooncake" in figures:
        print("mooncake store-only (put+get) GiB/s: " + ", ".join(
            f"{label} {figs['store_gibps']:.2f}" for label, figs in figures["mooncake"].items()
        ), file=sys.stderr)  # fmt: skip
    for name, value in result["ratios"].items():
        print(f"  {name:<44} {value:6.2f}", file=sys.stderr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES_MIB), help="batch sizes in MiB")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per size and path (default: per path)")
    parser.add_argument("--skip-ray", action="store_true", help="leave out the Ray default path")
    parser.add_argument("--skip-mooncake", action="store_true", help="leave out MooncakeStore and raw Mooncake")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        if not args.skip_ray:
            raise
    made = make_batches(args.sizes)
    batches = {size: batch for size, (batch, _, _) in made.items()}
    labels = [f"{size}MiB" for size in args.sizes]
    figures: dict[str, dict] = {"memory": {}}
    reference: dict[str, dict] = {"memcpy": {}}

    async def memory_part() -> None:
        for size, (batch, src, cold) in made.items():
            gc.collect()
            repeats = repeats_for("memory", size, args.repeats)
            figures["memory"][f"{size}MiB"], reference["memcpy"][f"{size}MiB"] = await measure_memory(
                size, batch, src, cold, repeats
            )

    anyio.run(memory_part)
    if not args.skip_mooncake:
        figures["mooncake"], reference["raw_mooncake"] = anyio.run(run_mooncake, batches, args.repeats)
    if not args.skip_ray:
        reference["ray_default"] = run_ray(batches, args.repeats)
    ratios = compute_ratios(figures, reference, labels)
    return {"benchmark": "datapath", "figures": figures, "reference": reference, "ratios": ratios}


if __name__ == "__main__":
    outcome = main()
    print_table(outcome)
    print(json.dumps(outcome))
