"""`mooncake_p2p`: the learner writes each weight version straight into every engine's memory over
Mooncake's TransferEngine (TCP here, RDMA on clusters), then commits it.

Engine side, `SlotReceiver` (in the engine's process): on `hello` it starts a TransferEngine and
registers two receive slots (shadow buffers) big enough for one version; it answers with its peer
address and the slots' addresses. Bytes land in a slot while the engines keep generating from their
live weights. On `commit(slot, layout)` it verifies every bucket's xxh3 checksum over the slot and
only then hands the version to its engines (which apply it whole, between decode steps); a slot
with any bad bucket is refused and the engines stay on their version.

Learner side, `MooncakeP2PTransport`: packs each version into one registered staging buffer cut
into buckets (`stages.weights.layout`), writes the buckets to each receiver's free slot with
`batch_transfer_sync_write` (paced when `pace_bytes_per_s` is set: on a 2-core box an unpaced TCP
push starves generation), and commits. A refused commit is retried (`retries`), then raised as
`WeightPushError`: never reported as success. A receiver that cannot be reached (its process died)
is skipped, counted in `unreachable`, and caught up with the latest version once its process is
back (`resend`), so one dead engine never stops the run.

The control messages (hello, commit and their replies) are msgpack structs, validated on arrival;
weights never travel pickled. TransferEngine listens on all interfaces (Mooncake's choice);
peers are addressed as `ip:rpc_port` (127.0.0.1, or `$BATON_HOST` on multi-node runs) with
`P2PHANDSHAKE` metadata, no metadata server.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import numpy as np
import torch

from stages.weights.base import ApplyReply, EngineReceiver, LocalAsker, RemoteReceiver, WeightPushError, require_newer
from stages.weights.layout import Layout, LayoutError, bad_buckets, decode_layout, encode_layout, fill, plan, views

HELLO, COMMIT = "weights.p2p.hello", "weights.p2p.commit"


class Hello(msgspec.Struct, frozen=True):
    capacity: int
    protocol: str = "tcp"
    device: str = ""


class HelloReply(msgspec.Struct, frozen=True):
    peer: str
    slots: tuple[int, ...]
    capacity: int


class Commit(msgspec.Struct, frozen=True):
    slot: int
    layout: bytes


def _transfer_engine(protocol: str, device: str) -> Any:
    from buffers.mooncake_master import require_mooncake

    require_mooncake()  # names the package or system library to install
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(advertised_host(), "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        raise WeightPushError(
            f"TransferEngine.initialize({advertised_host()}, P2PHANDSHAKE, {protocol!r}, {device!r}) returned {rc}"
        )
    return engine


def advertised_host() -> str:
    """The address peers use to reach this process's TransferEngine: 127.0.0.1 unless `BATON_HOST`
    names this node's address (multi-node runs)."""
    return os.environ.get("BATON_HOST", "127.0.0.1")


class SlotReceiver(EngineReceiver):
    """The engine side (see the module docstring). `handlers()` are its mailbox entries."""

    def __init__(self, engines: list[Any]) -> None:
        super().__init__(engines)
        self._te: Any = None
        self._slots: list[np.ndarray] = []

    def handlers(self) -> dict[str, Callable[[bytes, Any], Awaitable[bytes]]]:
        return {HELLO: self.hello, COMMIT: self.commit}

    async def hello(self, header: bytes, _blob: Any = None) -> bytes:
        hello = msgspec.msgpack.decode(header, type=Hello)
        if self._te is None:
            self._te = _transfer_engine(hello.protocol, hello.device)
        if not self._slots or self._slots[0].nbytes < hello.capacity:
            for slot in self._slots:
                self._te.unregister_memory(slot.ctypes.data)
            self._slots = [np.zeros(hello.capacity, dtype=np.uint8) for _ in range(2)]
            for slot in self._slots:
                if self._te.register_memory(slot.ctypes.data, slot.nbytes) != 0:
                    raise WeightPushError(f"cannot register a {slot.nbytes}-byte receive slot with TransferEngine")
        reply = HelloReply(
            f"{advertised_host()}:{self._te.get_rpc_port()}",
            tuple(s.ctypes.data for s in self._slots),
            self._slots[0].nbytes,
        )
        return msgspec.msgpack.encode(reply)

    async def commit(self, header: bytes, _blob: Any = None) -> bytes:
        try:
            commit = msgspec.msgpack.decode(header, type=Commit)
            layout = decode_layout(commit.layout)
            if not 0 <= commit.slot < len(self._slots):
                raise LayoutError(f"no slot {commit.slot}")
            slot = self._slots[commit.slot]
            if (held := self.holds(layout.version)) is not None:  # a re-send of what it has
                return held
            bad = bad_buckets(slot, layout)
            if bad:
                raise LayoutError(f"buckets {bad} of version {layout.version} fail their checksum")
        except (LayoutError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self.refuse(str(exc))
        # the engines own their copy: the slot is written again two versions from now
        return await self.apply(layout.version, {name: t.clone() for name, t in views(slot, layout).items()})

    def close(self) -> None:
        if self._te is not None:
            for slot in self._slots:
                self._te.unregister_memory(slot.ctypes.data)
        self._slots, self._te = [], None


@dataclass
class _Target:
    asker: Any
    peer: str = ""
    slots: tuple[int, ...] = ()
    capacity: int = 0
    next_slot: int = 0


@dataclass
class MooncakeP2PTransport:
    """The learner side (see the module docstring)."""

    protocol: str = "tcp"
    device: str = ""
    bucket_bytes: int = 32 << 20
    pace_bytes_per_s: float | None = None
    retries: int = 2
    name: str = "mooncake_p2p"
    stats: dict = field(
        default_factory=lambda: {"pushes": 0, "bytes": 0, "retries": 0, "unreachable": 0, "push_s": 0.0}
    )

    def __post_init__(self) -> None:
        self._targets: list[_Target] = []
        self._te: Any = None
        self._staging: np.ndarray | None = None
        self._layout: Layout | None = None
        self._last = -1
        self._busy_lock: anyio.Lock | None = None
        self._source: dict[str, torch.Tensor] | None = None
        # fault injection: called with (staging buffer, layout, attempt) before each write
        self.before_write: Callable[[np.ndarray, Layout, int], None] | None = None

    @property
    def _busy(self) -> anyio.Lock:
        if self._busy_lock is None:  # made on first use, inside the event loop that uses it
            self._busy_lock = anyio.Lock()
        return self._busy_lock

    def subscribe(self, receiver: Any) -> None:
        """A receiver: anything with `ask(box, header)` (another process) or an engine in this process."""
        if not hasattr(receiver, "ask"):
            receiver = LocalAsker(SlotReceiver([receiver]), getattr(receiver, "name", "local"))
        self._targets.append(_Target(receiver))

    def remote_receiver(self, peer: Any, name: str) -> Any:
        """The receiver for an engine process reachable through `peer.ask` (the Ray runtime)."""
        return RemoteReceiver(peer, name, self)

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        require_newer(version, self._last)
        t0 = time.perf_counter()
        async with self._busy:  # a resend and a publish never share the staging buffer
            await self._publish(version, tensors)
        self.stats["pushes"] += 1
        self.stats["push_s"] += time.perf_counter() - t0

    async def _publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self._source = tensors
        try:
            self._layout = await anyio.to_thread.run_sync(self._pack, version, tensors)
            for target in self._targets:
                await self._push(target)
        finally:
            self._source = None  # the learner changes these tensors in place from its next step on
        self._last = version

    async def resend(self, asker: Any) -> None:
        """Push the latest version to one receiver again (its process was restarted)."""
        async with self._busy:
            for target in self._targets:
                if target.asker is asker:
                    target.slots = ()  # a new process: say hello again
                    if self._layout is not None:
                        await self._push(target)

    async def close(self) -> None:
        for target in self._targets:
            if isinstance(target.asker, LocalAsker):
                target.asker.receiver.close()
        if self._te is not None and self._staging is not None:
            self._te.unregister_memory(self._staging.ctypes.data)
        self._targets.clear()
        self._te = self._staging = None

    # -- internals -------------------------------------------------------------------------------
    def _pack(self, version: int, tensors: dict[str, torch.Tensor]) -> Layout:
        layout = plan(version, tensors, self.bucket_bytes)
        if self._te is None:
            self._te = _transfer_engine(self.protocol, self.device)
        if self._staging is None or self._staging.nbytes < layout.total:
            if self._staging is not None:
                self._te.unregister_memory(self._staging.ctypes.data)
            self._staging = np.zeros(layout.total, dtype=np.uint8)
            if self._te.register_memory(self._staging.ctypes.data, self._staging.nbytes) != 0:
                raise WeightPushError(f"cannot register a {layout.total}-byte staging buffer with TransferEngine")
        return fill(self._staging, tensors, layout)

    async def _push(self, target: _Target) -> None:
        layout = self._layout
        assert layout is not None and self._staging is not None
        for attempt in range(self.retries + 1):
            if not target.slots or target.capacity < layout.total:
                answer = await target.asker.ask(HELLO, self._hello(layout))
                if answer is None:
                    self.stats["unreachable"] += 1
                    return  # its process is gone; `resend` catches it up once it is back
                hello = msgspec.msgpack.decode(answer, type=HelloReply)
                target.peer, target.slots, target.capacity, target.next_slot = (
                    hello.peer,
                    hello.slots,
                    hello.capacity,
                    0,
                )
            slot = target.next_slot
            if self.before_write is not None:
                self.before_write(self._staging, layout, attempt)
            try:
                await anyio.to_thread.run_sync(self._write, target, slot, layout)
            except WeightPushError as exc:  # its process may be gone: the next attempt says hello first
                reason, target.slots = str(exc), ()
                self.stats["retries"] += 1
                continue
            answer = await target.asker.ask(COMMIT, msgspec.msgpack.encode(Commit(slot, encode_layout(layout))))
            if answer is None:
                self.stats["unreachable"] += 1
                return
            reply = msgspec.msgpack.decode(answer, type=ApplyReply)
            if reply.ok:
                target.next_slot = 1 - slot  # the committed slot's bytes stay intact for a rollback
                self.stats["bytes"] += layout.total
                return
            self.stats["retries"] += 1
            reason = reply.reason
            if self._source is not None:  # the staging bytes may be what is damaged: pack them again
                await anyio.to_thread.run_sync(fill, self._staging, self._source, layout)
        if not target.slots and await target.asker.ask(HELLO, self._hello(layout)) is None:
            self.stats["unreachable"] += 1  # the last write failed because its process is gone
            return
        raise WeightPushError(
            f"receiver {target.asker.name} refused version {layout.version} {self.retries + 1} times: {reason}"
        )

    def _hello(self, layout: Layout) -> bytes:
        return msgspec.msgpack.encode(Hello(layout.total, self.protocol, self.device))

    def _write(self, target: _Target, slot: int, layout: Layout) -> None:
        assert self._staging is not None
        src, dst = self._staging.ctypes.data, target.slots[slot]
        started, sent = time.perf_counter(), 0
        for bucket in layout.buckets:
            rc = self._te.batch_transfer_sync_write(
                target.peer, [src + bucket.offset], [dst + bucket.offset], [bucket.nbytes]
            )
            if rc != 0:
                raise WeightPushError(f"TransferEngine write to {target.asker.name} ({target.peer}) returned {rc}")
            sent += bucket.nbytes
            if self.pace_bytes_per_s:
                ahead = sent / self.pace_bytes_per_s - (time.perf_counter() - started)
                if ahead > 0:
                    time.sleep(ahead)
