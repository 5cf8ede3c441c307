"""The learner side every byte-moving transport shares (`disk`, `delta`, `broadcast`, `mooncake_p2p`).

A transport says only what differs: `engine_receiver` (its engine side, for engines in this
process), `stage` (make each version sendable once: a file, a packed buffer, clones) and `send`
(one attempt at one receiver: its own messages and bytes, deciding what to send, e.g. a delta or
the whole state). `PushTransport` does the rest the same way for all:

* an answered attempt is an `ApplyReply`; a refused one, or one whose link broke (`LinkBroken`),
  is tried again, `retries` more times, then raised as `WeightPushError`: never counted as delivered;
* a receiver that does not answer (its process is gone) is skipped, counted in `unreachable`, and its
  session forgotten (`Target.forget`), so `resend` catches it up, from scratch, once it is back;
* a publish and a resend never interleave; every transport fills the same `stats` (`base.STATS`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

import anyio
import msgspec
import torch

from stages.weights.base import (
    ApplyReply,
    Asker,
    EngineReceiver,
    LocalAsker,
    RemoteReceiver,
    WeightPushError,
    WeightReceiver,
    new_stats,
    require_newer,
    state_bytes,
)


class LinkBroken(RuntimeError):
    """An attempt failed on the way (a write or a collective broke) while the receiver still answers:
    it is tried again like a refusal. The transport has already reset what the next attempt needs."""


@dataclass(eq=False)
class Target:
    """One subscribed receiver; a transport's subclass adds its session with it (a group, slots)."""

    asker: Asker

    def forget(self) -> None:
        """Drop the session: the receiver's process is gone or new, the next send starts over."""


class PushTransport:
    """Base of the byte-moving transports (see the module docstring); subclasses are dataclasses
    with the fields `retries` and `name`, and call `super().__post_init__()`."""

    name: str
    retries: int
    target_type: ClassVar[type[Target]] = Target

    def __post_init__(self) -> None:
        self.stats = new_stats()
        self._targets: list[Target] = []
        self._published = -1  # the last version `publish` returned for
        self._staged = -1  # the version `send` sends (`resend` too)
        self._lock: anyio.Lock | None = None

    # -- what each transport says ----------------------------------------------------------------
    def engine_receiver(self, engines: list[Any]) -> EngineReceiver:
        """The engine side, for engines in the learner's process."""
        raise NotImplementedError

    async def stage(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Make `version` ready for `send` (once, for every receiver)."""
        raise NotImplementedError

    async def send(self, target: Any, attempt: int) -> tuple[bytes | None, int]:
        """One attempt to deliver the staged version: (the encoded `ApplyReply` or None when the
        receiver does not answer, the bytes sent). Raises `LinkBroken` when the way broke."""
        raise NotImplementedError

    # -- the same for all ------------------------------------------------------------------------
    def subscribe(self, receiver: WeightReceiver | Asker) -> None:
        """An `Asker` (another process, a `remote_receiver`) or an engine in this process."""
        if not isinstance(receiver, Asker):
            receiver = LocalAsker(self.engine_receiver([receiver]), receiver.name)
        self._targets.append(self.target_type(receiver))

    def remote_receiver(self, peer: Any, name: str) -> RemoteReceiver:
        return RemoteReceiver(peer, name, self)

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        require_newer(version, self._published)
        started = time.perf_counter()
        async with self._busy:
            await self.stage(version, tensors)
            self._staged = version
            for target in self._targets:
                await self._deliver(target, self.retries + 1)
        self._published = version
        self.stats["versions"] += 1
        self.stats["state_bytes"] += state_bytes(tensors)
        self.stats["seconds"] += time.perf_counter() - started

    async def resend(self, receiver: Any) -> None:
        """One attempt at catching `receiver` up with the staged version, from a fresh session."""
        async with self._busy:
            for target in self._targets:
                if target.asker is receiver:
                    target.forget()
                    if self._staged < 0:
                        continue
                    try:
                        if await self._deliver(target, attempts=1):
                            self.stats["resent"] += 1
                    except WeightPushError:
                        self.stats["deferred"] += 1

    async def close(self) -> None:
        self._targets.clear()

    @property
    def _busy(self) -> anyio.Lock:
        if self._lock is None:  # made on first use, inside the event loop that uses it
            self._lock = anyio.Lock()
        return self._lock

    async def _deliver(self, target: Target, attempts: int) -> bool:
        """The push loop: True once `target` holds the staged version, False when it is unreachable."""
        reason = ""
        for attempt in range(attempts):
            try:
                answer, nbytes = await self.send(target, attempt)
            except LinkBroken as exc:
                reason = str(exc)
                self.stats["refused"] += 1
                continue
            if answer is None:
                target.forget()
                self.stats["unreachable"] += 1
                return False
            self.stats["bytes"] += nbytes
            reply = msgspec.msgpack.decode(answer, type=ApplyReply)
            if reply.ok:
                return True
            reason = reply.reason
            self.stats["refused"] += 1
        raise WeightPushError(f"receiver {target.asker.name} refused version {self._staged} {attempts} times: {reason}")
