"""The transfer plan (stages.weights.reshard) against gather-then-slice: every engine rank's tensors,
assembled from the pieces each learner rank writes out of its own shard, equal the full model
gathered with torch.cat and sliced the way SGLang's tensor-parallel loaders slice it (written out
plainly below, not through the module under test)."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Shard

from stages.weights.layout import views
from stages.weights.reshard import (
    EngineLayout,
    PlacementError,
    SourcePlacement,
    TPConfig,
    bad_buckets,
    byte_offsets,
    bytes_per_rank,
    check_plan,
    make_buckets,
    padding_ranges,
    piece_bytes,
    plan,
    receive_layout,
    receiver_checksum,
    sender_checksum,
    unverified_bytes,
    with_checksum,
    write_piece,
)

torch.set_num_threads(1)
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def qwen2_shapes(m: dict) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of a Qwen2/Llama-style model (tied: no lm_head, as in HF)."""
    h, hd, inter = m["hidden"], m["head_dim"], m["inter"]
    shapes = {"model.embed_tokens.weight": (m["vocab"], h)}
    for i in range(m["layers"]):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        for part, heads in (("q", m["heads"]), ("k", m["kv"]), ("v", m["kv"])):
            shapes[f"{p}.self_attn.{part}_proj.weight"] = (heads * hd, h)
            if m["bias"]:
                shapes[f"{p}.self_attn.{part}_proj.bias"] = (heads * hd,)
        shapes[f"{p}.self_attn.o_proj.weight"] = (h, m["heads"] * hd)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        shapes[f"{p}.mlp.gate_proj.weight"] = (inter, h)
        shapes[f"{p}.mlp.up_proj.weight"] = (inter, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not m["tied"]:
        shapes["lm_head.weight"] = (m["vocab"], h)
    return shapes


@st.composite
def models(draw) -> dict:
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    kv = draw(st.sampled_from([tp, 2 * tp] + [d for d in range(1, tp) if tp % d == 0]))
    heads = kv * draw(st.integers(1, 2)) * (tp // kv if kv < tp else 1)
    return dict(tp=tp, kv=kv, heads=heads, head_dim=draw(st.integers(1, 3)), hidden=draw(st.integers(1, 5)),
                inter=tp * draw(st.integers(1, 3)), vocab=draw(st.integers(1, 150)), layers=draw(st.integers(1, 2)),
                bias=draw(st.booleans()), tied=draw(st.booleans()), world=draw(st.integers(1, 5)),
                dtype=draw(st.sampled_from(["torch.float32", "torch.bfloat16"])), seed=draw(st.integers(0, 2**16)))


def random_full(shapes: dict, dtype: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kind = getattr(torch, dtype.removeprefix("torch."))
    return {n: torch.randn(s, generator=g).to(kind) for n, s in shapes.items()}


def local_shard(full: torch.Tensor, dim: int | None, world: int, rank: int) -> torch.Tensor:
    """What DTensor Shard(dim) / Replicate() leaves on `rank`: torch.chunk's piece, or none (0 rows)."""
    if dim is None:
        return full
    chunks = torch.chunk(full, world, dim=dim)
    return chunks[rank] if rank < len(chunks) else full.narrow(dim, full.shape[dim], 0)


def gather(locals_: list[dict[str, torch.Tensor]], dims: dict[str, int | None]) -> dict[str, torch.Tensor]:
    return {n: locals_[0][n] if d is None else torch.cat([rank[n] for rank in locals_], dim=d) for n, d in dims.items()}


def tp_slices(full: dict[str, torch.Tensor], m: dict, rank: int) -> dict[str, torch.Tensor]:
    """Engine rank `rank`'s tensors, sliced from the gathered model as SGLang's loaders slice them."""
    tp, kv, out = m["tp"], m["kv"], {}

    def kv_slice(t: torch.Tensor) -> torch.Tensor:  # kv heads split by tp, or each on tp / kv ranks
        return t.chunk(tp)[rank] if kv >= tp else t.chunk(kv)[rank * kv // tp]

    for name, t in full.items():
        if "_proj" in name and name.split(".")[-2] in ("k_proj", "v_proj", "up_proj"):
            continue
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            k, v = full[name.replace("q_proj", "k_proj")], full[name.replace("q_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = torch.cat([t.chunk(tp)[rank], kv_slice(k), kv_slice(v)])
        elif name.endswith("gate_proj.weight"):
            up = full[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t.chunk(tp)[rank], up.chunk(tp)[rank]])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = t.chunk(tp, dim=1)[rank]
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            pad_to = 64 if math.ceil(t.shape[0] / 64) * 64 % tp == 0 else 64 * tp
            padded = math.ceil(t.shape[0] / pad_to) * pad_to
            out[name] = torch.cat([t, t.new_zeros(padded - t.shape[0], t.shape[1])]).chunk(tp)[rank]
        else:
            out[name] = t
    return out


def push(source: SourcePlacement, engine: EngineLayout, locals_: list[dict], bucket_bytes: int, rng) -> dict:
    """Plan, check, write every piece from its rank's own shard into garbage-filled receive buffers
    (padding zeroed by the receiver), checksum every bucket on both sides."""
    layouts = [receive_layout(engine, r) for r in range(len(engine.ranks))]
    offsets = [byte_offsets(layout) for layout in layouts]
    pieces = plan(source, engine, offsets)
    check_plan(source, engine, offsets, pieces)
    buffers = [torch.from_numpy(rng.integers(0, 256, layout.total, dtype=np.uint8)) for layout in layouts]
    for r, buffer in enumerate(buffers):
        for offset, nbytes in padding_ranges(engine, r, offsets):
            buffer[offset : offset + nbytes] = 0
    for p in pieces:
        write_piece(buffers[p.dst_rank], p, piece_bytes(p, locals_[p.src_rank][p.src_name], source))
    buckets = [with_checksum(b, locals_[b.src_rank], source) for b in make_buckets(pieces, bucket_bytes)]
    assert [p for b in buckets for p in b.pieces] == pieces  # every piece in exactly one bucket, in order
    for b in buckets:
        assert b.checksum == receiver_checksum(buffers[b.dst_rank], b.ranges)
    for r in range(len(engine.ranks)):
        assert unverified_bytes([b.check() for b in buckets], engine, r) == 0
    return dict(pieces=pieces, buckets=buckets, buffers=buffers,
                tensors=[views(buf, layout) for buf, layout in zip(buffers, layouts, strict=True)])


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name


@FAST
@given(models(), st.integers(16, 600), st.integers(0, 2**16))
def test_fsdp_shards_into_full_and_tensor_parallel_engines_equal_gather_then_slice(m, bucket_bytes, seed):
    shapes = qwen2_shapes(m)
    full = random_full(shapes, m["dtype"], m["seed"])
    locals_ = [{n: local_shard(t, 0, m["world"], r) for n, t in full.items()} for r in range(m["world"])]
    source = SourcePlacement.fsdp_dim0(shapes, m["world"], m["dtype"])
    config = TPConfig(m["heads"], m["kv"], m["tied"])
    engine = EngineLayout.combine(EngineLayout.full(shapes, m["dtype"]),
                                  EngineLayout.tensor_parallel(shapes, m["tp"], config, m["dtype"]))

    out = push(source, engine, locals_, bucket_bytes, np.random.default_rng(seed))

    gathered = gather(locals_, dict.fromkeys(shapes, 0))
    assert_bitwise(out["tensors"][0], gathered)
    for rank in range(m["tp"]):
        assert_bitwise(out["tensors"][1 + rank], tp_slices(gathered, m, rank))


@FAST
@given(models(), st.data())
def test_any_1d_dtensor_placement_equals_gather_then_slice(m, data):
    shapes = qwen2_shapes(m)
    dims = {n: data.draw(st.sampled_from([None, *range(len(s))]), label=n) for n, s in shapes.items()}
    full = random_full(shapes, m["dtype"], m["seed"])
    locals_ = [{n: local_shard(t, dims[n], m["world"], r) for n, t in full.items()} for r in range(m["world"])]
    source = SourcePlacement.from_placements(shapes, m["world"], dims, m["dtype"])
    config = TPConfig(m["heads"], m["kv"], m["tied"])
    engine = EngineLayout.combine(EngineLayout.full(shapes, m["dtype"]),
                                  EngineLayout.tensor_parallel(shapes, m["tp"], config, m["dtype"]))

    out = push(source, engine, locals_, 1 << 10, np.random.default_rng(m["seed"]))

    gathered = gather(locals_, dims)
    assert_bitwise(out["tensors"][0], gathered)
    for rank in range(m["tp"]):
        assert_bitwise(out["tensors"][1 + rank], tp_slices(gathered, m, rank))


@FAST
@given(models(), st.data())
def test_a_corrupted_byte_fails_exactly_its_bucket(m, data):
    shapes = qwen2_shapes(m)
    full = random_full(shapes, m["dtype"], m["seed"])
    locals_ = [{n: local_shard(t, 0, m["world"], r) for n, t in full.items()} for r in range(m["world"])]
    source = SourcePlacement.fsdp_dim0(shapes, m["world"], m["dtype"])
    engine = EngineLayout.tensor_parallel(shapes, m["tp"], TPConfig(m["heads"], m["kv"], m["tied"]), m["dtype"])
    out = push(source, engine, locals_, 64, np.random.default_rng(m["seed"]))
    checks = [b.check() for b in out["buckets"]]
    assert all(bad_buckets(out["buffers"][r], [c for c in checks if c.dst_rank == r]) == [] for r in range(m["tp"]))

    victim = data.draw(st.integers(0, len(checks) - 1), label="bucket")
    offset, nbytes = checks[victim].ranges[data.draw(st.integers(0, len(checks[victim].ranges) - 1), label="range")]
    at = offset + data.draw(st.integers(0, nbytes - 1), label="byte")
    buffer = out["buffers"][checks[victim].dst_rank]
    buffer[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")

    mine = [c for c in checks if c.dst_rank == checks[victim].dst_rank]
    assert bad_buckets(buffer, mine) == [mine.index(checks[victim])]


def test_hand_written_two_ranks_tp2_qkv():
    """2 learner ranks (FSDP rows), an engine of TP=2, q 4x4 (4 heads of 1), k and v 2x4 (2 kv heads):
    engine rank r's fused 4x4 qkv_proj is q rows 2r..2r+1, k row r, v row r, all held by learner rank r."""
    shapes = {"l.q_proj.weight": (4, 4), "l.k_proj.weight": (2, 4), "l.v_proj.weight": (2, 4)}
    source = SourcePlacement.fsdp_dim0(shapes, 2, "torch.float32")
    engine = EngineLayout.tensor_parallel(shapes, 2, TPConfig(num_heads=4, num_kv_heads=2), "torch.float32")
    offsets = {"l.qkv_proj.weight": 0}

    pieces = plan(source, engine, offsets)

    assert [(p.src_rank, p.src_name, p.src_box, p.dst_rank, p.dst_offset, p.nbytes) for p in pieces] == [
        (0, "l.q_proj.weight", ((0, 2), (0, 4)), 0, 0, 32),
        (0, "l.k_proj.weight", ((0, 1), (0, 4)), 0, 32, 16),
        (0, "l.v_proj.weight", ((0, 1), (0, 4)), 0, 48, 16),
        (1, "l.q_proj.weight", ((2, 4), (0, 4)), 1, 0, 32),
        (1, "l.k_proj.weight", ((1, 2), (0, 4)), 1, 32, 16),
        (1, "l.v_proj.weight", ((1, 2), (0, 4)), 1, 48, 16),
    ]
    q, k, v = (torch.arange(math.prod(s), dtype=torch.float32).reshape(s) + 100 * i for i, s in
               enumerate(shapes.values()))
    locals_ = [{"l.q_proj.weight": q[2 * r : 2 * r + 2], "l.k_proj.weight": k[r : r + 1],
                "l.v_proj.weight": v[r : r + 1]} for r in range(2)]
    buffers = [np.zeros(64, dtype=np.uint8) for _ in range(2)]
    for p in pieces:
        write_piece(buffers[p.dst_rank], p, piece_bytes(p, locals_[p.src_rank][p.src_name], source))
    for r in range(2):
        got = torch.from_numpy(buffers[r]).view(torch.float32).reshape(4, 4)
        assert torch.equal(got, torch.cat([q[2 * r : 2 * r + 2], k[r : r + 1], v[r : r + 1]]))


def test_kv_heads_fewer_than_tp_are_replicated_on_consecutive_ranks():
    shapes = {"a.q_proj.weight": (4, 3), "a.k_proj.weight": (2, 3), "a.v_proj.weight": (2, 3)}
    engine = EngineLayout.tensor_parallel(shapes, 4, TPConfig(num_heads=4, num_kv_heads=2), "torch.float32")
    k_rows = [[s.src_box[0] for s in rank[0].segments if s.src_name == "a.k_proj.weight"] for rank in engine.ranks]
    assert k_rows == [[(0, 1)], [(0, 1)], [(1, 2)], [(1, 2)]]


@pytest.mark.parametrize("world", range(1, 7))
def test_fsdp_dim0_boxes_are_torch_chunk_and_dtensor_shard0(world):
    for rows in range(0, 14):
        source = SourcePlacement.fsdp_dim0({"w": (rows, 3)}, world, "torch.float32")
        chunks = torch.chunk(torch.arange(rows), world)
        for rank in range(world):
            size, offset = Shard.local_shard_size_and_offset(rows, world, rank)
            start, stop = source.params["w"].owned[rank][0]
            assert (stop - start, start) == (size, offset)
            assert list(range(start, stop)) == (chunks[rank].tolist() if rank < len(chunks) else [])


def test_row_parallel_slices_from_dim0_shards_are_one_write_per_rank_and_shard1_one_per_row():
    shapes = {"x.o_proj.weight": (6, 8)}
    rowwise = SourcePlacement.fsdp_dim0(shapes, 3, "torch.float32")
    engine = EngineLayout.tensor_parallel(shapes, 2, TPConfig(2, 2), "torch.float32")
    pieces = plan(rowwise, engine, {"x.o_proj.weight": 0})
    writes = [(p.src_rank, p.dst_rank, p.nbytes) for p in pieces]
    assert writes == [(r, e, 2 * 4 * 4) for r in range(3) for e in range(2)]  # 2 rows x 4 columns of fp32

    colwise = SourcePlacement.from_placements(shapes, 2, {"x.o_proj.weight": 1}, "torch.float32")
    pieces = plan(colwise, EngineLayout.full(shapes, "torch.float32"), {"x.o_proj.weight": 0})
    assert len(pieces) == 2 * 6 and {p.nbytes for p in pieces} == {4 * 4}


def test_replicated_parameters_are_spread_over_the_ranks_that_hold_them():
    shapes = {f"n{i}.norm.weight": (100,) for i in range(12)} | {"big": (1024, 1024)}
    source = SourcePlacement.from_placements(shapes, 4, dict.fromkeys(shapes), "torch.float32")
    pieces = plan(source, EngineLayout.full(shapes, "torch.float32"), byte_offsets(
        receive_layout(EngineLayout.full(shapes, "torch.float32"), 0)))
    sent = bytes_per_rank(pieces, 4)
    assert sum(sent) == (12 * 100 + 1024 * 1024) * 4
    assert max(sent) - min(sent) <= 400  # the big one cut in four, the norms one by one to the least loaded
    assert sorted(p.src_rank for p in pieces if p.src_name == "big") == [0, 1, 2, 3]


def test_tied_embeddings_send_no_lm_head_and_vocab_padding_is_zeroed_by_the_receiver():
    shapes = {"model.embed_tokens.weight": (70, 2), "lm_head.weight": (70, 2)}
    engine = EngineLayout.tensor_parallel(shapes, 2, TPConfig(2, 2, tie_word_embeddings=True), "torch.float32")
    assert [[t.name for t in rank] for rank in engine.ranks] == [["model.embed_tokens.weight"]] * 2
    assert [t.shape for rank in engine.ranks for t in rank] == [(64, 2), (64, 2)]  # 70 padded to 128
    offsets = byte_offsets(receive_layout(engine, 1))
    assert padding_ranges(engine, 1, offsets) == [(6 * 2 * 4, 58 * 2 * 4)]  # rank 1 holds rows 64..69


def test_a_tampered_plan_fails_check_plan():
    shapes = {"a.gate_proj.weight": (4, 3), "a.up_proj.weight": (4, 3)}
    source = SourcePlacement.fsdp_dim0(shapes, 2, "torch.float32")
    engine = EngineLayout.tensor_parallel(shapes, 2, TPConfig(2, 2), "torch.float32")
    offsets = {"a.gate_up_proj.weight": 128}
    pieces = plan(source, engine, offsets)
    check_plan(source, engine, offsets, pieces)
    first = pieces[0]
    for tampered in (pieces[1:], pieces + [first], [msgspec.structs.replace(first, src_rank=1)] + pieces[1:],
                     [msgspec.structs.replace(first, dst_offset=first.dst_offset + 4)] + pieces[1:]):
        with pytest.raises(PlacementError):
            check_plan(source, engine, offsets, tampered)


@pytest.mark.parametrize("make, message", [
    (lambda: EngineLayout.tensor_parallel({"m.rotary.inv_freq": (4,)}, 1, TPConfig(1, 1)), "m.rotary.inv_freq"),
    (lambda: EngineLayout.tensor_parallel({}, 2, TPConfig(3, 3)), "num_attention_heads 3"),
    (lambda: EngineLayout.tensor_parallel({"a.q_proj.weight": (2, 2)}, 1, TPConfig(2, 2)), "a.k_proj.weight"),
    (lambda: SourcePlacement.from_boxes({"w": (4,)}, 2, {"w": [((0, 2),), ((3, 4),)]}), "held by no rank"),
    (lambda: plan(SourcePlacement.fsdp_dim0({"w": (2,)}, 1, "torch.float32"),
                  EngineLayout.full({"w": (2,)}, "torch.bfloat16"), {"w": 0}), "travels as torch.float32"),
])
def test_bad_input_is_a_clear_error(make, message):
    with pytest.raises(PlacementError, match=message):
        make()


def test_a_local_shard_of_the_wrong_shape_or_dtype_is_refused():
    source = SourcePlacement.fsdp_dim0({"w": (5, 2)}, 2, "torch.bfloat16")
    pieces = plan(source, EngineLayout.full({"w": (5, 2)}), {"w": 0})
    with pytest.raises(PlacementError, match="cast it"):
        sender_checksum(make_buckets(pieces)[0], {"w": torch.zeros(3, 2)}, source)
