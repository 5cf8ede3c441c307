"""How a whole weight version gets into an SGLang server: `ServerUpdate`, one object per engine.

Three paths (`update`): "tensor" hands the server shared-memory handles of the tensors (same host
only), "distributed" broadcasts them over a torch.distributed group the server joins on the first
update (NCCL on GPU, gloo on CPU), "disk" writes a safetensors folder the server loads. Every path
runs inside `/begin_weight_update` ... `/end_weight_update`, so the server never generates from a
half-applied version; the engine (`stages.engines.sglang.SGLangEngine`) decides when to apply and what
happens to requests in flight.
"""

from __future__ import annotations

import base64
import io
import shutil
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import torch

from pipeline.net import free_port
from stages.weights.groups import pair_group

UPDATE_PATHS = ("tensor", "distributed", "disk")


class ServerUpdate:
    """Applies versions to one server (see the module docstring). `call(method, route, body, check=True)`
    is the engine's HTTP call (retried, typed errors)."""

    def __init__(self, name: str, model_path: Path, call: Callable[..., Awaitable[Any]]) -> None:
        self.name, self.model_path, self.call = name, model_path, call
        self.group: Any = None  # torch process group for path "distributed", formed on the first update
        self.group_name = ""
        self.weights_dir: Path | None = None  # path "disk": the folder versions are written to

    async def apply(self, version: int, tensors: dict[str, torch.Tensor], path: str) -> None:
        """Put `version` into the server whole, tagged str(version), by `path` (one of UPDATE_PATHS)."""
        tag = str(version)
        await self.call("POST", "/begin_weight_update", {})
        try:
            if path == "tensor":  # the copy into shared memory, off the event loop: 0.63 s for 512 MiB here
                payload = await anyio.to_thread.run_sync(_serialize_shared, tensors)
                await self.call("POST", "/update_weights_from_tensor", {
                    "serialized_named_tensors": [payload],
                    "flush_cache": False, "weight_version": tag,
                })
            elif path == "distributed":
                await self._update_distributed(tensors, tag)
            else:
                folder = await anyio.to_thread.run_sync(self._write_version, version, tensors)
                await self.call("POST", "/update_weights_from_disk", {
                    "model_path": str(folder), "flush_cache": False, "weight_version": tag,
                })
        finally:
            await self.call("POST", "/end_weight_update", {})

    def server_restarted(self) -> None:
        """The old server's end of the broadcast group is gone: the next update forms a new one."""
        self.group = None

    async def close(self, server_up: bool) -> None:
        """Leave the broadcast group (telling the server when it is up) and remove written versions."""
        if self.group is not None:
            group, self.group = self.group, None
            if server_up:
                await self.call("POST", "/destroy_weights_update_group", {"group_name": self.group_name}, check=False)
            try:
                torch.distributed.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - the server side may already be gone
                pass
        if self.weights_dir is not None:
            shutil.rmtree(self.weights_dir, ignore_errors=True)
            self.weights_dir = None

    async def _update_distributed(self, tensors: dict[str, torch.Tensor], tag: str) -> None:
        if self.group is None:
            await self._init_group("nccl" if next(iter(tensors.values())).is_cuda else "gloo")
        names = list(tensors)
        body = {
            "names": names, "dtypes": [str(tensors[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(tensors[n].shape) for n in names], "group_name": self.group_name,
            "flush_cache": False, "weight_version": tag,
        }
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.call, "POST", "/update_weights_from_distributed", body)
            group = self.group

            def broadcast() -> None:
                for n in names:
                    torch.distributed.broadcast(tensors[n].contiguous(), src=0, group=group)

            await anyio.to_thread.run_sync(broadcast)

    async def _init_group(self, backend: str) -> None:
        port = free_port()
        self.group_name = f"baton-{self.name}-{uuid.uuid4().hex[:6]}"
        body = {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": self.group_name, "backend": backend,
        }
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.call, "POST", "/init_weights_update_group", body)
            self.group = await anyio.to_thread.run_sync(pair_group, port, self.group_name, 0, backend)

    def _write_version(self, version: int, tensors: dict[str, torch.Tensor]) -> Path:
        """safetensors of `version` in a fresh folder (the previous one is removed once replaced)."""
        from safetensors.torch import save_file

        if self.weights_dir is None:
            self.weights_dir = Path(tempfile.mkdtemp(prefix=f"baton-{self.name}-weights-"))
        folder = self.weights_dir / f"v{version:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(self.model_path) / "config.json", folder / "config.json")
        unique, seen = {}, set()
        for n, t in tensors.items():  # tied weights share storage, which safetensors refuses: copies
            t = t.detach().cpu().contiguous()
            unique[n] = t.clone() if t.data_ptr() in seen else t
            seen.add(t.data_ptr())
        save_file(unique, folder / "model.safetensors")
        for old in self.weights_dir.iterdir():
            if old != folder and old.name < folder.name:
                shutil.rmtree(old, ignore_errors=True)
        return folder


def _serialize_shared(tensors: dict[str, torch.Tensor]) -> str:
    """SGLang's `update_weights_from_tensor` payload: the named tensors as shared-memory handles.

    This is SGLang's own same-host protocol (a ForkingPickler of shared-memory handles, base64),
    used only towards a server on this machine; the bytes are handles, not the weights. On CPU the
    `file_system` sharing strategy is required (the default kills SGLang's scheduler).
    """
    from multiprocessing.reduction import ForkingPickler

    torch.multiprocessing.set_sharing_strategy("file_system")
    named = [(name, t.detach().contiguous()) for name, t in tensors.items()]
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named)
    return base64.b64encode(buffer.getvalue()).decode()


def version_of_tag(tag: Any, submitted: int) -> int:
    """Our tags are str(version); the server's initial "default" is the weights it loaded."""
    try:
        return int(tag)
    except (TypeError, ValueError):
        return submitted
