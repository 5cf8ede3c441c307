"""Weight snapshots: the latest version kept in the run's object store, so an engine that starts
late or restarts loads it without the learner's help.

The learner saves each version (every `snapshot_every` versions) under `{run}/weights/{instance}`
(instance: the run folder's name, so a later run of the same name on a shared store never picks up
this one's weights), outside the versioned rollout keys (`{run}/v{version}/...`), so the buffer's
eviction never touches it. The value is one uint8 buffer: an 8-byte little-endian header length,
the packed layout (msgpack), then the tensors' bytes in checksummed buckets (`stages.weights.packed`).
`load_snapshot` validates all of it and returns the version as received (`as_received`: an adapter's
descriptor decoded once), or None only when there is no snapshot yet; a damaged one (a descriptor that
does not decode included) raises `WeightPayloadError`, never passes for "no snapshot". Each put
replaces the previous value whole.
"""

from __future__ import annotations

import numpy as np
import torch

from buffers.retry import with_retries
from buffers.store import KeyNotFound, ObjectStore
from stages.weights.adapter import AdapterError, AdapterVersion, as_received
from stages.weights.packed import WeightPayloadError, pack, unpack

_HEADER_LEN = 8


def snapshot_key(run: str, instance: str) -> str:
    return f"{run}/weights/{instance}"


def encode_snapshot(version: int, tensors: dict[str, torch.Tensor]) -> np.ndarray:
    header, blob = pack(version, tensors)
    out = np.empty(_HEADER_LEN + len(header) + blob.nbytes, dtype=np.uint8)
    out[:_HEADER_LEN] = np.frombuffer(len(header).to_bytes(_HEADER_LEN, "little"), dtype=np.uint8)
    out[_HEADER_LEN : _HEADER_LEN + len(header)] = np.frombuffer(header, dtype=np.uint8)
    out[_HEADER_LEN + len(header) :] = blob
    return out


def decode_snapshot(data: memoryview | bytes | np.ndarray) -> tuple[int, dict[str, torch.Tensor]]:
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.nbytes < _HEADER_LEN:
        raise WeightPayloadError(f"a weight snapshot of {raw.nbytes} bytes has no header")
    n = int.from_bytes(raw[:_HEADER_LEN].tobytes(), "little")
    if n > raw.nbytes - _HEADER_LEN:
        raise WeightPayloadError(f"a weight snapshot of {raw.nbytes} bytes claims a {n}-byte header")
    return unpack(raw[_HEADER_LEN : _HEADER_LEN + n].tobytes(), raw[_HEADER_LEN + n :])


async def save_snapshot(store: ObjectStore, key: str, version: int, tensors: dict[str, torch.Tensor]) -> int:
    """Store `version` as the latest snapshot under `key`; returns its size in bytes."""
    payload = encode_snapshot(version, tensors)
    await with_retries(lambda: store.put(key, payload))
    return payload.nbytes


async def load_snapshot(store: ObjectStore, key: str) -> tuple[int, dict[str, torch.Tensor] | AdapterVersion] | None:
    """The latest (version, weights as received) under `key`, or None when the learner has saved none yet."""
    try:
        data = await with_retries(lambda: store.get(key))
    except KeyNotFound:
        return None
    version, tensors = decode_snapshot(data)
    try:
        return version, as_received(tensors)
    except AdapterError as exc:
        raise WeightPayloadError(f"the weight snapshot of version {version}: {exc}") from None
