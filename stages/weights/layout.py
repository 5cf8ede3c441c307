"""Named tensors as one flat byte buffer, cut into checksummed buckets: the unit every byte-moving
weight transport sends and every receiver verifies.

`plan(version, tensors, bucket_bytes)` places each tensor at a 64-byte-aligned offset and groups
consecutive tensors into buckets of about `bucket_bytes` (a tensor larger than that is a bucket of
its own). A bucket's xxh3-64 checksum covers exactly the bytes of its tensors, in order (never the
alignment gaps), so the sender can compute it from its own tensors without packing them
(`with_checksums`) and a receiver from the buffer they landed in. `fill(buffer, tensors, layout)`
copies the tensors in and returns the layout with the checksums. A receiver calls
`bad_buckets(buffer, layout)` before it applies anything and `views(buffer, layout)` for zero-copy
tensors over the buffer (a numpy uint8 array or a torch uint8 tensor, e.g. shared memory). `Layout` is a msgspec
struct: it crosses processes as msgpack, never pickle, and `decode_layout` validates it (offsets
inside `total`, known dtypes) before any byte is trusted.
"""

from __future__ import annotations

import warnings

import msgspec
import numpy as np
import torch
import xxhash

ALIGN = 64
DTYPES = {str(t): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                                torch.uint8)}  # uint8: an adapter version's descriptor (stages.weights.adapter)


class LayoutError(ValueError):
    """A layout or buffer that does not check out (bad entry, wrong size, checksum mismatch)."""


class TensorEntry(msgspec.Struct, frozen=True):
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class Bucket(msgspec.Struct, frozen=True):
    offset: int
    nbytes: int
    first: int  # index of its first tensor in `Layout.tensors`
    count: int  # how many consecutive tensors it holds
    checksum: int = 0


class Layout(msgspec.Struct, frozen=True):
    version: int
    total: int
    tensors: tuple[TensorEntry, ...]
    buckets: tuple[Bucket, ...]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan(version: int, tensors: dict[str, torch.Tensor], bucket_bytes: int = 32 << 20) -> Layout:
    """Where each tensor goes and how the buffer is cut into buckets (checksums not yet known)."""
    entries: list[TensorEntry] = []
    buckets: list[Bucket] = []
    offset = start = first = 0
    for name, t in tensors.items():
        if str(t.dtype) not in DTYPES:
            raise LayoutError(f"tensor {name!r} has dtype {t.dtype}, not one of {sorted(DTYPES)}")
        n = t.numel() * t.element_size()
        if offset > start and offset + n - start > bucket_bytes:  # close the bucket before this tensor
            buckets.append(Bucket(start, offset - start, first, len(entries) - first))
            start, first = offset, len(entries)
        entries.append(TensorEntry(name, str(t.dtype), tuple(t.shape), offset, n))
        offset = _align(offset + n)
    if len(entries) > first:
        buckets.append(Bucket(start, offset - start, first, len(entries) - first))
    return Layout(version, offset, tuple(entries), tuple(buckets))


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy()


def checksum(buffer: np.ndarray | torch.Tensor, layout: Layout, bucket: Bucket) -> int:
    """xxh3-64 of the bytes of the bucket's tensors in `buffer`, in order."""
    data = buffer.numpy() if isinstance(buffer, torch.Tensor) else buffer
    h = xxhash.xxh3_64()
    for e in layout.tensors[bucket.first : bucket.first + bucket.count]:
        h.update(data[e.offset : e.offset + e.nbytes])
    return h.intdigest()


def with_checksums(tensors: dict[str, torch.Tensor], layout: Layout) -> Layout:
    """The layout with every bucket's checksum computed from the sender's own (CPU) tensors: the
    same value `checksum` finds in a buffer the tensors were written into, without packing them."""
    sums = []
    for b in layout.buckets:
        h = xxhash.xxh3_64()
        for e in layout.tensors[b.first : b.first + b.count]:
            h.update(_as_bytes(tensors[e.name]))
        sums.append(msgspec.structs.replace(b, checksum=h.intdigest()))
    return msgspec.structs.replace(layout, buckets=tuple(sums))


def fill(buffer: np.ndarray, tensors: dict[str, torch.Tensor], layout: Layout) -> Layout:
    """Copy `tensors` into `buffer` (uint8, at least `layout.total` bytes) as planned; returns the
    layout with every bucket's checksum (alignment gaps are zeroed, so checksums are reproducible)."""
    if buffer.dtype != np.uint8 or buffer.nbytes < layout.total:
        raise LayoutError(f"buffer of {buffer.nbytes} bytes for a layout of {layout.total}")
    end = 0
    for entry in layout.tensors:
        buffer[end : entry.offset] = 0
        buffer[entry.offset : entry.offset + entry.nbytes] = _as_bytes(tensors[entry.name].cpu())
        end = entry.offset + entry.nbytes
    buffer[end : layout.total] = 0
    return msgspec.structs.replace(
        layout, buckets=tuple(msgspec.structs.replace(b, checksum=checksum(buffer, layout, b)) for b in layout.buckets)
    )


def bad_buckets(buffer: np.ndarray | torch.Tensor, layout: Layout) -> list[int]:
    """Indexes of the buckets whose bytes in `buffer` do not match their checksum."""
    if buffer.nbytes < layout.total:
        raise LayoutError(f"buffer of {buffer.nbytes} bytes for a layout of {layout.total}")
    return [i for i, b in enumerate(layout.buckets) if checksum(buffer, layout, b) != b.checksum]


def views(buffer: np.ndarray | torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Zero-copy tensors over `buffer` (valid while the buffer is neither freed nor rewritten; over a
    read-only buffer, such as bytes from a store, they must not be written: clone them first). Over a
    torch tensor in shared memory the views stay shared: another process can map them by handle."""
    if isinstance(buffer, torch.Tensor):
        base = buffer
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            base = torch.from_numpy(buffer)
    return {e.name: base[e.offset : e.offset + e.nbytes].view(DTYPES[e.dtype]).view(e.shape) for e in layout.tensors}


def encode_layout(layout: Layout) -> bytes:
    return msgspec.msgpack.encode(layout)


def decode_layout(data: bytes) -> Layout:
    """A Layout from another process, validated: entries and buckets inside `total`, known dtypes,
    sizes consistent with shapes, buckets covering every tensor."""
    try:
        layout = msgspec.msgpack.decode(data, type=Layout)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise LayoutError(f"bad weight layout: {exc}") from None
    for e in layout.tensors:
        dtype = DTYPES.get(e.dtype)
        size = int(np.prod(e.shape, dtype=np.int64)) * (dtype.itemsize if dtype is not None else 0)
        if dtype is None or e.offset < 0 or e.offset + e.nbytes > layout.total or size != e.nbytes:
            raise LayoutError(f"bad entry for {e.name!r}: {e}")
    covered = 0  # the buckets hold every tensor exactly once, in order: nothing is applied unverified
    for b in layout.buckets:
        if b.offset < 0 or b.nbytes < 0 or b.offset + b.nbytes > layout.total:
            raise LayoutError(f"bucket {b} lies outside {layout.total} bytes")
        if b.first != covered or b.count < 1 or b.first + b.count > len(layout.tensors):
            raise LayoutError(f"bucket {b} does not continue at tensor {covered}")
        for e in layout.tensors[b.first : b.first + b.count]:
            if not b.offset <= e.offset <= e.offset + e.nbytes <= b.offset + b.nbytes:
                raise LayoutError(f"tensor {e.name!r} lies outside its bucket {b}")
        covered += b.count
    if covered != len(layout.tensors):
        raise LayoutError(f"tensors {covered}.. are in no bucket: they would be applied unverified")
    return layout


def state_checksum(tensors: dict[str, torch.Tensor]) -> int:
    """xxh3 of every tensor's name and bytes, in sorted-name order: one number for a whole version (the
    broadcast transport's announce, an engine's proof that it holds a version)."""
    h = xxhash.xxh3_64()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return h.intdigest()
