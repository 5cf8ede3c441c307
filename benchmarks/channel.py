"""Refs per second through a local `Channel`, against anyio's memory object stream in the same run.

One producer task sends N refs, one consumer task receives them; the figure is N / elapsed wall time.
Each transport is one `bench_*` coroutine taking the items and returning the elapsed seconds, so
another transport (e.g. a Ray-hosted channel) is one more function and one more row.

`local_checkpoint_every_op` is the local channel made to yield on every operation, as the anyio
stream does (table only), to show what amortising checkpoints buys.

Ray section (skip with `--skip-ray`): a `RayChannel` (host actor, same bound) between a producer Ray
actor (another process) and this process. `ray_refs_per_s` moves the refs as a pipeline would, by
`send_many` batches of RAY_SEND_BATCH and `receive_many(MAX_ITEMS)`; `ray_send_many_8` (table only)
sends batches of 8; `ray_plain_refs_per_s` uses one round trip per ref (`send` / async iteration).
Throughput is about (batch size) x (round trips per second), and a round trip is ~1-3 ms here. Ray is
started (127.0.0.1 only) and shut down here; the timing starts once both actors run and ends when the
driver has received the last ref.

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
RAY_SEND_BATCH = MAX_ITEMS  # refs per send_many (a channel-full); the table also shows 8


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


def _ray_producer_class():
    """The producer actor class (built here so that Ray ships it by value, whatever imported this module)."""
    import msgspec
    import ray

    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self) -> None:
            self.items: list[Ref] = []

        async def load(self, data: bytes) -> int:
            self.items = msgspec.msgpack.decode(data, type=list[Ref])
            return len(self.items)

        async def produce(self, channel, batch: int) -> None:
            items = self.items
            if batch:
                for i in range(0, len(items), batch):
                    await channel.send_many(items[i : i + batch])
            else:
                for item in items:
                    await channel.send(item)
            await channel.aclose()

    return Producer


async def bench_ray(items: Sequence[Ref], batch: int) -> float:
    """Producer actor -> RayChannel -> this process; needs Ray initialised. batch == 0: plain send/receive."""
    import msgspec
    import ray

    from pipeline.runtime.ray_channel import RayChannel

    channel = RayChannel.create("bench", max_items=MAX_ITEMS)
    producer = _ray_producer_class().remote()
    try:
        await producer.load.remote(msgspec.msgpack.encode(list(items)))
        await channel.stats()  # the host runs too
        received = 0
        started = time.perf_counter()
        done = producer.produce.remote(channel, batch)
        if batch:
            while True:
                try:
                    received += len(await channel.receive_many(MAX_ITEMS))
                except anyio.EndOfStream:
                    break
        else:
            async for _ in channel:
                received += 1
        await done
        elapsed = time.perf_counter() - started
    finally:
        channel.kill()
        ray.kill(producer)
    if received != len(items):
        raise RuntimeError(f"received {received} of {len(items)} items")
    return elapsed


async def run_ray(n_batched: int, n_plain: int, repeats: int) -> dict[str, float]:
    import os

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from pipeline.runtime.ray import init_own_cluster

    init_own_cluster(num_cpus=2, log_to_driver=False)  # never a cluster `ray start` left behind
    try:
        best: dict[str, float] = {}
        for _ in range(repeats):
            runs = (
                ("ray_refs_per_s", n_batched, RAY_SEND_BATCH),
                ("ray_send_many_8_refs_per_s", n_batched // 2, 8),
                ("ray_plain_refs_per_s", n_plain, 0),
            )
            for name, n, batch in runs:
                rate = n / await bench_ray(make_refs(n), batch)
                best[name] = max(best.get(name, 0.0), rate)
        return best
    finally:
        ray.shutdown()


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
    parser.add_argument("--skip-ray", action="store_true", help="skip the Ray-hosted channel (no Ray start)")
    parser.add_argument("--ray-items", type=int, default=5_000, help="refs through the Ray channel, batched")
    parser.add_argument("--ray-plain-items", type=int, default=1_000, help="refs through it, one per round trip")
    args = parser.parse_args(argv)

    rates = anyio.run(run_all, args.items, args.repeats, backend="asyncio")
    if not args.skip_ray:
        rates |= anyio.run(run_ray, args.ray_items, args.ray_plain_items, args.repeats, backend="asyncio")
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
    if not args.skip_ray:
        result["figures"]["ray_refs_per_s"] = round(rates["ray_refs_per_s"])
        result["figures"]["ray_plain_refs_per_s"] = round(rates["ray_plain_refs_per_s"])
        result["ratios"]["ray_refs_per_s"] = round(rates["ray_refs_per_s"])
        result["ratios"]["ray_vs_local"] = round(rates["ray_refs_per_s"] / rates["local_refs_per_s"], 5)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
