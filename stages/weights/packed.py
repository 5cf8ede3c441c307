"""Weights as bytes for another process: one flat buffer plus a validated msgspec manifest.

`pack(version, tensors)` lays every tensor's bytes end to end in one uint8 array and describes them
(name, dtype, shape, offset) in a msgspec header carrying the version and an xxh3 checksum of the
buffer. `unpack` refuses anything that does not check out (`WeightPayloadError`): no pickle, and an
engine never applies a damaged or partial version.

`PackedWeightReceiver` is the learner's side of a receiver in another process: a WeightReceiver
whose `receive_weights` packs the version and delivers it to the peer's mailbox "weights"; it
keeps the latest version so a restarted peer catches up at once (`resend`).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import torch
import xxhash

_DTYPES = {str(t): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)}
MAILBOX = "weights"


class WeightPayloadError(ValueError):
    """Packed weights that fail validation (checksum, sizes, dtypes)."""


class TensorEntry(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class Manifest(msgspec.Struct, frozen=True):
    version: int
    total: int
    checksum: int
    tensors: tuple[TensorEntry, ...]


def pack(version: int, tensors: dict[str, torch.Tensor]) -> tuple[bytes, np.ndarray]:
    entries, offset = [], 0
    for name, t in tensors.items():
        if str(t.dtype) not in _DTYPES:
            raise WeightPayloadError(f"tensor {name!r} has dtype {t.dtype}, not one of {sorted(_DTYPES)}")
        n = t.numel() * t.element_size()
        entries.append(TensorEntry(name, str(t.dtype), tuple(t.shape), offset, n))
        offset += n
    blob = np.empty(offset, dtype=np.uint8)
    for entry, t in zip(entries, tensors.values(), strict=True):
        flat = t.detach().cpu().contiguous().view(-1).view(torch.uint8)
        blob[entry.offset : entry.offset + entry.nbytes] = flat.numpy()
    manifest = Manifest(version, offset, xxhash.xxh3_64_intdigest(blob), tuple(entries))
    return msgspec.msgpack.encode(manifest), blob


def unpack(header: bytes, blob: np.ndarray) -> tuple[int, dict[str, torch.Tensor]]:
    try:
        manifest = msgspec.msgpack.decode(header, type=Manifest)
    except msgspec.ValidationError as exc:
        raise WeightPayloadError(f"bad weight manifest: {exc}") from None
    if blob.dtype != np.uint8 or blob.ndim != 1 or blob.nbytes != manifest.total:
        raise WeightPayloadError(f"weight buffer has {blob.nbytes} bytes, the manifest says {manifest.total}")
    if xxhash.xxh3_64_intdigest(blob) != manifest.checksum:
        raise WeightPayloadError(f"weights of version {manifest.version} fail their checksum")
    tensors = {}
    for e in manifest.tensors:
        dtype = _DTYPES.get(e.dtype)
        if dtype is None or e.offset < 0 or e.offset + e.nbytes > manifest.total:
            raise WeightPayloadError(f"bad entry for {e.name!r}: {e}")
        raw = torch.from_numpy(blob[e.offset : e.offset + e.nbytes].copy())
        tensors[e.name] = raw.view(dtype).reshape(e.shape)
    return manifest.version, tensors


class PackedWeightReceiver:
    """A WeightReceiver for a peer process (any object with `async deliver(box, header, blob)`)."""

    def __init__(self, peer: Any, name: str) -> None:
        self.peer, self.name = peer, name
        self._latest: tuple[bytes, np.ndarray] | None = None

    async def receive_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self._latest = pack(version, tensors)
        await self.peer.deliver(MAILBOX, *self._latest)

    async def resend(self) -> None:
        if self._latest is not None:
            await self.peer.deliver(MAILBOX, *self._latest)


def mailbox_for(engines: list[Any]):
    """The handler a producer process registers: unpack, validate, stage on every local engine."""

    async def deliver(header: bytes, blob: np.ndarray) -> None:
        version, tensors = unpack(header, blob)
        for engine in engines:
            await engine.receive_weights(version, tensors)

    return deliver
