"""RefBuffer: the buffer stage. It indexes refs (never payloads) and hands them on in order.

It replays nothing: reuse of a group (training on it more than once) happens in the learner's
`policies.selection.ReplayWindow`. The buffer only bounds and orders what is on its way there.

Guarantees:
* every ref received is either forwarded to the consumer exactly once or expired exactly once
  (handed to `pipeline.context.refuse`, which accounts for it per the policy); none is silently forgotten;
* refs are forwarded FIFO (oldest first);
* at most `max_refs` refs / `max_bytes` payload bytes are held; beyond that the buffer stops
  receiving, so backpressure reaches the producers through the bounded channel;
* whenever the version clock moves, refs that `expired(ref, version)` are removed at once
  (eviction by version), so stale payloads do not sit in the store.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import anyio

from buffers.faulty import open_store
from buffers.store import ObjectStore, StoreSpec
from pipeline.actor import BaseActor
from pipeline.channel import Channel
from pipeline.context import RunContext, refuse
from pipeline.refs import HeldRef, Ref


@dataclass
class RefBuffer:
    """The DSL/config object: `RefBuffer(store, max_refs=256, max_bytes=256 << 20)`."""

    store: ObjectStore | StoreSpec
    max_refs: int = 256
    max_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if self.max_refs < 1 or self.max_bytes < 1:
            raise ValueError(
                f"buffer.max_refs and buffer.max_bytes must be >= 1, got {self.max_refs}, {self.max_bytes}"
            )

    @contextlib.contextmanager
    def serve_store(self) -> Iterator[StoreOpening]:
        """The store for this run: a spec that serves (a Mooncake master started for the run) does so
        for the block; anything else is opened as it is."""
        if isinstance(self.store, ServesStore):
            with self.store.serve() as served:
                yield StoreOpening(served)
        else:
            yield StoreOpening(self.store)

    def actors(self, ctx: RunContext, inbox: Channel | None, outbox: Channel | None):
        assert inbox is not None and outbox is not None
        return [RefBufferActor(self, ctx.services.store, ctx, inbox, outbox)]


@runtime_checkable
class ServesStore(Protocol):
    """A store spec that needs something running for the run's length (a Mooncake master)."""

    def serve(self) -> contextlib.AbstractContextManager[StoreSpec]: ...


@dataclass(frozen=True)
class StoreOpening:
    """A `pipeline.contracts.StoreOpener`: opens `store` (a store, or a spec) in the calling process."""

    store: ObjectStore | StoreSpec

    def open(self, holder: bool, faults: Any) -> ObjectStore:
        return open_store(self.store, holder=holder, faults=faults)


class RefBufferActor(BaseActor):
    name = "buffer"

    def __init__(
        self, spec: RefBuffer, store: ObjectStore, ctx: RunContext, inbox: Channel, outbox: Channel
    ) -> None:
        self.spec, self.store, self.ctx, self.inbox, self.outbox = spec, store, ctx, inbox, outbox
        self.index: deque[Ref] = deque()
        self.nbytes = 0
        self.evicted = 0
        self._changed = anyio.Event()
        self._frees = None
        self._forwarding: list[Ref] = []  # taken from the index, being sent on

    async def stop(self) -> None:
        await self.store.close()

    def held_refs(self) -> list[HeldRef]:
        """The refs being forwarded and those in the index, oldest first (what a checkpoint records of the
        buffer; a ref of the batch being forwarded may also be in the next channel already: a resume
        counts each group once)."""
        return [HeldRef(ref=ref, holder=self.name) for ref in (*self._forwarding, *self.index)]

    def _expired(self, ref: Ref, version: int) -> bool:
        return self.ctx.policy.accept(version, ref.version) != "train"

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            self._frees = tg
            tg.start_soon(self._receive)
            tg.start_soon(self._evict_on_version)
            await self._forward()
            tg.cancel_scope.cancel()

    def _full(self, incoming: Ref) -> bool:
        """Holding `incoming` too would break max_refs or max_bytes (one ref always fits when empty)."""
        if len(self.index) >= self.spec.max_refs:
            return True
        return bool(self.index) and self.nbytes + incoming.nbytes > self.spec.max_bytes

    def _poke(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _receive(self) -> None:
        while True:
            try:  # whatever has arrived, in one round trip (the channel may live in another process)
                refs = await self.inbox.receive_many(self.spec.max_refs)
            except anyio.EndOfStream:
                return
            for ref in refs:
                while self._full(ref):
                    await self._changed.wait()
                self.index.append(ref)
                self.nbytes += ref.nbytes
                self._poke()

    async def _forward(self) -> None:
        while True:
            while not self.index:
                await self._changed.wait()
            # once taken from the index a ref belongs to the consumer, whose acceptance check
            # covers it; so a ref is either evicted here or forwarded, never both
            batch = [self.index.popleft() for _ in range(min(len(self.index), self.outbox.max_items))]
            self.nbytes -= sum(r.nbytes for r in batch)
            self._poke()
            self.ctx.note(self.name, f"forwarding {len(batch)} refs ({len(self.index)} left in the index)")
            self._forwarding = batch
            await self.outbox.send_many(batch)
            self._forwarding = []
            self.ctx.note(self.name, f"forwarded {len(batch)} refs ({len(self.index)} left in the index)")

    async def _evict_on_version(self) -> None:
        version = await self.ctx.clock.current()
        while True:
            version = await self.ctx.clock.wait_change(version)
            expired = [ref for ref in self.index if self._expired(ref, version)]
            if not expired:
                continue
            gone = {id(r) for r in expired}
            self.index = deque(r for r in self.index if id(r) not in gone)
            self.nbytes = sum(r.nbytes for r in self.index)
            self.evicted += len(expired)
            self._poke()
            for ref in expired:
                await refuse(self.ctx, ref, version, self.store, self._frees)
