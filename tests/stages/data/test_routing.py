"""The tiny MoE model family (make_tiny_moe_model, moe_layout) and routing replay (stages.data.routing):
capture then replay at the same weights is bit-identical to a plain forward; after the router moved, replay
computes the rollout's routing (against an independent forward whose routers are replaced) with the gate
weights from the current router, which still gets gradients; router disagreement with replay off and on."""

from __future__ import annotations

import json

import torch

torch.set_num_threads(1)

import pytest  # noqa: E402
from transformers import Qwen2MoeConfig, Qwen3MoeConfig  # noqa: E402

from stages.data.model import ModelFolderError, load_model, make_tiny_model, make_tiny_moe_model  # noqa: E402
from stages.data.routing import (  # noqa: E402
    MoELayout,
    moe_layout,
    own_routing,
    recorded_routing,
    replay_routing,
    router_disagreement,
    routers,
)

LAYOUT = MoELayout(layers=(0, 1), experts=8, top_k=2, norm_topk_prob=True)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return make_tiny_moe_model(tmp_path_factory.mktemp("tiny_moe"))


@pytest.fixture
def model(moe_folder):
    torch.manual_seed(0)
    return load_model(moe_folder).eval()


def _inputs(rows: int = 3, seq: int = 10) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 60, (rows, seq), generator=gen)
    attn = torch.ones_like(ids)
    attn[0, :3] = 0  # a left-padded row
    return {"input_ids": ids, "attention_mask": attn}


def _move_router(model, inputs, steps: int = 4) -> None:
    """A few AdamW steps of next-token loss: the routers (and everything else) move."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        logits = model(**inputs).logits[:, :-1]
        targets = inputs["input_ids"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def test_tiny_moe_model_loads_back_with_its_layout(moe_folder, tmp_path) -> None:
    config = json.loads((moe_folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["head_dim"] == 16 and config["num_local_experts"] == 8
    model = load_model(moe_folder)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert moe_layout(model) == LAYOUT and moe_layout(model.config) == LAYOUT
    assert make_tiny_moe_model(moe_folder) == moe_folder  # reused
    with pytest.raises(ModelFolderError, match="experts = 8"):
        make_tiny_moe_model(moe_folder, experts=4)
    dense = make_tiny_model(tmp_path / "dense")
    with pytest.raises(ModelFolderError):  # a dense tiny folder is never reused as an MoE one
        make_tiny_moe_model(dense)
    assert moe_layout(load_model(dense)) is None


def test_moe_layout_follows_sparse_step_and_dense_layers() -> None:
    config = Qwen3MoeConfig(num_hidden_layers=4, num_experts=300, num_experts_per_tok=4, decoder_sparse_step=2)
    layout = moe_layout(config)
    assert layout.layers == (1, 3) and layout.experts == 300 and layout.id_dtype.__name__ == "int16"
    assert moe_layout(Qwen2MoeConfig(num_hidden_layers=3, mlp_only_layers=[1])).layers == (0, 2)
    assert moe_layout(Qwen3MoeConfig(num_hidden_layers=2, num_experts=0)) is None


def test_replay_of_own_routing_is_bit_identical(model) -> None:
    inputs = _inputs()
    recorded = own_routing(model, **inputs)
    assert recorded.shape == (3, 10, 2, 2)
    mask = inputs["attention_mask"].bool()
    with torch.no_grad():
        plain = model(**inputs).logits
        with replay_routing(model, recorded, mask) as seen:
            replayed = model(**inputs).logits
        with replay_routing(model, recorded.to(torch.uint8), mask):  # as a completion carries them
            assert torch.equal(model(**inputs).logits, plain)
    assert torch.equal(plain, replayed)
    assert seen.disagreement() == [0.0, 0.0] and seen.own_disagreement() == [0.0, 0.0]
    assert seen.positions == int(mask.sum())
    assert all(not gate._forward_hooks for gate in routers(model, LAYOUT))  # removed on exit


def _forced_forward(model, recorded: torch.Tensor, mask: torch.Tensor, inputs) -> torch.Tensor:
    """The reference: each router's forward REPLACED by one that takes the recorded experts at masked
    positions (its own top-k elsewhere) with weights renormalised from its own softmax."""
    flat, flat_mask = recorded.reshape(-1, *recorded.shape[2:]), mask.reshape(-1)
    originals = []
    for j, gate in enumerate(routers(model, LAYOUT)):
        def forced(hidden, gate=gate, j=j):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.nn.functional.softmax(logits, dim=-1, dtype=torch.float)
            own = torch.topk(probs, gate.top_k, dim=-1).indices
            indices = torch.where(flat_mask[:, None], flat[:, j], own)
            weights = probs.gather(1, indices)
            return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), indices
        originals.append((gate, gate.forward))
        gate.forward = forced
    try:
        with torch.no_grad():
            return model(**inputs).logits
    finally:
        for gate, forward in originals:
            gate.forward = forward


def test_replay_after_the_router_moved_routes_as_the_rollout(model) -> None:
    inputs = _inputs()
    recorded = own_routing(model, **inputs)  # the rollout's routing, at the old weights
    mask = inputs["attention_mask"].bool()
    mask[:, :4] = False  # prompt positions: the learner's own top-k
    _move_router(model, inputs)
    with torch.no_grad(), recorded_routing(model, recorded, mask, replay=False) as off:
        plain = model(**inputs).logits
    assert min(off.disagreement()) > 0 and off.disagreement() == off.own_disagreement()
    with torch.no_grad(), replay_routing(model, recorded, mask) as on:
        replayed = model(**inputs).logits
    assert on.disagreement() == [0.0, 0.0] and max(on.own_disagreement()) > 0  # the router itself still differs
    reference = _forced_forward(model, recorded, mask, inputs)
    torch.testing.assert_close(replayed, reference, rtol=0, atol=1e-6)
    assert not torch.allclose(replayed, plain, atol=1e-4)
    now = own_routing(model, **inputs)
    assert router_disagreement(now, recorded, mask).tolist() == pytest.approx(off.disagreement())


def test_router_gets_gradients_under_replay(model) -> None:
    inputs = _inputs()
    recorded = own_routing(model, **inputs)
    recorded = (recorded + 1) % LAYOUT.experts  # other experts than its own: the replayed ones get the weights
    model.train()
    with replay_routing(model, recorded, inputs["attention_mask"].bool()):
        logp = torch.log_softmax(model(**inputs).logits, -1)
    logp[..., 5].sum().backward()
    for gate in routers(model, LAYOUT):
        assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0


def test_bad_replay_input_is_refused(model, moe_folder, tmp_path) -> None:
    inputs = _inputs()
    mask = inputs["attention_mask"].bool()
    with pytest.raises(ValueError, match="shape"):
        with replay_routing(model, torch.zeros(3, 10, 2, 3, dtype=torch.long), mask):
            pass
    with pytest.raises(ValueError, match="positions"):
        with replay_routing(model, torch.zeros(3, 10, 2, 2, dtype=torch.long), mask), torch.no_grad():
            model(input_ids=inputs["input_ids"][:, :5])
    dense = load_model(make_tiny_model(tmp_path / "dense"))
    with pytest.raises(ValueError, match="dense"):
        with replay_routing(dense, torch.zeros(3, 10, 2, 2, dtype=torch.long), mask):
            pass
