"""The WeightTransport protocol: how a new weight version reaches the engines.

`publish(version, tensors)` returns once every subscribed receiver holds the whole version
(staged for the next decode step). A transport never delivers part of a version: a receiver
either gets all named tensors of `version` or none. Versions published are strictly increasing.
A receiver that refuses a version (damaged, or not its base) is retried and then raised as
`WeightPushError`, never counted as delivered; a receiver whose process is unreachable is skipped
and caught up by `resend()` once it is back, so one dead engine never stops the others.

Engines in another process are reached as a `RemoteReceiver` (their host's `ask` mailboxes) and
answer each version with an `ApplyReply`; every message is msgpack, validated on arrival.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import msgspec
import torch


@runtime_checkable
class WeightReceiver(Protocol):
    name: str

    async def receive_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None: ...


@runtime_checkable
class WeightTransport(Protocol):
    name: str

    def subscribe(self, receiver: WeightReceiver) -> None: ...

    def remote_receiver(self, peer: Any, name: str) -> Any:
        """A receiver to subscribe for the engines of another process, reached through `peer`
        (`deliver`/`ask` into its mailboxes); it has `resend()` for when that process restarts."""
        ...

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None: ...

    async def close(self) -> None: ...


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
    transport: Any

    async def ask(self, box: str, header: bytes) -> bytes | None:
        return await self.peer.ask(box, header)

    async def resend(self) -> None:
        await self.transport.resend(self)
