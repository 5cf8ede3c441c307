"""`delta`: send only the elements that changed since the version the receiving slot holds.

The learner keeps its last versions packed in the engine's dtype (`engine_dtype`: a fp32 learner
with bf16 engines diffs bf16 values, most of which do not move in a step) and tracks, from every
reply, which version each of the receiver's two slots holds. A version goes out as a `DeltaMessage`:
the slot to rebuild, the version's checksummed bucket layout (`stages.weights.layout`) and a
`stages.weights.sparse.Patch` (per bucket: element indices, a bitmask or the whole bucket, and the
values) with its payload. The receiver (`DeltaReceiver`, engine side) rebuilds the slot in place
from exactly the patch's base, verifies every bucket's checksum, and only then hands its engines
the version (views over the slot; the other slot is the next one rebuilt). A patch it cannot apply
is refused and the learner sends the whole state, as it does to a new or restarted receiver.

What it buys depends on the training: at RL learning rates most bf16 values stay bit-identical
from one step to the next; with frozen parts only the trained tensors travel at all.
`stats["bytes"]` against `stats["full_bytes"]`, and `changed` against `elements`, show how much.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import numpy as np
import torch

from stages.weights.base import ApplyReply, EngineReceiver, PushTransport, Target
from stages.weights.layout import LayoutError, decode_layout, encode_layout, views
from stages.weights.sparse import Patch, Planner, SlotReply, Slots

DELTA = "weights.delta"


class DeltaMessage(msgspec.Struct, frozen=True):
    slot: int  # the receive slot to rebuild (never the one its engines run on)
    layout: bytes  # the version's Layout (msgpack), with every bucket's checksum
    patch: Patch
    blob: bytes  # the patch's payload


class DeltaReceiver(EngineReceiver):
    """The engine side (mailbox `weights.delta`): two receive slots, rebuilt in place."""

    def __init__(self, engines: list[Any]) -> None:
        super().__init__(engines)
        self.slots = Slots([np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.uint8)])

    def handlers(self) -> dict[str, Any]:
        return {DELTA: self.delta}

    async def delta(self, header: bytes, _blob: Any = None) -> bytes:
        """Every reply says which slot the engines run on and what each slot holds."""
        return self.slots.reply(msgspec.msgpack.decode(await self._delta(header), type=ApplyReply))

    async def _delta(self, header: bytes) -> bytes:
        try:
            message = msgspec.msgpack.decode(header, type=DeltaMessage)
            layout = decode_layout(message.layout)
            if (held := self.holds(layout.version)) is not None:
                return held
            slot = message.slot
            if slot in (0, 1) and slot != self.slots.live and self.slots.slots[slot].nbytes < layout.total:
                self.slots.slots[slot], self.slots.holds[slot] = np.zeros(layout.total, dtype=np.uint8), -1
            payload = np.frombuffer(message.blob, dtype=np.uint8)
            buffer = await anyio.to_thread.run_sync(self.slots.rebuild, slot, layout, message.patch, payload)
        except (LayoutError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self.refuse(str(exc))
        reply = await self.apply(layout.version, views(buffer, layout))
        if self.version == layout.version:  # its engines run on the slot now (not when one refused it)
            self.slots.applied(slot)
        return reply


@dataclass(eq=False)
class _DeltaTarget(Target):
    holds: tuple[int, ...] = (-1, -1)  # the version each receive slot holds, as its last reply said
    live: int = -1

    def forget(self) -> None:
        self.holds, self.live = (-1, -1), -1  # a new process holds nothing: the whole state first


@dataclass
class DeltaTransport(PushTransport):
    retries: int = 1
    engine_dtype: str | None = None  # e.g. "bfloat16": floating tensors are sent (and diffed) in it
    bucket_bytes: int = 4 << 20
    name: str = "delta"
    target_type = _DeltaTarget
    receiver = DeltaReceiver

    def __post_init__(self) -> None:
        super().__post_init__()
        self.planner = Planner(self.engine_dtype, self.stats)


    async def stage(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        await anyio.to_thread.run_sync(self.planner.stage, version, tensors, self.bucket_bytes)
        self.stats["copied"] += 1

    async def send(self, target: _DeltaTarget, attempt: int) -> tuple[bytes | None, int]:
        """A patch from what the target's free slot (or its other one) holds; after a refusal the whole state."""
        slot = 1 - target.live if target.live in (0, 1) else 0
        patch, pieces = await anyio.to_thread.run_sync(self.planner.patch, target.holds, slot, attempt > 0)
        message = self._message(slot, patch, b"".join(p.tobytes() for p in pieces))
        answer = await target.asker.ask(DELTA, msgspec.msgpack.encode(message))
        if answer is not None:
            reply = msgspec.msgpack.decode(answer, type=SlotReply)
            target.holds, target.live = reply.holds, reply.live
        return answer, len(message.blob)

    def _message(self, slot: int, patch: Patch, blob: bytes) -> DeltaMessage:
        layout = self.planner.versions.layout
        assert layout is not None
        return DeltaMessage(slot, encode_layout(layout), patch, blob)
