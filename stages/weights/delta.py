"""`delta`: send only the tensors that changed since the version the engine holds.

The learner keeps a copy of the version it last published. A new version goes out as a
`DeltaHeader` (the base version it applies to, the new version, an xxh3 checksum of the whole
resulting state) plus the changed tensors in one checksummed bucket layout (`stages.weights.layout`).
The receiver (`DeltaReceiver`, engine side) keeps the full state of its version; it applies a delta
only onto exactly its base, recomputes the checksum of the result, and hands the engines the whole
new state only if it matches. Otherwise it refuses and says what it holds: the learner then sends
the full state (a delta against nothing), which is how a new or restarted engine catches up.

What it buys depends on the training: with full-parameter AdamW every tensor moves every step and a
delta is the whole model; with frozen parts (embeddings, LoRA bases, a frozen tower) only the
trained tensors travel. `stats["bytes"]` against `stats["state_bytes"]` shows which case a run is in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch
import xxhash

from stages.weights.base import EngineReceiver, PushTransport, Target
from stages.weights.layout import LayoutError
from stages.weights.packed import pack, unpack

DELTA = "weights.delta"


class DeltaMessage(msgspec.Struct, frozen=True):
    base: int  # the version the delta applies to; -1: a full state
    version: int
    checksum: int  # xxh3 of every tensor of the resulting state, in sorted-name order
    layout: bytes  # the changed tensors' Layout (msgpack)
    blob: bytes  # their bytes


def state_checksum(tensors: dict[str, torch.Tensor]) -> int:
    h = xxhash.xxh3_64()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return h.intdigest()


class DeltaReceiver(EngineReceiver):
    """The engine side (mailbox `weights.delta`)."""

    def __init__(self, engines: list[Any]) -> None:
        super().__init__(engines)
        self.state: dict[str, torch.Tensor] = {}

    def handlers(self) -> dict[str, Any]:
        return {DELTA: self.delta}

    async def delta(self, header: bytes, _blob: Any = None) -> bytes:
        try:
            message = msgspec.msgpack.decode(header, type=DeltaMessage)
            if (held := self.holds(message.version)) is not None:
                return held
            if message.base != -1 and message.base != self.version:
                raise LayoutError(f"a delta against version {message.base}, but this engine holds {self.version}")
            _, changed = unpack(message.layout, np.frombuffer(message.blob, dtype=np.uint8))
            result = changed if message.base == -1 else {**self.state, **changed}
            if state_checksum(result) != message.checksum:
                raise LayoutError(f"version {message.version} rebuilt from the delta does not match its checksum")
        except (LayoutError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self.refuse(str(exc))
        self.state = result
        return await self.apply(message.version, result)


@dataclass(eq=False)
class _DeltaTarget(Target):
    full: bool = False  # send the whole state first: a new process holds no base

    def forget(self) -> None:
        self.full = True


@dataclass
class DeltaTransport(PushTransport):
    retries: int = 1
    name: str = "delta"
    target_type = _DeltaTarget

    def __post_init__(self) -> None:
        super().__post_init__()
        self._state: dict[str, torch.Tensor] | None = None  # the staged version's: the next delta's base
        self._delta: DeltaMessage | None = None
        self._full: DeltaMessage | None = None  # made when a receiver first needs the whole state

    def engine_receiver(self, engines: list[Any]) -> DeltaReceiver:
        return DeltaReceiver(engines)

    async def stage(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """The delta against the last staged version (a receiver that does not hold it refuses and
        gets the whole state), which is the next delta's base even if not every receiver took it."""
        current = {name: t.detach().cpu().clone() for name, t in tensors.items()}
        base, prev = (-1, {}) if self._state is None else (self._staged, self._state)
        changed = {n: t for n, t in current.items() if n not in prev or not torch.equal(t, prev[n])}
        self._delta, self._full, self._state = self._message(base, version, current, changed), None, current
        self.stats["copied"] += 1

    async def send(self, target: _DeltaTarget, attempt: int) -> tuple[bytes | None, int]:
        """The delta first; the whole state to a receiver that refused it or is new (`forget`)."""
        message = self._delta
        assert message is not None and self._state is not None
        if (attempt > 0 or target.full) and message.base != -1:
            if self._full is None:
                self._full = self._message(-1, message.version, self._state, self._state)
            message = self._full
            self.stats["full_sends"] += 1
        target.full = False
        return await target.asker.ask(DELTA, msgspec.msgpack.encode(message)), len(message.blob)

    def _message(self, base: int, version: int, state: dict, changed: dict) -> DeltaMessage:
        layout, blob = pack(version, changed, bucket_bytes=1 << 62)
        return DeltaMessage(base, version, state_checksum(state), layout, blob.tobytes())
