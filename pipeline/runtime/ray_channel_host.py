"""The Ray actor side of `pipeline.runtime.ray_channel`: `ChannelHost` owns one local `Channel` and
answers every operation with a reply `(status, payload, depth, nbytes, closed)`; the status codes here are
the whole protocol between it and the `RayChannel` proxy (see that module's docstring for the guarantees,
cancellation included). Items arrive and leave as msgspec msgpack bytes, never pickled.
"""

from __future__ import annotations

import os
from collections import deque
from time import perf_counter
from typing import Any

import anyio
import msgspec

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback-only Ray if we start it

import ray  # noqa: E402

from pipeline.channel import Channel, ChannelClosed  # noqa: E402

__all__ = ["ChannelHost"]

# reply status codes: a reply is (status, payload, depth, nbytes, closed)
_OK = 0
_CLOSED = 1  # send on a closed channel (payload: number of items of a batch admitted before)
_END = 2  # receive on a closed, drained channel
_WOULD_BLOCK = 3
_CANCELLED = 4  # the operation was abandoned before it took effect
_INVALID = 5  # the item did not decode as item_type (payload: message)

_Reply = tuple[int, Any, int, int, bool]


def _size_of(item: object) -> int:
    return getattr(item, "nbytes", 0)


@ray.remote(num_cpus=0, max_concurrency=1000)
class ChannelHost:
    """The Ray async actor that owns one local Channel (create it with `RayChannel.create`).

    Every method runs on the actor's event loop, one asyncio task per call; replies are
    `(status, payload, depth, nbytes, closed)`.
    """

    def __init__(self, name: str, max_items: int, max_bytes: int | None, item_type: type) -> None:
        self._channel: Channel[Any] = Channel(name, max_items=max_items, max_bytes=max_bytes)
        self._decode_one = msgspec.msgpack.Decoder(item_type).decode
        self._decode_many = msgspec.msgpack.Decoder(list[item_type]).decode  # type: ignore[valid-type]
        self._encode = msgspec.msgpack.Encoder().encode
        # operations in progress, by id (cancelled by `abandon`), and ids abandoned before they started
        # (or after they finished: the proxy then clears them with `forget` / `unreceive`)
        self._ops: dict[int, anyio.CancelScope] = {}
        self._abandoned: set[int] = set()
        # items taken by an abandoned receive, given back: served before anything in the channel
        self._returned: deque[Any] = deque()
        self._returned_nbytes = 0
        self._received_adjust = 0
        # receivers line up here, so only the head waits inside the channel and a give-back can wake it
        self._receive_lock = anyio.Lock()
        self._head: anyio.CancelScope | None = None
        self._receive_wait_s = 0.0
        self._counters = {"abandoned": 0, "cancelled_in_host": 0, "given_back": 0, "unreceived": 0}

    # -- helpers ---------------------------------------------------------------------------------
    def _reply(self, status: int, payload: Any = None) -> _Reply:
        ch = self._channel
        return status, payload, ch.depth + len(self._returned), ch.nbytes + self._returned_nbytes, ch.closed

    def _start(self, op: int) -> bool:
        """False if `op` was abandoned before it started."""
        if op in self._abandoned:
            self._abandoned.discard(op)
            return False
        return True

    def _give_back(self, items: list[Any]) -> None:
        self._counters["given_back"] += len(items)
        for item in reversed(items):
            self._returned.appendleft(item)
            self._returned_nbytes += _size_of(item)
        self._received_adjust -= len(items)
        if self._head is not None:
            self._head.cancel()  # the head receiver re-checks `_returned`

    def _take_returned(self, taken: list[Any], max_items: int) -> None:
        while self._returned and len(taken) < max_items:
            item = self._returned.popleft()
            self._returned_nbytes -= _size_of(item)
            self._received_adjust += 1
            taken.append(item)

    def _top_up(self, taken: list[Any], max_items: int) -> None:
        while len(taken) < max_items:
            try:
                taken.append(self._channel.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream):
                return

    async def _take(self, taken: list[Any], max_items: int) -> None:
        """Append 1..max_items items to `taken` (waiting for the first); EndOfStream when closed and drained.

        Items are appended as soon as they are out of the channel, so a caller cancelled afterwards
        still finds them in `taken` and can give them back.
        """
        async with self._receive_lock:
            while True:
                self._take_returned(taken, max_items)
                if taken:
                    break
                head = anyio.CancelScope()
                self._head = head
                try:
                    with head:
                        taken.append(await self._channel.receive())
                finally:
                    self._head = None
                if taken:
                    break
            self._top_up(taken, max_items)

    # -- operations ------------------------------------------------------------------------------
    async def send(self, op: int, data: bytes) -> _Reply:
        try:
            item = self._decode_one(data)
        except msgspec.MsgspecError as exc:
            return self._reply(_INVALID, f"channel {self._channel.name!r}: invalid item: {exc}")
        return await self._send([item], op, wait=True)

    async def send_many(self, op: int, data: bytes) -> _Reply:
        try:
            items = self._decode_many(data)
        except msgspec.MsgspecError as exc:
            return self._reply(_INVALID, f"channel {self._channel.name!r}: invalid item: {exc}")
        return await self._send(items, op, wait=True)

    async def send_nowait(self, op: int, data: bytes) -> _Reply:
        try:
            item = self._decode_one(data)
        except msgspec.MsgspecError as exc:
            return self._reply(_INVALID, f"channel {self._channel.name!r}: invalid item: {exc}")
        return await self._send([item], op, wait=False)

    async def _send(self, items: list[Any], op: int, wait: bool) -> _Reply:
        if not self._start(op):
            return self._reply(_CANCELLED, 0)
        # fast path: admit what fits now, without a cancel scope (nothing here can be interrupted)
        sent = 0
        try:
            for item in items:
                self._channel.send_nowait(item)
                sent += 1
        except anyio.WouldBlock:
            if not wait:
                return self._reply(_WOULD_BLOCK)
        except ChannelClosed:
            return self._reply(_CLOSED, sent)
        if sent == len(items):
            return self._reply(_OK, sent)
        closed = False
        with anyio.CancelScope() as scope:
            self._ops[op] = scope
            try:
                for item in items[sent:]:
                    await self._channel.send(item)
                    sent += 1
            except ChannelClosed:
                closed = True
            finally:
                del self._ops[op]
        if closed:
            return self._reply(_CLOSED, sent)
        if sent < len(items):  # cancelled (by `abandon`) before the last item went in
            return self._reply(_CANCELLED, sent)
        return self._reply(_OK, sent)

    async def receive(self, op: int, max_items: int, wait: bool = True) -> _Reply:
        """Take 1..max_items items (max_items == 0: exactly one, encoded alone rather than as a list)."""
        if not self._start(op):
            return self._reply(_CANCELLED)
        limit = max(max_items, 1)
        taken: list[Any] = []
        if not self._receive_lock.locked():  # no receiver waiting: take what is there now, if anything
            self._take_returned(taken, limit)
            self._top_up(taken, limit)
        if not taken and not wait:
            if self._channel.closed and not self._channel.depth and not self._returned:
                return self._reply(_END)
            return self._reply(_WOULD_BLOCK)
        if not taken:
            started = perf_counter()
            end = False
            with anyio.CancelScope() as scope:
                self._ops[op] = scope
                try:
                    await self._take(taken, limit)
                except anyio.EndOfStream:
                    end = True
                finally:
                    del self._ops[op]
                    self._receive_wait_s += perf_counter() - started
            if scope.cancel_called:  # abandoned: whatever was taken goes back before anyone else runs
                if taken:
                    self._give_back(taken)
                return self._reply(_CANCELLED)
            if end:
                return self._reply(_END)
        return self._reply(_OK, self._encode(taken if max_items else taken[0]))

    async def abandon(self, op: int) -> None:
        """The caller of `op` was cancelled: cancel it if in progress, else make it a no-op if it starts."""
        self._counters["abandoned"] += 1
        scope = self._ops.get(op)
        if scope is not None:
            scope.cancel()
            self._counters["cancelled_in_host"] += 1
        else:
            self._abandoned.add(op)

    async def forget(self, op: int) -> None:
        """`op` had finished when it was abandoned; drop the mark `abandon` left."""
        self._abandoned.discard(op)

    async def unreceive(self, op: int, data: bytes, many: bool) -> _Reply:
        """`op` (a receive) had already replied when it was abandoned: put its items back in front."""
        self._abandoned.discard(op)
        items = self._decode_many(data) if many else [self._decode_one(data)]
        self._counters["unreceived"] += len(items)
        self._give_back(items)
        return self._reply(_OK)

    async def close(self) -> _Reply:
        self._channel.close()
        return self._reply(_OK)

    async def cancellations(self) -> dict[str, int]:
        """Counts of abandoned operations, of those cancelled in the host, of items given back (in all,
        and of those, sent back by a proxy because the reply had already left). For tests and debugging."""
        return dict(self._counters, pending_marks=len(self._abandoned))

    async def items(self) -> bytes:
        """The items inside, oldest first (given-back ones lead), msgpack-encoded; takes nothing out."""
        return self._encode([*self._returned, *self._channel.items()])

    async def stats(self) -> bytes:
        s = self._channel.stats()
        stats = msgspec.structs.replace(
            s,
            depth=s.depth + len(self._returned),
            nbytes=s.nbytes + self._returned_nbytes,
            received=s.received + self._received_adjust,
            receive_wait_s=self._receive_wait_s,  # measured here: the channel sees only the head receiver
        )
        return msgspec.msgpack.encode(stats)
