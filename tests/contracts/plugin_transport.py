"""A user's weight transport, outside the package: it plugs in by its path, e.g.
`weights.transport = "tests.contracts.plugin_transport:SafetensorsTransport"`, and passes the same
contract as the built-ins (tests/contracts/test_transport_contract.py).

Each version travels as one safetensors blob inside a msgpack `Blob` message (no pickle), with the
xxh3 checksum of its bytes; the engine side (`receiver`) verifies the checksum, loads the tensors and
applies them whole, or refuses the version. The push loop, retries and catch-ups are `PushTransport`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import xxhash

from stages.weights.base import EngineReceiver, PushTransport, Target

BOX = "weights.plugin.safetensors"


class Blob(msgspec.Struct, frozen=True):
    version: int
    data: bytes  # safetensors
    checksum: int  # xxh3-64 of `data`


class BlobReceiver(EngineReceiver):
    """The engine side: verify, load, apply (mailbox `weights.plugin.safetensors`)."""

    def handlers(self) -> dict[str, Any]:
        return {BOX: self.blob}

    async def blob(self, header: bytes, _blob: Any = None) -> bytes:
        from safetensors.torch import load

        message = msgspec.msgpack.decode(header, type=Blob)
        if (held := self.holds(message.version)) is not None:
            return held
        if xxhash.xxh3_64_intdigest(message.data) != message.checksum:
            return self.refuse(f"version {message.version} fails its checksum")
        return await self.apply(message.version, load(message.data))


@dataclass
class SafetensorsTransport(PushTransport):
    retries: int = 1
    name: str = "safetensors"
    receiver = BlobReceiver

    def __post_init__(self) -> None:
        super().__post_init__()
        self._message: Blob | None = None
        self.damage: Any = None  # tests: called with the data, returns what is sent instead

    async def stage(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save

        data = save({n: t.detach().cpu().contiguous().clone() for n, t in tensors.items()})  # tied: a copy each
        self._message = Blob(version, data, xxhash.xxh3_64_intdigest(data))
        self.stats["copied"] += 1

    async def send(self, target: Target, attempt: int) -> tuple[bytes | None, int]:
        assert self._message is not None
        message = self._message
        if self.damage is not None:
            message = msgspec.structs.replace(message, data=self.damage(message.data))
        return await target.asker.ask(BOX, msgspec.msgpack.encode(message)), len(message.data)
