"""A weight version as a sparse delta against the version the vLLM server kept (the `delta` transport carried
into vLLM, `VLLMEngine(push="delta")`); the server's side is `tools/vllm-cpu/baton_vllm/version_delta.py`,
whose docstring gives the file format.

`PushedBase.of(version, tensors)` is the engine's own copy of the bytes it last pushed (what the server kept:
never views over a transport's receive slot, which the next version rebuilds). `write_delta_file` compares a
new version with it element by element, as unsigned integers of each tensor's item size (bit-exact: a value
that did not move is not sent, a NaN is not "changed"), and writes per tensor nothing (unchanged), its changed
elements (uint32 indices, then the values), or the whole tensor when that is smaller. The header's buckets
carry the digests of the WHOLE new version, so the server verifies the version it rebuilt, not the patch. A
version in another layout than the base (a tensor added, a shape changed) is not a delta: `None`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import numpy as np
import torch

from stages.engines.vllm_update import (
    CHECKSUM,
    VersionRefused,
    as_bytes,
    header_of,
    push_file,
    version_path,
    write_file,
)
from stages.weights.layout import ALIGN, plan

WHOLE_NEEDED = "send the whole version"  # baton_vllm.version_delta.WHOLE_NEEDED: the server's cue to fall back
UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True)
class PushedBase:
    """A version the server kept: its number, its layout's entries, and a private copy of every tensor's bytes."""

    version: int
    entries: tuple[tuple[str, str, tuple[int, ...], int, int], ...]
    data: dict[str, np.ndarray]

    @classmethod
    def of(cls, version: int, tensors: dict[str, torch.Tensor], bucket_bytes: int = 32 << 20) -> PushedBase:
        layout = plan(version, tensors, bucket_bytes)
        return cls(version, _entries(layout), {n: as_bytes(t).copy() for n, t in tensors.items()})


def _entries(layout) -> tuple[tuple[str, str, tuple[int, ...], int, int], ...]:
    return tuple((e.name, e.dtype, tuple(e.shape), e.offset, e.nbytes) for e in layout.tensors)


def _patch(new: np.ndarray, old: np.ndarray, itemsize: int) -> tuple[str, int, list[np.ndarray]] | None:
    """(kind, element count, byte pieces) of one tensor's patch; None when it did not change."""
    unsigned = UNSIGNED[itemsize]
    changed = np.flatnonzero(new.view(unsigned) != old.view(unsigned))
    if changed.size == 0:
        return None
    if changed.size * (4 + itemsize) >= new.nbytes:
        return "whole", 0, [new]
    values = new.view(unsigned)[changed]
    return "sparse", int(changed.size), [changed.astype(np.uint32).view(np.uint8), values.view(np.uint8)]


def write_delta_file(path: str | Path, version: int, tensors: dict[str, torch.Tensor], base: PushedBase,
                     checksum: str = CHECKSUM, bucket_bytes: int = 32 << 20) -> tuple[Path, dict] | None:
    """Write `version` as a delta against `base` (the module docstring); (path, {"changed", "elements",
    "bytes"}) or None when the two are not in the same layout (send the whole version)."""
    layout = plan(version, tensors, bucket_bytes)
    if _entries(layout) != base.entries or any(int(np.prod(e.shape)) >= 1 << 32 for e in layout.tensors):
        return None
    patches, pieces, offset, changed, elements = [], [], 0, 0, 0
    for index, e in enumerate(layout.tensors):
        new = as_bytes(tensors[e.name])
        itemsize = tensors[e.name].element_size()
        elements += new.nbytes // itemsize
        if (patch := _patch(new, base.data[e.name], itemsize)) is None:
            continue
        kind, count, parts = patch
        nbytes = sum(p.nbytes for p in parts)
        pad = -offset % ALIGN
        pieces += [np.zeros(pad, dtype=np.uint8), *parts]
        offset += pad
        patches.append([index, kind, offset, nbytes, count])
        offset += nbytes
        changed += count if kind == "sparse" else new.nbytes // itemsize
    header = header_of(version, tensors, layout, checksum)
    header.update(base=base.version, patch_total=offset, patches=patches)
    return write_file(path, header, pieces), {"changed": changed, "elements": elements, "bytes": offset}


async def push_delta(client: httpx.AsyncClient, base_url: str, version: int, tensors: dict[str, torch.Tensor],
                     base: PushedBase, checksum: str = CHECKSUM) -> dict | None:
    """Push `version` as a delta against `base` (kept by the server again); its figures (`write_delta_file`),
    or None when the server does not hold `base` or the layouts differ: nothing applied, send the whole version.
    A damaged delta (its result fails a checksum) raises `VersionRefused`, a failed update `UpdateFailed`."""
    path = version_path(version)
    try:
        written = await anyio.to_thread.run_sync(write_delta_file, path, version, tensors, base, checksum)
        if written is None:
            return None
        try:
            await push_file(client, base_url, version, path, keep=True)
        except VersionRefused as exc:
            if WHOLE_NEEDED in str(exc):
                return None
            raise
        return written[1]
    finally:
        path.unlink(missing_ok=True)
