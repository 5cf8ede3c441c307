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
trained tensors travel. `stats["bytes"]` and `stats["full_bytes"]` show which case a run is in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch
import xxhash

from stages.weights.base import ApplyReply, EngineReceiver, LocalAsker, RemoteReceiver, WeightPushError, require_newer
from stages.weights.layout import LayoutError, bad_buckets, decode_layout, encode_layout, fill, plan, views

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
            layout = decode_layout(message.layout)
            blob = np.frombuffer(message.blob, dtype=np.uint8)
            if blob.nbytes != layout.total or bad_buckets(blob, layout):
                raise LayoutError(f"the delta to version {message.version} fails its checksum")
            changed = {name: t.clone() for name, t in views(blob, layout).items()}
            result = changed if message.base == -1 else {**self.state, **changed}
            if state_checksum(result) != message.checksum:
                raise LayoutError(f"version {message.version} rebuilt from the delta does not match its checksum")
        except (LayoutError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self.refuse(str(exc))
        self.state = result
        return await self.apply(message.version, result)


@dataclass
class DeltaTransport:
    retries: int = 1
    name: str = "delta"
    stats: dict = field(default_factory=lambda: {"pushes": 0, "bytes": 0, "full_bytes": 0, "full_sends": 0})

    def __post_init__(self) -> None:
        self._targets: list[Any] = []
        self._prev: dict[str, torch.Tensor] | None = None
        self._prev_version = -1
        self._latest: dict[str, torch.Tensor] | None = None

    def subscribe(self, receiver: Any) -> None:
        """An engine in this process, or anything with `ask(box, header)` (a `remote_receiver`)."""
        if not hasattr(receiver, "ask"):
            receiver = LocalAsker(DeltaReceiver([receiver]), getattr(receiver, "name", "local"))
        self._targets.append(receiver)

    def remote_receiver(self, peer: Any, name: str) -> Any:
        return RemoteReceiver(peer, name, self)

    async def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        require_newer(version, self._prev_version)
        current = {name: t.detach().cpu().clone() for name, t in tensors.items()}
        prev = self._prev
        changed = (
            current
            if prev is None
            else {n: t for n, t in current.items() if n not in prev or not torch.equal(t, prev[n])}
        )
        base = -1 if prev is None else self._prev_version
        delta = self._message(base, version, current, changed)
        full = delta if base == -1 else None
        for target in self._targets:
            await self._send(target, delta, lambda: full or self._message(-1, version, current, current))
        self._prev, self._prev_version = current, version
        self.stats["pushes"] += 1
        self.stats["full_bytes"] += sum(t.numel() * t.element_size() for t in current.values())

    async def resend(self, target: Any) -> None:
        if self._prev is not None:
            message = self._message(-1, self._prev_version, self._prev, self._prev)
            await self._send(target, message, lambda: message)

    async def close(self) -> None:
        self._targets.clear()

    def _message(self, base: int, version: int, state: dict, changed: dict) -> DeltaMessage:
        layout = plan(version, changed, 1 << 62)
        blob = np.zeros(layout.total, dtype=np.uint8)
        layout = fill(blob, changed, layout)
        return DeltaMessage(base, version, state_checksum(state), encode_layout(layout), blob.tobytes())

    async def _send(self, target: Any, message: DeltaMessage, full: Any) -> None:
        reason = ""
        for _ in range(self.retries + 1):
            answer = await target.ask(DELTA, msgspec.msgpack.encode(message))
            if answer is None:
                return  # unreachable: caught up with a full state on restart (`resend`)
            reply = msgspec.msgpack.decode(answer, type=ApplyReply)
            self.stats["bytes"] += len(message.blob)
            if reply.ok:
                return
            reason = reply.reason
            if message.base != -1:  # the receiver does not hold the base: send the whole state
                message = full()
                self.stats["full_sends"] += 1
        raise WeightPushError(f"receiver {target.name} refused version {message.version}: {reason}")
