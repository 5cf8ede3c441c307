"""A version declares itself an adapter on receipt: the transport's engine side decodes the descriptor once
(`as_received`) and every engine gets an `AdapterVersion` (or the full weights as they came); a descriptor
that does not decode is refused there like any version that does not check out, and no engine sees it."""

from __future__ import annotations

import msgspec
import pytest
import torch

from buffers.memory import MemoryStore
from stages.weights.adapter import (
    ADAPTER_KEY,
    AdapterError,
    AdapterSpec,
    AdapterVersion,
    Probe,
    as_received,
    pack_adapter,
)
from stages.weights.base import ApplyReply, EngineReceiver, WeightPushError
from stages.weights.inproc import InprocTransport
from stages.weights.packed import PackedReceiver, WeightPayloadError, pack
from stages.weights.snapshot import load_snapshot, save_snapshot

pytestmark = pytest.mark.anyio
SPEC = AdapterSpec(rank=2, alpha=4.0, target_modules=("q_proj",), base="tiny:00", probe=Probe((1, 2), (-0.5,), 1e-4))
LORA = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 8),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 2)}
FULL = {"model.embed_tokens.weight": torch.arange(12.0).reshape(3, 4)}


def undecodable() -> dict[str, torch.Tensor]:
    return {**LORA, ADAPTER_KEY: torch.frombuffer(bytearray(b"\x93not a spec"), dtype=torch.uint8)}


class Recording:
    """An engine that keeps what it was handed."""

    def __init__(self, name: str = "rec") -> None:
        self.name, self.got = name, []

    async def receive_weights(self, version: int, weights) -> None:
        self.got.append((version, weights))


def assert_adapter(weights) -> None:
    assert isinstance(weights, AdapterVersion) and weights.spec == SPEC
    assert weights.tensors.keys() == LORA.keys() and all(torch.equal(weights.tensors[n], t) for n, t in LORA.items())


def test_as_received_decodes_an_adapter_and_passes_full_weights_through() -> None:
    assert as_received(FULL) is FULL
    assert_adapter(as_received(pack_adapter(SPEC, LORA)))


async def test_every_engine_side_hands_engines_the_version_as_received() -> None:
    receiver, packed, direct = Recording(), Recording(), Recording()
    reply = await EngineReceiver([receiver]).apply(1, pack_adapter(SPEC, LORA))
    assert msgspec.msgpack.decode(reply, type=ApplyReply).ok
    await PackedReceiver([packed]).deliver(*pack(1, pack_adapter(SPEC, LORA)))
    transport = InprocTransport()
    transport.subscribe(direct)
    await transport.publish(1, pack_adapter(SPEC, LORA))
    await transport.publish(2, FULL)
    for engine in (receiver, packed, direct):
        assert_adapter(engine.got[0][1])
    assert direct.got[1][1].keys() == FULL.keys()


async def test_a_descriptor_that_does_not_decode_is_refused_before_any_engine_sees_it() -> None:
    engine = Recording()
    receiver = EngineReceiver([engine])
    reply = msgspec.msgpack.decode(await receiver.apply(1, undecodable()), type=ApplyReply)
    assert not reply.ok and "does not decode" in reply.reason and reply.version == -1
    assert receiver.rejected == 1 and engine.got == []
    transport = InprocTransport()
    transport.subscribe(engine)
    with pytest.raises(WeightPushError, match="does not decode"):
        await transport.publish(1, undecodable())
    assert engine.got == [] and transport.stats["refused"] == 1
    with pytest.raises(AdapterError, match="does not decode"):  # another process's mailbox: told to its sender
        await PackedReceiver([engine]).deliver(*pack(1, undecodable()))
    assert engine.got == []


async def test_a_snapshot_is_loaded_as_received() -> None:
    store = MemoryStore()
    await save_snapshot(store, "run/weights/a", 3, pack_adapter(SPEC, LORA))
    version, weights = await load_snapshot(store, "run/weights/a")
    assert version == 3
    assert_adapter(weights)
    await save_snapshot(store, "run/weights/a", 4, undecodable())
    with pytest.raises(WeightPayloadError, match="does not decode"):
        await load_snapshot(store, "run/weights/a")
