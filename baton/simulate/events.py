"""A discrete-event loop in virtual time, and blocking channel operations on the real `Channel` for it.

Used by `baton simulate` (baton.simulate) to run a pipeline's stages as cost models. Nothing here is
RL-specific.

Processes are generators. A process yields what it waits for:

* a number `dt` (seconds, >= 0): resume after `dt` of virtual time;
* `Wait(*keys, timeout=None)`: resume when someone `notify`s one of `keys` (the process receives the
  key), or after `timeout` seconds (it receives `TIMEOUT`), whichever comes first.

The loop jumps from event to event, so a run costs what its events cost, not what its virtual time
spans. Processes woken at the same instant resume in the order they started waiting (FIFO).

Why the real `Channel` is driven through its non-blocking surface: its `send`/`receive` wait on anyio
events, which would need an anyio event loop whose clock is virtual (anyio has none; asyncio's can be
replaced, trio's only through its test clock), and then each blocking operation costs event-loop round
trips (task switches, the gate's task group and cancel scope per wait) instead of one generator step
here; the 10k-step runs `baton simulate` promises in seconds leave no room for that. Every bound a
channel keeps (items, bytes,
the oversized-item exception, FIFO order, close-then-drain) lives in `send_nowait`/`receive_nowait`,
which `channel_send`/`channel_receive` call; only the waiting is the loop's: a blocked sender waits for
the key `(channel, "space")`, a blocked receiver for `(channel, "items")`, each notified by the other
side, and waiters retry in FIFO order, as the channel's own waiters would be served.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Generator, Hashable
from typing import Any

import anyio

from pipeline.channel import Channel

Process = Generator[Any, Any, Any]

TIMEOUT = "timeout"

__all__ = ["TIMEOUT", "EventLoop", "Process", "Wait", "channel_receive", "channel_receive_many", "channel_send"]


class Wait:
    """What a process yields to wait for one of `keys` to be notified (or for `timeout` seconds)."""

    __slots__ = ("keys", "timeout")

    def __init__(self, *keys: Hashable, timeout: float | None = None) -> None:
        if timeout is not None and timeout < 0:
            raise ValueError(f"Wait timeout must be >= 0, got {timeout}")
        self.keys = keys
        self.timeout = timeout


class _Parked:
    """One wait of one process; stale once the process was resumed by another key or its timeout."""

    __slots__ = ("process", "live")

    def __init__(self, process: Process) -> None:
        self.process = process
        self.live = True


class EventLoop:
    """Runs generator processes in virtual time (seconds from 0). See the module docstring."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events = 0  # process resumptions so far (what a run costs)
        self._heap: list[tuple[float, int, Process, Any, _Parked | None]] = []
        self._seq = 0
        self._waiting: dict[Hashable, deque[_Parked]] = {}
        self._cancelled: set[int] = set()
        self._live: set[int] = set()

    def spawn(self, process: Process, delay: float = 0.0) -> Process:
        """Start `process` after `delay` seconds; returns it (for `cancel` and `alive`)."""
        self._live.add(id(process))
        self._schedule(self.now + delay, process, None, None)
        return process

    def alive(self, process: Process) -> bool:
        return id(process) in self._live

    def cancel(self, process: Process) -> None:
        """Stop `process` where it waits; it never resumes (its `finally` blocks run now)."""
        if id(process) in self._live:
            self._live.discard(id(process))
            self._cancelled.add(id(process))
            process.close()

    def notify(self, key: Hashable) -> int:
        """Resume every process waiting for `key` (in the order they started waiting); returns how many."""
        queue = self._waiting.pop(key, None)
        if not queue:
            return 0
        woken = 0
        for parked in queue:
            if parked.live and id(parked.process) in self._live:
                parked.live = False
                self._schedule(self.now, parked.process, key, None)
                woken += 1
        return woken

    def waiting(self, key: Hashable) -> int:
        """How many processes wait for `key` now."""
        return sum(1 for p in self._waiting.get(key, ()) if p.live)

    def run(self, until: float | None = None, stop: Any = None) -> None:
        """Resume processes in time order until none is runnable, virtual time passes `until`, or
        `stop()` (checked after each resumption) returns true."""
        heap = self._heap
        while heap:
            when, _, process, value, timer = heap[0]
            if until is not None and when > until:
                self.now = until
                return
            heapq.heappop(heap)
            if timer is not None:  # a Wait's timeout: only if the wait is still open
                if not timer.live:
                    continue
                timer.live = False
            if id(process) not in self._live:
                continue
            self.now = when
            self._step(process, value)
            if stop is not None and stop():
                return

    def _schedule(self, when: float, process: Process, value: Any, timer: _Parked | None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, process, value, timer))

    def _step(self, process: Process, value: Any) -> None:
        self.events += 1
        try:
            request = process.send(value)
        except StopIteration:
            self._live.discard(id(process))
            return
        if isinstance(request, Wait):
            parked = _Parked(process)
            for key in request.keys:
                self._waiting.setdefault(key, deque()).append(parked)
            if request.timeout is not None:
                self._schedule(self.now + request.timeout, process, TIMEOUT, parked)
            return
        dt = float(request)
        if dt < 0:
            raise ValueError(f"a process asked to sleep {dt} s")
        self._schedule(self.now + dt, process, None, None)


def channel_send(loop: EventLoop, channel: Channel, item: Any) -> Process:
    """`await channel.send(item)` in virtual time: wait while the item does not fit."""
    while True:
        try:
            channel.send_nowait(item)
        except anyio.WouldBlock:
            yield Wait((channel, "space"))
            continue
        loop.notify((channel, "items"))
        return


def channel_receive(loop: EventLoop, channel: Channel) -> Process:
    """`await channel.receive()` in virtual time: wait while the channel is empty (raises EndOfStream
    once it is closed and drained)."""
    while True:
        try:
            item = channel.receive_nowait()
        except anyio.WouldBlock:
            yield Wait((channel, "items"))
            continue
        loop.notify((channel, "space"))
        return item


def channel_receive_many(loop: EventLoop, channel: Channel, max_items: int) -> Process:
    """`await channel.receive_many(max_items)`: wait for one item, then take what is there, up to `max_items`."""
    items = [(yield from channel_receive(loop, channel))]
    while len(items) < max_items:
        try:
            items.append(channel.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            break
        loop.notify((channel, "space"))
    return items
