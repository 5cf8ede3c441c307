"""Expert-sparse deltas (`stages.weights.sparse`, form `experts`): fused expert tensors [E, ...] with
some experts unchanged and some partly changed rebuild bit-exact, and expert-sparse bytes <=
element-sparse bytes <= full; a damaged experts part is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.weights.layout import LayoutError, plan
from stages.weights.sparse import EXPERTS, Slots, Versions, diff, expert_blocks, is_fused_experts


def moe_state(g: torch.Generator, experts: int, hidden: int, inner: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One MoE layer as transformers 5 holds it: router, fused experts, a dense tensor beside them."""
    return {
        "layers.0.mlp.gate.weight": torch.randn(experts, hidden, generator=g).to(dtype),
        "layers.0.mlp.experts.gate_up_proj": torch.randn(experts, 2 * inner, hidden, generator=g).to(dtype),
        "layers.0.mlp.experts.down_proj": torch.randn(experts, hidden, inner, generator=g).to(dtype),
        "layers.0.input_layernorm.weight": torch.randn(hidden + 3, generator=g).to(dtype),  # an odd size: a gap
    }


def step(old: dict[str, torch.Tensor], g: torch.Generator, moved: list[int], share: float) -> dict[str, torch.Tensor]:
    """A step that changes `share` of the elements of the experts in `moved` only (and of the dense tensors)."""
    new = {}
    for name, t in old.items():
        t = t.clone()
        picks = torch.rand(t.shape, generator=g) < share
        if "experts" in name.split("."):
            picks[[e for e in range(t.shape[0]) if e not in moved]] = False
        t[picks] += 0.5
        new[name] = t
    return new


def pack(tensors: dict[str, torch.Tensor], bucket_bytes: int):
    versions = Versions()
    buffer = versions.add(1, tensors, plan(1, tensors, bucket_bytes)).copy()
    return versions.layout, buffer


def rebuild(layout, base: np.ndarray, patch, pieces) -> np.ndarray:
    slots = Slots([base.copy(), np.zeros_like(base)])
    slots.holds = [1, -1]
    payload = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint8)
    return slots.rebuild(0, layout, patch, payload).copy()


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    experts=st.integers(1, 9),
    moved=st.lists(st.integers(0, 8), max_size=4),
    share=st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    bucket_bytes=st.sampled_from([1, 4096, 1 << 20]),
)
def test_expert_sparse_rebuilds_bit_exact_and_is_never_larger(seed, experts, moved, share, dtype, bucket_bytes) -> None:
    g = torch.Generator().manual_seed(seed)
    old = moe_state(g, experts, hidden=8, inner=6, dtype=dtype)
    new = step(old, g, [e for e in moved if e < experts], share)
    layout, base = pack(old, bucket_bytes)
    new_layout, target = pack(new, bucket_bytes)
    sizes = {}
    for experts_on in (True, False):
        patch, pieces = diff(new_layout, target, base, base_version=1, source=0, experts=experts_on)
        assert np.array_equal(rebuild(new_layout, base, patch, pieces), target)  # apply(base, delta) == new
        sizes[experts_on] = sum(p.nbytes for p in pieces)
        assert experts_on or all(p.form != EXPERTS for p in patch.parts)
    assert sizes[True] <= sizes[False] <= new_layout.total


def test_unchanged_experts_cost_one_bit_each() -> None:
    """bf16 experts: 2 of 8 moved in half their elements, the rest bit-identical to the base: the
    element-sparse bitmask covers all 8 experts, the expert-sparse one the 2 that moved."""
    g = torch.Generator().manual_seed(0)
    old = {"mlp.experts.down_proj": torch.randn(8, 64, 128, generator=g).to(torch.bfloat16)}
    new = step(old, g, moved=[2, 5], share=0.5)
    layout, base = pack(old, 1 << 20)
    new_layout, target = pack(new, 1 << 20)
    patch, pieces = diff(new_layout, target, base, 1, 0)
    element, element_pieces = diff(new_layout, target, base, 1, 0, experts=False)
    (part,) = patch.parts
    assert part.form == EXPERTS and part.inner == "bitmask" and element.parts[0].form == "bitmask"
    assert np.unpackbits(pieces[0], count=8).tolist() == [0, 0, 1, 0, 0, 1, 0, 0]
    sent, element_sent = sum(p.nbytes for p in pieces), sum(p.nbytes for p in element_pieces)
    values = part.changed * 2
    assert sent - values <= 1 + (element_sent - values) / 4
    assert np.array_equal(rebuild(new_layout, base, patch, pieces), target)


def test_blocks_are_one_per_expert_and_one_per_other_tensor() -> None:
    g = torch.Generator().manual_seed(1)
    state = moe_state(g, experts=4, hidden=8, inner=6, dtype=torch.bfloat16)
    layout = plan(1, state, 1 << 20)
    assert [is_fused_experts(e) for e in layout.tensors] == [False, True, True, False]
    bounds = expert_blocks(layout, layout.buckets[0], np.uint16)
    assert bounds.size - 1 == 1 + 4 + 4 + 1 and bounds[0] == 0 and bounds[-1] == layout.buckets[0].nbytes // 2
    assert np.all(np.diff(bounds) > 0)
    dense = plan(1, {"w": torch.zeros(8, 4, 4)}, 1 << 20)
    assert expert_blocks(dense, dense.buckets[0], np.uint32) is None


@pytest.mark.parametrize("damage", ["block bits", "values"])
def test_a_damaged_experts_part_is_refused(damage: str) -> None:
    g = torch.Generator().manual_seed(2)
    old = {"mlp.experts.gate_up_proj": torch.randn(8, 32, 64, generator=g).to(torch.bfloat16)}
    new = step(old, g, moved=[1], share=0.02)
    layout, base = pack(old, 1 << 20)
    new_layout, target = pack(new, 1 << 20)
    patch, pieces = diff(new_layout, target, base, 1, 0)
    assert patch.parts[0].form == EXPERTS
    payload = np.concatenate(pieces)
    if damage == "block bits":
        payload[0] = 0b10000000  # expert 0 marked moved in place of expert 1
    else:
        payload[-1] ^= 0x5A
    slots = Slots([base.copy(), np.zeros_like(base)])
    slots.holds = [1, -1]
    with pytest.raises(LayoutError):
        slots.rebuild(0, new_layout, patch, payload)
    assert slots.holds == [-1, -1]


@pytest.mark.anyio
async def test_delta_transport_skips_unchanged_experts_and_the_engine_holds_the_exact_version() -> None:
    from stages.weights.base import LocalAsker
    from stages.weights.delta import DeltaReceiver, DeltaTransport

    class Sink:
        name = "sink"

        async def receive_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
            self.version, self.tensors = version, tensors

    g = torch.Generator().manual_seed(3)
    transports, sinks = {}, {}
    for experts_on in (True, False):
        transports[experts_on] = DeltaTransport(engine_dtype="bfloat16", bucket_bytes=1 << 20)
        sinks[experts_on] = Sink()
        transports[experts_on].planner.experts = experts_on
        transports[experts_on].subscribe(LocalAsker(DeltaReceiver([sinks[experts_on]]), "engine-0"))
    state = moe_state(g, experts=8, hidden=32, inner=24, dtype=torch.float32)
    for version in (1, 2, 3):
        for experts_on, transport in transports.items():
            await transport.publish(version, state)
            sink = sinks[experts_on]
            assert sink.version == version
            assert all(torch.equal(sink.tensors[n], t.to(torch.bfloat16)) for n, t in state.items())
        state = step(state, g, moved=[version], share=0.5)
    on, off = transports[True].stats, transports[False].stats
    assert on["refused"] == off["refused"] == 0 and on["bytes"] < off["bytes"]
