"""`broadcast`: each version as a torch.distributed broadcast (gloo on CPU, NCCL on GPU) from the
learner into every engine process.

Every engine process joins a two-member group with the learner (`pair_group`; formed on the
learner's first hello through the process's mailbox), so one dead engine can only fail its own
group, never hang the others; every collective has a timeout (`timeout_s`). A version is announced
with a msgpack `Announce` (names, dtypes, shapes, an xxh3 checksum of all the bytes); the engine
receives the tensors, recomputes the checksum and applies the version only if it matches, then
replies. A refused version is sent again (`retries`), then raised as `WeightPushError`; an engine
that cannot be reached (or whose group broke) is skipped and caught up with a fresh group on
restart. SGLang servers take this same path through their own `update_weights_from_distributed`
(`engine.update = "distributed"`); this module is for engine processes baton runs.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import torch

from pipeline.net import free_port
from stages.weights.base import ApplyReply, EngineReceiver, RemoteReceiver, WeightPushError, require_newer
from stages.weights.delta import state_checksum
from stages.weights.groups import pair_group
from stages.weights.layout import DTYPES

JOIN, RECEIVE = "weights.broadcast.join", "weights.broadcast.receive"


class GroupBroken(RuntimeError):
    """A collective failed: the other member died or the link broke."""


class Join(msgspec.Struct, frozen=True):
    port: int
    name: str
    backend: str = "gloo"
    timeout_s: float = 120.0


class Announce(msgspec.Struct, frozen=True):
    version: int
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    checksum: int


class BroadcastReceiver(EngineReceiver):
    """The engine side (mailboxes `weights.broadcast.join` and `weights.broadcast.receive`)."""

    def __init__(self, engines: list[Any]) -> None:
        super().__init__(engines)
        self._group: Any = None

    def handlers(self) -> dict[str, Any]:
        return {JOIN: self.join, RECEIVE: self.receive}

    async def join(self, header: bytes, _blob: Any = None) -> bytes:
        join = msgspec.msgpack.decode(header, type=Join)
        self._group = await anyio.to_thread.run_sync(
            lambda: pair_group(join.port, join.name, 1, join.backend, join.timeout_s)
        )
        return msgspec.msgpack.encode(ApplyReply(True, self.version))

    async def receive(self, header: bytes, _blob: Any = None) -> bytes:
        announce = msgspec.msgpack.decode(header, type=Announce)
        if self._group is None:
            return self.refuse("not in a group: join first")
        bad = [d for d in announce.dtypes if d not in DTYPES]  # received (the learner is sending), never applied
        group = self._group

        def receive_all() -> dict[str, torch.Tensor]:
            tensors = {}
            for name, dtype, shape in zip(announce.names, announce.dtypes, announce.shapes, strict=True):
                t = torch.empty(shape, dtype=DTYPES.get(dtype, torch.uint8))
                torch.distributed.broadcast(t, src=0, group=group)
                tensors[name] = t
            return tensors

        try:
            tensors = await anyio.to_thread.run_sync(receive_all)
        except RuntimeError as exc:  # the group broke (the learner or the link died): form a new one
            self._group = None
            return self.refuse(f"broadcast failed: {exc}")
        if bad:
            return self.refuse(f"unknown dtypes {bad}")
        if (held := self.holds(announce.version)) is not None:
            return held
        if state_checksum(tensors) != announce.checksum:
            return self.refuse(f"version {announce.version} fails its checksum")
        return await self.apply(announce.version, tensors)


@dataclass
class _Member:
    asker: Any
    group: Any = None


@dataclass
class BroadcastTransport:
    backend: str = "auto"  # "auto": nccl for CUDA tensors, else gloo
    timeout_s: float = 120.0
    retries: int = 1
    name: str = "broadcast"
    stats: dict = field(default_factory=lambda: {"pushes": 0, "bytes": 0, "retries": 0, "unreachable": 0})

    def __post_init__(self) -> None:
        self._members: list[_Member] = []
        self._latest: dict[str, torch.Tensor] | None = None
        self._version = -1
        # fault injection (tests): called with (tensors, attempt) right before they are sent
        self.before_send: Any = None

    def subscribe(self, receiver: Any) -> None:
        """Anything with `ask(box, header)`: a `remote_receiver` (engines in another process)."""
        if not hasattr(receiver, "ask"):
            raise TypeError("the broadcast transport reaches engine processes; in-process engines use 'inproc'")
        self._members.append(_Member(receiver))

    def remote_receiver(self, peer: Any, name: str) -> Any:
        return RemoteReceiver(peer, name, self)

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        require_newer(version, self._version)
        self._latest, self._version = tensors, version
        for member in self._members:
            await self._send(member)
        self._latest = {n: t.detach().clone() for n, t in tensors.items()}  # for a restarted engine
        self.stats["pushes"] += 1

    async def resend(self, asker: Any) -> None:
        for member in self._members:
            if member.asker is asker and self._latest is not None:
                member.group = None  # a new process: a new group
                await self._send(member)

    async def close(self) -> None:
        for member in self._members:
            if member.group is not None:
                torch.distributed.destroy_process_group(member.group)
        self._members.clear()

    def _backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        assert self._latest is not None
        return "nccl" if next(iter(self._latest.values())).is_cuda else "gloo"

    async def _join(self, member: _Member) -> bool:
        """Form the member's group; False when its process does not answer (it is gone)."""
        join = Join(free_port(), f"baton-bcast-{uuid.uuid4().hex[:8]}", self._backend(), self.timeout_s)
        answered: list[bytes | None] = []
        async with anyio.create_task_group() as tg:

            async def ask() -> None:
                answered.append(await member.asker.ask(JOIN, msgspec.msgpack.encode(join)))
                if answered[0] is None:
                    tg.cancel_scope.cancel()  # nobody will join: stop waiting for the rendezvous

            tg.start_soon(ask)
            try:
                member.group = await anyio.to_thread.run_sync(
                    lambda: pair_group(join.port, join.name, 0, join.backend, join.timeout_s), abandon_on_cancel=True
                )
            except RuntimeError:
                member.group = None
        return member.group is not None and bool(answered) and answered[0] is not None

    async def _send_once(self, member: _Member, announce: Announce, outgoing: dict[str, torch.Tensor]) -> bytes | None:
        """One announce + broadcast; the engine's reply (None: unreachable). Raises GroupBroken
        when the group breaks mid-send."""
        answered: list[bytes | None] = []
        group = member.group

        async def ask() -> None:
            answered.append(await member.asker.ask(RECEIVE, msgspec.msgpack.encode(announce)))

        def send_all() -> None:
            for name in announce.names:
                torch.distributed.broadcast(outgoing[name], src=0, group=group)

        broken = ""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(ask)
                await anyio.to_thread.run_sync(send_all)
        except* RuntimeError as group_error:
            broken = str(group_error.exceptions[0])
        if broken:
            raise GroupBroken(broken)
        return answered[0]

    async def _send(self, member: _Member) -> None:
        tensors = self._latest
        assert tensors is not None
        names = tuple(tensors)
        announce = Announce(
            self._version,
            names,
            tuple(str(tensors[n].dtype) for n in names),
            tuple(tuple(tensors[n].shape) for n in names),
            state_checksum(tensors),
        )
        reason = ""
        for attempt in range(self.retries + 1):
            if member.group is None and not await self._join(member):
                self.stats["unreachable"] += 1
                return
            outgoing = {n: t.detach().contiguous() for n, t in tensors.items()}
            if self.before_send is not None:
                outgoing = self.before_send(outgoing, attempt)
            try:
                answer = await self._send_once(member, announce, outgoing)
            except GroupBroken as exc:  # the group broke mid-send: a new one next attempt
                member.group, reason = None, str(exc)
                self.stats["retries"] += 1
                continue
            if answer is None:
                self.stats["unreachable"] += 1
                member.group = None
                return
            reply = msgspec.msgpack.decode(answer, type=ApplyReply)
            self.stats["bytes"] += sum(t.numel() * t.element_size() for t in outgoing.values())
            if reply.ok:
                return
            reason = reply.reason
            self.stats["retries"] += 1
        raise WeightPushError(f"receiver {member.asker.name} refused version {self._version}: {reason}")
