"""`mooncake_p2p` from a sharded learner: every rank writes its own rows into the engines' receive slots.

No rank gathers the model. The transfer plan (`stages.weights.reshard`), made once per run from the
parameters' global shapes and placements, says which bytes of which parameter each learner rank holds
(read off its DTensor: FSDP2's `Shard(0)` rows, an expert-parallel layer's block of experts, a
replicated parameter held whole by every rank: `shard_dim`) and where they go in an engine's receive
slot (the whole tensors today's receivers hold, at the offsets of `receive_layout`). Per version and
engine, rank 0's transport says hello and picks the free slot as for one rank; then every rank writes
its pieces with its own TransferEngine, straight from its registered shard memory (or through one bucket
of staging when the engines hold another dtype), and checksums each of its buckets (xxh3 over the bytes
it wrote, in order); rank 0 commits the version with every rank's checks. The receiver verifies every
check against the slot, and that the checks cover every byte of the version exactly once, before it
applies anything: a byte corrupted in flight, or a rank's write that never landed, refuses the whole
version and the engines stay on theirs.

`ShardWriter` is one rank's side; `ShardSource` is what the transport needs of the learner's ranks
(rank 0's `stages.learner.ranks.RankedTrainer` implements it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec
import numpy as np
import torch

from stages.weights.layout import Layout, LayoutError
from stages.weights.reshard import (
    BucketCheck,
    EngineLayout,
    PlacementError,
    SourcePlacement,
    byte_offsets,
    make_buckets,
    materialise,
    plan,
    receive_layout,
    receiver_checksum,
)
from stages.weights.transfer_engine import transfer_engine


class PushSettings(msgspec.Struct, frozen=True):
    """How every rank writes: the transport's own settings."""

    protocol: str = "tcp"
    device: str = ""
    bucket_bytes: int = 32 << 20
    engine_dtype: str | None = None
    pace_bytes_per_s: float | None = None


@runtime_checkable
class ShardSource(Protocol):
    """The learner's ranks, as a push from the shards sees them (called from rank 0, in a worker thread)."""

    def receive_layout(self, version: int, settings: PushSettings) -> Layout:
        """The engines' receive layout of a whole version (every parameter at its offset)."""
        ...

    def write(self, peer: str, address: int, version: int, settings: PushSettings) -> list[BucketCheck]:
        """Every rank writes its pieces of `version` into the slot at `address` of the TransferEngine at
        `peer`; returns every rank's bucket checks. Raises ConnectionError naming a rank whose write failed."""
        ...


@runtime_checkable
class ShardPublisher(Protocol):
    """What a transport that declares `pushes_from_shards` has (`mooncake_p2p`)."""

    async def publish_shards(self, version: int, shards: ShardSource) -> None: ...


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A rank's own part of a parameter: its DTensor shard, or the whole tensor on one rank."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_dim(name: str, tensor: torch.Tensor, world_size: int) -> int | None:
    """The placement of one learner parameter as the plan takes it (`SourcePlacement.from_placements`): d
    for a DTensor placed `Shard(d)` on the learner's 1-D mesh (FSDP2's rows, or `stages.learner.experts`'
    blocks of experts), None for one every rank holds whole (`Replicate()`, or a plain tensor)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return None
    placements = tuple(tensor.placements)
    if tensor.device_mesh.ndim != 1 or tensor.device_mesh.size() != world_size:
        raise PlacementError(f"learner parameter {name!r} lies on a mesh of shape {tuple(tensor.device_mesh.shape)}; "
                             f"a push from the shards takes one dimension of all {world_size} ranks")
    if isinstance(placements[0], Shard):
        return placements[0].dim
    if isinstance(placements[0], Replicate):
        return None
    raise PlacementError(f"learner parameter {name!r} is placed {placements[0]}; a push from the shards takes "
                         "Shard(d) or Replicate()")


class ShardWriter:
    """One learner rank's writes (see the module docstring). `params`: the model's named parameters
    (DTensors when sharded); their storage stays put across steps, so it is registered once."""

    def __init__(self, params: dict[str, torch.Tensor], rank: int, world_size: int, settings: PushSettings) -> None:
        self.params, self.rank, self.settings = params, rank, settings
        first = next(iter(params.values()))
        self.dtype = f"torch.{settings.engine_dtype}" if settings.engine_dtype else str(first.dtype)
        shapes = {name: tuple(p.shape) for name, p in params.items()}
        placements = {name: shard_dim(name, p, world_size) for name, p in params.items()}
        self.source = SourcePlacement.from_placements(shapes, world_size, placements, self.dtype)
        engine = EngineLayout.full(shapes, self.dtype)
        self.layout = receive_layout(engine, 0, 0, settings.bucket_bytes)
        for name, p in params.items():  # the plan's boxes are this rank's own, or nothing would fit
            if tuple(_local(p).shape) != self.source.local_shape(rank, name):
                raise PlacementError(f"learner rank {rank} holds {name!r} as {tuple(_local(p).shape)}, not the "
                                     f"{self.source.local_shape(rank, name)} its placement gives it")
        pieces = plan(self.source, engine, byte_offsets(self.layout))
        self.buckets = [b for b in make_buckets(pieces, settings.bucket_bytes) if b.src_rank == rank]
        self.te = transfer_engine(settings.protocol, settings.device)
        self.staging = np.empty(max(settings.bucket_bytes, max((b.nbytes for b in self.buckets), default=1)),
                                dtype=np.uint8)
        self._register(self.staging.ctypes.data, self.staging.nbytes)
        self._registered_storage: set[int] = set()
        self._checks: tuple[int, list[BucketCheck]] | None = None  # the checks of the version last written

    def receive_layout(self, version: int) -> Layout:
        return msgspec.structs.replace(self.layout, version=version)

    def write(self, peer: str, address: int, version: int) -> list[BucketCheck]:
        """Write this rank's pieces of `version` into the slot at `address`; its bucket checks."""
        locals_ = {name: _local(p.detach()) for name, p in self.params.items()}
        converted = str(next(iter(locals_.values())).dtype) != self.dtype
        if not converted:
            self._register_storage(locals_.values())
        started, sent, checks = time.perf_counter(), 0, []
        for bucket in self.buckets:
            sources, digest = self._sources(bucket, locals_, converted)
            rc = self.te.batch_transfer_sync_write(peer, [s for s, _ in sources],
                                                   [address + p.dst_offset for p in bucket.pieces],
                                                   [p.nbytes for p in bucket.pieces])
            if rc != 0:
                raise ConnectionError(f"learner rank {self.rank}: TransferEngine write to {peer} returned {rc}")
            checks.append(BucketCheck(self.rank, bucket.dst_rank, bucket.ranges, digest))
            sent += bucket.nbytes
            self._pace(started, sent)
        self._checks = (version, checks)
        return checks

    def _sources(self, bucket: Any, locals_: dict[str, torch.Tensor], converted: bool) -> tuple[list, int]:
        """Per piece (address, bytes) to write from, and the bucket's checksum over those bytes in order: the
        shard's own memory when the piece is contiguous there in the engines' dtype, else one bucket of
        staging (converted to that dtype)."""
        import xxhash

        h, sources, at = xxhash.xxh3_64(), [], 0
        for piece in bucket.pieces:
            part = materialise(piece, locals_[piece.src_name], self.source)
            if converted:
                part = part.to(getattr(torch, self.dtype.removeprefix("torch."))).contiguous()
            host = part.cpu() if part.is_cuda else part  # checksummed on the host; written from where it is
            data = host.reshape(-1).view(torch.uint8).numpy() if part.numel() else np.empty(0, np.uint8)
            if converted or part.untyped_storage().data_ptr() not in self._registered_storage:
                self.staging[at : at + data.nbytes] = data
                sources.append((self.staging.ctypes.data + at, data.nbytes))
                at += data.nbytes
            else:
                sources.append((part.data_ptr(), data.nbytes))
            h.update(data)
        return sources, h.intdigest()

    def _register_storage(self, tensors: Any) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._registered_storage and storage.nbytes():
                self._register(storage.data_ptr(), storage.nbytes())
                self._registered_storage.add(storage.data_ptr())

    def _register(self, address: int, nbytes: int) -> None:
        if self.te.register_memory(address, nbytes) != 0:
            raise ConnectionError(f"learner rank {self.rank}: cannot register {nbytes} bytes with TransferEngine")

    def _pace(self, started: float, sent: int) -> None:
        if self.settings.pace_bytes_per_s:
            ahead = sent / self.settings.pace_bytes_per_s - (time.perf_counter() - started)
            if ahead > 0:
                time.sleep(ahead)


def verify_shards(buffer: np.ndarray | torch.Tensor, layout: Layout, checks: Sequence[BucketCheck]) -> None:
    """Raise `LayoutError` unless `checks` cover every byte of `layout`'s tensors exactly once and every
    check's bytes in `buffer` match its checksum (the receiver's test before it applies anything)."""
    covered = sorted((offset, offset + n) for c in checks for offset, n in c.ranges)  # ranges: (offset, nbytes)
    wanted = sorted((e.offset, e.offset + e.nbytes) for e in layout.tensors if e.nbytes)
    if _merged(covered) != _merged(wanted) or sum(b - a for a, b in covered) != sum(b - a for a, b in wanted):
        got, want = sum(b - a for a, b in covered), sum(b - a for a, b in wanted)
        raise LayoutError(f"the learner's ranks checked {got} bytes of version {layout.version}, which has {want}")
    bad = [c for c in checks if receiver_checksum(buffer, c.ranges) != c.checksum]
    if bad:
        ranks = sorted({c.src_rank for c in bad})
        raise LayoutError(f"{len(bad)} buckets of version {layout.version} from learner ranks {ranks} fail "
                          "their checksum")


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
