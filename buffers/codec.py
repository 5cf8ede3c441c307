"""The rollout-batch codec: one contiguous, checksummed, zero-copy-decodable buffer per batch.

Wire format (all integers little-endian):

    [0, 16)                 preamble: magic b"BTN\\x01" | u32 header_len | u64 xxh3_64(header bytes)
    [16, 16 + header_len)   header: msgspec-msgpack `Header` (format_version, rows, tokens, field
                            descriptors, meta, body_nbytes, checksum)
    [.., body_start)        zero padding; body_start = align64(16 + header_len)
    [body_start, end)       body: the arrays, in descriptor order, each starting at a 64-byte
                            aligned body offset, zero padding between them; end = body_start + body_nbytes

Invariants a decoder checks (a violation raises a `CodecError`, never returns data):

* the payload is exactly `body_start + body_nbytes` bytes long (shorter: `TruncatedPayload`);
* magic and `format_version` are known (else `ForeignPayload`);
* the header checksum matches and the header padding is zero, so every header byte is covered;
* descriptors are consistent: one `offsets` field (int64, rows + 1 long), token fields with
  `shape[0] == tokens` (1-D, or per-token arrays with trailing dims: typed-ragged, e.g. an MoE
  token's routed experts [tokens, layers, top_k]), row fields with `shape[0] == rows`, dtypes in
  the allow-list, `nbytes == prod(shape) * itemsize`, 64-aligned ascending non-overlapping ranges
  ending at `body_nbytes`;
* `checksum == xxh3_64(body)` (when `verify=True`), and offsets start at 0, never decrease and
  end at `tokens`.

The batch itself (`RolloutBatch`, `to_torch`) lives in `buffers.batch`, re-exported here. `encode` copies
each array once and hashes the body once; `encode_parts` gives the same bytes as parts, the arrays where
they lie (hashed, not copied) for a store that sends from several buffers; `decode` returns read-only
numpy views into the caller's buffer. Large encode buffers come from a process-wide pool and return to
it when the last view of the payload (including arrays decoded from it) is gone.
"""

from __future__ import annotations

import math
import struct
from typing import Annotated, Literal

import msgspec
import numpy as np
import xxhash
from typing_extensions import Buffer

from buffers.batch import (  # the batch's names, re-exported from here (their old home)
    _ALLOWED_NAMES,
    _WIRE_DTYPES,
    ALLOWED_DTYPES,
    MetaValue,
    RolloutBatch,
    _check_meta,
    _wire_dtype,
    to_torch,
)
from buffers.pool import BufferPool, shared_pool
from buffers.store import Gathered

__all__ = [
    "ALLOWED_DTYPES",
    "FORMAT_VERSION",
    "MAGIC",
    "CodecError",
    "CorruptPayload",
    "FieldDescriptor",
    "ForeignPayload",
    "Header",
    "MetaValue",
    "RolloutBatch",
    "TruncatedPayload",
    "configure_pool",
    "decode",
    "encode",
    "encode_parts",
    "peek",
    "to_torch",
]

MAGIC = b"BTN\x01"
FORMAT_VERSION = 1
ALIGN = 64
MAX_HEADER_NBYTES = 16 << 20
_PREAMBLE = struct.Struct("<4sIQ")
_U64_MAX = 2**64 - 1

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class CodecError(ValueError):
    """A payload could not be encoded or decoded. The message says what was expected and found."""


class TruncatedPayload(CodecError):
    """The payload is shorter than its preamble/header says it is."""


class CorruptPayload(CodecError):
    """A checksum mismatch, or descriptors inconsistent with each other or with the payload."""


class ForeignPayload(CodecError):
    """Not a baton payload (bad magic) or a format version this codec does not read."""


class FieldDescriptor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one array lives in the body. `offset` is relative to the body start."""

    name: str
    kind: Literal["offsets", "token", "row"]
    dtype: str
    shape: tuple[NonNegative, ...]
    offset: NonNegative
    nbytes: NonNegative


class Header(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The payload header; `peek` returns it without touching the body."""

    format_version: int
    rows: NonNegative
    tokens: NonNegative
    fields: tuple[FieldDescriptor, ...]
    meta: dict[str, MetaValue]
    body_nbytes: NonNegative
    checksum: NonNegative


class _VersionProbe(msgspec.Struct):
    format_version: int


_HEADER_DECODER = msgspec.msgpack.Decoder(Header)
_VERSION_DECODER = msgspec.msgpack.Decoder(_VersionProbe)
_ENCODER = msgspec.msgpack.Encoder()


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


_POOL = shared_pool()


def configure_pool(max_idle_bytes: int) -> None:
    """Cap the bytes of idle encode buffers kept for reuse (0 disables reuse)."""
    if max_idle_bytes < 0:
        raise ValueError(f"max_idle_bytes must be >= 0, got {max_idle_bytes}")
    _POOL.max_idle_bytes = max_idle_bytes
    _POOL.trim()


def _checksum(data: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(data)


_new_hasher = xxhash.xxh3_64
_HASH_CHUNK = 512 << 10


def _write_body(out: np.ndarray, body_start: int, columns: list[tuple[FieldDescriptor, np.ndarray]]) -> int:
    """Copy every array into place, zero the gaps, and return xxh3_64 of the body.

    Contiguous arrays are copied in chunks that are hashed right after they land, while they are
    still in cache; other arrays (strided, byte-swapped) are copied whole and hashed afterwards.
    """
    out_bytes, hasher = memoryview(out), _new_hasher()
    end = hashed = body_start
    for desc, arr in columns:
        start = body_start + desc.offset
        out_bytes[end:start] = bytes(start - end)
        end = start + desc.nbytes
        wire = _WIRE_DTYPES[desc.dtype]
        if not desc.nbytes:
            continue
        if not (arr.flags.c_contiguous and arr.dtype == wire):
            np.copyto(out[start:end].view(wire).reshape(arr.shape), arr, casting="equiv")
            continue
        src = memoryview(arr).cast("B")
        for chunk in range(start, end, _HASH_CHUNK):
            chunk_end = min(chunk + _HASH_CHUNK, end)
            out_bytes[chunk:chunk_end] = src[chunk - start : chunk_end - start]
            hasher.update(out_bytes[hashed:chunk_end])
            hashed = chunk_end
    hasher.update(out_bytes[hashed:end])
    return hasher.intdigest()


def _layout(batch: RolloutBatch) -> tuple[list[tuple[FieldDescriptor, np.ndarray]], Header]:
    """Each array with its descriptor (64-aligned body offsets, in column order), and the header without
    its checksum."""
    columns, pos = [], 0
    for name, kind, arr in batch._columns():
        wire = _wire_dtype(arr.dtype)
        if wire is None:
            raise CodecError(f"field {name!r}: dtype {arr.dtype} is not allowed (allowed: {_ALLOWED_NAMES})")
        pos = _align(pos)
        columns.append((FieldDescriptor(name, kind, wire.str, arr.shape, pos, arr.nbytes), arr))
        pos += arr.nbytes
    descriptors = tuple(desc for desc, _ in columns)
    return columns, Header(FORMAT_VERSION, batch.rows, batch.tokens, descriptors, batch.meta, pos, _U64_MAX)


def _write_head(out: np.ndarray, header_bytes: bytes, body_start: int) -> None:
    """Preamble, header and zero padding into `out[:body_start]`."""
    header_end = _PREAMBLE.size + len(header_bytes)
    _PREAMBLE.pack_into(out, 0, MAGIC, len(header_bytes), _checksum(header_bytes))
    out[_PREAMBLE.size : header_end] = np.frombuffer(header_bytes, dtype=np.uint8)
    out[header_end:body_start] = 0


def encode(batch: RolloutBatch, *, pool: BufferPool | None = None) -> memoryview:
    """Encode `batch` into one contiguous payload (see the module docstring for the layout).

    Returns a read-only memoryview over a fresh (or recycled) buffer; the payload is immutable and
    its memory is recycled once nothing references it or anything decoded from it. `pool` lets a
    store hand out its own (e.g. registered) memory, so the payload is written where it is sent from.
    """
    pool = _POOL if pool is None else pool
    columns, header = _layout(batch)
    body_start = _align(_PREAMBLE.size + len(_ENCODER.encode(header)))
    out = pool.take(body_start + header.body_nbytes)
    header = msgspec.structs.replace(header, checksum=_write_body(out, body_start, columns))
    header_bytes = _ENCODER.encode(header)
    if _align(_PREAMBLE.size + len(header_bytes)) != body_start:
        moved = pool.take(_align(_PREAMBLE.size + len(header_bytes)) + header.body_nbytes)
        moved[len(moved) - header.body_nbytes :] = out[body_start:]
        out, body_start = moved, len(moved) - header.body_nbytes
    _write_head(out, header_bytes, body_start)
    return memoryview(out).toreadonly()


_ZEROS = np.zeros(ALIGN, dtype=np.uint8)
_ZEROS.flags.writeable = False


def encode_parts(batch: RolloutBatch, *, pool: BufferPool | None = None) -> tuple[Gathered, Header]:
    """The payload `encode` makes, byte for byte, as parts: a head (preamble, header, padding; from
    `pool`), then each array where it lies with the zero gaps between them. Nothing is copied but the head
    and arrays that are not C-contiguous in their wire dtype; the body is hashed once. The parts are the
    batch's own arrays: they must not change until the put that takes them returns. Returns the parts and
    the header (its checksum is the Ref's)."""
    columns, header = _layout(batch)
    hasher, parts, end = _new_hasher(), [], 0
    for desc, arr in columns:
        if desc.offset > end:
            gap = _ZEROS[: desc.offset - end]
            hasher.update(gap)
            parts.append(gap)
        end = desc.offset + desc.nbytes
        if not desc.nbytes:
            continue
        wire = _WIRE_DTYPES[desc.dtype]
        if not (arr.flags.c_contiguous and arr.dtype == wire):
            arr = np.ascontiguousarray(arr.astype(wire, casting="equiv", copy=False))
        body = arr.reshape(-1).view(np.uint8)
        hasher.update(body)
        parts.append(body)
    header = msgspec.structs.replace(header, checksum=hasher.intdigest())
    header_bytes = _ENCODER.encode(header)
    body_start = _align(_PREAMBLE.size + len(header_bytes))
    head = (_POOL if pool is None else pool).take(body_start)
    _write_head(head, header_bytes, body_start)
    return Gathered((head, *parts), body_start + header.body_nbytes), header


def _as_bytes_view(buf: Buffer) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _decode_header(header_bytes: memoryview) -> Header:
    """Foreign if `format_version` is not ours (whatever the rest says), corrupt if it does not parse."""
    try:
        header = _HEADER_DECODER.decode(header_bytes)
    except msgspec.DecodeError as exc:
        try:
            version = _VERSION_DECODER.decode(header_bytes).format_version
        except msgspec.DecodeError:
            version = FORMAT_VERSION
        if version == FORMAT_VERSION:
            raise CorruptPayload(f"invalid header: {exc}") from None
    else:
        version = header.format_version
    if version != FORMAT_VERSION:
        raise ForeignPayload(f"expected format_version {FORMAT_VERSION}, found {version}")
    return header


def _read_header(view: memoryview) -> tuple[Header, int]:
    """Validate preamble, header checksum, version and total length; return (header, body_start)."""
    n = len(view)
    if n < _PREAMBLE.size:
        if bytes(view[: len(MAGIC)]) == MAGIC[:n]:
            raise TruncatedPayload(f"expected at least a {_PREAMBLE.size}-byte preamble, found {n} bytes")
        raise ForeignPayload(f"expected magic {MAGIC!r}, found {bytes(view[: len(MAGIC)])!r}")
    magic, header_len, header_sum = _PREAMBLE.unpack_from(view)
    if magic != MAGIC:
        raise ForeignPayload(f"expected magic {MAGIC!r}, found {magic!r}")
    if header_len > MAX_HEADER_NBYTES:
        raise CorruptPayload(f"expected a header of at most {MAX_HEADER_NBYTES} bytes, found {header_len}")
    header_end = _PREAMBLE.size + header_len
    if n < header_end:
        raise TruncatedPayload(f"expected at least {header_end} bytes for the header, found {n}")
    header_bytes = view[_PREAMBLE.size : header_end]
    if (found := _checksum(header_bytes)) != header_sum:
        raise CorruptPayload(f"header checksum mismatch: expected {header_sum:#018x}, found {found:#018x}")
    header = _decode_header(header_bytes)
    body_start = _align(header_end)
    total = body_start + header.body_nbytes
    if n < total:
        raise TruncatedPayload(f"expected {total} bytes (body of {header.body_nbytes}), found {n}")
    if n > total:
        raise CorruptPayload(f"expected {total} bytes, found {n} ({n - total} trailing bytes)")
    if bytes(view[header_end:body_start]) != bytes(body_start - header_end):
        raise CorruptPayload(f"expected zero padding in bytes [{header_end}, {body_start}), found non-zero")
    return header, body_start


def _check_descriptors(header: Header) -> None:
    end, names, offsets_fields = 0, set(), 0
    for d in header.fields:
        where = f"field {d.name!r}"
        if not d.name:
            raise CorruptPayload("expected non-empty field names, found an empty one")
        if d.name in names:
            raise CorruptPayload(f"{where}: expected unique field names, found a duplicate")
        names.add(d.name)
        dtype = _WIRE_DTYPES.get(d.dtype)
        if dtype is None:
            raise CorruptPayload(f"{where}: expected a dtype in {sorted(_WIRE_DTYPES)}, found {d.dtype!r}")
        if d.nbytes != math.prod(d.shape) * dtype.itemsize:
            raise CorruptPayload(
                f"{where}: expected nbytes {math.prod(d.shape) * dtype.itemsize}, found {d.nbytes}"
            )
        if d.offset % ALIGN or d.offset < end:
            raise CorruptPayload(f"{where}: expected a {ALIGN}-aligned offset >= {end}, found {d.offset}")
        end = d.offset + d.nbytes
        if d.kind == "offsets":
            offsets_fields += 1
            if d.dtype != "<i8":
                raise CorruptPayload(f"{where}: expected offsets dtype '<i8', found {d.dtype!r}")
            if d.shape != (header.rows + 1,):
                raise CorruptPayload(f"{where}: expected shape {(header.rows + 1,)}, found {d.shape}")
            continue
        leading = header.tokens if d.kind == "token" else header.rows  # typed-ragged: trailing dims are free
        if len(d.shape) < 1 or d.shape[0] != leading:
            raise CorruptPayload(f"{where}: expected shape ({leading}, ...), found {d.shape}")
    if offsets_fields != 1:
        raise CorruptPayload(f"expected exactly one offsets field, found {offsets_fields}")
    if end != header.body_nbytes:
        raise CorruptPayload(
            f"expected body_nbytes {end} (end of the last field), found {header.body_nbytes}"
        )


def peek(buf: Buffer) -> Header:
    """The header of a payload (rows, body_nbytes, checksum, meta), without reading the body."""
    return _read_header(_as_bytes_view(buf))[0]


def decode(buf: Buffer, *, verify: bool = True) -> RolloutBatch:
    """Decode a payload into read-only numpy views of `buf` (no copy).

    `verify=False` skips only the body checksum; every structural check still runs.
    """
    view = _as_bytes_view(buf)
    header, body_start = _read_header(view)
    _check_descriptors(header)
    if verify and (found := _checksum(view[body_start:])) != header.checksum:
        raise CorruptPayload(f"body checksum mismatch: expected {header.checksum:#018x}, found {found:#018x}")
    body = np.frombuffer(view, dtype=np.uint8, offset=body_start)
    body.flags.writeable = False
    columns: dict[str, dict[str, np.ndarray]] = {"offsets": {}, "token": {}, "row": {}}
    for d in header.fields:
        columns[d.kind][d.name] = (
            body[d.offset : d.offset + d.nbytes].view(_WIRE_DTYPES[d.dtype]).reshape(d.shape)
        )
    offsets = columns["offsets"].popitem()[1]
    if offsets[0] != 0 or offsets[-1] != header.tokens or bool((offsets[1:] < offsets[:-1]).any()):
        raise CorruptPayload(f"expected offsets non-decreasing from 0 to {header.tokens}, found otherwise")
    try:
        meta = _check_meta(header.meta)
    except ValueError as exc:
        raise CorruptPayload(f"invalid header: {exc}") from None
    return RolloutBatch._trusted(offsets, columns["token"], columns["row"], meta)
