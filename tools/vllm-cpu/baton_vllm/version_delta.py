"""A weight version sent as a sparse delta against the version the server holds (baton's `delta` transport,
carried into vLLM): rebuilt in the server's private memory, then verified like a whole version.

A delta file has the same layout as a whole one (`baton_vllm.version_file`), with three more header keys:
`base` (the version it is a delta against), `patch_total` (bytes of patch data after the header, instead of
`total` bytes of tensors) and `patches`, a list of [tensor index, kind, offset, nbytes, count]:

- kind "whole": the tensor's `nbytes` bytes at `offset` of the patch data;
- kind "sparse": `count` uint32 element indices at `offset`, then `count` element values (as unsigned
  integers of the tensor's item size, so bit patterns, NaNs included, travel exactly).

A tensor with no patch is the base's, byte for byte. `tensors`, `total` and `buckets` describe the RESULT,
and every bucket's digest is of the result's bytes: `rebuild` never trusts the base or the patch, the
caller's `verify` of the result does. A base the server does not hold (it restarted, missed a version, or
its layout differs) raises `BaseNotHeld`: the sender sends the whole version instead.
"""

from __future__ import annotations

import numpy as np

from baton_vllm.version_file import Entry, VersionFileError, check_entries

WHOLE_NEEDED = "send the whole version"  # in every BaseNotHeld message: the sender's cue to fall back
UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class BaseNotHeld(VersionFileError):
    """The delta's base is not what the server holds: nothing was applied."""


class Held:
    """The version the server applied last, kept (private memory) as the base of the next delta."""

    def __init__(self, version: int, entries: list[Entry], data: np.ndarray) -> None:
        self.version, self.entries, self.data = version, entries, data


def rebuild(header: dict, patch: np.ndarray, held: Held | None) -> np.ndarray:
    """The result's data bytes: a copy of `held`'s with the header's patches applied (unverified)."""
    base = header["base"]
    if held is None or held.version != base:
        raise BaseNotHeld(f"a delta against version {base}, but the server holds "
                          f"{'no kept version' if held is None else f'version {held.version}'}: {WHOLE_NEEDED}")
    entries = check_entries(header)
    if entries != held.entries:
        raise BaseNotHeld(f"a delta against version {base} in another layout than the server's: {WHOLE_NEEDED}")
    result = held.data.copy()  # a patch that fails verification leaves the held base untouched
    for index, kind, offset, nbytes, count in header["patches"]:
        if not 0 <= index < len(entries) or offset < 0 or offset + nbytes > len(patch):
            raise VersionFileError(f"a patch of tensor {index} at {offset}+{nbytes} lies outside the delta's data")
        name, dtype, _, start, size = entries[index]
        target = result[start : start + size]
        if kind == "whole" and nbytes == size:
            target[:] = patch[offset : offset + nbytes]
        elif kind == "sparse" and nbytes == count * (4 + dtype.itemsize):
            indices = patch[offset : offset + 4 * count].view(np.uint32)
            if count and int(indices.max()) >= size // dtype.itemsize:
                raise VersionFileError(f"a patch of {name!r} indexes past its {size // dtype.itemsize} elements")
            target.view(UNSIGNED[dtype.itemsize])[indices] = patch[offset + 4 * count : offset + nbytes].view(
                UNSIGNED[dtype.itemsize])
        else:
            raise VersionFileError(f"a patch of {name!r} of kind {kind!r} with {nbytes} bytes for {count} elements")
    return result
