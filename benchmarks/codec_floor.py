"""Where the codec's time goes on the rollout path, and the least the path can cost with its guarantees.

`benchmarks/datapath.py` times encode -> MooncakeStore.put -> get -> decode(verify=True) against raw Mooncake
put + get of the same bytes. This benchmark splits the codec's share, for the same batches (1, 16, 64 MiB):

1. **parts** (one process, no store): `encode` beside its two necessary parts, the copy of the batch's arrays
   into one buffer (`np.copyto` per column: the one copy into the store's registered memory) and xxh3_64 of the
   payload (the checksum written at encode); `decode(verify=True)` beside xxh3_64 of the payload (the checksum
   checked at read) and `decode(verify=False)`. `encode_rest` / `decode_rest` are what is left (header, pool,
   descriptors, views: the Python overhead).
2. **overlap** (two processes, as in datapath.py): a raw `batch_put_from` of the payload alone, then `encode`
   alone, then both at once (the put in a thread, the encode here); the same for `batch_get_into` and
   `decode(verify=True)`. `hidden` is the share of the codec's time the overlap took off the sum
   (1: fully hidden behind the transfer, 0: none). On a machine where the transfer keeps every core busy
   (Mooncake's blocking calls spin their calling thread for the whole transfer) nothing can be hidden.

`floor_parts_ratio` is the same for the path the producer takes since 2026-12-07 (`encode_parts`: the arrays
sent where they lie, so two hashes and no copy). `floor_ratio` is raw put+get over raw put+get plus the floor
(copy + two hashes): the best
`mooncake_with_codec_vs_raw_mooncake` a path that copies once and checks a checksum at both ends can reach
when nothing overlaps, even with a store that costs nothing, with the parts' speeds measured alone;
`codec_ratio_in_context` is the same with `encode` and `decode` as the overlap part times them, each right
after a transfer, as on the path (where they run slower than alone). Medians over the repeats, after warm-up rounds.
Prints a table to stderr and one JSON object as the last line of stdout. Flags: --sizes, --repeats,
--skip-mooncake.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402
import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from benchmarks.datapath import MIB, SIZES_MIB, WARMUP, Reaper, chunked, make_batch, mooncake_cluster  # noqa: E402
from buffers.codec import RolloutBatch, decode, encode, encode_parts  # noqa: E402
from buffers.pool import BufferPool  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls after WARMUP calls (its result dropped at once)."""
    samples = []
    for i in range(WARMUP + repeats):
        t0 = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - t0
        del result
        if i >= WARMUP:
            samples.append(seconds)
    return statistics.median(samples)


def measure_parts(batch: RolloutBatch, repeats: int) -> dict[str, float]:
    pool = BufferPool(512 << 20, min_nbytes=0)
    payload = encode(batch, pool=pool)
    columns = [arr for _, _, arr in batch._columns()]
    dst = pool.take(len(payload))

    def copy() -> None:  # every column into its 64-aligned slot, as encode places it
        at = 0
        for arr in columns:
            np.copyto(dst[at : at + arr.nbytes], arr.reshape(-1).view(np.uint8))
            at += -(-arr.nbytes // 64) * 64

    out = {
        "payload_bytes": len(payload),
        "encode_s": timed(lambda: encode(batch, pool=pool), repeats),
        "encode_parts_s": timed(lambda: encode_parts(batch, pool=pool), repeats),
        "copy_s": timed(copy, repeats),
        "hash_s": timed(lambda: xxhash.xxh3_64_intdigest(payload), repeats),
        "decode_s": timed(lambda: decode(payload, verify=True), repeats),
        "decode_unverified_s": timed(lambda: decode(payload, verify=False), repeats),
    }
    out["encode_rest_s"] = out["encode_s"] - out["copy_s"] - out["hash_s"]
    out["decode_rest_s"] = out["decode_s"] - out["hash_s"]
    out["floor_s"] = out["copy_s"] + 2 * out["hash_s"]
    out["floor_parts_s"] = 2 * out["hash_s"]  # the gathered path (encode_parts, a put from the arrays): no copy
    return out


def timed_once(fn) -> float:
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    del result
    return seconds


def together(transfer, codec) -> float:
    """Seconds until both `transfer()` (in a thread) and `codec()` (here) are done."""
    t0 = time.perf_counter()
    thread = threading.Thread(target=transfer)
    thread.start()
    result = codec()
    thread.join()
    del result
    return time.perf_counter() - t0


def measure_overlap(store, size_mib: int, batch: RolloutBatch, repeats: int, reaper: Reaper) -> dict[str, float]:
    client, config, chunk = store._client, store._config, store.settings.chunk_bytes
    payload = encode(batch, pool=store.pool)
    nbytes = len(payload)
    src, dst = store.pool.take(nbytes), store.pool.take(nbytes)
    src[:] = np.frombuffer(payload, dtype=np.uint8)
    names = ("put", "encode", "put_with_encode", "get", "decode", "get_with_decode")
    times: dict[str, list[float]] = {name: [] for name in names}

    def put(key: str) -> None:
        keys, ptrs, sizes = chunked(key, src.ctypes.data, nbytes, chunk)
        assert all(rc == 0 for rc in client.batch_put_from(keys, ptrs, sizes, config)), f"put {key} failed"
        reaper.add(*keys)

    def get(key: str) -> None:
        keys, ptrs, sizes = chunked(key, dst.ctypes.data, nbytes, chunk)
        assert client.batch_get_into(keys, ptrs, sizes) == sizes, f"get {key} failed"

    for i in range(WARMUP + repeats):
        alone, both = f"floor/{size_mib}/{i}/a", f"floor/{size_mib}/{i}/b"
        rounds = (
            timed_once(partial(put, alone)), timed_once(partial(encode, batch, pool=store.pool)),
            together(partial(put, both), partial(encode, batch, pool=store.pool)),
            timed_once(partial(get, alone)), timed_once(partial(decode, payload, verify=True)),
            together(partial(get, both), partial(decode, payload, verify=True)),
        )  # fmt: skip
        reaper.reap()
        if i >= WARMUP:
            for name, seconds in zip(names, rounds, strict=True):
                times[name].append(seconds)
    reaper.reap(wait=True)
    out = {name: statistics.median(samples) for name, samples in times.items()}
    for transfer, codec in (("put", "encode"), ("get", "decode")):
        saved = out[transfer] + out[codec] - out[f"{transfer}_with_{codec}"]
        out[f"{codec}_hidden"] = saved / out[codec]
    return {f"{name}_s" if not name.endswith("hidden") else name: v for name, v in out.items()}


async def run_overlap(batches: dict[int, RolloutBatch], repeats: int) -> dict[str, dict[str, float]]:
    from buffers.mooncake import MooncakeSettings, MooncakeStore

    out = {}
    with tempfile.TemporaryDirectory(prefix="codec-floor-") as tmp, mooncake_cluster(Path(tmp)) as address:
        store = MooncakeStore(MooncakeSettings(master_server_address=address, global_segment_size=0))
        try:
            reaper = Reaper(store)
            for size, batch in batches.items():
                out[f"{size}MiB"] = measure_overlap(store, size, batch, repeats, reaper)
        finally:
            await store.close()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES_MIB), help="batch sizes in MiB")
    parser.add_argument("--repeats", type=int, default=15, help="measured repeats per size")
    parser.add_argument("--skip-mooncake", action="store_true", help="only the parts, no overlap measurement")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)  # the same draws as datapath.py: the same batches
    batches = {size: make_batch(size * MIB, rng) for size in args.sizes}
    parts = {f"{size}MiB": measure_parts(batch, args.repeats) for size, batch in batches.items()}
    overlap = {} if args.skip_mooncake else anyio.run(run_overlap, batches, args.repeats)
    for label, figs in overlap.items():
        raw = figs["put_s"] + figs["get_s"]
        parts[label]["floor_ratio"] = raw / (raw + parts[label]["floor_s"])
        parts[label]["floor_parts_ratio"] = raw / (raw + parts[label]["floor_parts_s"])
        parts[label]["codec_ratio_in_context"] = raw / (raw + figs["encode_s"] + figs["decode_s"])
    return {"benchmark": "codec_floor", "parts": parts, "overlap": overlap}


def print_table(result: dict) -> None:
    for label, figs in result["parts"].items():
        ms = {k[:-2]: v * 1e3 for k, v in figs.items() if k.endswith("_s")}
        print(f"{label:>6} encode {ms['encode']:.2f} ms = copy {ms['copy']:.2f} + hash {ms['hash']:.2f} + rest "
              f"{ms['encode_rest']:.2f}; decode {ms['decode']:.2f} = hash {ms['hash']:.2f} + rest "
              f"{ms['decode_rest']:.2f}; floor (copy + 2 hashes) {ms['floor']:.2f} ms; encode_parts "
              f"{ms['encode_parts']:.2f} ms, its floor (2 hashes) {ms['floor_parts']:.2f} ms"
              + (f", floor_ratio {figs['floor_ratio']:.2f}, floor_parts_ratio {figs['floor_parts_ratio']:.2f}, "
                 f"codec_ratio_in_context "
                 f"{figs['codec_ratio_in_context']:.2f}" if "floor_ratio" in figs else ""), file=sys.stderr)
    for label, figs in result["overlap"].items():
        ms = {k[:-2]: v * 1e3 for k, v in figs.items() if k.endswith("_s")}
        print(f"{label:>6} put {ms['put']:.2f} + encode {ms['encode']:.2f} -> together {ms['put_with_encode']:.2f} "
              f"(hidden {figs['encode_hidden']:.2f}); get {ms['get']:.2f} + decode {ms['decode']:.2f} -> together "
              f"{ms['get_with_decode']:.2f} (hidden {figs['decode_hidden']:.2f})", file=sys.stderr)


if __name__ == "__main__":
    outcome = main()
    print_table(outcome)
    print(json.dumps(outcome))
