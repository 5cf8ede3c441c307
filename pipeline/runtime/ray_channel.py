"""A `Channel` that lives in a Ray actor, so that stages in different processes can share it.

`ChannelHost` is an async Ray actor that owns one local `pipeline.channel.Channel`. Blocked sends and
receives wait *inside the actor* (one actor task per waiter), so backpressure crosses processes.
`RayChannel` is the proxy: it has the public surface of `Channel`, is serialisable (it holds only the
actor handle, the channel's name and bounds, and the item type), and can be used from any process of
the cluster, driver or actor. Items cross as msgspec msgpack bytes of `item_type`, never as pickled
objects; the host decodes (so validates) every item and a malformed one raises `ChannelItemError` in
the sender. Sizes for the byte bound come from the decoded item's `nbytes` attribute, as locally.

Same guarantees as `Channel` (bounds, backpressure, FIFO, no loss/no duplication, close then drain,
`ChannelClosed` / `anyio.EndOfStream` / `anyio.WouldBlock` raised in the caller), with these
differences:

- Every operation is one actor round trip (1-3 ms on this 2-core box), so `send_nowait` / `receive_nowait` /
  `stats` / `items` are coroutines, and `depth` / `nbytes` / `closed` are the snapshot carried by this proxy's
  last reply (`await stats()` for a fresh one). `close()` is synchronous and returns at once like
  `Channel.close`; the host applies it asynchronously (`await aclose()` waits until it has). Sends made
  through a proxy after its own `close()` raise `ChannelClosed` without a round trip.
- Throughput: use `send_many` / `receive_many`, which move a whole batch per round trip. Plain
  `send`/`receive` are one round trip per item (fine for control traffic, not for bulk).
- Works on the asyncio backend only (Ray's object refs are asyncio futures).
- FIFO between processes is the order in which the host *admits* sends; two sends racing from two
  processes are ordered by arrival. One proxy awaiting its sends one after another keeps its order.

Cancellation (what a cancelled proxy call guarantees). Each call carries an operation id. When the
caller is cancelled while the call is in flight, the proxy (shielded, at most `CLEANUP_TIMEOUT_S`)
tells the host to abandon that operation, then waits for the call's reply:

- `receive` / `receive_many`: no item is lost. If the host task is still waiting (the usual case: a
  consumer cancelled while blocked on an empty channel), it is cancelled inside the host, atomically:
  anything it took goes back to the *front* of the channel before any other receiver runs. If the
  host had already replied, the proxy sends the items back to the front of the channel before the
  cancellation propagates (so the cancelled caller's own next receive sees them first). Only in that
  second case is there a window of about two round trips in which *other* consumers may receive
  later items first or, if the channel is closed and otherwise empty, see `EndOfStream` early.
  Returned items sit ahead of the channel's bound, so the host may briefly hold up to (number of
  returned items) more than `max_items` / `max_bytes`.
- `send`: a send cancelled while waiting for room (or before the host started it) has not put its
  item in. If the host had already admitted the item, it stays in (received exactly once) and the
  caller still sees the cancellation. `send_many` cancelled midway may have put in a prefix.
- Not covered: a *process* that dies mid-call (an item the host already handed to a dead consumer is
  lost; a dead producer's blocked send still waits in the host and may be admitted later), a host
  actor that dies (calls raise `ray.exceptions.RayActorError`; its items are gone), and cleanup that
  times out.
"""

from __future__ import annotations

import itertools
import os
import random
from collections import deque
from collections.abc import Iterable
from time import perf_counter
from typing import Any, TypeVar

import anyio
import msgspec

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback-only Ray if we start it

import ray  # noqa: E402

from pipeline.channel import Channel, ChannelBase, ChannelClosed, ChannelStats  # noqa: E402
from pipeline.refs import Ref  # noqa: E402

T = TypeVar("T")

__all__ = ["ChannelHost", "ChannelItemError", "RayChannel"]

# reply status codes: a reply is (status, payload, depth, nbytes, closed)
_OK = 0
_CLOSED = 1  # send on a closed channel (payload: number of items of a batch admitted before)
_END = 2  # receive on a closed, drained channel
_WOULD_BLOCK = 3
_CANCELLED = 4  # the operation was abandoned before it took effect
_INVALID = 5  # the item did not decode as item_type (payload: message)

_Reply = tuple[int, Any, int, int, bool]


class ChannelItemError(ValueError):
    """The host could not decode an item as the channel's item type; nothing was put in."""


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


class RayChannel(ChannelBase[T]):
    """Proxy on a `ChannelHost`: the surface of `Channel`, from any process (see the module docstring)."""

    CLEANUP_TIMEOUT_S = 10.0
    _REPR_NOTE = " (last seen)"

    def __init__(self, host: Any, name: str, max_items: int, max_bytes: int | None, item_type: type[T]) -> None:
        super().__init__(name, max_items, max_bytes)
        self._host = host
        self.item_type = item_type
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode_one = msgspec.msgpack.Decoder(item_type).decode
        self._decode_many = msgspec.msgpack.Decoder(list[item_type]).decode  # type: ignore[valid-type]
        self._op_base = random.getrandbits(62) << 40  # operation ids: unique per proxy instance
        self._op_counter = itertools.count(1)
        # bound actor methods, looked up once
        self._send_m = host.send
        self._send_many_m = host.send_many
        self._receive_m = host.receive

    @classmethod
    def create(
        cls,
        name: str,
        max_items: int,
        max_bytes: int | None = None,
        item_type: type[T] = Ref,  # type: ignore[assignment]
        *,
        max_concurrency: int = 1000,
        **actor_options: Any,
    ) -> RayChannel[T]:
        """Start a `ChannelHost` actor (num_cpus=0) for a new channel and return a proxy on it.

        `max_concurrency` bounds the number of operations (blocked waiters included) the host runs at
        once. `actor_options` go to `.options()` (e.g. `name=`, `lifetime=`). Ray must be initialised.
        """
        Channel(name, max_items=max_items, max_bytes=max_bytes)  # validate the bounds here, in the caller
        host = ChannelHost.options(max_concurrency=max_concurrency, **actor_options).remote(
            name, max_items, max_bytes, item_type
        )
        return cls(host, name, max_items, max_bytes, item_type)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._host, self.name, self.max_items, self.max_bytes, self.item_type))

    @property
    def host(self) -> Any:
        """The `ChannelHost` actor handle."""
        return self._host

    # -- plumbing --------------------------------------------------------------------------------
    async def _call(self, method: Any, *args: Any, receive_many: bool | None = None) -> _Reply:
        """One round trip for operation `method(op, *args)`; on cancellation, abandon it (see module doc).

        `receive_many` is None for sends, else whether the reply payload is a list (for giving back).
        """
        op = self._op_base | next(self._op_counter)
        ref = method.remote(op, *args)
        try:
            reply = await ref
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.CLEANUP_TIMEOUT_S):
                await self._abandon(op, ref, receive_many)
            raise
        _, _, self._depth, self._nbytes, closed = reply
        self._closed = self._closed or closed
        return reply

    async def _abandon(self, op: int, ref: Any, receive_many: bool | None) -> None:
        try:
            await self._host.abandon.remote(op)
            status, payload, *_ = await ref
            if status == _CANCELLED:
                return  # nothing taken, nothing put in (or a prefix of a batch: see module doc)
            if status == _OK and receive_many is not None:
                await self._host.unreceive.remote(op, payload, receive_many)
            else:
                self._host.forget.remote(op)
        except ray.exceptions.RayError:
            return  # the host is gone: nothing left to give back

    def _check(self, reply: _Reply) -> Any:
        status, payload = reply[0], reply[1]
        if status == _OK:
            return payload
        if status == _CLOSED:
            self._closed = True
            raise self._closed_error()
        if status == _END:
            raise anyio.EndOfStream
        if status == _WOULD_BLOCK:
            raise anyio.WouldBlock
        if status == _INVALID:
            raise ChannelItemError(payload)
        raise RuntimeError(f"channel {self.name!r}: unexpected reply status {status}")  # pragma: no cover

    # -- the Channel surface ---------------------------------------------------------------------
    async def send(self, item: T) -> None:
        """Put `item` in, waiting (in the host, FIFO with other senders) while it does not fit."""
        if self.before_send is not None:
            await self.before_send()
        if self._closed:
            raise self._closed_error()
        self._check(await self._call(self._send_m, self._encode(item)))

    async def send_many(self, items: Iterable[T]) -> None:
        """Put `items` in, in order, in one round trip (waiting in the host while they do not fit).

        On `ChannelClosed`, the exception's `sent` attribute counts the items that went in first.
        """
        if self.before_send is not None:
            await self.before_send()
        if self._closed:
            raise self._closed_error()
        batch = items if isinstance(items, list) else list(items)
        if not batch:
            return
        reply = await self._call(self._send_many_m, self._encode(batch))
        if reply[0] == _CLOSED:
            self._closed = True
            error = self._closed_error()
            error.sent = reply[1]  # type: ignore[attr-defined]
            raise error
        self._check(reply)

    async def send_nowait(self, item: T) -> None:
        """Put `item` in if it fits now, else raise `anyio.WouldBlock` (a coroutine: one round trip)."""
        if self._closed:
            raise self._closed_error()
        self._check(await self._call(self._host.send_nowait, self._encode(item)))

    async def receive(self) -> T:
        """Take the next item, waiting (in the host, FIFO with other receivers) while the channel is empty."""
        return self._decode_one(self._check(await self._call(self._receive_m, 0, receive_many=False)))

    async def receive_many(self, max_items: int) -> list[T]:
        """Take 1..max_items items in one round trip: wait for the first, then whatever is there.

        Raises `anyio.EndOfStream` once the channel is closed and drained.
        """
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        return self._decode_many(self._check(await self._call(self._receive_m, max_items, receive_many=True)))

    async def receive_nowait(self) -> T:
        """Take the next item if there is one now, else raise `anyio.WouldBlock` / `anyio.EndOfStream`."""
        reply = await self._call(self._receive_m, 0, False, receive_many=False)
        return self._decode_one(self._check(reply))

    async def receive_many_nowait(self, max_items: int) -> list[T]:
        """Take up to `max_items` items that are there now, in one round trip (maybe none; never raises
        `WouldBlock` or `EndOfStream`)."""
        try:
            reply = self._check(await self._call(self._receive_m, max_items, False, receive_many=True))
        except (anyio.WouldBlock, anyio.EndOfStream):
            return []
        return self._decode_many(reply)

    def close(self) -> None:
        """Refuse further sends (idempotent). Returns at once; the host applies it asynchronously."""
        self._closed = True
        self._host.close.remote()

    async def aclose(self) -> None:
        """Close, and wait until the host has applied it."""
        self._closed = True
        _, _, self._depth, self._nbytes, _ = await self._host.close.remote()

    async def stats(self) -> ChannelStats:
        """A fresh snapshot from the host (receive_wait_s also counts receivers queued behind the head)."""
        stats = msgspec.msgpack.decode(await self._host.stats.remote(), type=ChannelStats)
        self._depth, self._nbytes = stats.depth, stats.nbytes
        self._closed = self._closed or stats.closed
        return stats

    async def items(self) -> list[T]:
        """A snapshot of the items inside, oldest first (for checkpoints and diagnosis; takes nothing out)."""
        return self._decode_many(await self._host.items.remote())

    def kill(self) -> None:
        """Kill the host actor (its items are lost); calls in flight raise `ray.exceptions.RayActorError`."""
        ray.kill(self._host)
