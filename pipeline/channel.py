"""A bounded async channel of small items (typically refs), for tasks of one event loop.

What a channel guarantees:

- Bounded by items: it never holds more than `max_items` items.
- Bounded by bytes: with `max_bytes` set, the sizes of the items it holds (as given by `size_of`,
  by default the item's `nbytes` attribute) never add up to more than `max_bytes`, with one
  exception so that nothing deadlocks: an item larger than `max_bytes` on its own is admitted into an
  *empty* channel (and then it is the only item until it is received).
- Backpressure: `send` waits while the item does not fit; `receive` waits while the channel is
  empty and open. The `*_nowait` variants raise `anyio.WouldBlock` instead of waiting.
- FIFO: items are received in the order their sends completed. Waiting senders are admitted, and
  waiting receivers served, in the order they started waiting; a newcomer never overtakes a waiter.
- No loss, no duplication: every item whose `send` returned is received exactly once (if someone
  keeps receiving). A `send` that raises (cancelled, or `ChannelClosed`) has not put its item in;
  a `receive` that raises (cancelled, or `EndOfStream`) has not taken one out. A cancelled waiter
  hands its turn to the next one, so cancellation never leaves the channel stuck.
- Close then drain: `close()` is idempotent; afterwards `send` raises `ChannelClosed` (waiting senders
  are woken to raise it too), while items already inside stay receivable; once the channel is closed
  and empty, `receive` raises `anyio.EndOfStream` and iteration stops.
- Checkpoints: a `send`/`receive` that has to wait is a checkpoint (cancellable while waiting, and
  a cancelled waiter neither puts in nor takes out an item). One that need not wait passes a
  checkpoint (yield to other tasks, deliver cancellation) *before* acting once every
  `Channel.CHECKPOINT_EVERY` operations on the channel, so a tight loop still yields, without paying
  an event-loop round trip per item.

A channel is not thread-safe: use it from the tasks of one event loop (any anyio backend).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from time import perf_counter
from typing import Generic, TypeVar

import anyio
import msgspec
from anyio.lowlevel import checkpoint

T = TypeVar("T")

__all__ = ["Channel", "ChannelBase", "ChannelClosed", "ChannelStats"]


class ChannelClosed(Exception):
    """`send` on a closed channel."""


class ChannelStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of a channel: its bounds, what it holds, totals and accumulated waiting times."""

    name: str
    depth: int
    nbytes: int
    max_items: int
    max_bytes: int | None
    sent: int
    received: int
    send_wait_s: float
    receive_wait_s: float
    closed: bool


def _nbytes_of(item: object) -> int:
    return getattr(item, "nbytes", 0)


class _Waiter:
    """A task waiting for its turn; it stays at its place in the queue until it succeeds or gives up."""

    __slots__ = ("event", "size")

    def __init__(self, size: int) -> None:
        self.event = anyio.Event()
        self.size = size


class ChannelBase(Generic[T]):
    """What a local `Channel` and a `pipeline.runtime.ray_channel.RayChannel` share: name and bounds (checked
    here), `depth` / `nbytes` / `closed` (exact locally, a proxy's as of its last reply), repr, the
    `ChannelClosed` they raise, and iteration until `anyio.EndOfStream`."""

    # fault injection (pipeline.faults, channel.stall): awaited before each send when set; None costs
    # one attribute check per send
    before_send: Callable[[], Awaitable[None]] | None = None
    _REPR_NOTE = ""

    def __init__(self, name: str, max_items: int, max_bytes: int | None) -> None:
        if max_items < 1:
            raise ValueError(f"channel {name!r}: max_items must be >= 1, got {max_items}")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"channel {name!r}: max_bytes must be >= 1 or None, got {max_bytes}")
        self.name = name
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._depth = 0
        self._nbytes = 0
        self._closed = False

    def __repr__(self) -> str:
        bytes_bound = "" if self.max_bytes is None else f" bytes={self._nbytes}/{self.max_bytes}"
        state = " closed" if self._closed else ""
        kind = type(self).__name__
        return f"<{kind} {self.name!r} items={self.depth}/{self.max_items}{bytes_bound}{state}{self._REPR_NOTE}>"

    @property
    def depth(self) -> int:
        """Number of items in the channel."""
        return self._depth

    @property
    def nbytes(self) -> int:
        """Sum of the sizes of the items in the channel."""
        return self._nbytes

    @property
    def closed(self) -> bool:
        return self._closed

    def _closed_error(self) -> ChannelClosed:
        return ChannelClosed(f"channel {self.name!r} is closed")

    async def receive(self) -> T:
        raise NotImplementedError

    def __aiter__(self) -> ChannelBase[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None


class Channel(ChannelBase[T]):
    """A bounded FIFO of items between tasks; see the module docstring for its guarantees."""

    CHECKPOINT_EVERY = 32

    def __init__(
        self,
        name: str,
        max_items: int,
        max_bytes: int | None = None,
        size_of: Callable[[T], int] | None = None,
    ) -> None:
        super().__init__(name, max_items, max_bytes)
        self._size_of: Callable[[T], int] = size_of or _nbytes_of
        self._buffer: deque[tuple[T, int]] = deque()
        self._send_waiters: deque[_Waiter] = deque()
        self._receive_waiters: deque[_Waiter] = deque()
        self._sent = 0
        self._received = 0
        self._send_wait_s = 0.0
        self._receive_wait_s = 0.0
        self._ops = 0

    @property
    def depth(self) -> int:
        """Number of items in the channel."""
        return len(self._buffer)

    def __len__(self) -> int:
        return len(self._buffer)

    def items(self) -> list[T]:
        """A snapshot of the items inside, oldest first (for checkpoints and diagnosis; takes nothing out)."""
        return [item for item, _ in self._buffer]

    def stats(self) -> ChannelStats:
        return ChannelStats(
            name=self.name,
            depth=len(self._buffer),
            nbytes=self._nbytes,
            max_items=self.max_items,
            max_bytes=self.max_bytes,
            sent=self._sent,
            received=self._received,
            send_wait_s=self._send_wait_s,
            receive_wait_s=self._receive_wait_s,
            closed=self._closed,
        )

    def _fits(self, size: int) -> bool:
        buffered = len(self._buffer)
        if buffered >= self.max_items:
            return False
        return self.max_bytes is None or buffered == 0 or self._nbytes + size <= self.max_bytes

    def _admit(self, item: T, size: int) -> None:
        self._buffer.append((item, size))
        self._nbytes += size
        self._sent += 1
        if self._receive_waiters:
            self._receive_waiters[0].event.set()

    def _take(self) -> T:
        item, size = self._buffer.popleft()
        self._nbytes -= size
        self._received += 1
        self._wake_sender()
        return item

    def _wake_sender(self) -> None:
        if self._send_waiters:
            head = self._send_waiters[0]
            if self._closed or self._fits(head.size):
                head.event.set()

    def _wake_receiver(self) -> None:
        if self._receive_waiters and (self._buffer or self._closed):
            self._receive_waiters[0].event.set()

    def send_nowait(self, item: T) -> None:
        """Put `item` in now, or raise `anyio.WouldBlock` (full, or senders waiting) / `ChannelClosed`."""
        if self._closed:
            raise self._closed_error()
        size = self._size_of(item)
        if self._send_waiters or not self._fits(size):
            raise anyio.WouldBlock
        self._admit(item, size)

    def receive_nowait(self) -> T:
        """Take the next item now, or raise `anyio.WouldBlock` / `anyio.EndOfStream` (closed and drained)."""
        if self._buffer and not self._receive_waiters:
            return self._take()
        if self._closed and not self._buffer:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    async def send(self, item: T) -> None:
        """Put `item` in, waiting (in FIFO order with other senders) while it does not fit."""
        if self.before_send is not None:
            await self.before_send()
        self._ops += 1
        if self._ops >= self.CHECKPOINT_EVERY:
            self._ops = 0
            await checkpoint()
        if self._closed:
            raise self._closed_error()
        size = self._size_of(item)
        if not self._send_waiters and self._fits(size):
            self._admit(item, size)
            return
        waiter = _Waiter(size)
        self._send_waiters.append(waiter)
        started = perf_counter()
        try:
            while True:
                await waiter.event.wait()
                if self._closed:
                    raise self._closed_error()
                if self._send_waiters[0] is waiter and self._fits(size):
                    break
                waiter.event = anyio.Event()
        except BaseException:
            self._send_waiters.remove(waiter)
            self._wake_sender()
            raise
        finally:
            self._send_wait_s += perf_counter() - started
        self._send_waiters.popleft()
        self._admit(item, size)
        self._wake_sender()

    async def receive(self) -> T:
        """Take the next item, waiting (in FIFO order with other receivers) while the channel is empty."""
        self._ops += 1
        if self._ops >= self.CHECKPOINT_EVERY:
            self._ops = 0
            await checkpoint()
        if self._buffer and not self._receive_waiters:
            return self._take()
        if self._closed and not self._buffer:
            raise anyio.EndOfStream
        waiter = _Waiter(0)
        self._receive_waiters.append(waiter)
        started = perf_counter()
        try:
            while True:
                await waiter.event.wait()
                if self._receive_waiters[0] is waiter:
                    if self._buffer:
                        break
                    if self._closed:
                        raise anyio.EndOfStream
                waiter.event = anyio.Event()
        except BaseException:
            self._receive_waiters.remove(waiter)
            self._wake_receiver()
            raise
        finally:
            self._receive_wait_s += perf_counter() - started
        self._receive_waiters.popleft()
        item = self._take()
        self._wake_receiver()
        return item

    async def receive_many(self, max_items: int) -> list[T]:
        """Wait for one item, then take whatever else is there now, up to `max_items` in all."""
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        first = await self.receive()
        return [first, *self.receive_many_nowait(max_items - 1)]

    def receive_many_nowait(self, max_items: int) -> list[T]:
        """Take up to `max_items` items that are there now (maybe none); never waits or raises."""
        items: list[T] = []
        while len(items) < max_items:
            try:
                items.append(self.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream):
                break
        return items

    async def send_many(self, items: list[T]) -> None:
        """Send each item in order (waiting as `send` does)."""
        for item in items:
            await self.send(item)

    def close(self) -> None:
        """Refuse further sends; items inside stay receivable. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wake_sender()
        self._wake_receiver()
