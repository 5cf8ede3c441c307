"""Channel: bounds by items and bytes, FIFO, no loss under cancellation, close-then-drain, stats."""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.channel import Channel, ChannelClosed, ChannelStats

pytestmark = pytest.mark.anyio

SHORT = 0.05
HUNG_AFTER = 60.0  # a guard against a hang, far above any correct run's time



@dataclass(frozen=True)
class Item:
    id: int
    nbytes: int = 0


async def assert_blocks(call) -> None:
    """`call()` does not complete within SHORT seconds (it is cancelled instead)."""
    with anyio.move_on_after(SHORT) as scope:
        await call()
    assert scope.cancelled_caught, "expected the call to block"


async def test_send_blocks_when_full_until_a_receive() -> None:
    ch: Channel[Item] = Channel("c", max_items=2)
    with anyio.fail_after(HUNG_AFTER):
        await ch.send(Item(0))
        await ch.send(Item(1))
    await assert_blocks(lambda: ch.send(Item(99)))
    assert ch.depth == 2
    done = anyio.Event()

    async def sender() -> None:
        await ch.send(Item(2))
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(sender)
        await anyio.wait_all_tasks_blocked()
        assert not done.is_set()
        with pytest.raises(anyio.WouldBlock):
            ch.send_nowait(Item(3))
        with anyio.fail_after(HUNG_AFTER):
            assert (await ch.receive()).id == 0
            await done.wait()
    assert [ch.receive_nowait().id for _ in range(2)] == [1, 2]


async def test_send_blocks_by_bytes() -> None:
    ch: Channel[Item] = Channel("c", max_items=100, max_bytes=100)
    with anyio.fail_after(HUNG_AFTER):
        await ch.send(Item(0, nbytes=60))
        await ch.send(Item(1, nbytes=40))
    assert ch.nbytes == 100
    await assert_blocks(lambda: ch.send(Item(2, nbytes=1)))
    ch.receive_nowait()
    with anyio.fail_after(HUNG_AFTER):
        await ch.send(Item(2, nbytes=50))
    await assert_blocks(lambda: ch.send(Item(3, nbytes=11)))
    assert (ch.depth, ch.nbytes) == (2, 90)


async def test_one_receive_admits_every_waiting_sender_that_now_fits() -> None:
    ch: Channel[Item] = Channel("c", max_items=100, max_bytes=10)
    ch.send_nowait(Item(0, nbytes=10))
    async with anyio.create_task_group() as tg:
        for i in range(1, 5):
            tg.start_soon(ch.send, Item(i, nbytes=3))
            await anyio.wait_all_tasks_blocked()
        assert ch.receive_nowait().id == 0
        await anyio.wait_all_tasks_blocked()
        assert (ch.depth, ch.nbytes) == (3, 9)
        assert [ch.receive_nowait().id for _ in range(3)] == [1, 2, 3]
    assert ch.receive_nowait().id == 4


async def test_oversize_item_is_admitted_into_an_empty_channel_only() -> None:
    ch: Channel[Item] = Channel("c", max_items=4, max_bytes=10)
    with anyio.fail_after(HUNG_AFTER):
        await ch.send(Item(0, nbytes=1000))
    assert (ch.depth, ch.nbytes) == (1, 1000)
    await assert_blocks(lambda: ch.send(Item(1, nbytes=1)))
    assert ch.receive_nowait().id == 0
    ch.send_nowait(Item(1, nbytes=5))
    with pytest.raises(anyio.WouldBlock):
        ch.send_nowait(Item(2, nbytes=1000))


async def test_custom_size_of() -> None:
    ch: Channel[bytes] = Channel("c", max_items=10, max_bytes=5, size_of=len)
    ch.send_nowait(b"abc")
    with pytest.raises(anyio.WouldBlock):
        ch.send_nowait(b"xyz")
    assert ch.nbytes == 3


async def test_fifo_under_concurrent_senders() -> None:
    ch: Channel[tuple[int, int]] = Channel("c", max_items=3)
    received: list[tuple[int, int]] = []

    async def sender(p: int) -> None:
        for i in range(200):
            await ch.send((p, i))

    async def consumer() -> None:
        async for item in ch:
            received.append(item)

    with anyio.fail_after(HUNG_AFTER):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            async with anyio.create_task_group() as senders:
                for p in range(5):
                    senders.start_soon(sender, p)
            ch.close()
    assert len(received) == 1000
    for p in range(5):
        assert [i for q, i in received if q == p] == list(range(200))


async def test_waiting_senders_are_admitted_in_arrival_order_and_not_overtaken() -> None:
    ch: Channel[str] = Channel("c", max_items=1)
    ch.send_nowait("first")
    async with anyio.create_task_group() as tg:
        for name in "ABC":
            tg.start_soon(ch.send, name)
            await anyio.wait_all_tasks_blocked()
        assert ch.receive_nowait() == "first"
        with pytest.raises(anyio.WouldBlock):
            ch.send_nowait("newcomer")
        with anyio.move_on_after(SHORT):
            await ch.send("newcomer")
        with anyio.fail_after(HUNG_AFTER):
            got = [await ch.receive() for _ in range(3)]
    assert got == ["A", "B", "C"]


async def test_waiting_receivers_are_served_in_arrival_order() -> None:
    ch: Channel[int] = Channel("c", max_items=8)
    got: list[tuple[str, int]] = []

    async def receiver(name: str) -> None:
        got.append((name, await ch.receive()))

    async with anyio.create_task_group() as tg:
        for name in "ABC":
            tg.start_soon(receiver, name)
            await anyio.wait_all_tasks_blocked()
        for i in range(3):
            ch.send_nowait(i)
        with pytest.raises(anyio.WouldBlock):
            ch.receive_nowait()
    assert got == [("A", 0), ("B", 1), ("C", 2)]


async def test_close_then_drain() -> None:
    ch: Channel[int] = Channel("c", max_items=4)
    for i in range(3):
        await ch.send(i)
    ch.close()
    ch.close()
    assert ch.closed
    assert await ch.receive() == 0
    assert [i async for i in ch] == [1, 2]
    with pytest.raises(anyio.EndOfStream):
        await ch.receive()
    with pytest.raises(anyio.EndOfStream):
        ch.receive_nowait()


async def test_send_after_close_raises() -> None:
    ch: Channel[int] = Channel("rollouts-ish", max_items=4)
    ch.close()
    with pytest.raises(ChannelClosed, match="rollouts-ish"):
        await ch.send(1)
    with pytest.raises(ChannelClosed):
        ch.send_nowait(1)
    assert ch.stats().sent == 0


async def test_blocked_sender_is_woken_by_close() -> None:
    ch: Channel[int] = Channel("c", max_items=1)
    ch.send_nowait(0)
    outcomes: list[str] = []

    async def sender(i: int) -> None:
        try:
            await ch.send(i)
            outcomes.append("sent")
        except ChannelClosed:
            outcomes.append("closed")

    with anyio.fail_after(HUNG_AFTER):
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender, 1)
            tg.start_soon(sender, 2)
            await anyio.wait_all_tasks_blocked()
            ch.close()
    assert outcomes == ["closed", "closed"]
    assert [i async for i in ch] == [0]


async def test_blocked_receiver_is_woken_by_close() -> None:
    ch: Channel[int] = Channel("c", max_items=1)
    with anyio.fail_after(HUNG_AFTER):
        async with anyio.create_task_group() as tg:

            async def receiver() -> None:
                with pytest.raises(anyio.EndOfStream):
                    await ch.receive()

            tg.start_soon(receiver)
            tg.start_soon(receiver)
            await anyio.wait_all_tasks_blocked()
            ch.close()


@pytest.mark.parametrize("cancel_first", [True, False])
async def test_cancelled_receiver_does_not_lose_an_item(cancel_first: bool) -> None:
    """Cancelled before its turn came, the waiter takes nothing and passes its turn on; cancelled after
    it was served, its receive completes. Either way the item is received exactly once."""
    ch: Channel[int] = Channel("c", max_items=4)
    scope = anyio.CancelScope()
    by_cancelled: list[int] = []
    by_next: list[int] = []

    async def receiver() -> None:
        with scope:
            by_cancelled.append(await ch.receive())

    async def next_receiver() -> None:
        with anyio.move_on_after(SHORT):
            by_next.append(await ch.receive())

    async with anyio.create_task_group() as tg:
        tg.start_soon(receiver)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(next_receiver)
        await anyio.wait_all_tasks_blocked()
        if cancel_first:
            scope.cancel()
            ch.send_nowait(7)
        else:
            ch.send_nowait(7)
            scope.cancel()
    assert by_cancelled + by_next == [7]
    if cancel_first:
        assert by_next == [7]
    assert (ch.depth, ch.stats().received) == (0, 1)


@pytest.mark.parametrize("cancel_first", [True, False])
async def test_cancelled_sender_neither_loses_nor_duplicates_nor_blocks_the_next(cancel_first: bool) -> None:
    """A waiting sender cancelled before its turn came adds nothing and passes its turn on; one
    cancelled after it was admitted returns normally, its item added once."""
    ch: Channel[int] = Channel("c", max_items=1)
    ch.send_nowait(0)
    scope = anyio.CancelScope()
    completed: list[int] = []

    async def sender(i: int, cancellable: bool) -> None:
        with scope if cancellable else anyio.CancelScope():
            await ch.send(i)
            completed.append(i)

    async with anyio.create_task_group() as tg:
        tg.start_soon(sender, 1, True)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(sender, 2, False)
        await anyio.wait_all_tasks_blocked()
        if cancel_first:
            scope.cancel()
            assert ch.receive_nowait() == 0
        else:
            assert ch.receive_nowait() == 0
            scope.cancel()
        expected = [2] if cancel_first else [1, 2]
        with anyio.fail_after(HUNG_AFTER):
            got = [await ch.receive() for _ in expected]
    assert got == expected
    assert sorted(completed) == expected
    assert (ch.depth, ch.stats().sent, ch.stats().received) == (0, len(got) + 1, len(got) + 1)


async def test_stats() -> None:
    ch: Channel[Item] = Channel("c", max_items=1, max_bytes=64)
    assert ch.stats() == ChannelStats(
        name="c",
        depth=0,
        nbytes=0,
        max_items=1,
        max_bytes=64,
        sent=0,
        received=0,
        send_wait_s=0.0,
        receive_wait_s=0.0,
        closed=False,
    )
    await ch.send(Item(0, nbytes=10))
    assert (ch.depth, len(ch), ch.nbytes) == (1, 1, 10)
    async with anyio.create_task_group() as tg:
        tg.start_soon(ch.send, Item(1, nbytes=20))
        await anyio.sleep(SHORT)
        await ch.receive()
    stats = ch.stats()
    assert (stats.depth, stats.nbytes, stats.sent, stats.received) == (1, 20, 2, 1)
    assert stats.send_wait_s >= SHORT * 0.5
    await ch.receive()
    async with anyio.create_task_group() as tg:
        tg.start_soon(ch.receive)
        await anyio.sleep(SHORT)
        ch.send_nowait(Item(2))
    assert ch.stats().receive_wait_s >= SHORT * 0.5
    ch.close()
    assert ch.stats().closed


def test_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError, match="max_items"):
        Channel("c", max_items=0)
    with pytest.raises(ValueError, match="max_bytes"):
        Channel("c", max_items=1, max_bytes=0)


async def test_tight_loop_still_yields() -> None:
    ch: Channel[int] = Channel("c", max_items=4)
    other_ran = anyio.Event()

    async def other() -> None:
        other_ran.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)
        for i in range(Channel.CHECKPOINT_EVERY * 2):
            await ch.send(i)
            await ch.receive()
            if other_ran.is_set():
                break
        assert other_ran.is_set()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    max_items=st.integers(1, 5),
    max_bytes=st.none() | st.integers(1, 40),
    producers=st.lists(
        st.lists(st.tuples(st.integers(0, 30), st.integers(0, 3), st.booleans()), max_size=12),
        min_size=1,
        max_size=4,
    ),
    consumers=st.lists(
        st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=30), min_size=1, max_size=3
    ),
)
async def test_random_interleavings_keep_order_bounds_and_items(
    max_items: int,
    max_bytes: int | None,
    producers: list[list[tuple[int, int, bool]]],
    consumers: list[list[tuple[int, bool]]],
) -> None:
    """Producers send items (size, checkpoints before, impatient: give up rather than wait);
    consumers receive (checkpoints before, impatient) and then drain until closed. What was received
    is exactly what was admitted, in admission order, and the bounds hold after every operation."""
    ch: Channel[Item] = Channel("h", max_items=max_items, max_bytes=max_bytes)
    admitted: list[int] = []
    received: list[int] = []

    def check_bounds() -> None:
        assert ch.depth <= max_items
        assert max_bytes is None or ch.nbytes <= max_bytes or ch.depth == 1

    async def producer(p: int, plan: list[tuple[int, int, bool]]) -> None:
        for i, (size, yields, impatient) in enumerate(plan):
            for _ in range(yields):
                await anyio.lowlevel.checkpoint()
            item = Item(p * 1000 + i, nbytes=size)
            with anyio.CancelScope() as scope:
                if impatient:
                    scope.cancel()
                await ch.send(item)
                admitted.append(item.id)
            check_bounds()

    async def consumer(plan: list[tuple[int, bool]]) -> None:
        for yields, impatient in plan:
            for _ in range(yields):
                await anyio.lowlevel.checkpoint()
            with anyio.CancelScope() as scope:
                if impatient:
                    scope.cancel()
                try:
                    received.append((await ch.receive()).id)
                except anyio.EndOfStream:
                    return
            check_bounds()
        async for item in ch:
            received.append(item.id)
            check_bounds()

    with anyio.fail_after(HUNG_AFTER):
        async with anyio.create_task_group() as tg:
            for plan in consumers:
                tg.start_soon(consumer, plan)
            async with anyio.create_task_group() as ptg:
                for p, plan in enumerate(producers):
                    ptg.start_soon(producer, p, plan)
            ch.close()
    assert received == admitted
    stats = ch.stats()
    assert (stats.sent, stats.received, stats.depth, stats.nbytes) == (len(admitted), len(received), 0, 0)
