"""Where the learner's parameters live: for each parameter, the box of it each rank holds.

A rank's local tensor for a parameter (FSDP2: `param.to_local()`, cast to the dtype the engines
receive) is exactly its box: element `i` of the box is `local[i - origin]`, origin being the box's
start. A rank holding nothing of a parameter has a box of volume 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from stages.weights.layout import DTYPES
from stages.weights.reshard.boxes import Box, chunk, extents, grid, inside, volume, whole


class PlacementError(ValueError):
    """A placement, engine layout or plan that does not check out; the message names the parameter."""


def itemsize(dtype: str) -> int:
    if dtype not in DTYPES:
        raise PlacementError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype].itemsize


@dataclass(frozen=True)
class ParamPlacement:
    """One parameter: its global shape, the dtype its bytes travel in, and `owned[rank]`, the box each
    rank holds (boxes may overlap: a replicated region is held by several ranks)."""

    shape: tuple[int, ...]
    dtype: str
    owned: tuple[Box, ...]


def shard_boxes(shape: Sequence[int], dim: int, world_size: int) -> tuple[Box, ...]:
    """The boxes of DTensor `Shard(dim)` on a 1-D mesh of `world_size` (torch.chunk rows along `dim`;
    FSDP2's `fully_shard` uses `Shard(0)`)."""
    full = whole(shape)
    return tuple(full[:dim] + (chunk(shape[dim], world_size, r),) + full[dim + 1 :] for r in range(world_size))


def replicate_boxes(shape: Sequence[int], world_size: int) -> tuple[Box, ...]:
    """The boxes of DTensor `Replicate()`: every rank holds the whole parameter."""
    return (whole(shape),) * world_size


@dataclass(frozen=True)
class SourcePlacement:
    """The learner's parameters (in order) over `world_size` ranks. Invariant (checked when made):
    every element of every parameter is held by at least one rank, and every box lies inside its
    parameter."""

    world_size: int
    params: Mapping[str, ParamPlacement]

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise PlacementError(f"world_size is {self.world_size}; it must be at least 1")
        for name, p in self.params.items():
            itemsize(p.dtype)
            if len(p.owned) != self.world_size:
                raise PlacementError(f"parameter {name!r} has {len(p.owned)} boxes for {self.world_size} ranks")
            for rank, box in enumerate(p.owned):
                if volume(box) and not inside(box, p.shape):
                    raise PlacementError(f"parameter {name!r}: rank {rank}'s box {box} is outside {p.shape}")
            orphans = [cell for cell, owners in grid(whole(p.shape), p.owned) if not owners]
            if orphans:
                raise PlacementError(f"parameter {name!r}: region {orphans[0]} is held by no rank")

    @classmethod
    def fsdp_dim0(cls, shapes: Mapping[str, Sequence[int]], world_size: int,
                  dtype: str | Mapping[str, str] = "torch.bfloat16") -> SourcePlacement:
        """FSDP2 (`fully_shard`): every parameter `Shard(0)`, rank r holding rows chunk(n, N, r)."""
        return cls.from_placements(shapes, world_size, dict.fromkeys(shapes, 0), dtype)

    @classmethod
    def from_placements(cls, shapes: Mapping[str, Sequence[int]], world_size: int,
                        placements: Mapping[str, int | None],
                        dtype: str | Mapping[str, str] = "torch.bfloat16") -> SourcePlacement:
        """Any DTensor placement on a 1-D mesh: `placements[name]` is d for `Shard(d)`, None for
        `Replicate()` (read them off a DTensor: `p.placements[0].dim`, or None when replicated)."""
        boxes = {}
        for name, shape in shapes.items():
            dim = placements.get(name, "missing")
            if dim == "missing":
                raise PlacementError(f"parameter {name!r} has no placement (give Shard's dim, or None)")
            if dim is not None and not 0 <= dim < len(shape):
                raise PlacementError(f"parameter {name!r} of shape {tuple(shape)} cannot be Shard({dim})")
            boxes[name] = replicate_boxes(shape, world_size) if dim is None else shard_boxes(shape, dim, world_size)
        return cls.from_boxes(shapes, world_size, boxes, dtype)

    @classmethod
    def from_boxes(cls, shapes: Mapping[str, Sequence[int]], world_size: int,
                   boxes: Mapping[str, Sequence[Box]],
                   dtype: str | Mapping[str, str] = "torch.bfloat16") -> SourcePlacement:
        """The general form: `boxes[name][rank]` is the box rank holds (volume 0: nothing)."""
        params = {}
        for name, shape in shapes.items():
            kind = dtype if isinstance(dtype, str) else dtype[name]
            owned = tuple(tuple((int(a), int(b)) for a, b in box) for box in boxes[name])
            params[name] = ParamPlacement(tuple(int(n) for n in shape), kind, owned)
        return cls(world_size, params)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: p.shape for name, p in self.params.items()}

    @property
    def dtypes(self) -> dict[str, str]:
        return {name: p.dtype for name, p in self.params.items()}

    def param(self, name: str) -> ParamPlacement:
        if name not in self.params:
            raise PlacementError(f"the learner has no parameter {name!r}")
        return self.params[name]

    def origin(self, rank: int, name: str) -> tuple[int, ...]:
        """Global index of element 0 of `rank`'s local tensor of `name`."""
        return tuple(a for a, _ in self.param(name).owned[rank])

    def local_shape(self, rank: int, name: str) -> tuple[int, ...]:
        return extents(self.param(name).owned[rank])

    def check_local(self, rank: int, name: str, local: torch.Tensor) -> None:
        """A clear error when a rank's local tensor is not what the placement says it holds."""
        p = self.param(name)
        if tuple(local.shape) != self.local_shape(rank, name) or str(local.dtype) != p.dtype:
            raise PlacementError(f"rank {rank}'s local {name!r} is {tuple(local.shape)} {local.dtype}; the "
                                 f"placement says {self.local_shape(rank, name)} {p.dtype} (cast it to the "
                                 "engines' dtype before sending)")
