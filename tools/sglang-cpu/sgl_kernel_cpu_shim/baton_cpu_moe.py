"""CPU-ONLY patches for SGLang 0.5.23's mixture-of-experts paths.

1. Routed-experts capture (`--enable-return-routed-experts`).
The capturer's host buffer (`sglang/srt/state_capturer/base.py`, `BaseHostCache`) is allocated by
`alloc_with_host_register`, which pins it with `cudaHostRegister` (`_cuda_host_register` in
`sglang/srt/mem_cache/pool_host/common.py`); without CUDA torch raises ("Torch not compiled with CUDA
enabled") and the scheduler dies at start-up. On a CPU-only server there is no device to copy to, so
pinning buys nothing: this patch makes `_cuda_host_register` a no-op there (the buffer stays ordinary
CPU memory; its `destroy` only unregisters on CUDA/HIP already).

2. Qwen2-MoE's shared-expert gate: `fused_gate_sigmoid_mul[_add]`
(`sglang/kernels/ops/elementwise/elementwise.py`, imported by name into `sglang/srt/models/qwen2_moe.py`)
launches a Triton kernel, which has no CPU driver ("0 active drivers"): the first request crashes. Without
CUDA both become the same arithmetic in torch: sigmoid(hidden @ gate) * shared (added in place for `_add`).

Each acts only when its module is imported while torch sees no CUDA; anything else is untouched. It is
imported at interpreter start-up by `baton_cpu_lora` (the module the `.pth` file written by
`tools/sglang-cpu/install.sh` imports). Never install it beside a GPU SGLang.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


def _unpinned(buffer, registration_granularity_bytes=None) -> None:
    """No host registration without CUDA: the buffer stays ordinary CPU memory."""


def _gated(hidden_states, gate_weight, shared_output):
    import torch

    gate = torch.sigmoid(hidden_states @ gate_weight.reshape(-1, 1).to(hidden_states.dtype))
    return (gate * shared_output).to(shared_output.dtype)


def fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output):
    return _gated(hidden_states, gate_weight, shared_output)


def fused_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states) -> None:
    final_hidden_states.add_(_gated(hidden_states, gate_weight, shared_output))


def _patch_pin(module) -> None:
    module._cuda_host_register = _unpinned


def _patch_gate(module) -> None:
    module.fused_gate_sigmoid_mul = fused_gate_sigmoid_mul
    module.fused_gate_sigmoid_mul_add = fused_gate_sigmoid_mul_add


PATCHES = {"sglang.srt.mem_cache.pool_host.common": _patch_pin,
           "sglang.kernels.ops.elementwise.elementwise": _patch_gate}


def _patch(fullname, module) -> None:
    import torch

    if not torch.cuda.is_available():
        PATCHES[fullname](module)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds each module of PATCHES through the other finders and patches it right after it executes."""

    def __init__(self) -> None:
        self.pending = set(PATCHES)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _patch(fullname, module)

        spec.loader.exec_module = exec_module
        return spec


if not any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _PatchAfterImport())
