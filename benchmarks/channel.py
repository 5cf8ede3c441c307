"""Refs per second through a local `Channel`, against anyio's memory object stream in the same run.

One producer task sends N refs, one consumer task receives them; the figure is N / elapsed wall time.
Each transport is one `bench_*` coroutine taking the items and returning the elapsed seconds, so
another transport (e.g. a Ray-hosted channel) is one more function and one more row.

`local_checkpoint_every_op` is the local channel made to yield on every operation, as the anyio
stream does (table only), to show what amortising checkpoints buys.

Prints a table to stderr and, as the last stdout line, one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.channel import Channel  # noqa: E402
from pipeline.refs import Ref, make_key  # noqa: E402

MAX_ITEMS = 64
REF_NBYTES = 4096


def make_refs(n: int) -> list[Ref]:
    return [
        Ref(
            store="bench",
            key=make_key("bench", i // 1000, f"g{i % 97}", f"s{i}"),
            version=i // 1000,
            version_max=i // 1000,
            rows=8,
            nbytes=REF_NBYTES,
            checksum=i,
            group=f"g{i % 97}",
        )
        for i in range(n)
    ]


async def _pump(
    send: Callable[[Ref], Awaitable[None]],
    close: Callable[[], None],
    consume: Callable[[], Awaitable[int]],
    items: Sequence[Ref],
) -> float:
    received = 0

    async def producer() -> None:
        for item in items:
            await send(item)
        close()

    async def consumer() -> None:
        nonlocal received
        received = await consume()

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer)
        tg.start_soon(producer)
    elapsed = time.perf_counter() - started
    if received != len(items):
        raise RuntimeError(f"received {received} of {len(items)} items")
    return elapsed


class _CheckpointEveryOpChannel(Channel[Ref]):
    CHECKPOINT_EVERY = 1


async def bench_local(
    items: Sequence[Ref], max_bytes: int | None = None, channel_type: type[Channel[Ref]] = Channel
) -> float:
    channel = channel_type("bench", max_items=MAX_ITEMS, max_bytes=max_bytes)

    async def consume() -> int:
        n = 0
        async for _ in channel:
            n += 1
        return n

    return await _pump(channel.send, channel.close, consume, items)


async def bench_local_bytes_bounded(items: Sequence[Ref]) -> float:
    return await bench_local(items, max_bytes=MAX_ITEMS // 2 * REF_NBYTES)


async def bench_local_checkpoint_every_op(items: Sequence[Ref]) -> float:
    return await bench_local(items, channel_type=_CheckpointEveryOpChannel)


async def bench_anyio_stream(items: Sequence[Ref]) -> float:
    send_stream, receive_stream = anyio.create_memory_object_stream[Ref](MAX_ITEMS)

    async def consume() -> int:
        n = 0
        async with receive_stream:
            async for _ in receive_stream:
                n += 1
        return n

    return await _pump(send_stream.send, send_stream.close, consume, items)


TRANSPORTS: dict[str, Callable[[Sequence[Ref]], Awaitable[float]]] = {
    "local_refs_per_s": bench_local,
    "local_bytes_bounded_refs_per_s": bench_local_bytes_bounded,
    "local_checkpoint_every_op_refs_per_s": bench_local_checkpoint_every_op,
    "anyio_memory_stream_refs_per_s": bench_anyio_stream,
}


async def run_all(n: int, repeats: int) -> dict[str, float]:
    items = make_refs(n)
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, bench in TRANSPORTS.items():
            elapsed = await bench(items)
            best[name] = min(best.get(name, float("inf")), elapsed)
    return {name: n / elapsed for name, elapsed in best.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=1, help="best of this many runs per transport")
    args = parser.parse_args(argv)

    rates = anyio.run(run_all, args.items, args.repeats, backend="asyncio")
    reference = rates["anyio_memory_stream_refs_per_s"]
    print(f"{'transport':<40}{'refs/s':>12}{'vs anyio':>10}", file=sys.stderr)
    for name, rate in rates.items():
        print(f"{name:<40}{rate:>12,.0f}{rate / reference:>10.2f}", file=sys.stderr)
    result = {
        "benchmark": "channel",
        "figures": {
            "local_refs_per_s": round(rates["local_refs_per_s"]),
            "local_bytes_bounded_refs_per_s": round(rates["local_bytes_bounded_refs_per_s"]),
        },
        "reference": {"anyio_memory_stream_refs_per_s": round(reference)},
        "ratios": {
            "local_refs_per_s": round(rates["local_refs_per_s"]),
            "local_vs_anyio_stream": round(rates["local_refs_per_s"] / reference, 3),
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
