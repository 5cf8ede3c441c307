"""`mooncake_p2p`: the learner writes each weight version straight into every engine's memory over
Mooncake's TransferEngine (TCP here, RDMA on clusters), then commits it.

Engine side, `SlotReceiver` (in the engine's process): on `hello` it starts a TransferEngine and
registers two receive slots (shadow buffers) big enough for one version; it answers with its peer
address and the slots' addresses. Bytes land in a slot while the engines keep generating from their
live weights. On `commit(slot, layout)` it verifies every bucket's xxh3 checksum over the slot and
only then hands the version to its engines (which apply it whole, between decode steps); a slot
with any bad bucket is refused and the engines stay on their version.

Learner side, `MooncakeP2PTransport`: cuts each version into buckets (`stages.weights.layout`),
writes them from the learner's own registered tensors (CUDA or strided ones through a staging
buffer) to each receiver's free slot with
`batch_transfer_sync_write` (paced when `pace_bytes_per_s` is set: on a 2-core box an unpaced TCP
push starves generation), and commits (retries, unreachable engines and catch-ups:
`PushTransport`; a restarted engine says hello again).

With `engine_dtype` (e.g. "bfloat16" for a fp32 learner) each version is first packed in that dtype
and written from the packed copy. With `sparse=True` a version is sent as element-level deltas
(`stages.weights.sparse`): the receiver also registers an inbox; the learner writes each delta's
payload there and commits it with its `Patch`, and the receiver rebuilds the free slot in place
(from the version it holds, or from a copy of the live slot), verifies every bucket and applies the
version, all or nothing. Every commit reply says what each slot holds; a receiver holding no base
the learner kept, or one that refused, gets the whole version written into its slot as before.

The control messages (hello, commit and their replies) are msgpack structs, validated on arrival;
weights never travel pickled. TransferEngine listens on all interfaces (Mooncake's choice);
peers are addressed as `ip:rpc_port` (127.0.0.1, or `$BATON_HOST` on multi-node runs) with
`P2PHANDSHAKE` metadata, no metadata server.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import numpy as np
import torch

from stages.weights.base import (
    ApplyReply,
    EngineReceiver,
    LinkBroken,
    LocalAsker,
    PushTransport,
    Target,
    WeightPushError,
)
from stages.weights.layout import (
    Layout,
    LayoutError,
    decode_layout,
    encode_layout,
    fill,
    plan,
    views,
    with_checksums,
)
from stages.weights.mooncake_shards import PushSettings, ShardSource
from stages.weights.reshard import BucketCheck
from stages.weights.sparse import Patch, Planner, SlotReply, Slots
from stages.weights.transfer_engine import advertised_host, transfer_engine

HELLO, COMMIT = "weights.p2p.hello", "weights.p2p.commit"
_CHECKSUMS = ThreadPoolExecutor(1, thread_name_prefix="baton-p2p-checksums")  # a version's, beside its first write


class Hello(msgspec.Struct, frozen=True):
    capacity: int
    protocol: str = "tcp"
    device: str = ""
    inbox: bool = False  # sparse deltas: also register an inbox their payloads are written into


class HelloReply(msgspec.Struct, frozen=True):
    peer: str
    slots: tuple[int, ...]
    capacity: int
    live: int = -1  # the slot its engines run on (never written), -1: none
    inbox: int = 0  # the inbox's address (0: none)
    holds: tuple[int, ...] = ()  # the version each slot holds (-1: none)


class Commit(msgspec.Struct, frozen=True):
    slot: int
    layout: bytes
    patch: Patch | None = None  # None: the slot was written whole; else rebuild it from the inbox
    checks: tuple[BucketCheck, ...] = ()  # written by the learner's ranks (mooncake_shards): each rank's buckets


# every commit reply, whatever happened (applied, already held, refused), says which slot the
# engines run on (the learner's next write goes to the other one) and what each slot holds
CommitReply = SlotReply


class SlotReceiver(EngineReceiver):
    """The engine side (see the module docstring). `handlers()` are its mailbox entries.

    Invariant: the learner writes only the slot that is not `live`. A committed, verified version
    is handed to the engines as views over its slot, without a copy; `commit` replies only after
    every engine's `receive_weights` returned, i.e. once no engine reads the other slot any more,
    so that slot is free for the next version. The slots are shared memory, so an engine in
    another process (an SGLang server) can map the same bytes by handle.
    """

    def __init__(self, engines: list[Any]) -> None:
        super().__init__(engines)
        self._te: Any = None
        self.slots = Slots([])
        self._inbox: torch.Tensor | None = None

    def handlers(self) -> dict[str, Callable[[bytes, Any], Awaitable[bytes]]]:
        return {HELLO: self.hello, COMMIT: self.commit}

    async def hello(self, header: bytes, _blob: Any = None) -> bytes:
        hello = msgspec.msgpack.decode(header, type=Hello)
        if self._te is None:
            self._te = transfer_engine(hello.protocol, hello.device)
        slots = self.slots.slots
        if not slots or slots[0].nbytes < hello.capacity:
            # engines keep their current weights alive (views hold the old slot)
            self.slots = Slots(await anyio.to_thread.run_sync(self._new_slots, hello.capacity))
        if hello.inbox and (self._inbox is None or self._inbox.nbytes < hello.capacity):
            self._inbox = (await anyio.to_thread.run_sync(self._register, [], 1, hello.capacity, False))[0]
        reply = HelloReply(
            f"{advertised_host()}:{self._te.get_rpc_port()}",
            tuple(s.data_ptr() for s in self.slots.slots),
            self.slots.slots[0].nbytes,
            self.slots.live,
            self._inbox.data_ptr() if hello.inbox and self._inbox is not None else 0,
            tuple(self.slots.holds),
        )
        return msgspec.msgpack.encode(reply)

    def _new_slots(self, capacity: int) -> list[torch.Tensor]:
        return self._register(self.slots.slots, 2, capacity, True)

    def _register(self, old: list[torch.Tensor], n: int, capacity: int, shared: bool) -> list[torch.Tensor]:
        """`n` new registered buffers in place of `old` (shared: mappable by name, as SGLang needs)."""
        for buffer in old:
            self._te.unregister_memory(buffer.data_ptr())
        if shared:
            torch.multiprocessing.set_sharing_strategy("file_system")
        buffers = [torch.zeros(capacity, dtype=torch.uint8) for _ in range(n)]
        for buffer in buffers:
            if shared:
                buffer.share_memory_()
            if self._te.register_memory(buffer.data_ptr(), buffer.nbytes) != 0:
                raise WeightPushError(f"cannot register a {buffer.nbytes}-byte receive buffer with TransferEngine")
        return buffers

    async def commit(self, header: bytes, _blob: Any = None) -> bytes:
        """Every reply, whatever happened, says which slot the engines run on now."""
        return self.slots.reply(msgspec.msgpack.decode(await self._commit(header), type=ApplyReply))

    async def _commit(self, header: bytes) -> bytes:
        try:
            commit = msgspec.msgpack.decode(header, type=Commit)
            layout = decode_layout(commit.layout)
            if (held := self.holds(layout.version)) is not None:  # a re-send of what it has
                return held
            if commit.patch is not None and self._inbox is None:
                raise LayoutError("a delta, but this receiver has no inbox (say hello with inbox=True)")
            inbox = self._inbox.numpy() if commit.patch is not None else None
            if commit.checks:
                slot = await anyio.to_thread.run_sync(self.slots.take_shards, commit.slot, layout, commit.checks)
            else:
                slot = await anyio.to_thread.run_sync(self.slots.rebuild, commit.slot, layout, commit.patch, inbox)
        except (LayoutError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self.refuse(str(exc))
        reply = await self.apply(layout.version, views(slot, layout))
        if self.version == layout.version:  # its engines run on the slot now (not when one refused it)
            self.slots.applied(commit.slot)
        return reply

    def close(self) -> None:
        if self._te is not None:
            for buffer in [*self.slots.slots, *([self._inbox] if self._inbox is not None else [])]:
                self._te.unregister_memory(buffer.data_ptr())
        self.slots, self._inbox, self._te = Slots([]), None, None


@dataclass(eq=False)
class _SlotTarget(Target):
    peer: str = ""
    slots: tuple[int, ...] = ()
    capacity: int = 0
    next_slot: int = 0
    inbox: int = 0
    holds: tuple[int, ...] = ()  # the version each slot holds, as the receiver's last reply said

    def forget(self) -> None:
        self.slots, self.holds = (), ()  # whatever it holds now, the next send learns it from a hello


@dataclass
class MooncakeP2PTransport(PushTransport):
    """The learner side (see the module docstring)."""

    protocol: str = "tcp"
    device: str = ""
    bucket_bytes: int = 32 << 20
    pace_bytes_per_s: float | None = None
    retries: int = 2
    engine_dtype: str | None = None  # e.g. "bfloat16": floating tensors are converted and sent in it
    sparse: bool = False  # send each version as element-level deltas (`stages.weights.sparse`)
    name: str = "mooncake_p2p"
    target_type = _SlotTarget
    receiver = SlotReceiver
    pushes_from_shards = True

    def __post_init__(self) -> None:
        super().__post_init__()
        # packed versions in the engine dtype (the deltas' bases), when converting or diffing
        self._planner = Planner(self.engine_dtype, self.stats) if self.sparse or self.engine_dtype else None
        self._payload: np.ndarray | None = None  # a delta's payload, registered, written to inboxes
        self._te: Any = None
        self._registered: dict[int, int] = {}  # address -> bytes registered with TransferEngine
        self._staging: np.ndarray | None = None
        self._layout: Layout | None = None
        self._sources: list[int] = []  # where each layout entry's bytes are, in this process
        self._source: dict[str, torch.Tensor] = {}  # the staged tensors: `_sources` point into them
        self._checksums: Future[Layout] | None = None  # the layout's checksums, being computed
        # fault injection: called with (layout, attempt) after a version's buckets were written; a
        # returned (offset, bytes) is written over the receiver's slot (damage in flight)
        self.damage: Callable[[Layout, int], tuple[int, bytes] | None] | None = None
        self._shards: ShardSource | None = None  # the learner's ranks, while a version is pushed from its shards
        self._staged_from_shards = False  # the staged version came from the shards: no rank here holds it whole


    async def publish_shards(self, version: int, shards: ShardSource) -> None:
        """Publish `version` from the learner's shards: every rank writes its own pieces into each engine's
        free slot, rank 0 commits with every rank's checks (`stages.weights.mooncake_shards`)."""
        if self.sparse:
            raise WeightPushError("weights.sparse deltas need the whole version on one rank; with "
                                  "learner.world_size > 1 set weights.sparse = false")
        self._shards = shards
        try:
            await self.publish(version, {})
        finally:
            self._shards = None

    def push_settings(self) -> PushSettings:
        return PushSettings(self.protocol, self.device, self.bucket_bytes, self.engine_dtype, self.pace_bytes_per_s)

    async def stage(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Written from `tensors` themselves when they are on CPU, without a packing copy: they must
        not change until `publish` returns (the learner's next optimizer step waits for it). A
        `resend` while the learner changes them sends torn bytes, which the receiver refuses."""
        self._staged_from_shards = self._shards is not None
        if self._shards is not None:
            self._layout = await anyio.to_thread.run_sync(self._shards.receive_layout, version, self.push_settings())
            self.stats["state_bytes"] += self._layout.total
            return
        if self._planner is not None:
            await anyio.to_thread.run_sync(self._stage_packed, version, tensors)
            return
        layout = plan(version, tensors, self.bucket_bytes)
        packed = await anyio.to_thread.run_sync(self._prepare, tensors, layout)
        self._source, self._layout = tensors, packed or layout
        if packed is None:  # checksum them while the first write runs
            self._checksums = _CHECKSUMS.submit(with_checksums, tensors, layout)

    async def send(self, target: _SlotTarget, attempt: int) -> tuple[bytes | None, int]:
        """Write the version into the receiver's free slot, then commit it."""
        layout = self._layout
        assert layout is not None
        fresh = not target.slots or target.capacity < layout.total or (self.sparse and not target.inbox)
        if fresh and not await self._hello(target, layout):
            return None, 0
        slot, patch, nbytes = target.next_slot, None, layout.total
        if self._shards is not None:
            return await self._send_shards(target, slot, layout, attempt)
        if self.sparse and self._planner is not None:
            patch, pieces = await anyio.to_thread.run_sync(self._planner.patch, target.holds, slot, attempt > 0)
        try:
            if patch is None or patch.base == -1:
                patch = None  # the whole version, written straight into the slot
                await anyio.to_thread.run_sync(self._write, target, slot, layout, attempt)
            else:
                nbytes = await anyio.to_thread.run_sync(self._write_patch, target, layout, pieces, attempt)
        except WeightPushError as exc:
            if not await self._hello(target, layout):
                return None, 0  # the write failed because its process is gone
            raise LinkBroken(str(exc)) from None
        if self._checksums is not None:
            self._layout, self._checksums = await anyio.to_thread.run_sync(self._checksums.result), None
        commit = Commit(slot, encode_layout(self._layout), patch)
        answer = await target.asker.ask(COMMIT, msgspec.msgpack.encode(commit))
        if answer is not None:
            reply = msgspec.msgpack.decode(answer, type=CommitReply)
            target.next_slot = 1 - reply.live if reply.live in (0, 1) else slot  # never the live slot
            target.holds = reply.holds
        return answer, nbytes

    async def close(self) -> None:
        for target in list(self._targets):
            if isinstance(target.asker, LocalAsker):
                target.asker.receiver.close()
        if self._te is not None:
            for address in self._registered:
                self._te.unregister_memory(address)
        self._registered.clear()
        self._te, self._staging, self._source = None, None, {}
        await super().close()

    async def resend(self, receiver: Any) -> None:
        """A catch-up of a version pushed from the shards needs every rank (a collective the learner's own
        flow must order): it waits for the next publish, which reaches the receiver anew."""
        if self._staged_from_shards:
            async with self._busy:
                for target in (t for t in self._targets if t.asker is receiver):
                    target.forget()
                    self.stats["deferred"] += 1
            return
        await super().resend(receiver)

    # -- internals -------------------------------------------------------------------------------
    async def _send_shards(self, target: _SlotTarget, slot: int, layout: Layout,
                           attempt: int) -> tuple[bytes | None, int]:
        """Every rank writes its pieces into `slot`; then the commit with every rank's checks."""
        assert self._shards is not None
        try:
            checks = await anyio.to_thread.run_sync(self._shards.write, target.peer, target.slots[slot],
                                                    layout.version, self.push_settings())
        except ConnectionError as exc:
            if not await self._hello(target, layout):
                return None, 0
            raise LinkBroken(str(exc)) from None
        if self.damage is not None and (hit := self.damage(layout, attempt)) is not None:
            await anyio.to_thread.run_sync(self._write_bytes, target, target.slots[slot] + hit[0], hit[1])
        answer = await target.asker.ask(COMMIT, msgspec.msgpack.encode(Commit(slot, encode_layout(layout),
                                                                               checks=tuple(checks))))
        if answer is not None:
            reply = msgspec.msgpack.decode(answer, type=CommitReply)
            target.next_slot = 1 - reply.live if reply.live in (0, 1) else slot
            target.holds = reply.holds
        return answer, layout.total

    def _stage_packed(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Pack the version in the engine dtype (kept as a base of later deltas), written from there."""
        assert self._planner is not None
        if self._te is None:
            self._te = transfer_engine(self.protocol, self.device)
        buffer = self._planner.stage(version, tensors, self.bucket_bytes)
        self._layout = self._planner.versions.layout
        assert self._layout is not None
        self._keep_registered()
        self._sources = [buffer.ctypes.data + e.offset for e in self._layout.tensors]
        self.stats["copied"] += 1

    def _keep_registered(self) -> None:
        assert self._planner is not None
        buffers = [*self._planner.versions.packed.values(), *([self._payload] if self._payload is not None else [])]
        self._register({b.ctypes.data: b.nbytes for b in buffers})

    def _write_patch(self, target: _SlotTarget, layout: Layout, pieces: list[np.ndarray], attempt: int) -> int:
        """Write a delta's payload into the receiver's inbox (its commit rebuilds the slot); returns its bytes."""
        total = sum(p.nbytes for p in pieces)
        if self._payload is None or self._payload.nbytes < total:
            self._payload = np.empty(max(total, 1), dtype=np.uint8)
            self._keep_registered()
        if total:
            np.concatenate(pieces, out=self._payload[:total])
            starts = range(0, total, self.bucket_bytes)
            rc = self._te.batch_transfer_sync_write(
                target.peer,
                [self._payload.ctypes.data + s for s in starts],
                [target.inbox + s for s in starts],
                [min(self.bucket_bytes, total - s) for s in starts],
            )
            if rc != 0:
                raise WeightPushError(f"TransferEngine write to {target.asker.name} ({target.peer}) returned {rc}")
        if self.damage is not None and (hit := self.damage(layout, attempt)) is not None:
            self._write_bytes(target, target.inbox + hit[0], hit[1])  # a delta: damage its payload
        return total

    def _prepare(self, tensors: dict[str, torch.Tensor], layout: Layout) -> Layout | None:
        """Register the memory the version is written from. CPU tensors are written from where they
        are (returns None: checksums still to compute); anything else (CUDA, non-contiguous) is
        packed into a registered staging buffer first (returns the checksummed layout)."""
        if self._te is None:
            self._te = transfer_engine(self.protocol, self.device)
        direct = all(t.device.type == "cpu" and t.is_contiguous() for t in tensors.values())
        if direct:
            storages = [t.untyped_storage() for t in tensors.values()]
            self._register({s.data_ptr(): max(s.nbytes(), 1) for s in storages})
            self._sources = [tensors[e.name].data_ptr() for e in layout.tensors]
            return None
        if self._staging is None or self._staging.nbytes < layout.total:
            self._staging = np.zeros(layout.total, dtype=np.uint8)
        self._register({self._staging.ctypes.data: self._staging.nbytes})
        self._sources = [self._staging.ctypes.data + e.offset for e in layout.tensors]
        self.stats["copied"] += 1
        return fill(self._staging, tensors, layout)

    def _register(self, regions: dict[int, int]) -> None:
        """Keep exactly `regions` registered (a learner's parameters stay where they are, so after
        the first version this registers nothing)."""
        for address, nbytes in list(self._registered.items()):
            if regions.get(address) != nbytes:
                self._te.unregister_memory(address)
                del self._registered[address]
        for address, nbytes in regions.items():
            if address not in self._registered:
                if self._te.register_memory(address, nbytes) != 0:
                    raise WeightPushError(f"cannot register {nbytes} bytes of weights with TransferEngine")
                self._registered[address] = nbytes

    async def _hello(self, target: _SlotTarget, layout: Layout) -> bool:
        """Learn the receiver's slots (its process may be new); False when it does not answer."""
        ask = Hello(layout.total, self.protocol, self.device, self.sparse)
        answer = await target.asker.ask(HELLO, msgspec.msgpack.encode(ask))
        if answer is None:
            return False
        hello = msgspec.msgpack.decode(answer, type=HelloReply)
        target.peer, target.slots, target.capacity = hello.peer, hello.slots, hello.capacity
        target.inbox, target.holds = hello.inbox, hello.holds
        target.next_slot = 1 - hello.live if hello.live in (0, 1) else 0
        return True

    def _write(self, target: _SlotTarget, slot: int, layout: Layout, attempt: int) -> None:
        dst = target.slots[slot]
        started, sent = time.perf_counter(), 0
        for bucket in layout.buckets:
            entries = range(bucket.first, bucket.first + bucket.count)
            sizes = [layout.tensors[i].nbytes for i in entries]
            if sum(sizes):
                rc = self._te.batch_transfer_sync_write(
                    target.peer,
                    [self._sources[i] for i in entries],
                    [dst + layout.tensors[i].offset for i in entries],
                    sizes,
                )
                if rc != 0:
                    raise WeightPushError(f"TransferEngine write to {target.asker.name} ({target.peer}) returned {rc}")
            sent += bucket.nbytes
            if self.pace_bytes_per_s:
                ahead = sent / self.pace_bytes_per_s - (time.perf_counter() - started)
                if ahead > 0:
                    time.sleep(ahead)
        if self.damage is not None and (hit := self.damage(layout, attempt)) is not None:
            self._write_bytes(target, dst + hit[0], hit[1])

    def _write_bytes(self, target: _SlotTarget, address: int, data: bytes) -> None:
        if self._te is None:  # a push from the shards writes through the ranks' own engines
            self._te = transfer_engine(self.protocol, self.device)
        scratch = np.frombuffer(bytearray(data), dtype=np.uint8)
        self._te.register_memory(scratch.ctypes.data, scratch.nbytes)
        try:
            self._te.batch_transfer_sync_write(target.peer, [scratch.ctypes.data], [address], [scratch.nbytes])
        finally:
            self._te.unregister_memory(scratch.ctypes.data)
