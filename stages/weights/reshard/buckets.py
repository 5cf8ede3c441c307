"""Checksummed buckets of a plan's pieces, and the bytes a rank writes.

A bucket is the pieces one learner rank writes to one engine rank, consecutive in the plan, about
`bucket_bytes` in all (a larger piece is a bucket of its own). Its checksum is xxh3-64 over its
ranges' bytes in order, the way `stages.weights.layout` checksums a bucket (one streaming xxh3 over
the bytes, no gaps): the sender computes it from its local tensors (`sender_checksum`), the
receiver from its buffer (`receiver_checksum`), and the receiver applies a version only when every
`BucketCheck` it was sent matches and the checks cover every byte it expects (`bad_buckets`,
`unverified_bytes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import pairwise

import msgspec
import numpy as np
import torch
import xxhash

from stages.weights.reshard.engine import EngineLayout
from stages.weights.reshard.placement import PlacementError, SourcePlacement
from stages.weights.reshard.plan import Piece


class PieceBucket(msgspec.Struct, frozen=True):
    """Pieces `src_rank` writes to `dst_rank`, in order; `checksum` once computed (`with_checksum`)."""

    src_rank: int
    dst_rank: int
    pieces: tuple[Piece, ...]
    checksum: int = 0

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """(dst_offset, nbytes) of each piece, in order."""
        return tuple((p.dst_offset, p.nbytes) for p in self.pieces)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def check(self) -> BucketCheck:
        """What the receiver verifies, without the pieces."""
        return BucketCheck(self.src_rank, self.dst_rank, self.ranges, self.checksum)


class BucketCheck(msgspec.Struct, frozen=True):
    """The ranges (offset, nbytes) of a receive buffer one learner rank wrote, in order, and their xxh3-64."""

    src_rank: int
    dst_rank: int
    ranges: tuple[tuple[int, int], ...]
    checksum: int


def make_buckets(pieces: Sequence[Piece], bucket_bytes: int = 32 << 20) -> list[PieceBucket]:
    """The plan's pieces (ordered by src_rank, dst_rank, dst_offset, as `plan` returns them) in buckets
    of at most about `bucket_bytes`, each for one (src_rank, dst_rank) pair. Every piece is in exactly one."""
    buckets: list[PieceBucket] = []
    current: list[Piece] = []
    size = 0
    for p in pieces:
        same = current and (current[0].src_rank, current[0].dst_rank) == (p.src_rank, p.dst_rank)
        if current and (not same or size + p.nbytes > bucket_bytes):
            buckets.append(PieceBucket(current[0].src_rank, current[0].dst_rank, tuple(current)))
            current, size = [], 0
        current.append(p)
        size += p.nbytes
    if current:
        buckets.append(PieceBucket(current[0].src_rank, current[0].dst_rank, tuple(current)))
    return buckets


def materialise(piece: Piece, local: torch.Tensor, source: SourcePlacement) -> torch.Tensor:
    """The piece's elements from its rank's local tensor, contiguous: the bytes to write."""
    source.check_local(piece.src_rank, piece.src_name, local)
    origin = source.origin(piece.src_rank, piece.src_name)
    index = tuple(slice(a - o, b - o) for (a, b), o in zip(piece.src_box, origin, strict=True))
    return local[index].contiguous()


def piece_bytes(piece: Piece, local: torch.Tensor, source: SourcePlacement) -> np.ndarray:
    """`materialise` as a uint8 array of `piece.nbytes` (on the CPU)."""
    data = materialise(piece, local, source).cpu().reshape(-1).view(torch.uint8).numpy()
    if data.nbytes != piece.nbytes:
        raise PlacementError(f"{piece}: materialised {data.nbytes} bytes")
    return data


def sender_checksum(bucket: PieceBucket, locals_: Mapping[str, torch.Tensor], source: SourcePlacement) -> int:
    """xxh3-64 of the bucket's bytes, from `src_rank`'s own local tensors (name -> local shard)."""
    h = xxhash.xxh3_64()
    for p in bucket.pieces:
        h.update(piece_bytes(p, locals_[p.src_name], source))
    return h.intdigest()


def with_checksum(bucket: PieceBucket, locals_: Mapping[str, torch.Tensor], source: SourcePlacement) -> PieceBucket:
    return msgspec.structs.replace(bucket, checksum=sender_checksum(bucket, locals_, source))


def receiver_checksum(buffer: np.ndarray | torch.Tensor, ranges: Sequence[tuple[int, int]]) -> int:
    """xxh3-64 of `ranges` of a receive buffer (uint8), in order."""
    data = buffer.numpy() if isinstance(buffer, torch.Tensor) else buffer
    h = xxhash.xxh3_64()
    for offset, nbytes in ranges:
        if offset < 0 or offset + nbytes > data.nbytes:
            raise PlacementError(f"range [{offset}, {offset + nbytes}) lies outside a buffer of {data.nbytes} bytes")
        h.update(data[offset : offset + nbytes])
    return h.intdigest()


def bad_buckets(buffer: np.ndarray | torch.Tensor, checks: Sequence[BucketCheck]) -> list[int]:
    """Indexes of the checks whose ranges in `buffer` do not hash to their checksum."""
    return [i for i, c in enumerate(checks) if receiver_checksum(buffer, c.ranges) != c.checksum]


def unverified_bytes(checks: Sequence[BucketCheck], engine: EngineLayout, rank: int) -> int:
    """Bytes engine rank `rank` expects (its tensors' non-padding bytes) minus those the checks cover;
    nonzero (or overlapping checks, an error) means some bytes would be applied unverified."""
    spans = sorted((o, o + n) for c in checks if c.dst_rank == rank for o, n in c.ranges)
    for (a, b), (c, _) in pairwise(spans):
        if c < b:
            raise PlacementError(f"engine rank {rank}: checked ranges [{a}, {b}) and [{c}, ...) overlap")
    return sum(t.written_nbytes for t in engine.ranks[rank]) - sum(b - a for a, b in spans)


def write_piece(buffer: np.ndarray | torch.Tensor, piece: Piece, data: np.ndarray) -> None:
    """Put a piece's bytes into a receive buffer (what a one-sided write does; for transports without one
    and for tests)."""
    target = buffer.numpy() if isinstance(buffer, torch.Tensor) else buffer
    target[piece.dst_offset : piece.dst_offset + piece.nbytes] = data
