"""`inproc`: engines in the learner's process get a private copy of each version."""

from __future__ import annotations

from typing import Any

import torch

from stages.weights.base import WeightReceiver, require_newer
from stages.weights.packed import PackedWeightReceiver


class InprocTransport:
    name = "inproc"

    def __init__(self) -> None:
        self._receivers: list[WeightReceiver] = []
        self._last = -1
        self.pushes = 0
        self.bytes_pushed = 0

    def subscribe(self, receiver: WeightReceiver) -> None:
        self._receivers.append(receiver)

    def remote_receiver(self, peer: Any, name: str) -> PackedWeightReceiver:
        """Engines in another process get each version packed and checksummed through `peer`."""
        return PackedWeightReceiver(peer, name)

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        require_newer(version, self._last)
        for receiver in self._receivers:
            # a copy per receiver: the learner keeps training in place while engines decode
            copy = {name: t.detach().clone() for name, t in tensors.items()}
            await receiver.receive_weights(version, copy)
            self.bytes_pushed += sum(t.numel() * t.element_size() for t in copy.values())
        self._last = version
        self.pushes += 1

    async def close(self) -> None:
        self._receivers.clear()
