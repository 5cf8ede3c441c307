"""The WeightTransport protocol: how a new weight version reaches the engines.

`publish(version, tensors)` returns once every subscribed receiver holds the whole version
(staged for the next decode step). A transport never delivers part of a version: a receiver
either gets all named tensors of `version` or none. Versions published are strictly increasing.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class WeightReceiver(Protocol):
    name: str

    async def receive_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None: ...


@runtime_checkable
class WeightTransport(Protocol):
    name: str

    def subscribe(self, receiver: WeightReceiver) -> None: ...

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None: ...

    async def close(self) -> None: ...


class WeightPushError(RuntimeError):
    """A version could not be delivered to every receiver."""
