"""Named tensors as one flat byte buffer, cut into checksummed buckets: the unit every byte-moving
weight transport sends and every receiver verifies.

`plan(version, tensors, bucket_bytes)` places each tensor at a 64-byte-aligned offset and groups
consecutive tensors into buckets of about `bucket_bytes` (a tensor larger than that is a bucket of
its own). `fill(buffer, tensors, layout)` copies the tensors in and returns the layout with each
bucket's xxh3-64 checksum. A receiver calls `bad_buckets(buffer, layout)` before it applies
anything and `views(buffer, layout)` for zero-copy tensors over the buffer. `Layout` is a msgspec
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
DTYPES = {str(t): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)}


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
    entries, buckets, offset, start = [], [], 0, 0
    for name, t in tensors.items():
        if str(t.dtype) not in DTYPES:
            raise LayoutError(f"tensor {name!r} has dtype {t.dtype}, not one of {sorted(DTYPES)}")
        n = t.numel() * t.element_size()
        if offset > start and offset + n - start > bucket_bytes:  # close the bucket before this tensor
            buckets.append(Bucket(start, offset - start))
            start = offset
        entries.append(TensorEntry(name, str(t.dtype), tuple(t.shape), offset, n))
        offset = _align(offset + n)
    if offset > start:
        buckets.append(Bucket(start, offset - start))
    return Layout(version, offset, tuple(entries), tuple(buckets))


def checksum(buffer: np.ndarray, bucket: Bucket) -> int:
    return xxhash.xxh3_64_intdigest(buffer[bucket.offset : bucket.offset + bucket.nbytes])


def fill(buffer: np.ndarray, tensors: dict[str, torch.Tensor], layout: Layout) -> Layout:
    """Copy `tensors` into `buffer` (uint8, at least `layout.total` bytes) as planned; returns the
    layout with every bucket's checksum (alignment gaps are zeroed, so checksums are reproducible)."""
    if buffer.dtype != np.uint8 or buffer.nbytes < layout.total:
        raise LayoutError(f"buffer of {buffer.nbytes} bytes for a layout of {layout.total}")
    end = 0
    for entry in layout.tensors:
        buffer[end : entry.offset] = 0
        flat = tensors[entry.name].detach().cpu().contiguous().view(-1).view(torch.uint8)
        buffer[entry.offset : entry.offset + entry.nbytes] = flat.numpy()
        end = entry.offset + entry.nbytes
    buffer[end : layout.total] = 0
    return msgspec.structs.replace(
        layout, buckets=tuple(msgspec.structs.replace(b, checksum=checksum(buffer, b)) for b in layout.buckets)
    )


def bad_buckets(buffer: np.ndarray, layout: Layout) -> list[int]:
    """Indexes of the buckets whose bytes in `buffer` do not match their checksum."""
    if buffer.nbytes < layout.total:
        raise LayoutError(f"buffer of {buffer.nbytes} bytes for a layout of {layout.total}")
    return [i for i, b in enumerate(layout.buckets) if checksum(buffer, b) != b.checksum]


def views(buffer: np.ndarray, layout: Layout) -> dict[str, torch.Tensor]:
    """Zero-copy tensors over `buffer` (valid while the buffer is neither freed nor rewritten; over a
    read-only buffer, such as bytes from a store, they must not be written: clone them first)."""
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
    for b in layout.buckets:
        if b.offset < 0 or b.nbytes < 0 or b.offset + b.nbytes > layout.total:
            raise LayoutError(f"bucket {b} lies outside {layout.total} bytes")
    for e in layout.tensors:
        dtype = DTYPES.get(e.dtype)
        size = int(np.prod(e.shape, dtype=np.int64)) * (dtype.itemsize if dtype is not None else 0)
        if dtype is None or e.offset < 0 or e.offset + e.nbytes > layout.total or size != e.nbytes:
            raise LayoutError(f"bad entry for {e.name!r}: {e}")
        if not any(b.offset <= e.offset and e.offset + e.nbytes <= b.offset + b.nbytes for b in layout.buckets):
            raise LayoutError(f"tensor {e.name!r} is in no bucket: it would be applied unverified")
    return layout
