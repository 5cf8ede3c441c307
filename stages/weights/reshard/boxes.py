"""Boxes: axis-aligned regions of a tensor, one [start, stop) range per dimension, in global coordinates.

A box of a 0-d tensor is the empty tuple (one element). Every function here is pure integer
arithmetic; nothing touches tensor data.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

Range = tuple[int, int]
Box = tuple[Range, ...]


def whole(shape: Sequence[int]) -> Box:
    """The box covering a tensor of `shape`."""
    return tuple((0, int(n)) for n in shape)


def extents(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def volume(box: Box) -> int:
    """Elements in `box` (1 for a 0-d box, 0 when any range is empty)."""
    return math.prod(max(0, b - a) for a, b in box)


def intersect(a: Box, b: Box) -> Box:
    """The overlap of two boxes of one tensor (a box of volume 0 when they do not overlap)."""
    return tuple((max(x0, y0), max(max(x0, y0), min(x1, y1))) for (x0, x1), (y0, y1) in zip(a, b, strict=True))


def contains(outer: Box, inner: Box) -> bool:
    if len(outer) != len(inner):
        return False
    return all(o0 <= i0 <= i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def inside(box: Box, shape: Sequence[int]) -> bool:
    """`box` is a well-formed region of a tensor of `shape`."""
    return contains(whole(shape), box)


def same_extents(source: Box, target: Box) -> bool:
    """`source` and `target` hold the same elements in the same order: equal extents, except that the
    longer one may have leading dimensions of extent 1 the other lacks (one expert of a stacked
    [experts, ...] parameter is a tensor of its own on an engine that takes experts one by one)."""
    lead = len(source) - len(target)
    longer, shorter = (source, target) if lead >= 0 else (target, source)
    dims = extents(longer)
    return all(n == 1 for n in dims[: abs(lead)]) and dims[abs(lead):] == extents(shorter)


def move(box: Box, source: Box, target: Box) -> Box:
    """`box`, a region of `source`, carried to the same place in `target` (`same_extents`: leading
    unit dimensions that one of them lacks are dropped from, or taken from `target` into, the result)."""
    lead = len(source) - len(target)
    if lead > 0:
        box, source = box[lead:], source[lead:]
    elif lead < 0:
        box, target = target[:-lead] + box, target
        source = target[:-lead] + source
    return tuple((a - s + t, b - s + t) for (a, b), (s, _), (t, _) in zip(box, source, target, strict=True))


def chunk(n: int, parts: int, index: int) -> Range:
    """The rows [start, stop) that chunk `index` of `parts` gets out of `n` rows, as `torch.chunk` cuts
    them and DTensor's `Shard` places them (`Shard.local_shard_size_and_offset`): every chunk but the
    last non-empty ones holds ceil(n / parts) rows, the last ranks fewer, possibly none (their range
    is empty and starts at n)."""
    size = -(-n // parts)
    return min(n, index * size), min(n, (index + 1) * size)


def row_major_offset(index: Sequence[int], shape: Sequence[int]) -> int:
    """Element offset of `index` in a contiguous tensor of `shape`."""
    offset = 0
    for i, n in zip(index, shape, strict=True):
        offset = offset * n + i
    return offset


def contiguous_runs(box: Box, shape: Sequence[int]) -> list[Box]:
    """`box` of a contiguous tensor of `shape` cut into the fewest sub-boxes each contiguous in memory,
    in memory order: the innermost dimensions the box spans fully join the run, the first one it
    covers partly bounds it, and every dimension outside that one is taken one index at a time."""
    if volume(box) == 0:
        return []
    if not box:
        return [box]
    split = len(box) - 1
    while split > 0 and box[split] == (0, shape[split]):
        split -= 1
    outer = [range(a, b) for a, b in box[:split]]
    return [tuple((i, i + 1) for i in index) + box[split:] for index in itertools.product(*outer)]


def grid(region: Box, boxes: Sequence[Box]) -> list[tuple[Box, tuple[int, ...]]]:
    """`region` cut along every edge of `boxes` that falls inside it: each cell with the indexes of the
    boxes holding all of it (a cell is either inside a box or outside it, never across its edge).
    Cells of volume 0 are left out. On a 1-D mesh the boxes of one tensor differ along one dimension
    at most, so the grid has at most one cell per box there."""
    live = [(i, box) for i, box in enumerate(boxes) if volume(intersect(box, region))]
    cuts = []
    for d, (start, stop) in enumerate(region):
        edges = {start, stop} | {e for _, box in live for e in box[d] if start < e < stop}
        cuts.append(list(itertools.pairwise(sorted(edges))))
    return [(cell, tuple(i for i, box in live if contains(box, cell))) for cell in itertools.product(*cuts)]
