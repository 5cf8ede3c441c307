"""How a whole weight version gets into a vLLM server: through vLLM's native update protocol, carried by
baton's own transfer backend ("baton_shm", `tools/vllm-cpu/baton_vllm/`, loaded by the server).

`push_weights(client, base_url, version, tensors)`:

1. writes the version to one file in /dev/shm (`write_version_file`: baton's bucket plan,
   `stages.weights.layout.plan`, every bucket with a checksum of its bytes);
2. `/init_weight_transfer_engine {path, version}`: the server reads the file into private memory and
   verifies every bucket BEFORE vLLM's update starts. A damaged, partial or mislabelled version is
   refused there (`VersionRefused`) and the server keeps serving its old weights exactly;
3. `/start_weight_update`, `/update_weights {version}` (the server applies the verified version in one
   worker call, with the two CPU repairs), `/finish_weight_update {weight_version: str(version)}`. A
   failure here may leave the server's layers on the meta device while its /health still answers 200,
   so it raises `UpdateFailed`, which tells the engine to restart the server (and catch it up);
4. removes the file, whatever happened.

`stages.engines.vllm_delta.push_delta` sends a version as a sparse delta against the one the server kept
(pushed with `keep`) instead, through the same steps; the server rebuilds it and verifies the result.

The engine pauses the server around a push when it wants exact version spans (`/pause?mode=keep`):
the update itself is one worker call, so no decode step ever sees half a version, but a step between
`/update_weights` and `/finish_weight_update` would run the new weights under the old tag.

The checksum is sha256 (stdlib on both sides; ~0.9 GB/s here, measured 2026-12-07). The server also
verifies xxh3-64 (`checksum="xxh3_64"`, ~14x faster) where its venv has the xxhash package.

The landed check (`check_landed`) asks the server for its teacher-forced prompt logprobs of
`stages.engines.sglang_probe.WeightProbe`'s fixed tokens (`/v1/completions`, `prompt_logprobs`) and
compares them with a float32 torch forward of the same weights (`WeightProbe.expected`): vLLM's own
`/weight_checker` sees no linear weights on CPU (they are prepacked).
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import numpy as np
import torch

from stages.engines.base import EngineError
from stages.engines.sglang_probe import PushMismatch, WeightProbe
from stages.weights.adapter import Probe
from stages.weights.layout import ALIGN, plan

BACKEND = "baton_shm"
SERVER_FLAGS = (
    "--worker-extension-cls", "baton_vllm.extension.BatonWorkerExtension",
    "--weight-transfer-config", json.dumps({"backend": BACKEND}),
)
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # the weight-update routes exist only in dev mode
CHECKSUM = "sha256"
MAGIC, FORMAT = b"BATONWV1", "baton-weights-1"  # tools/vllm-cpu/baton_vllm/version_file.py reads them
SHM = Path("/dev/shm")


class VllmPushError(EngineError):
    """A version did not get into the vLLM server."""


class VersionRefused(VllmPushError):
    """The server refused the version before its update started (a checksum, a partial file): it still
    serves the weights it had, exactly."""


class UpdateFailed(VllmPushError):
    """The server failed inside its update: its layers may be empty. Restart it and catch it up."""

    restart_server = True


def _digest(algorithm: str, chunks) -> str:
    if algorithm == "sha256":
        import hashlib

        h = hashlib.sha256()
    elif algorithm == "xxh3_64":
        import xxhash

        h = xxhash.xxh3_64()
    else:
        raise ValueError(f"checksum {algorithm!r}: use 'sha256' or 'xxh3_64'")
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes (a view where it is contiguous on the CPU)."""
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()


def header_of(version: int, tensors: dict[str, torch.Tensor], layout, checksum: str = CHECKSUM) -> dict:
    """The header of `version` placed by `layout` (`stages.weights.layout.plan`): every bucket's digest of its
    tensors' bytes, as `baton_vllm.version_file` verifies them."""
    buckets = []
    for b in layout.buckets:
        entries = layout.tensors[b.first : b.first + b.count]
        buckets.append([b.offset, b.nbytes, b.first, b.count,
                        _digest(checksum, (as_bytes(tensors[e.name]) for e in entries))])
    return {"format": FORMAT, "version": version, "total": layout.total, "checksum": checksum,
            "tensors": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in layout.tensors],
            "buckets": buckets}


def write_file(path: str | Path, header: dict, pieces: list[np.ndarray]) -> Path:
    """MAGIC, the header's length, the msgpack header, zero padding to 64 bytes, then `pieces` in order."""
    encoded = msgspec.msgpack.encode(header)
    start = -(-(16 + len(encoded)) // ALIGN) * ALIGN
    path = Path(path)
    with open(path, "wb") as f:
        f.write(MAGIC + len(encoded).to_bytes(8, "little") + encoded)
        f.write(b"\0" * (start - 16 - len(encoded)))
        for piece in pieces:
            f.write(piece.tobytes())
    return path


def write_version_file(path: str | Path, version: int, tensors: dict[str, torch.Tensor],
                       checksum: str = CHECKSUM, bucket_bytes: int = 32 << 20) -> Path:
    """Write `version` to `path` in the format `baton_vllm.version_file` reads (see its docstring):
    MAGIC, the header's length, the msgpack header (placement from `stages.weights.layout.plan`, every
    bucket's digest), zero padding to 64 bytes, then the tensors' bytes at their planned offsets."""
    layout = plan(version, tensors, bucket_bytes)
    pieces, end = [], 0
    for e in layout.tensors:  # alignment gaps are zeros; each tensor at its offset
        pieces += [np.zeros(e.offset - end, dtype=np.uint8), as_bytes(tensors[e.name])]
        end = e.offset + e.nbytes
    pieces.append(np.zeros(layout.total - end, dtype=np.uint8))
    return write_file(path, header_of(version, tensors, layout, checksum), pieces)


def version_path(version: int, folder: Path = SHM) -> Path:
    """A fresh file name for `version` (shared memory on Linux, else the temp folder)."""
    folder = folder if folder.is_dir() else Path(tempfile.gettempdir())
    return folder / f"baton-vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}-v{version}.bin"


async def push_weights(client: httpx.AsyncClient, base_url: str, version: int,
                       tensors: dict[str, torch.Tensor], checksum: str = CHECKSUM, keep: bool = False,
                       damage: Callable[[Path], None] | None = None) -> None:
    """Put `version` into the server whole, tagged str(version) (see the module docstring);
    `VersionRefused` or `UpdateFailed` when it did not land. `keep`: the server keeps it as the base of the
    next delta (`stages.engines.vllm_delta`). `damage`, given the written file before the server reads it, is
    the `engine.push_refused` fault's hook (`damage_file`)."""
    import anyio

    path = version_path(version)
    try:
        await anyio.to_thread.run_sync(write_version_file, path, version, tensors, checksum)
        if damage is not None:
            damage(path)
        await push_file(client, base_url, version, path, keep)
    finally:
        path.unlink(missing_ok=True)


async def push_file(client: httpx.AsyncClient, base_url: str, version: int, path: Path, keep: bool) -> None:
    """Steps 2 and 3 of the module docstring for a version file already written at `path`."""
    base = base_url.rstrip("/")
    await _post(client, f"{base}/init_weight_transfer_engine",
                {"init_info": {"path": str(path), "version": version, "keep": keep}}, VersionRefused, version)
    await _post(client, f"{base}/start_weight_update", {}, UpdateFailed, version)
    await _post(client, f"{base}/update_weights", {"update_info": {"version": version}}, UpdateFailed, version)
    await _post(client, f"{base}/finish_weight_update", {"weight_version": str(version)}, UpdateFailed, version)


def damage_file(path: Path) -> None:
    """Flip the first byte of the first tensor in a written version file (at the data's offset 0, so its
    bucket's checksum fails on the server)."""
    with open(path, "r+b") as f:
        head = f.read(16)
        start = -(-(16 + int.from_bytes(head[8:16], "little")) // ALIGN) * ALIGN
        f.seek(start)
        byte = f.read(1)
        f.seek(start)
        f.write(bytes([byte[0] ^ 0xFF]))


async def _post(client: httpx.AsyncClient, url: str, body: dict, error: type[VllmPushError], version: int) -> None:
    """One protocol call; a non-2xx answer raises `error`, a broken connection `UpdateFailed` (the
    server is gone or wedged: restart it)."""
    route = url.rsplit("/", 1)[-1]
    try:
        response = await client.post(url, json=body)
    except httpx.HTTPError as exc:
        raise UpdateFailed(f"version {version}: {route} got no answer ({type(exc).__name__}: {exc})") from exc
    if response.status_code >= 300:
        raise error(f"version {version}: {route} answered {response.status_code}: {response.text[:500]}")


def probe_body(model: str, tokens: tuple[int, ...] | list[int]) -> dict:
    """The `/v1/completions` body that asks for the server's teacher-forced logprobs of `tokens`."""
    return {"model": model, "prompt": list(tokens), "max_tokens": 1, "temperature": 0.0,
            "prompt_logprobs": 0, "logprobs": 0}


def served_logprobs(answer: dict, tokens: tuple[int, ...] | list[int]) -> list[float]:
    """The logprob the server gave each token after the first (its prompt logprobs)."""
    rows = answer["choices"][0]["prompt_logprobs"][1:]
    return [float(row[str(token)]["logprob"]) for row, token in zip(rows, tokens[1:], strict=True)]


async def check_landed(client: httpx.AsyncClient, base_url: str, model: str, version: int,
                       expected: Probe) -> float:
    """The largest difference between the server's probe logprobs and `expected`
    (`WeightProbe.expected` of the version's tensors); `PushMismatch` beyond its tolerance."""
    response = await client.post(f"{base_url.rstrip('/')}/v1/completions", json=probe_body(model, expected.tokens))
    if response.status_code >= 300:
        raise VllmPushError(f"version {version}: the probe request answered {response.status_code}: "
                            f"{response.text[:300]}")
    diff = expected.difference(served_logprobs(response.json(), expected.tokens))
    if diff > expected.tolerance:
        raise PushMismatch(f"version {version} is not what the vLLM server computes: its probe logprobs differ "
                           f"from the version's weights by {diff:.3g} (tolerance {expected.tolerance:g})")
    return diff


__all__ = ["SERVER_FLAGS", "SERVER_ENV", "VersionRefused", "UpdateFailed", "VllmPushError", "WeightProbe",
           "push_weights", "check_landed", "write_version_file", "damage_file"]
