"""`inproc`: engines in the learner's process get a private copy of each version, as received
(`as_received`: an adapter's descriptor decoded once); another process's receiver (an `Asker`) gets it
in band and decodes it there.

A receiver that raises on a version (an engine refusing weights that do not fit, a server refusing a
damaged copy) keeps its own version; each refusal is counted in `stats["refused"]` and the version is sent
to that receiver again (`retries` more times, tenacity, a fresh copy each time; not an adapter descriptor
that does not decode: it never will); then `publish` raises `WeightPushError` naming it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from tenacity import AsyncRetrying, retry_if_not_exception_type, stop_after_attempt, wait_exponential

from stages.weights.adapter import AdapterError, as_received
from stages.weights.base import Asker, WeightPushError, WeightReceiver, new_stats, require_newer, state_bytes
from stages.weights.packed import PackedReceiver, PackedWeightReceiver


class InprocTransport:
    name = "inproc"
    receiver = PackedReceiver  # engines in another process get each version packed (through Ray)
    pushes_from_shards = False

    def __init__(self, retries: int = 2) -> None:
        self.retries = retries
        self._receivers: list[WeightReceiver] = []
        self._last = -1
        self.stats = new_stats()

    def subscribe(self, receiver: WeightReceiver) -> Callable[[], None]:
        self._receivers.append(receiver)

        def unsubscribe() -> None:
            self._receivers = [r for r in self._receivers if r is not receiver]

        return unsubscribe

    def remote_receiver(self, peer: Any, name: str) -> PackedWeightReceiver:
        """Engines in another process get each version packed and checksummed through `peer`."""
        return PackedWeightReceiver(peer, name, self)

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        require_newer(version, self._last)
        started = time.perf_counter()
        for receiver in list(self._receivers):  # a receiver may join or leave while a version goes out
            try:
                async for attempt in AsyncRetrying(stop=stop_after_attempt(self.retries + 1), reraise=True,
                                                   retry=retry_if_not_exception_type(AdapterError),
                                                   wait=wait_exponential(multiplier=0.05, max=1.0)):
                    with attempt:
                        copy = await self._deliver(receiver, version, tensors)
            except Exception as exc:  # noqa: BLE001 - whatever it raised, the version did not reach it
                raise WeightPushError(f"receiver {receiver.name} refused version {version} "
                                      f"{self.retries + 1} times: {exc}") from exc
            self.stats["bytes"] += state_bytes(copy)
        self._last = version
        self.stats["versions"] += 1
        self.stats["copied"] += 1
        self.stats["state_bytes"] += state_bytes(tensors)
        self.stats["seconds"] += time.perf_counter() - started

    async def _deliver(self, receiver: WeightReceiver, version: int,
                       tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One attempt: a copy of the version to `receiver` (the learner keeps training in place while engines
        decode); a refusal is counted and raised."""
        copy = {name: t.detach().clone() for name, t in tensors.items()}
        try:
            await receiver.receive_weights(version, copy if isinstance(receiver, Asker) else as_received(copy))
        except Exception:
            self.stats["refused"] += 1
            raise
        return copy

    async def resend(self, receiver: Any) -> None:
        """A restarted engine process gets the latest version again (engines here never restart alone)."""
        if isinstance(receiver, PackedWeightReceiver) and await receiver.deliver_latest():
            self.stats["resent"] += 1

    async def close(self) -> None:
        self._receivers.clear()
