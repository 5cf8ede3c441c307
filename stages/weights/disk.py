"""`disk`: each version as a safetensors file on a filesystem every engine can read.

The learner writes `ROOT/v{version:08d}/model.safetensors` into a temporary folder and renames it
into place, so a reader never sees half a version; the file's xxh3 checksum travels in the notice.
Engines in the learner's process load it directly; an engine process gets a msgpack `DiskNotice`
(version, path, checksum) through its host's `ask` and replies whether it applied it
(`DiskReceiver`). A receiver verifies the checksum before it loads anything, so a damaged or
partial file is refused and the engine keeps its version (retries, unreachable engines and
catch-ups: `PushTransport`). Only the newest `keep` versions stay on disk. ROOT must be
shared by all engine processes (one host, or a network filesystem).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import torch
import xxhash

from stages.weights.base import EngineReceiver, PushTransport, Target, WeightPushError

NOTICE = "weights.disk"


class DiskNotice(msgspec.Struct, frozen=True):
    version: int
    path: str
    checksum: int


def file_checksum(path: Path) -> int:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.intdigest()


def write_weights(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Write a whole version's `tensors` as one safetensors file at `path` (tied weights, which share storage,
    once: under the first name); returns the file's checksum, which `load_verified` checks."""
    from safetensors.torch import save_file

    unique: dict[int, tuple[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        unique.setdefault(t.data_ptr(), (name, t.detach().cpu().contiguous()))
    save_file(dict(unique.values()), path)
    return file_checksum(path)


def load_verified(notice: DiskNotice) -> dict[str, torch.Tensor]:
    """The version's tensors, or WeightPushError when the file is missing or fails its checksum."""
    from safetensors.torch import load_file

    path = Path(notice.path)
    if not path.is_file():
        raise WeightPushError(f"weights of version {notice.version} are not at {path}")
    if file_checksum(path) != notice.checksum:
        raise WeightPushError(f"weights of version {notice.version} at {path} fail their checksum")
    return load_file(path)


class DiskReceiver(EngineReceiver):
    """The engine side: verify, load, apply (mailbox `weights.disk`)."""

    def handlers(self) -> dict[str, Any]:
        return {NOTICE: self.notice}

    async def notice(self, header: bytes, _blob: Any = None) -> bytes:
        notice = msgspec.msgpack.decode(header, type=DiskNotice)
        if (held := self.holds(notice.version)) is not None:
            return held
        try:
            tensors = await anyio.to_thread.run_sync(load_verified, notice)
        except WeightPushError as exc:
            return self.refuse(str(exc))
        return await self.apply(notice.version, tensors)


@dataclass
class DiskTransport(PushTransport):
    root: str | Path | None = None  # default: a fresh temporary folder
    keep: int = 2
    retries: int = 2
    name: str = "disk"
    receiver = DiskReceiver

    def __post_init__(self) -> None:
        super().__post_init__()
        self._notice: DiskNotice | None = None
        self._file_bytes = 0


    async def stage(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self._notice = await anyio.to_thread.run_sync(self._write, version, tensors)
        self._file_bytes = Path(self._notice.path).stat().st_size
        self.stats["copied"] += 1

    async def send(self, target: Target, attempt: int) -> tuple[bytes | None, int]:
        return await target.asker.ask(NOTICE, msgspec.msgpack.encode(self._notice)), self._file_bytes

    def _write(self, version: int, tensors: dict[str, torch.Tensor]) -> DiskNotice:
        if self.root is None:
            self.root = tempfile.mkdtemp(prefix="baton-weights-")
        root = Path(self.root)
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"v{version:08d}"
        staging = Path(tempfile.mkdtemp(prefix=f".v{version:08d}-", dir=root))
        checksum = write_weights(staging / "model.safetensors", tensors)
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)  # atomic: readers see the whole version or none
        for old in sorted(p for p in root.glob("v*") if p.is_dir())[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return DiskNotice(version, str(final / "model.safetensors"), checksum)
