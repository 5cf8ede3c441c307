"""The transfer plan: which learner rank writes which bytes where, so that no rank ever gathers the model.

`plan(source, engine, engine_byte_offsets)` lists `Piece`s. A piece is one write: rank `src_rank`
materialises `src_box` of parameter `src_name` from its own local tensor
(`local[box - origin].contiguous()`, `reshard.buckets.materialise`) and writes its `nbytes` at
`dst_offset` of engine rank `dst_rank`'s receive buffer, where they are contiguous (row-major) in
tensor `dst_name`. A region that is not contiguous in the destination is cut into the fewest runs
that are (a `Shard(1)` source into a whole tensor: one run per row; a row-parallel slice from
`Shard(0)` rows: one run per rank).

Invariants (`check_plan` asserts them; the tests check it on random layouts): every destination
byte that some segment covers is written exactly once, by a piece whose source box lies in its
rank's box; padding is written by no piece. Where several ranks hold a region (`Replicate`), one
rank writes each byte: the one that has been given the fewest bytes so far (ties: the lowest rank),
and a replicated region of `split_bytes` or more is cut by rows over the ranks holding it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import pairwise

import msgspec

from stages.weights.reshard.boxes import Box, contains, contiguous_runs, grid, move, row_major_offset, volume, whole
from stages.weights.reshard.engine import EngineLayout, EngineTensor, Segment
from stages.weights.reshard.placement import PlacementError, SourcePlacement, itemsize


class Piece(msgspec.Struct, frozen=True):
    """One write of `nbytes` from `src_rank` (box `src_box`, global coordinates, of `src_name`) to byte
    `dst_offset` of engine rank `dst_rank`'s receive buffer (inside tensor `dst_name`)."""

    src_rank: int
    src_name: str
    src_box: tuple[tuple[int, int], ...]
    dst_rank: int
    dst_name: str
    dst_offset: int
    nbytes: int


Offsets = Mapping[str, int] | Sequence[Mapping[str, int]]


def _offsets_of(offsets: Offsets, rank: int) -> Mapping[str, int]:
    return offsets if isinstance(offsets, Mapping) else offsets[rank]


def _base(offsets: Offsets, rank: int, tensor: EngineTensor) -> int:
    found = _offsets_of(offsets, rank).get(tensor.name)
    if found is None:
        raise PlacementError(f"engine rank {rank}'s byte offsets have no tensor {tensor.name!r}")
    return found


def plan(source: SourcePlacement, engine: EngineLayout, engine_byte_offsets: Offsets,
         split_bytes: int = 1 << 20) -> list[Piece]:
    """Every write of one version, ordered by (src_rank, dst_rank, dst_offset). `engine_byte_offsets`:
    tensor name -> byte offset in the receive buffer, one mapping for every engine rank or one per
    rank (`engine.byte_offsets(engine.receive_layout(...))`)."""
    load = [0] * source.world_size
    pieces: list[Piece] = []
    for rank, tensors in enumerate(engine.ranks):
        for tensor in tensors:
            base = _base(engine_byte_offsets, rank, tensor)
            for seg in tensor.segments:
                param = source.param(seg.src_name)
                if param.dtype != tensor.dtype:
                    raise PlacementError(f"learner parameter {seg.src_name!r} travels as {param.dtype}; engine "
                                         f"tensor {tensor.name!r} is {tensor.dtype}")
                for cell, owners in grid(seg.src_box, param.owned):
                    if not owners:
                        raise PlacementError(f"region {cell} of {seg.src_name!r} is held by no learner rank")
                    for src_rank, box in _assign(cell, owners, load, itemsize(tensor.dtype), split_bytes):
                        pieces += _runs(src_rank, box, seg, rank, tensor, base)
    return sorted(pieces, key=lambda p: (p.src_rank, p.dst_rank, p.dst_offset))


def _assign(cell: Box, owners: tuple[int, ...], load: list[int], size: int, split_bytes: int) -> list[tuple[int, Box]]:
    """Who writes `cell`: its one owner, else the least loaded owners, the cell cut by rows among
    them when it is `split_bytes` or more."""
    parts = [cell]
    if len(owners) > 1 and cell and volume(cell) * size >= split_bytes:
        (start, stop), rest = cell[0], cell[1:]
        n = min(len(owners), stop - start)
        cuts = [start + (stop - start) * i // n for i in range(n + 1)]
        parts = [((a, b), *rest) for a, b in pairwise(cuts)]
    chosen, free = [], list(owners)
    for part in parts:
        rank = min(free, key=lambda r: (load[r], r))
        free.remove(rank)
        load[rank] += volume(part) * size
        chosen.append((rank, part))
    return chosen


def _runs(src_rank: int, box: Box, seg: Segment, dst_rank: int, tensor: EngineTensor, base: int) -> list[Piece]:
    size = itemsize(tensor.dtype)
    pieces = []
    for run in contiguous_runs(move(box, seg.src_box, seg.dst_box), tensor.shape):
        offset = base + row_major_offset([a for a, _ in run], tensor.shape) * size
        src = move(run, seg.dst_box, seg.src_box)
        pieces.append(Piece(src_rank, seg.src_name, src, dst_rank, tensor.name, offset, volume(run) * size))
    return pieces


def bytes_per_rank(pieces: Sequence[Piece], world_size: int) -> list[int]:
    """Bytes each learner rank sends under the plan."""
    sent = [0] * world_size
    for p in pieces:
        sent[p.src_rank] += p.nbytes
    return sent


def check_plan(source: SourcePlacement, engine: EngineLayout, engine_byte_offsets: Offsets,
               pieces: Sequence[Piece]) -> None:
    """Raise PlacementError unless: every piece reads inside its rank's box, lands where its segment
    says, contiguous in its tensor; no two pieces overlap in a receive buffer; and the pieces into each
    tensor carry exactly its segments' bytes (so every non-padding byte is written exactly once)."""
    written: dict[tuple[int, str], int] = {}
    spans: dict[int, list[tuple[int, int]]] = {}
    for p in pieces:
        tensor = engine.tensor(p.dst_rank, p.dst_name)
        _check_piece(source, tensor, _base(engine_byte_offsets, p.dst_rank, tensor), p)
        written[p.dst_rank, p.dst_name] = written.get((p.dst_rank, p.dst_name), 0) + p.nbytes
        spans.setdefault(p.dst_rank, []).append((p.dst_offset, p.dst_offset + p.nbytes))
    for rank, ranges in spans.items():
        ranges.sort()
        for (a, b), (c, _) in pairwise(ranges):
            if c < b:
                raise PlacementError(f"engine rank {rank}: writes [{a}, {b}) and [{c}, ...) overlap")
    for rank, tensors in enumerate(engine.ranks):
        for t in tensors:
            if written.get((rank, t.name), 0) != t.written_nbytes:
                raise PlacementError(f"engine rank {rank} tensor {t.name!r}: {written.get((rank, t.name), 0)} "
                                     f"bytes written, {t.written_nbytes} expected")


def _check_piece(source: SourcePlacement, tensor: EngineTensor, base: int, p: Piece) -> None:
    param = source.param(p.src_name)
    if not 0 <= p.src_rank < source.world_size or not contains(param.owned[p.src_rank], p.src_box):
        raise PlacementError(f"{p}: rank {p.src_rank} does not hold that box of {p.src_name!r}")
    size = itemsize(tensor.dtype)
    if p.nbytes != volume(p.src_box) * size or p.nbytes == 0:
        raise PlacementError(f"{p}: {p.nbytes} bytes for a box of {volume(p.src_box)} elements of {size} bytes")
    for seg in tensor.segments:
        if seg.src_name == p.src_name and contains(seg.src_box, p.src_box):
            dst = move(p.src_box, seg.src_box, seg.dst_box)
            if contiguous_runs(dst, tensor.shape) != [dst]:
                raise PlacementError(f"{p}: its region {dst} of {tensor.name!r} is not contiguous")
            if p.dst_offset != base + row_major_offset([a for a, _ in dst], tensor.shape) * size:
                raise PlacementError(f"{p}: lands at the wrong offset of {tensor.name!r}")
            return
    raise PlacementError(f"{p}: no segment of engine tensor {tensor.name!r} takes that box of {p.src_name!r}")


def padding_ranges(engine: EngineLayout, rank: int, engine_byte_offsets: Offsets) -> list[tuple[int, int]]:
    """(offset, nbytes) of the bytes of engine rank `rank`'s receive buffer that no piece writes (the
    vocab padding): the receiver zeroes them once, when it allocates the buffer."""
    ranges = []
    for tensor in engine.ranks[rank]:
        base, size = _base(engine_byte_offsets, rank, tensor), itemsize(tensor.dtype)
        for cell, owners in grid(whole(tensor.shape), [s.dst_box for s in tensor.segments]):
            if not owners:
                ranges += [(base + row_major_offset([a for a, _ in run], tensor.shape) * size, volume(run) * size)
                           for run in contiguous_runs(cell, tensor.shape)]
    return sorted(ranges)
