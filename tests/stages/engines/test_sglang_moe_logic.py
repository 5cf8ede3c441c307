"""Mixture-of-experts pieces of the SGLang engine without a server: expert names and layouts
(`stages.engines.sglang_moe`), routed experts' decoding and alignment, and the weight probe's reference
(the real server: tests/stages/engines/test_sglang_moe.py)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.data.routing import MoELayout
from stages.engines.sglang_moe import (
    completion_routes,
    decode_routes,
    fused_tensors,
    has_fused_experts,
    per_expert_tensors,
)


def fused_layer(experts: int, inter: int, hidden: int, prefix: str = "model.layers.0.mlp.experts"):
    return {
        f"{prefix}.gate_up_proj": torch.randn(experts, 2 * inter, hidden),
        f"{prefix}.down_proj": torch.randn(experts, hidden, inter),
        "model.layers.0.mlp.gate.weight": torch.randn(experts, hidden),
        "model.embed_tokens.weight": torch.randn(7, hidden),
    }


def test_fused_experts_split_into_the_loaders_per_expert_names_gate_rows_first() -> None:
    tensors = fused_layer(experts=3, inter=4, hidden=5)
    split = per_expert_tensors(tensors)
    gate_up, down = tensors["model.layers.0.mlp.experts.gate_up_proj"], tensors["model.layers.0.mlp.experts.down_proj"]
    for e in range(3):
        assert torch.equal(split[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"], gate_up[e, :4])
        assert torch.equal(split[f"model.layers.0.mlp.experts.{e}.up_proj.weight"], gate_up[e, 4:])
        assert torch.equal(split[f"model.layers.0.mlp.experts.{e}.down_proj.weight"], down[e])
    assert not has_fused_experts(split) and has_fused_experts(tensors)
    assert torch.equal(split["model.layers.0.mlp.gate.weight"], tensors["model.layers.0.mlp.gate.weight"])
    assert len(split) == 2 + 3 * 3


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(1, 4))
def test_per_expert_and_fused_are_exact_inverses(experts: int, inter: int, hidden: int) -> None:
    tensors = fused_layer(experts, inter, hidden)
    split = per_expert_tensors(tensors)
    assert per_expert_tensors(split).keys() == split.keys()  # already per expert: unchanged
    back = fused_tensors(split)
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[n], tensors[n]) for n in tensors)


def test_a_transformers_moe_state_dict_becomes_what_save_pretrained_writes(tmp_path) -> None:
    from safetensors.torch import load_file

    from stages.data.model import load_model, make_tiny_moe_model

    folder = make_tiny_moe_model(tmp_path / "moe")
    on_disk = load_file(folder / "model.safetensors")
    split = per_expert_tensors(load_model(folder).state_dict())
    assert set(split) - {"lm_head.weight"} == set(on_disk)  # the tied head is not stored
    assert all(torch.equal(split[n], on_disk[n]) for n in on_disk)


def test_bad_fused_and_per_expert_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="do not split"):
        per_expert_tensors({"m.mlp.experts.gate_up_proj": torch.zeros(2, 3, 4)})
    split = per_expert_tensors(fused_layer(3, 2, 2))
    del split["model.layers.0.mlp.experts.1.up_proj.weight"]
    with pytest.raises(ValueError, match="missing"):
        fused_tensors(split)


LAYOUT = MoELayout(layers=(0, 1), experts=8, top_k=2, norm_topk_prob=True)


def encode(routes: np.ndarray) -> str:
    return base64.b64encode(routes.astype(np.int32).tobytes()).decode()


def test_routes_keep_the_positions_that_sampled_each_generated_token() -> None:
    prompt, generated = 5, 3
    routes = np.arange((prompt + generated - 1) * 2 * 2).reshape(-1, 2, 2) % 8  # [positions, layers, top_k]
    decoded = decode_routes(encode(routes), LAYOUT)
    assert decoded.dtype == np.uint8 and decoded.shape == routes.shape
    kept = completion_routes(decoded, prompt, generated)
    assert kept.shape == (generated, 2, 2)
    np.testing.assert_array_equal(kept[0], routes[prompt - 1])  # token 0 was sampled from the prompt's last position
    np.testing.assert_array_equal(kept[-1], routes[-1])
    with pytest.raises(ValueError, match="routed positions"):
        completion_routes(decoded, prompt, generated + 1)


def test_routes_of_every_decoder_layer_keep_the_moe_layers_and_bad_ones_are_refused() -> None:
    sparse = MoELayout(layers=(1, 3), experts=8, top_k=2, norm_topk_prob=True)
    routes = np.random.default_rng(0).integers(0, 8, size=(6, 4, 2))  # 4 decoder layers reported
    np.testing.assert_array_equal(decode_routes(encode(routes), sparse), routes[:, [1, 3]])
    with pytest.raises(ValueError, match="outside"):
        decode_routes(encode(np.full((2, 2, 2), 9)), LAYOUT)
    with pytest.raises(ValueError, match="do not fit"):
        decode_routes(encode(np.zeros(5)), LAYOUT)


def test_the_probe_reference_is_the_models_own_forward_for_fused_and_per_expert_names(tmp_path) -> None:
    from stages.data.model import load_model, make_tiny_moe_model
    from stages.engines.sglang_probe import WeightProbe

    folder = make_tiny_moe_model(tmp_path / "moe")
    model = load_model(folder)
    probe = WeightProbe(folder)
    fused = probe.expected(model.state_dict(), 1e-5)
    split = probe.expected(per_expert_tensors(model.state_dict()), 1e-5)
    ids = torch.tensor([probe.tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    assert fused.difference(split.logprobs) == 0.0
    assert fused.difference(logp.tolist()) <= 1e-6


def test_a_dense_tied_folders_probe_reference_is_its_own_forward_and_low_precision_gets_the_wider_bound(
        tmp_path) -> None:
    """The start probe of a dense model (tied head, stored once) is the folder's own forward: what a server
    that loaded the folder computes. float32 keeps the engine's bound; bfloat16 gets the measured one."""
    from stages.data.model import load_model, make_tiny_model
    from stages.engines.sglang_probe import LOW_PRECISION_TOLERANCE, WeightProbe, dtype_tolerance, folder_version

    folder = make_tiny_model(tmp_path / "dense")
    model = load_model(folder).eval()
    probe = WeightProbe(folder)
    expected = probe.expected(folder_version(folder), 1e-5)
    ids = torch.tensor([probe.tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
    assert expected.difference(logp.tolist()) <= 1e-6
    assert (dtype_tolerance(1e-5, "float32"), dtype_tolerance(1e-5, "bfloat16")) == (1e-5, LOW_PRECISION_TOLERANCE)
