"""CPU-ONLY patch for SGLang 0.5.23's LoRA code: pinned host memory where no accelerator exists.

`sglang/srt/lora/layers.py` (and the torch-native LoRA backend) build their CPU offset tensors with
`torch.tensor(..., pin_memory=True)` and call `.pin_memory()` on CPU tensors; without CUDA torch
refuses both ("requires a CUDA or other accelerator backend"), so `--enable-lora` crashes the server
at start-up. Pinned memory only speeds host-to-device copies, and on a CPU-only server there is no
device: this patch makes those calls return ordinary CPU memory.

It acts only in a process that imports `sglang.srt.lora` while torch sees no accelerator, and only
then patches `torch.Tensor.pin_memory` and the `pin_memory=` keyword of torch's tensor factories. It
is imported at interpreter start-up by the `.pth` file `tools/sglang-cpu/install.sh` writes; a process
that never loads SGLang's LoRA code (or runs on a GPU) is untouched. Never install it beside a GPU
SGLang: there pinned memory is real and nothing here is needed.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys

TRIGGER = "sglang.srt.lora"
FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like")


def _patch_torch() -> None:
    import torch

    if getattr(torch, "_baton_cpu_pin_memory_patch", False) or torch.cuda.is_available():
        return

    def unpinned(self, *args, **kwargs):
        return self

    def without_pin(factory):
        @functools.wraps(factory)
        def make(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return make

    torch.Tensor.pin_memory = unpinned
    for name in FACTORIES:
        setattr(torch, name, without_pin(getattr(torch, name)))
    torch._baton_cpu_pin_memory_patch = True


class _PatchOnLoraImport(importlib.abc.MetaPathFinder):
    """Patches torch the first time SGLang's LoRA package is imported; finds nothing itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == TRIGGER:
            sys.meta_path.remove(self)
            _patch_torch()
        return None


if not any(isinstance(finder, _PatchOnLoraImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _PatchOnLoraImport())

import baton_cpu_moe  # noqa: E402,F401 - the MoE patches (routed-experts pin, shared-expert gate), same .pth line
