"""What each engine rank holds: its tensors, in its own naming, each assembled from boxes of the
learner's parameters.

`EngineLayout.full` is what receivers hold today: every parameter whole, under its own name, on one
rank. `EngineLayout.tensor_parallel` is the layout SGLang (and vLLM) give a Qwen2/Llama-style model
on `tp` ranks, read off SGLang 0.5.23's `QKVParallelLinear`, `MergedColumnParallelLinear`,
`RowParallelLinear` and `VocabParallelEmbedding` weight loaders; rank r holds:

* `*.qkv_proj.{weight,bias}`: its q rows, then its k rows, then its v rows (dim 0). q heads are split
  by tp. k/v heads are split by tp when num_kv_heads >= tp; otherwise each kv head is replicated on
  tp / num_kv_heads consecutive ranks (rank r holds head r // (tp / num_kv_heads)).
* `*.gate_up_proj.{weight,bias}`: its rows of gate, then its rows of up.
* `o_proj.weight`, `down_proj.weight`: row-parallel, columns [r*c, (r+1)*c) (dim 1); their biases whole.
* `embed_tokens.weight`, `lm_head.weight`: vocab-parallel rows. SGLang pads the vocab V to a
  multiple of 64 (of 64 * tp when that multiple is not divisible by tp); rank r's tensor has
  padded / tp rows, of which rows [r*per, (r+1)*per) that are below V come from the learner and
  the rest are padding. Padding is in no segment: no one writes it; the receiver keeps it zero (as
  SGLang's loader does, `fill_(0)`).
* norms (any name ending in `norm.weight` / `norm.bias`): whole on every rank.
* with tied embeddings, `lm_head.weight` is not a tensor of its own (SGLang's lm_head is
  embed_tokens); a learner parameter of that name is left out.

A dimension the layout splits must divide by tp (heads, intermediate size), as SGLang requires on GPU.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stages.weights.layout import Layout
from stages.weights.layout import plan as plan_layout
from stages.weights.reshard.boxes import Box, extents, inside, intersect, same_extents, volume, whole
from stages.weights.reshard.experts import ROUTERS, ExpertLayout, expert_tensors, is_expert
from stages.weights.reshard.placement import PlacementError, itemsize


@dataclass(frozen=True)
class Segment:
    """Box `src_box` of learner parameter `src_name` lands at `dst_box` of an engine tensor (`same_extents`: one
    expert of a stacked parameter may land in a tensor without its leading expert dimension)."""

    src_name: str
    src_box: Box
    dst_box: Box


@dataclass(frozen=True)
class EngineTensor:
    """An engine rank's tensor. Invariant (checked): segments lie inside it, never overlap, and carry
    boxes of equal extents; elements in no segment are padding, zero on the receiver."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        itemsize(self.dtype)
        for i, s in enumerate(self.segments):
            if not same_extents(s.src_box, s.dst_box) or not inside(s.dst_box, self.shape):
                raise PlacementError(f"engine tensor {self.name!r}: segment {s} does not fit {self.shape}")
            for other in self.segments[:i]:
                if volume(intersect(s.dst_box, other.dst_box)):
                    raise PlacementError(f"engine tensor {self.name!r}: segments {other} and {s} overlap")

    @property
    def nbytes(self) -> int:
        return volume(whole(self.shape)) * itemsize(self.dtype)

    @property
    def written_nbytes(self) -> int:
        """Bytes the learner writes (all but the padding)."""
        return sum(volume(s.dst_box) for s in self.segments) * itemsize(self.dtype)


@dataclass(frozen=True)
class TPConfig:
    """The model facts a tensor-parallel layout needs (`from_hf` reads them off a HF config)."""

    num_heads: int
    num_kv_heads: int
    tie_word_embeddings: bool = False
    vocab_padding: int = 64

    @classmethod
    def from_hf(cls, config: Any) -> TPConfig:
        heads = config.num_attention_heads
        return cls(heads, getattr(config, "num_key_value_heads", None) or heads,
                   bool(getattr(config, "tie_word_embeddings", False)))


@dataclass(frozen=True)
class EngineLayout:
    """`ranks[r]`: the tensors engine rank r holds, in its buffer's order. Several engines' layouts can
    be planned at once (`combine`): their ranks are numbered one after the other."""

    ranks: tuple[tuple[EngineTensor, ...], ...]

    @classmethod
    def full(cls, shapes: Mapping[str, Sequence[int]], dtype: str | Mapping[str, str] = "torch.bfloat16",
             experts: ExpertLayout | None = None) -> EngineLayout:
        """One rank holding every parameter whole, under its own name; with `experts`, `experts.ep` ranks
        holding every dense parameter whole and the experts as `experts` says (`reshard.experts`: blocks
        of whole experts, stacked or per expert)."""
        ranks = []
        for rank in range(experts.ep if experts else 1):
            tensors = []
            for name, shape in shapes.items():
                if experts is not None and is_expert(name):
                    tensors += _expert_tensors(name, shape, experts, experts.ep, rank, _dtype(dtype, name))
                    continue
                box = whole(shape)
                tensors.append(EngineTensor(name, tuple(shape), _dtype(dtype, name), (Segment(name, box, box),)))
            ranks.append(tuple(tensors))
        return cls(tuple(ranks))

    @classmethod
    def tensor_parallel(cls, shapes: Mapping[str, Sequence[int]], tp: int, config: TPConfig,
                        dtype: str | Mapping[str, str] = "torch.bfloat16",
                        experts: ExpertLayout | None = None) -> EngineLayout:
        """The layout of an SGLang engine of `tp` ranks (see the module docstring); its experts as
        `experts` says (default: TP-sharded experts, stacked under the learner's names)."""
        _check_heads(tp, config)
        experts = experts or ExpertLayout()
        ranks = []
        for rank in range(tp):
            tensors: dict[str, EngineTensor] = {}
            for name in shapes:
                if is_expert(name):
                    tensors |= {t.name: t for t in _expert_tensors(name, shapes[name], experts, tp, rank,
                                                                     _dtype(dtype, name))}
                    continue
                made = _tp_tensor(name, shapes, tp, rank, config)
                if made is not None and made[0] not in tensors:
                    dst_name, shape, segments = made
                    tensors[dst_name] = EngineTensor(dst_name, shape, _dtype(dtype, name), segments)
            ranks.append(tuple(tensors.values()))
        return cls(tuple(ranks))

    @classmethod
    def combine(cls, *layouts: EngineLayout) -> EngineLayout:
        return cls(tuple(rank for layout in layouts for rank in layout.ranks))

    def tensor(self, rank: int, name: str) -> EngineTensor:
        for t in self.ranks[rank]:
            if t.name == name:
                return t
        raise PlacementError(f"engine rank {rank} has no tensor {name!r}")


def _expert_tensors(name: str, shape: Sequence[int], experts: ExpertLayout, ranks: int, rank: int,
                    dtype: str) -> list[EngineTensor]:
    return [EngineTensor(dst, shape, dtype, tuple(Segment(name, src, box) for src, box in segments))
            for dst, shape, segments in expert_tensors(name, shape, experts, ranks, rank)]


def _dtype(dtype: str | Mapping[str, str], name: str) -> str:
    return dtype if isinstance(dtype, str) else dtype[name]


def _check_heads(tp: int, c: TPConfig) -> None:
    if tp < 1 or c.num_heads % tp:
        raise PlacementError(f"num_attention_heads {c.num_heads} does not divide by tp {tp}")
    kv_ok = c.num_kv_heads % tp == 0 if c.num_kv_heads >= tp else tp % c.num_kv_heads == 0
    if c.num_kv_heads < 1 or c.num_heads % c.num_kv_heads or not kv_ok:
        raise PlacementError(f"num_key_value_heads {c.num_kv_heads} neither divides by tp {tp} nor divides it "
                             f"(or does not divide num_attention_heads {c.num_heads})")


def _rows(shape: Sequence[int], start: int, stop: int) -> Box:
    return ((start, stop),) + whole(shape)[1:]


def _stack(shape: Sequence[int], parts: list[tuple[str, int, int]]) -> tuple[tuple[int, ...], tuple[Segment, ...]]:
    """Row ranges (name, start, stop) of learner parameters of one trailing shape, one after the other."""
    segments, at = [], 0
    for name, start, stop in parts:
        segments.append(Segment(name, _rows(shape, start, stop), _rows(shape, at, at + stop - start)))
        at += stop - start
    return (at, *shape[1:]), tuple(segments)


def _split(what: str, n: int, tp: int) -> int:
    if n % tp:
        raise PlacementError(f"{what} has {n} rows or columns, which do not divide by tp {tp}")
    return n // tp


def _qkv(prefix: str, kind: str, shapes: Mapping, tp: int, rank: int, c: TPConfig) -> tuple[list, Sequence[int]]:
    q, k, v = (_need(shapes, f"{prefix}.{p}_proj.{kind}") for p in "qkv")
    head_dim = _split(f"{prefix}.q_proj.{kind}", q[0], c.num_heads)
    if k[0] != c.num_kv_heads * head_dim or v[0] != k[0]:
        raise PlacementError(f"{prefix}.k_proj/v_proj.{kind} have {k[0]}/{v[0]} rows; "
                             f"{c.num_kv_heads} kv heads of {head_dim} make {c.num_kv_heads * head_dim}")
    qs = q[0] // tp
    ks = max(1, c.num_kv_heads // tp) * head_dim
    block = rank // max(1, tp // c.num_kv_heads)
    names = [f"{prefix}.{p}_proj.{kind}" for p in "qkv"]
    return [(names[0], rank * qs, (rank + 1) * qs), *((n, block * ks, (block + 1) * ks) for n in names[1:])], q


def _gate_up(prefix: str, kind: str, shapes: Mapping, tp: int, rank: int) -> tuple[list, Sequence[int]]:
    gate, up = (_need(shapes, f"{prefix}.{p}_proj.{kind}") for p in ("gate", "up"))
    if gate[0] != up[0]:
        raise PlacementError(f"{prefix}.gate_proj.{kind} has {gate[0]} rows, up_proj {up[0]}")
    rows = _split(f"{prefix}.gate_proj.{kind}", gate[0], tp)
    return [(f"{prefix}.{p}_proj.{kind}", rank * rows, (rank + 1) * rows) for p in ("gate", "up")], gate


def _need(shapes: Mapping, name: str) -> Sequence[int]:
    if name not in shapes:
        raise PlacementError(f"the learner has no parameter {name!r}, which a fused engine tensor needs")
    return shapes[name]


def vocab_rows(vocab: int, tp: int, rank: int, padding: int = 64) -> tuple[int, int, int]:
    """(start, stop, rows per rank): the vocab rows rank r of SGLang's VocabParallelEmbedding loads, and
    its padded partition size."""
    if -(-vocab // padding) * padding % tp:
        padding *= tp
    per = -(-vocab // padding) * padding // tp
    return min(rank * per, vocab), min((rank + 1) * per, vocab), per


_FUSED = re.compile(r"^(?P<prefix>.*)\.(?P<part>q|k|v|gate|up)_proj\.(?P<kind>weight|bias)$")
_ROW = re.compile(r"\.(o|down)_proj\.(?P<kind>weight|bias)$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")
_NORM = re.compile(r"norm\.(weight|bias)$")
Made = tuple[str, tuple[int, ...], tuple[Segment, ...]] | None


def _tp_tensor(name: str, shapes: Mapping, tp: int, rank: int, c: TPConfig) -> Made:
    """The engine tensor on `rank` that learner parameter `name` is (part of), or None (tied lm_head)."""
    shape = tuple(shapes[name])
    if m := _FUSED.search(name):
        prefix, part, kind = m["prefix"], m["part"], m["kind"]
        fused = "qkv_proj" if part in ("q", "k", "v") else "gate_up_proj"
        parts, first = _qkv(prefix, kind, shapes, tp, rank, c) if fused == "qkv_proj" else \
            _gate_up(prefix, kind, shapes, tp, rank)
        return (f"{prefix}.{fused}.{kind}", *_stack(first, parts))
    if (m := _ROW.search(name)) and m["kind"] == "weight":
        cols = _split(name, shape[1], tp)
        src = (whole(shape)[0], (rank * cols, (rank + 1) * cols), *whole(shape)[2:])
        return name, extents(src), (Segment(name, src, whole(extents(src))),)
    if _VOCAB.search(name):
        if name.endswith("lm_head.weight") and c.tie_word_embeddings:
            return None
        start, stop, per = vocab_rows(shape[0], tp, rank, c.vocab_padding)
        segments = (Segment(name, _rows(shape, start, stop), _rows(shape, 0, stop - start)),) if stop > start else ()
        return name, (per, *shape[1:]), segments
    if _ROW.search(name) or _NORM.search(name) or ROUTERS.search(name):
        return name, shape, (Segment(name, whole(shape), whole(shape)),)
    raise PlacementError(f"no tensor-parallel rule for learner parameter {name!r} (known: q/k/v/gate/up/o/down_proj, "
                         "embed_tokens, lm_head, *norm); push this model with EngineLayout.full")


def receive_layout(engine: EngineLayout, rank: int, version: int = 0, bucket_bytes: int = 32 << 20) -> Layout:
    """The receive buffer of engine rank `rank` as a `stages.weights.layout.Layout` (64-byte-aligned
    offsets, `views` over it): its tensors' offsets are the plan's `engine_byte_offsets`. Its own
    buckets are not the ones a sharded push verifies (those are `reshard.buckets`)."""
    tensors = {t.name: torch.empty(t.shape, dtype=_torch_dtype(t.dtype), device="meta") for t in engine.ranks[rank]}
    return plan_layout(version, tensors, bucket_bytes)


def byte_offsets(layout: Layout) -> dict[str, int]:
    return {e.name: e.offset for e in layout.tensors}


def _torch_dtype(dtype: str) -> torch.dtype:
    itemsize(dtype)
    return getattr(torch, dtype.removeprefix("torch."))

