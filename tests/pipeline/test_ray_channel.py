"""RayChannel across real processes: FIFO, backpressure by items and bytes, close then drain, no loss
under concurrency and cancellation, stats. One local Ray cluster for the module (127.0.0.1 only)."""

from __future__ import annotations

import os
import random
import sys
import time

import anyio
import msgspec
import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402

from pipeline.channel import ChannelClosed  # noqa: E402
from pipeline.refs import Ref, make_key  # noqa: E402
from pipeline.runtime.ray_channel import ChannelItemError, RayChannel  # noqa: E402

pytestmark = pytest.mark.anyio

SHORT = 0.4  # "does not complete within": long enough for several round trips on a busy 2-core box
HUNG_AFTER = 120.0  # a guard against a hang, far above any correct run's time

_encode = msgspec.msgpack.encode


def _decode_refs(data: bytes) -> list[Ref]:
    return msgspec.msgpack.decode(data, type=list[Ref])


# the peer actors below are defined in this module, which Ray workers cannot import: ship it by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def peers(ray_cluster):
    """Two long-lived peer actors (other processes) that produce into / consume from channels."""
    actors = [Peer.remote() for _ in range(2)]
    ray.get([a.ping.remote() for a in actors])
    yield actors
    for a in actors:
        ray.kill(a)


@pytest.fixture
def make_channel(ray_cluster):
    made: list[RayChannel[Ref]] = []

    def make(max_items: int, max_bytes: int | None = None) -> RayChannel[Ref]:
        ch = RayChannel.create("test", max_items=max_items, max_bytes=max_bytes)
        made.append(ch)
        ray.get(ch.host.stats.remote())  # the host process has started (so waits below are waits)
        return ch

    yield make
    for ch in made:
        ch.kill()


def ref(i: int, nbytes: int = 10, producer: str = "p") -> Ref:
    return Ref(
        store="s",
        key=make_key("run", 0, producer, f"s{i}"),
        version=0,
        version_max=0,
        rows=1,
        nbytes=nbytes,
        checksum=i,
        group=producer,
    )


@ray.remote(num_cpus=0)
class Peer:
    """A process on the other side of a channel."""

    async def ping(self) -> int:
        return os.getpid()

    async def produce(self, ch: RayChannel[Ref], data: bytes, batch: int = 0, close: bool = False) -> int:
        """Send the encoded refs (plainly if batch == 0, else by send_many of `batch`); return the pid."""
        items = _decode_refs(data)
        if batch:
            for i in range(0, len(items), batch):
                await ch.send_many(items[i : i + batch])
        else:
            for item in items:
                await ch.send(item)
        if close:
            await ch.aclose()
        return os.getpid()

    async def produce_random_batches(self, ch: RayChannel[Ref], data: bytes, seed: int) -> None:
        items = _decode_refs(data)
        rng = random.Random(seed)
        i = 0
        while i < len(items):
            n = rng.choice([1, 1, 3, 17, 40])
            if n == 1:
                await ch.send(items[i])
            else:
                await ch.send_many(items[i : i + n])
            i += n

    async def send_timed(self, ch: RayChannel[Ref], data: bytes) -> float | str:
        """Send one ref; return when (time.monotonic, system-wide) the send completed, or the error's name."""
        try:
            await ch.send(_decode_refs(data)[0])
        except ChannelClosed:
            return "ChannelClosed"
        return time.monotonic()

    async def consume(self, ch: RayChannel[Ref], max_items: int) -> bytes:
        """receive_many until the channel is closed and drained; return the refs encoded."""
        got: list[Ref] = []
        while True:
            try:
                got += await ch.receive_many(max_items)
            except anyio.EndOfStream:
                return _encode(got)

    async def receive_one(self, ch: RayChannel[Ref]) -> bytes | str:
        try:
            return _encode([await ch.receive()])
        except anyio.EndOfStream:
            return "EndOfStream"


async def test_fifo_actor_producer_to_driver(peers, make_channel) -> None:
    ch = make_channel(max_items=4)
    items = [ref(i) for i in range(60)]
    with anyio.fail_after(HUNG_AFTER):
        pid = peers[0].produce.remote(ch, _encode(items[:30]), 0)  # plain sends
        got = [await ch.receive() for _ in range(30)]
        assert await pid != os.getpid()
        done = peers[0].produce.remote(ch, _encode(items[30:]), 7, True)  # batches, then close
        async for item in ch:  # iteration stops at close + drained
            got.append(item)
        await done
    assert got == items
    assert ch.closed


async def test_fifo_driver_to_actor_consumer(peers, make_channel) -> None:
    ch = make_channel(max_items=8)
    items = [ref(i) for i in range(100)]
    with anyio.fail_after(HUNG_AFTER):
        consumed = peers[1].consume.remote(ch, 5)
        for item in items[:20]:
            await ch.send(item)
        await ch.send_many(items[20:90])
        for item in items[90:]:
            await ch.send(item)
        ch.close()
        assert _decode_refs(await consumed) == items


async def test_backpressure_by_items_across_processes(peers, make_channel) -> None:
    ch = make_channel(max_items=2)
    with anyio.fail_after(HUNG_AFTER):
        await ch.send_many([ref(0), ref(1)])
    assert ch.depth == 2
    blocked = peers[0].send_timed.remote(ch, _encode([ref(2)]))
    with anyio.move_on_after(SHORT) as scope:
        await blocked
    assert scope.cancelled_caught, "the producer's send should block while the channel is full"
    with pytest.raises(anyio.WouldBlock):
        await ch.send_nowait(ref(99))
    with anyio.fail_after(HUNG_AFTER):
        before_receive = time.monotonic()
        assert (await ch.receive()).checksum == 0
        completed_at = await blocked
    assert completed_at >= before_receive, "the blocked send completed before the driver received"
    with anyio.fail_after(HUNG_AFTER):
        assert [r.checksum for r in await ch.receive_many(10)] == [1, 2]
    stats = await ch.stats()
    assert stats.send_wait_s >= SHORT / 2  # the host's view starts when the send reached it
    assert (stats.sent, stats.received, stats.depth) == (3, 3, 0)


async def test_backpressure_by_bytes_across_processes(peers, make_channel) -> None:
    ch = make_channel(max_items=100, max_bytes=100)
    with anyio.fail_after(HUNG_AFTER):
        await ch.send(ref(0, nbytes=60))
        await ch.send(ref(1, nbytes=40))
    assert (ch.depth, ch.nbytes) == (2, 100)
    blocked = peers[0].send_timed.remote(ch, _encode([ref(2, nbytes=30)]))
    with anyio.move_on_after(SHORT) as scope:
        await blocked
    assert scope.cancelled_caught, "the producer's send should block while its bytes do not fit"
    with anyio.fail_after(HUNG_AFTER):
        before_receive = time.monotonic()
        assert (await ch.receive()).nbytes == 60
        completed_at = await blocked
    assert completed_at >= before_receive
    stats = await ch.stats()
    assert (stats.depth, stats.nbytes) == (2, 70)


async def test_close_then_drain_across_processes(peers, make_channel) -> None:
    ch = make_channel(max_items=10)
    waiting = peers[1].receive_one.remote(ch)  # the consumer process waits on the empty channel
    with anyio.fail_after(HUNG_AFTER):
        await ch.send(ref(0))
        assert [r.checksum for r in _decode_refs(await waiting)] == [0]
        await peers[0].produce.remote(ch, _encode([ref(i) for i in range(1, 6)]), 2, True)
        # closed with 5 items inside: still receivable, then EndOfStream, in every process
        with pytest.raises(ChannelClosed):
            await ch.send(ref(99))
        assert [r.checksum for r in await ch.receive_many(3)] == [1, 2, 3]
        assert _decode_refs(await peers[1].consume.remote(ch, 10)) == [ref(4), ref(5)]
        with pytest.raises(anyio.EndOfStream):
            await ch.receive()
        with pytest.raises(anyio.EndOfStream):
            await ch.receive_nowait()
        assert await peers[1].receive_one.remote(ch) == "EndOfStream"


async def test_close_wakes_a_blocked_receiver_in_another_process(peers, make_channel) -> None:
    ch = make_channel(max_items=2)
    waiting = peers[1].receive_one.remote(ch)
    with anyio.move_on_after(SHORT):
        await waiting
    with anyio.fail_after(HUNG_AFTER):
        await ch.aclose()
        assert await waiting == "EndOfStream"


async def test_send_after_close_raises_in_the_other_process(peers, make_channel) -> None:
    ch = make_channel(max_items=1)
    with anyio.fail_after(HUNG_AFTER):
        await ch.send(ref(0))
    blocked = peers[0].send_timed.remote(ch, _encode([ref(1)]))  # waits for room in the host
    with anyio.move_on_after(SHORT):
        await blocked
    with anyio.fail_after(HUNG_AFTER):
        await ch.aclose()
        assert await blocked == "ChannelClosed"  # a waiting sender is woken to raise it
        assert await peers[0].send_timed.remote(ch, _encode([ref(2)])) == "ChannelClosed"
        assert (await ch.receive()).checksum == 0
        with pytest.raises(anyio.EndOfStream):
            await ch.receive()


async def test_two_producer_processes_one_consumer_no_loss_no_duplication(peers, make_channel) -> None:
    ch = make_channel(max_items=32)
    n = 1500
    streams = {name: [ref(i, producer=name) for i in range(n)] for name in ("a", "b")}
    got: list[Ref] = []

    with anyio.fail_after(HUNG_AFTER):
        started = time.perf_counter()
        a = peers[0].produce_random_batches.remote(ch, _encode(streams["a"]), 0)
        b = peers[1].produce_random_batches.remote(ch, _encode(streams["b"]), 1)

        async def close_when_done() -> None:
            await a
            await b
            ch.close()

        async with anyio.create_task_group() as tg:
            tg.start_soon(close_when_done)
            while True:
                try:
                    got += await ch.receive_many(64)
                except anyio.EndOfStream:
                    break
        elapsed = time.perf_counter() - started
    assert len(got) == 2 * n
    for name, stream in streams.items():  # each producer's order survives; nothing lost or duplicated
        assert [r for r in got if r.group == name] == stream
    stats = await ch.stats()
    assert (stats.sent, stats.received, stats.depth, stats.closed) == (2 * n, 2 * n, 0, True)
    print(f"two producers -> one consumer: {2 * n / elapsed:,.0f} refs/s")


async def test_stats_reflect_depth_and_waits(make_channel) -> None:
    ch = make_channel(max_items=3, max_bytes=1000)
    with anyio.move_on_after(SHORT):
        await ch.receive()  # waits (then is cancelled: takes nothing)
    with anyio.fail_after(HUNG_AFTER):
        await ch.send_many([ref(0, nbytes=100), ref(1, nbytes=200)])
        stats = await ch.stats()
    assert (stats.depth, stats.nbytes, stats.sent, stats.received) == (2, 300, 2, 0)
    assert (stats.max_items, stats.max_bytes, stats.name, stats.closed) == (3, 1000, "test", False)
    assert stats.receive_wait_s >= SHORT / 2
    assert stats.send_wait_s == 0
    assert (ch.depth, ch.nbytes) == (2, 300)
    with anyio.fail_after(HUNG_AFTER):
        await ch.send(ref(2, nbytes=700))
        with anyio.move_on_after(SHORT):
            await ch.send(ref(3))  # full: waits, is cancelled, puts nothing in
        stats = await ch.stats()
    assert stats.send_wait_s >= SHORT / 2
    assert (stats.depth, stats.nbytes, stats.sent) == (3, 1000, 3)


async def test_cancelled_receive_loses_nothing(peers, make_channel) -> None:
    ch = make_channel(max_items=4)
    with anyio.move_on_after(SHORT) as scope:  # blocked in the host, then cancelled there
        await ch.receive()
    assert scope.cancelled_caught
    with anyio.move_on_after(SHORT):
        await ch.receive_many(10)
    with anyio.fail_after(HUNG_AFTER):
        await peers[0].produce.remote(ch, _encode([ref(0), ref(1)]), 0)
        assert [r.checksum for r in await ch.receive_many(10)] == [0, 1]
        counts = await ch.host.cancellations.remote()
    assert counts["cancelled_in_host"] == 2
    assert counts["given_back"] == 0
    assert counts["pending_marks"] == 0


async def test_random_cancellation_of_receives_keeps_every_item_once_in_order(peers, make_channel) -> None:
    """Cancel receives at random points of their round trip, including after the host replied."""
    ch = make_channel(max_items=8)
    n = 300
    items = [ref(i) for i in range(n)]
    rng = random.Random(7)
    got: list[Ref] = []
    with anyio.fail_after(HUNG_AFTER):
        done = peers[0].produce.remote(ch, _encode(items), 3, True)
        while True:
            with anyio.move_on_after(rng.random() * 0.004):
                try:
                    if rng.random() < 0.5:
                        got.append(await ch.receive())
                    else:
                        got += await ch.receive_many(4)
                except anyio.EndOfStream:
                    break
        await done
        counts = await ch.host.cancellations.remote()
    assert got == items
    assert counts["abandoned"] > 10
    assert counts["pending_marks"] == 0
    print(f"cancellations: {counts}")


async def test_cancelled_blocked_send_puts_nothing_in(make_channel) -> None:
    ch = make_channel(max_items=1)
    with anyio.fail_after(HUNG_AFTER):
        await ch.send(ref(0))
    with anyio.move_on_after(SHORT) as scope:
        await ch.send(ref(1))
    assert scope.cancelled_caught
    with anyio.move_on_after(SHORT):
        await ch.send_many([ref(2), ref(3)])
    with anyio.fail_after(HUNG_AFTER):
        await ch.aclose()
        assert [r.checksum for r in await ch.receive_many(10)] == [0]
        with pytest.raises(anyio.EndOfStream):
            await ch.receive_many(10)


async def test_nowait_variants(make_channel) -> None:
    ch = make_channel(max_items=1)
    with anyio.fail_after(HUNG_AFTER):
        with pytest.raises(anyio.WouldBlock):
            await ch.receive_nowait()
        await ch.send_nowait(ref(0))
        with pytest.raises(anyio.WouldBlock):
            await ch.send_nowait(ref(1))
        assert (await ch.receive_nowait()).checksum == 0


async def test_malformed_item_is_refused_at_the_sender(make_channel) -> None:
    ch = make_channel(max_items=4)
    bad = Ref(store="s", key="k", version="zero", version_max=0, rows=1, nbytes=1, checksum=0, group="g")  # type: ignore[arg-type]
    with anyio.fail_after(HUNG_AFTER):
        with pytest.raises(ChannelItemError, match="version"):
            await ch.send(bad)
        with pytest.raises(ChannelItemError):
            await ch.send_many([ref(0), bad])
        assert (await ch.stats()).depth == 0
    with pytest.raises(TypeError):
        await ch.send(object())  # type: ignore[arg-type]  # not encodable: refused before the round trip


def test_bounds_are_validated_in_the_caller(ray_cluster) -> None:
    with pytest.raises(ValueError, match="max_items"):
        RayChannel.create("bad", max_items=0)
    with pytest.raises(ValueError, match="max_bytes"):
        RayChannel.create("bad", max_items=1, max_bytes=0)
