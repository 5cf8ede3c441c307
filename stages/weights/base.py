"""The weight-transport contract: how a new weight version reaches the engines.

`publish(version, tensors)` returns once every subscribed receiver holds the whole version
(staged for the next decode step). A transport never delivers part of a version: a receiver
either gets all named tensors of `version` or none. Versions published are strictly increasing
(a publish that raised published nothing). A receiver that refuses a version (damaged, or not
its base) is retried and then raised as `WeightPushError`, never counted as delivered; a receiver
whose process is unreachable is skipped and caught up by `resend()` once it is back, so one dead
engine never stops the others.

Engines in this process are `WeightReceiver`s; engines in another process are reached as an
`Asker` (their host's `ask` mailboxes, see `remote_receiver`) and answer each version with an
`ApplyReply`; every message is msgpack, validated on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import msgspec
import torch


@runtime_checkable
class WeightReceiver(Protocol):
    """An engine in the learner's process."""

    name: str

    async def receive_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None: ...


@runtime_checkable
class Asker(Protocol):
    """A receiver reached by messages: `ask(box, header)` hands `header` to mailbox `box` and returns
    the encoded reply, or None when the receiver's process does not answer (it is gone)."""

    name: str

    async def ask(self, box: str, header: bytes) -> bytes | None: ...


@runtime_checkable
class WeightTransport(Protocol):
    """Everything the learner calls on a transport; `stats` has the keys of `new_stats()`."""

    name: str
    stats: dict[str, float]

    def subscribe(self, receiver: WeightReceiver | Asker) -> None: ...

    def remote_receiver(self, peer: Any, name: str) -> Any:
        """A receiver to subscribe for the engines of another process, reached through `peer`
        (`deliver`/`ask` into its mailboxes); its `resend()` calls this transport's `resend`."""
        ...

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None: ...

    async def resend(self, receiver: Any) -> None:
        """Catch one subscribed receiver up with the latest version (its process was restarted).
        Best effort: a refused catch-up is counted (`deferred`) and left to the next `publish`."""
        ...

    async def close(self) -> None: ...


STATS = {
    "versions": "versions published",
    "state_bytes": "the published versions' own bytes, summed",
    "bytes": "bytes sent, summed over receivers and over every attempt a receiver answered",
    "seconds": "time spent in publish",
    "copied": "versions sent from a copy (a file, a packed buffer, clones), not the learner's tensors",
    "refused": "attempts that did not deliver (refused, or the link broke); retried, then raised",
    "full_sends": "whole states sent in place of a partial version (the receiver lacked its base)",
    "unreachable": "sends skipped because the receiver's process did not answer",
    "resent": "catch-ups `resend` delivered",
    "deferred": "catch-ups `resend` could not deliver (left to the next publish)",
}


def new_stats() -> dict[str, float]:
    """A transport's counters: the keys of `STATS`, all zero; every transport counts them alike."""
    return dict.fromkeys(STATS, 0)


def state_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class WeightPushError(RuntimeError):
    """A version could not be delivered to every receiver."""


class ApplyReply(msgspec.Struct, frozen=True):
    """An engine process's answer to a version: applied (or already held), or refused and why;
    `version` is what it holds afterwards."""

    ok: bool
    version: int
    reason: str = ""


@dataclass
class RemoteReceiver:
    """The engines of another process, reached through `peer.ask(box, header)` (their host's
    mailboxes); `resend()` has the transport catch them up once that process was restarted."""

    peer: Any
    name: str
    transport: WeightTransport

    async def ask(self, box: str, header: bytes) -> bytes | None:
        return await self.peer.ask(box, header)

    async def resend(self) -> None:
        await self.transport.resend(self)


def require_newer(version: int, last: int) -> None:
    """Versions are published strictly increasing; anything else is a bug in the caller."""
    if version <= last:
        raise WeightPushError(f"version {version} published after {last}; versions must increase")


class EngineReceiver:
    """The engine side of a transport that moves bytes: the version its engines hold, how many
    versions it refused, and the replies. Subclasses verify what arrives and call `apply` only
    with a whole, verified version; every reply is an encoded `ApplyReply`."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines, self.version, self.rejected = engines, -1, 0

    def handlers(self) -> dict[str, Any]:
        """Mailbox name -> `async handler(header, blob) -> reply bytes`."""
        raise NotImplementedError

    def holds(self, version: int) -> bytes | None:
        """The reply for a version it already holds (or an older one), else None."""
        if version <= self.version:
            return msgspec.msgpack.encode(ApplyReply(True, self.version, "already applied"))
        return None

    def refuse(self, reason: str) -> bytes:
        self.rejected += 1
        return msgspec.msgpack.encode(ApplyReply(False, self.version, reason))

    async def apply(self, version: int, tensors: dict[str, torch.Tensor]) -> bytes:
        for engine in self.engines:
            await engine.receive_weights(version, tensors)
        self.version = version
        return msgspec.msgpack.encode(ApplyReply(True, self.version))


@dataclass
class LocalAsker:
    """An `EngineReceiver` in this process (local runtime, tests), reached by calling its handlers."""

    receiver: EngineReceiver
    name: str = "local"

    async def ask(self, box: str, header: bytes) -> bytes | None:
        return await self.receiver.handlers()[box](header, None)
