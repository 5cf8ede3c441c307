"""Weights as bytes for another process: one flat buffer plus its validated msgpack layout.

`pack(version, tensors)` lays every tensor into one uint8 array with a `stages.weights.layout`
Layout (one checksummed bucket per `bucket_bytes`). `unpack` refuses anything that does not check
out (`WeightPayloadError`: a malformed layout, a wrong size, a bucket failing its checksum): no
pickle, and an engine never applies a damaged or partial version.

`PackedWeightReceiver` is the learner's side of a receiver in another process: a WeightReceiver
whose `receive_weights` packs the version and delivers it to the peer's mailbox "weights"; it
keeps the latest version so a restarted peer catches up at once (`resend`, through its transport).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stages.weights.adapter import as_received
from stages.weights.base import EngineReceiver, RemoteReceiver
from stages.weights.layout import LayoutError, bad_buckets, decode_layout, encode_layout, fill, plan, views

MAILBOX = "weights"


class WeightPayloadError(LayoutError):
    """Packed weights that fail validation (layout, sizes, checksums)."""


def pack(version: int, tensors: dict[str, torch.Tensor], bucket_bytes: int = 32 << 20) -> tuple[bytes, np.ndarray]:
    layout = plan(version, tensors, bucket_bytes)
    blob = np.empty(layout.total, dtype=np.uint8)
    return encode_layout(fill(blob, tensors, layout)), blob


def unpack(header: bytes, blob: np.ndarray) -> tuple[int, dict[str, torch.Tensor]]:
    try:
        layout = decode_layout(header)
    except LayoutError as exc:
        raise WeightPayloadError(str(exc)) from None
    if blob.dtype != np.uint8 or blob.ndim != 1 or blob.nbytes != layout.total:
        raise WeightPayloadError(f"weight buffer has {blob.nbytes} bytes, the layout says {layout.total}")
    bad = bad_buckets(blob, layout)
    if bad:
        raise WeightPayloadError(f"weights of version {layout.version} fail their checksum (buckets {bad})")
    return layout.version, {name: t.clone() for name, t in views(blob, layout).items()}


@dataclass
class PackedWeightReceiver(RemoteReceiver):
    """A WeightReceiver for a peer process (any object with `async deliver(box, header, blob)`)."""

    _latest: tuple[bytes, np.ndarray] | None = None

    async def receive_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self._latest = pack(version, tensors)
        await self.peer.deliver(MAILBOX, *self._latest)

    async def deliver_latest(self) -> bool:
        """Deliver the latest version again (`resend`); False when there is none yet."""
        if self._latest is None:
            return False
        await self.peer.deliver(MAILBOX, *self._latest)
        return True


class PackedReceiver(EngineReceiver):
    """The engine side (mailbox `weights`): unpack, validate, stage on every engine of this process, as
    received (`as_received`: an adapter's descriptor decoded once; AdapterError when it does not decode)."""

    def handlers(self) -> dict[str, Any]:
        return {MAILBOX: self.deliver}

    async def deliver(self, header: bytes, blob: np.ndarray) -> None:
        version, tensors = unpack(header, blob)
        weights = as_received(tensors)
        for engine in self.engines:
            await engine.receive_weights(version, weights)
