"""The WeightTransport protocol: how a new weight version reaches the engines.

`publish(version, tensors)` returns once every subscribed receiver holds the whole version
(staged for the next decode step). A transport never delivers part of a version: a receiver
either gets all named tensors of `version` or none. Versions published are strictly increasing.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

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
