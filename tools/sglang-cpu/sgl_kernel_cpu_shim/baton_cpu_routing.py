"""CPU-ONLY patch for SGLang 0.5.23's routed-experts capture (`--enable-return-routed-experts`).

The capturer's host buffer (`sglang/srt/state_capturer/base.py`, `BaseHostCache`) is allocated by
`alloc_with_host_register`, which pins it with `cudaHostRegister` (`_cuda_host_register` in
`sglang/srt/mem_cache/pool_host/common.py`); without CUDA torch raises ("Torch not compiled with CUDA
enabled") and the scheduler dies at start-up. On a CPU-only server there is no device to copy to, so
pinning buys nothing: this patch makes `_cuda_host_register` a no-op there (the buffer stays ordinary
CPU memory; its `destroy` only unregisters on CUDA/HIP already).

It acts only when that module is imported while torch sees no CUDA; anything else is untouched. It is
imported at interpreter start-up by `baton_cpu_lora` (the module the `.pth` file written by
`tools/sglang-cpu/install.sh` imports). Never install it beside a GPU SGLang.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TRIGGER = "sglang.srt.mem_cache.pool_host.common"


def _unpinned(buffer, registration_granularity_bytes=None) -> None:
    """No host registration without CUDA: the buffer stays ordinary CPU memory."""


def _patch(module) -> None:
    import torch

    if not torch.cuda.is_available():
        module._cuda_host_register = _unpinned


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds TRIGGER through the other finders and patches it right after it executes; finds nothing else."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TRIGGER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if not any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _PatchAfterImport())
