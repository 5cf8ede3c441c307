"""A weight version as one file (in /dev/shm): read, validated and checksum-verified before any
byte reaches the model. Self-contained: the server's venv cannot import the project, so this module
needs only the stdlib, numpy, torch and msgspec (all in vLLM's venv); no pickle.

File layout (written by `stages.engines.vllm_update.write_version_file`):

    MAGIC (8 bytes) | header length (8 bytes, little-endian) | header (msgpack) | zero pad to 64 | data

The header is a map: `format` (= FORMAT), `version`, `total` (data bytes), `checksum` (the algorithm
of every bucket's digest: "sha256", or "xxh3_64" where xxhash is installed), `tensors` (a list of
[name, dtype, shape, offset, nbytes], offsets into the data) and `buckets` (a list of [offset, nbytes,
first, count, digest]: `count` consecutive tensors from index `first`, digest of exactly their bytes
in order, as hex). Placement and bucketing are baton's `stages.weights.layout.plan`.

`read_version(path, version)` answers the whole version or raises `VersionFileError`: a wrong magic
or format, a version other than the one asked for, a file shorter than its header says (a partial
write), an entry outside the data or inconsistent with its shape, a tensor in no bucket, or a bucket
whose digest does not match. The file is read into private memory before it is verified, so a file
rewritten afterwards cannot change what was checked. `read_kept(path, version, held)` also reads a
delta against the version the server holds (`baton_vllm.version_delta`: rebuilt from it, then verified
the same way) and returns the result as the next `Held`.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import msgspec
import numpy as np
import torch

MAGIC = b"BATONWV1"
FORMAT = "baton-weights-1"
ALIGN = 64
DTYPES = {str(t): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                torch.int32, torch.uint8)}


class VersionFileError(ValueError):
    """A version file that does not check out: nothing of it may be applied."""


def digest(algorithm: str, chunks) -> str:
    """Hex digest of the byte chunks (numpy uint8 arrays) under `algorithm` ("sha256" or "xxh3_64")."""
    if algorithm == "sha256":
        h = hashlib.sha256()
    elif algorithm == "xxh3_64":
        try:
            import xxhash
        except ImportError:
            raise VersionFileError("checksum xxh3_64 needs the xxhash package in the server's venv; "
                                   "write versions with checksum = 'sha256'") from None
        h = xxhash.xxh3_64()
    else:
        raise VersionFileError(f"unknown checksum algorithm {algorithm!r} (sha256 or xxh3_64)")
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def data_offset(header_len: int) -> int:
    return -(-(16 + header_len) // ALIGN) * ALIGN


def _read_header(raw: np.ndarray, path: Path) -> tuple[dict, int]:
    """The header and where the data start."""
    if len(raw) < 16 or raw[:8].tobytes() != MAGIC:
        raise VersionFileError(f"{path} is not a baton weight version (bad magic)")
    size = int.from_bytes(raw[8:16].tobytes(), "little")
    if 16 + size > len(raw):
        raise VersionFileError(f"{path} is truncated inside its header")
    try:
        header = msgspec.msgpack.decode(raw[16 : 16 + size].tobytes())
    except msgspec.DecodeError as exc:
        raise VersionFileError(f"{path}: bad header: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise VersionFileError(f"{path}: header format is not {FORMAT}")
    return header, data_offset(size)


Entry = tuple[str, torch.dtype, tuple[int, ...], int, int]  # name, dtype, shape, offset, nbytes in the data


def check_entries(header: dict) -> list[Entry]:
    """The header's tensor entries, each inside the data and of its shape's size (VersionFileError if not)."""
    total, entries = int(header["total"]), []
    for name, dtype_name, shape, offset, nbytes in header["tensors"]:
        dtype = DTYPES.get(dtype_name)
        size = math.prod(shape) * (dtype.itemsize if dtype is not None else 0)
        if dtype is None or offset < 0 or offset + nbytes > total or size != nbytes:
            raise VersionFileError(f"bad entry for {name!r}: {dtype_name} {shape} at {offset}+{nbytes} of {total}")
        entries.append((name, dtype, tuple(shape), offset, nbytes))
    return entries


def verify(header: dict, data: np.ndarray) -> list[Entry]:
    """The header's entries, once every tensor lies in exactly one bucket (in order) whose digest
    matches `data`; raises VersionFileError naming the first bad bucket otherwise."""
    entries, covered = check_entries(header), 0
    for i, (offset, nbytes, first, count, expected) in enumerate(header["buckets"]):
        if first != covered or count < 1 or first + count > len(entries):
            raise VersionFileError(f"bucket {i} does not continue at tensor {covered}")
        inside = entries[first : first + count]
        if any(not offset <= e[3] <= e[3] + e[4] <= offset + nbytes for e in inside):
            raise VersionFileError(f"bucket {i} does not hold its tensors")
        found = digest(header["checksum"], (data[e[3] : e[3] + e[4]] for e in inside))
        if found != expected:
            raise VersionFileError(f"bucket {i} (tensors {inside[0][0]!r}..) fails its {header['checksum']} "
                                   "checksum: the version is damaged")
        covered += count
    if covered != len(entries):
        raise VersionFileError(f"tensors {covered}.. are in no bucket: they would be applied unverified")
    return entries


def read_version(path: str | Path, version: int) -> dict[str, torch.Tensor]:
    """The named tensors of `version` from `path`, verified whole (see the module docstring)."""
    return read_kept(path, version, None)[0]


def read_kept(path: str | Path, version: int, held) -> tuple[dict[str, torch.Tensor], object]:
    """The named tensors of `version` from `path` (a whole version, or a delta against `held`, the
    `version_delta.Held` the server kept), verified whole, and the `Held` they make."""
    from baton_vllm.version_delta import Held, rebuild

    path = Path(path)
    try:
        raw = np.fromfile(path, dtype=np.uint8)  # private memory: what is checked is what is applied
    except OSError as exc:
        raise VersionFileError(f"cannot read {path}: {exc}") from None
    header, start = _read_header(raw, path)
    if header.get("version") != version:
        raise VersionFileError(f"{path} holds version {header.get('version')}, not {version}")
    try:
        size = int(header["patch_total"] if "base" in header else header["total"])
        if len(raw) < start + size:
            raise VersionFileError(f"{path} is partial: {max(len(raw) - start, 0)} of {size} data bytes")
        data = raw[start : start + size]
        if "base" in header:
            data = rebuild(header, data, held)
        if len(data) != int(header["total"]):
            raise VersionFileError(f"{path}: {len(data)} data bytes, its header says {header['total']}")
        entries = verify(header, data)
    except VersionFileError:
        raise
    except (KeyError, TypeError, ValueError) as exc:  # a header of the wrong shape
        raise VersionFileError(f"{path}: malformed header ({type(exc).__name__}: {exc})") from None
    base = torch.from_numpy(data)
    tensors = {name: base[offset : offset + nbytes].view(dtype).view(shape)
               for name, dtype, shape, offset, nbytes in entries}
    return tensors, Held(version, entries, data)
