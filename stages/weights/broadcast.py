"""`broadcast`: each version as a torch.distributed broadcast (gloo on CPU, NCCL on GPU) from the
learner into every engine process.

Every engine process joins a two-member group with the learner (`pair_group`; formed on the
learner's first hello through the process's mailbox), so one dead engine can only fail its own
group, never hang the others; every collective has a timeout (`timeout_s`). A version is announced
with a msgpack `Announce` (names, dtypes, shapes, an xxh3 checksum of all the bytes); the engine
receives the tensors, recomputes the checksum and applies the version only if it matches, then
replies (retries, unreachable engines and catch-ups: `PushTransport`; a restarted engine gets
a fresh group). SGLang servers take this same path through their own
`update_weights_from_distributed` (`engine.update = "distributed"`); this module is for engine
processes baton runs.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import torch

from pipeline.net import free_port
from stages.weights.base import ApplyReply, EngineReceiver, LinkBroken, PushTransport, Target, state_bytes
from stages.weights.groups import pair_group
from stages.weights.layout import DTYPES, state_checksum

JOIN, RECEIVE = "weights.broadcast.join", "weights.broadcast.receive"


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


@dataclass(eq=False)
class _Member(Target):
    group: Any = None  # its two-member group with the learner, formed on the first send

    def forget(self) -> None:
        self.group = None  # a new process: a new group


@dataclass
class BroadcastTransport(PushTransport):
    backend: str = "auto"  # "auto": nccl for CUDA tensors, else gloo
    timeout_s: float = 120.0
    retries: int = 1
    name: str = "broadcast"
    target_type = _Member
    receiver = BroadcastReceiver

    def __post_init__(self) -> None:
        super().__post_init__()
        self._latest: dict[str, torch.Tensor] = {}  # a copy: the learner trains on while it is sent
        self._announce: Announce | None = None
        # fault injection (tests): called with (tensors, attempt) right before they are sent
        self.before_send: Any = None

    def engine_receiver(self, engines: list[Any]) -> EngineReceiver:
        raise TypeError("the broadcast transport reaches engine processes; in-process engines use 'inproc'")

    async def stage(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        latest = self._latest = {n: t.detach().clone() for n, t in tensors.items()}
        dtypes, shapes = tuple(str(t.dtype) for t in latest.values()), tuple(tuple(t.shape) for t in latest.values())
        self._announce = Announce(version, tuple(latest), dtypes, shapes, state_checksum(latest))
        self.stats["copied"] += 1

    async def send(self, member: _Member, attempt: int) -> tuple[bytes | None, int]:
        """Announce the version and broadcast its tensors into the member's group (formed first if
        need be); a group that breaks mid-send is `LinkBroken`, and the next attempt forms a new one."""
        if member.group is None and not await self._join(member):
            return None, 0
        outgoing = {n: t.contiguous() for n, t in self._latest.items()}
        if self.before_send is not None:
            outgoing = self.before_send(outgoing, attempt)
        group, announce, answered = member.group, self._announce, []

        async def ask() -> None:
            answered.append(await member.asker.ask(RECEIVE, msgspec.msgpack.encode(announce)))

        def send_all() -> None:
            for name in announce.names:
                torch.distributed.broadcast(outgoing[name], src=0, group=group)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(ask)
                await anyio.to_thread.run_sync(send_all)
        except* RuntimeError as group_error:
            member.group = None
            raise LinkBroken(str(group_error.exceptions[0])) from None
        return answered[0], state_bytes(outgoing)

    async def close(self) -> None:
        for member in self._targets:
            if member.group is not None:
                torch.distributed.destroy_process_group(member.group)
        await super().close()

    def _backend(self) -> str:
        if self.backend != "auto":
            return self.backend
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
