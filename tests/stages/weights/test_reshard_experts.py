"""The transfer plan for mixture-of-experts models (stages.weights.reshard.experts) against gather-then-slice:
a Qwen3-MoE (Qwen2-MoE with its shared expert, when drawn) whose fused experts the learner holds whole,
sharded on any dim, or in expert-parallel blocks, pushed into engines that hold them whole, TP-sharded
(every expert, the intermediate dim split), EP-sharded (blocks of experts) or both, stacked or per
expert. Every engine rank's bytes equal the gathered model sliced plainly below (not through the module
under test), the way SGLang's FusedMoE loader slices it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.engines.sglang_moe import per_expert_tensors
from stages.weights.reshard import (
    EngineLayout,
    ExpertLayout,
    PlacementError,
    SourcePlacement,
    TPConfig,
    byte_offsets,
    bytes_per_rank,
    expert_parallel_source,
    is_expert,
    plan,
    receive_layout,
)
from tests.stages.weights.test_reshard import FAST, gather, local_shard, models, push, random_full, tp_slices

torch.set_num_threads(1)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def moe_models(draw) -> dict:
    m = draw(models())
    experts = draw(st.integers(1, 6))
    tp_ep = draw(st.sampled_from(divisors(math.gcd(m["tp"], experts))))
    return m | dict(experts=experts, tp_ep=tp_ep, moe_inter=(m["tp"] // tp_ep) * draw(st.integers(1, 2)),
                    full_ep=draw(st.sampled_from(divisors(experts))), shared=draw(st.booleans()),
                    per_expert=draw(st.booleans()), tp_per_expert=draw(st.booleans()))


def moe_shapes(m: dict) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of a Qwen3-MoE as transformers 5 holds it (fused experts; with `shared`, Qwen2-MoE's
    shared expert and its gate)."""
    h, hd, e, inter = m["hidden"], m["head_dim"], m["experts"], m["moe_inter"]
    shapes = {"model.embed_tokens.weight": (m["vocab"], h)}
    for i in range(m["layers"]):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        for part, heads in (("q", m["heads"]), ("k", m["kv"]), ("v", m["kv"])):
            shapes[f"{p}.self_attn.{part}_proj.weight"] = (heads * hd, h)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, m["heads"] * hd)
        shapes[f"{p}.self_attn.q_norm.weight"] = shapes[f"{p}.self_attn.k_norm.weight"] = (hd,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        shapes[f"{p}.mlp.gate.weight"] = (e, h)
        shapes[f"{p}.mlp.experts.gate_up_proj"] = (e, 2 * inter, h)
        shapes[f"{p}.mlp.experts.down_proj"] = (e, h, inter)
        if m["shared"]:
            shapes[f"{p}.mlp.shared_expert.gate_proj.weight"] = (m["inter"], h)
            shapes[f"{p}.mlp.shared_expert.up_proj.weight"] = (m["inter"], h)
            shapes[f"{p}.mlp.shared_expert.down_proj.weight"] = (h, m["inter"])
            shapes[f"{p}.mlp.shared_expert_gate.weight"] = (1, h)
    shapes["model.norm.weight"] = (h,)
    if not m["tied"]:
        shapes["lm_head.weight"] = (m["vocab"], h)
    return shapes


def expert_slices(full: dict[str, torch.Tensor], ep: int, moe_tp: int, rank: int, per_expert: bool) -> dict:
    """Engine rank `rank`'s expert tensors: expert block rank // moe_tp, intermediate slice rank % moe_tp."""
    block, part, out = rank // moe_tp, rank % moe_tp, {}
    for name, t in full.items():
        if not is_expert(name):
            continue
        prefix, first = name.rsplit(".", 1)[0], block * t.shape[0] // ep
        mine = t.chunk(ep)[block]
        if name.endswith("gate_up_proj"):
            inter = t.shape[1] // 2
            pieces = {"gate_proj": mine[:, :inter].chunk(moe_tp, dim=1)[part],
                      "up_proj": mine[:, inter:].chunk(moe_tp, dim=1)[part]}
        else:
            pieces = {"down_proj": mine.chunk(moe_tp, dim=2)[part]}
        if per_expert:
            out |= {f"{prefix}.{first + i}.{kind}.weight": w[i] for kind, w in pieces.items() for i in range(len(w))}
        else:
            out[name] = torch.cat(list(pieces.values()), dim=1)
    return out


def dense(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in tensors.items() if not is_expert(n)}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name


def learner_shards(m: dict, shapes: dict, full: dict, data) -> tuple[SourcePlacement, list[dict], dict]:
    """The learner's placement, each rank's local tensors, and the gathered model: either a random 1-D DTensor
    placement per parameter, or expert parallelism (blocks of experts, the rest FSDP2's rows)."""
    world = m["world"]
    src_eps = [d for d in divisors(world) if m["experts"] % d == 0]
    src_ep = data.draw(st.sampled_from([None, *src_eps]), label="learner expert_parallel (None: any placement)")
    if src_ep is None:
        dims = {n: data.draw(st.sampled_from([None, *range(len(s))]), label=n) for n, s in shapes.items()}
        locals_ = [{n: local_shard(t, dims[n], world, r) for n, t in full.items()} for r in range(world)]
        return SourcePlacement.from_placements(shapes, world, dims, m["dtype"]), locals_, gather(locals_, dims)
    locals_ = [{n: t.chunk(src_ep)[r % src_ep] if is_expert(n) else local_shard(t, 0, world, r)
                for n, t in full.items()} for r in range(world)]
    gathered = gather(locals_, dict.fromkeys(shapes, 0))
    gathered |= {n: torch.cat([locals_[r][n] for r in range(src_ep)]) for n in shapes if is_expert(n)}
    return expert_parallel_source(shapes, world, src_ep, m["dtype"]), locals_, gathered


@settings(FAST, max_examples=20)
@given(moe_models(), st.data())
def test_expert_placements_into_full_ep_and_tp_engines_equal_gather_then_slice(m, data):
    shapes = moe_shapes(m)
    full = random_full(shapes, m["dtype"], m["seed"])
    source, locals_, gathered = learner_shards(m, shapes, full, data)
    assert all(torch.equal(gathered[n], full[n]) for n in full)
    tp, full_ep, tp_ep = m["tp"], m["full_ep"], m["tp_ep"]
    config = TPConfig(m["heads"], m["kv"], m["tied"])
    engine = EngineLayout.combine(
        EngineLayout.full(shapes, m["dtype"]),
        EngineLayout.full(shapes, m["dtype"], ExpertLayout(full_ep, m["per_expert"])),
        EngineLayout.tensor_parallel(shapes, tp, config, m["dtype"], ExpertLayout(tp_ep, m["tp_per_expert"])))

    out = push(source, engine, locals_, 256, np.random.default_rng(m["seed"]))

    assert_same(out["tensors"][0], full)
    for rank in range(full_ep):
        assert_same(out["tensors"][1 + rank], dense(full) | expert_slices(full, full_ep, 1, rank, m["per_expert"]))
    for rank in range(tp):
        want = dense(tp_slices(dense(full), m, rank)) | expert_slices(full, tp_ep, tp // tp_ep, rank,
                                                                       m["tp_per_expert"])
        assert_same(out["tensors"][1 + full_ep + rank], want)


def test_expert_parallel_ranks_send_only_their_own_experts():
    """2 learner ranks of expert_parallel 2 (4 experts), an engine holding the experts whole, one of EP 2 and
    one of TP 2: each rank sends exactly its two experts' bytes to every engine rank that holds them, and no
    expert byte it does not hold; into the EP engine, rank r writes engine rank r only."""
    e, inter, h = 4, 6, 5
    shapes = {"l.mlp.experts.gate_up_proj": (e, 2 * inter, h), "l.mlp.experts.down_proj": (e, h, inter)}
    source = expert_parallel_source(shapes, 2, 2, "torch.float32")
    assert source == SourcePlacement.fsdp_dim0(shapes, 2, "torch.float32")  # what the learner's experts are
    one_copy = 3 * inter * h * e * 4
    for engine in (EngineLayout.full(shapes, "torch.float32"),
                   EngineLayout.full(shapes, "torch.float32", ExpertLayout(ep=2, per_expert=True)),
                   EngineLayout.tensor_parallel(shapes, 2, TPConfig(2, 2), "torch.float32"),
                   EngineLayout.full(shapes, "torch.float32", ExpertLayout(ep=1, per_expert=True))):
        offsets = [byte_offsets(receive_layout(engine, r)) for r in range(len(engine.ranks))]
        pieces = plan(source, engine, offsets)
        assert bytes_per_rank(pieces, 2) == [one_copy // 2] * 2
        for p in pieces:
            assert p.src_box[0][0] >= 2 * p.src_rank and p.src_box[0][1] <= 2 * (p.src_rank + 1), p
    ep = EngineLayout.full(shapes, "torch.float32", ExpertLayout(ep=2))
    pieces = plan(source, ep, [byte_offsets(receive_layout(ep, r)) for r in range(2)])
    assert {(p.src_rank, p.dst_rank) for p in pieces} == {(0, 0), (1, 1)}
    assert [t.shape for t in ep.ranks[1]] == [(2, 2 * inter, h), (2, h, inter)]


def test_per_expert_names_are_the_ones_sglang_takes():
    """The per-expert engine layout names exactly the tensors `sglang_moe.per_expert_tensors` sends SGLang."""
    shapes = {"model.layers.0.mlp.experts.gate_up_proj": (3, 4, 2), "model.layers.0.mlp.experts.down_proj": (3, 2, 2),
              "model.layers.0.mlp.gate.weight": (3, 2)}
    engine = EngineLayout.full(shapes, "torch.float32", ExpertLayout(per_expert=True))
    sent = per_expert_tensors({n: torch.zeros(s) for n, s in shapes.items()})
    assert {t.name: t.shape for t in engine.ranks[0]} == {n: tuple(t.shape) for n, t in sent.items()}


@pytest.mark.parametrize("make, message", [
    (lambda: EngineLayout.full({"a.mlp.experts.down_proj": (3, 2, 2)}, "torch.float32", ExpertLayout(ep=2)),
     "3 experts over ep 2"),
    (lambda: EngineLayout.tensor_parallel({"a.mlp.experts.down_proj": (2, 2, 3)}, 2, TPConfig(2, 2),
                                          "torch.float32"), "intermediate size of 3 over 2"),
    (lambda: EngineLayout.tensor_parallel({"a.mlp.experts.down_proj": (2, 2, 2)}, 2, TPConfig(2, 2),
                                          "torch.float32", ExpertLayout(ep=3)), "3 does not divide the engine's 2"),
    (lambda: EngineLayout.full({"a.mlp.experts.gate_up_proj": (2, 3, 2)}, "torch.float32", ExpertLayout()),
     "do not split in two"),
    (lambda: expert_parallel_source({"a.mlp.experts.down_proj": (4, 2, 2)}, 3, 2), "learner's 3 ranks"),
])
def test_bad_expert_layouts_are_a_clear_error(make, message):
    with pytest.raises(PlacementError, match=message):
        make()
