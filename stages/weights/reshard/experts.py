"""Mixture-of-experts weights in the transfer plan: where the learner's experts are, and how an engine's
ranks hold them.

The learner keeps each MoE layer's experts FUSED (transformers 5): `<p>.mlp.experts.gate_up_proj`
[E, 2I, H] (each expert's I gate rows, then its I up rows) and `<p>.mlp.experts.down_proj` [E, H, I].
Its ranks hold them whole, FSDP2's `Shard(0)` rows, or expert-parallel: `expert_parallel_source`
(`expert_source_boxes`: `ep` blocks of E / ep consecutive experts, learner rank r holding block r % ep,
the dense parameters FSDP2's rows).

An engine's ranks hold them as `ExpertLayout` says (`expert_tensors`, used by `EngineLayout.full` and
`EngineLayout.tensor_parallel`). Of an engine of `n` ranks (n = tp for a tensor-parallel engine), `ep`
blocks of experts are spread over rank groups of `n / ep` (`moe_tp`) consecutive ranks, as SGLang's
`--ep-size` groups them (moe_ep_rank = rank // moe_tp, moe_tp_rank = rank % moe_tp): rank r holds
experts [b E/ep, (b+1) E/ep) for b = r // moe_tp and, of each, the intermediate slice t = r % moe_tp
as FusedMoE shards it with TP: gate rows [t I/moe_tp, (t+1) I/moe_tp), the same up rows, and down_proj's
columns. ep = 1: every rank holds every expert (TP-sharded experts); moe_tp = 1: whole experts
(EP-sharded); both 1: the experts whole. In either weight format:

* **stacked** (`per_expert=False`): one tensor per layer and kind under the learner's own names,
  `gate_up_proj` [E/ep, 2I/moe_tp, H] (the rank's gate rows, then its up rows, per expert: SGLang's
  `w13_weight`) and `down_proj` [E/ep, H, I/moe_tp] (`w2_weight`);
* **per expert** (`per_expert=True`): `<p>.mlp.experts.{e}.gate_proj.weight` [I/moe_tp, H],
  `up_proj.weight` [I/moe_tp, H] and `down_proj.weight` [H, I/moe_tp] for each global expert id e the
  rank holds (the names `save_pretrained` writes and SGLang's and vLLM's loaders take).

A split that does not divide (experts by ep, intermediate size by moe_tp, ranks by ep) is a
PlacementError naming it. Pure integer arithmetic: nothing here touches tensor data.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from stages.weights.reshard.boxes import Box, chunk, extents, whole
from stages.weights.reshard.placement import PlacementError, SourcePlacement, shard_boxes

FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<part>gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")
# dense MoE parameters every engine rank holds whole: the router, Qwen2-MoE's shared-expert gate
ROUTERS = re.compile(r"\.mlp\.(gate|shared_expert_gate)\.weight$")


def expert_name(prefix: str, expert: int, part: str) -> str:
    """The per-expert name of `part` (gate_proj, up_proj, down_proj) of expert `expert` of layer `prefix`
    (`<p>.mlp.experts`)."""
    return f"{prefix}.{expert}.{part}.weight"


@dataclass(frozen=True)
class ExpertLayout:
    """How an engine's ranks hold the experts (see the module docstring): `ep` blocks of experts, each on
    `ranks / ep` ranks that split its intermediate dim; `per_expert` names, or stacked tensors."""

    ep: int = 1
    per_expert: bool = False

    def grid(self, ranks: int) -> tuple[int, int]:
        """(ep, moe_tp) of an engine of `ranks` ranks."""
        if self.ep < 1 or ranks % self.ep:
            raise PlacementError(f"an expert-parallel degree of {self.ep} does not divide the engine's {ranks} ranks")
        return self.ep, ranks // self.ep


def is_expert(name: str) -> bool:
    return FUSED_EXPERTS.match(name) is not None


def expert_source_boxes(shape: Sequence[int], world_size: int, ep: int, name: str = "experts") -> tuple[Box, ...]:
    """The boxes of a fused expert parameter `shape` [E, ...] on `world_size` learner ranks of which
    `ep` hold distinct blocks of E / ep experts: rank r holds block r % ep (a (replicas, ep) mesh)."""
    if ep < 1 or world_size % ep or shape[0] % ep:
        raise PlacementError(f"{name}: an expert-parallel degree of {ep} must divide the {shape[0]} experts and "
                             f"the learner's {world_size} ranks")
    full = whole(shape)
    return tuple((chunk(shape[0], ep, r % ep),) + full[1:] for r in range(world_size))


def expert_tensors(name: str, shape: Sequence[int], layout: ExpertLayout, ranks: int, rank: int
                   ) -> list[tuple[str, tuple[int, ...], tuple[tuple[Box, Box], ...]]]:
    """The engine tensors on `rank` (of `ranks`) that fused learner parameter `name` [E, ...] becomes:
    (engine name, shape, ((learner box, engine box), ...)) each."""
    match = FUSED_EXPERTS.match(name)
    if match is None or len(shape) != 3:
        raise PlacementError(f"{name!r} of shape {tuple(shape)} is not a fused expert tensor [experts, out, in]")
    prefix, part = match["prefix"], match["part"]
    ep, moe_tp = layout.grid(ranks)
    experts, hidden = shape[0], shape[1] if part == "down_proj" else shape[2]
    inter = shape[2] if part == "down_proj" else _halves(name, shape[1])
    if experts % ep or inter % moe_tp:
        raise PlacementError(f"{name!r}: {experts} experts over ep {ep} and an intermediate size of {inter} over "
                             f"{moe_tp} ranks per expert block must divide evenly")
    first, last = chunk(experts, ep, rank // moe_tp)
    cols = ((rank % moe_tp) * inter // moe_tp, (rank % moe_tp + 1) * inter // moe_tp)
    width = cols[1] - cols[0]
    if part == "down_proj":
        parts = {"down_proj": ((0, hidden), cols)}
    else:
        parts = {"gate_proj": (cols, (0, hidden)), "up_proj": ((inter + cols[0], inter + cols[1]), (0, hidden))}
    if layout.per_expert:
        return [(expert_name(prefix, e, kind), extents(box), ((((e, e + 1), *box), whole(extents(box))),))
                for e in range(first, last) for kind, box in parts.items()]
    block = (first, last)
    if part == "down_proj":
        down = ((block, *parts["down_proj"]), ((0, last - first), (0, hidden), (0, width)))
        return [(name, (last - first, hidden, width), (down,))]
    segments = tuple(((block, *box), ((0, last - first), (i * width, (i + 1) * width), (0, hidden)))
                     for i, box in enumerate(parts.values()))
    return [(name, (last - first, 2 * width, hidden), segments)]


def _halves(name: str, rows: int) -> int:
    if rows % 2:
        raise PlacementError(f"{name!r} has {rows} rows per expert: its gate and up rows do not split in two")
    return rows // 2



def expert_parallel_source(shapes: Mapping[str, Sequence[int]], world_size: int, ep: int,
                           dtype: str | Mapping[str, str] = "torch.bfloat16") -> SourcePlacement:
    """The learner's placement with `ep`-way expert parallelism: every fused expert parameter in blocks of
    experts (`expert_source_boxes`), every other parameter FSDP2's `Shard(0)` rows over all ranks. At
    ep = world_size, with experts dividing by it, this is `SourcePlacement.fsdp_dim0` (what
    `stages.learner.experts` places: `Shard(0)` on the learner's mesh)."""
    boxes = {name: expert_source_boxes(shape, world_size, ep, name) if is_expert(name)
             else shard_boxes(shape, 0, world_size) for name, shape in shapes.items()}
    return SourcePlacement.from_boxes(shapes, world_size, boxes, dtype)
