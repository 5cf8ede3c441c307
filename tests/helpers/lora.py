"""LoRA adapters for tests: a peft policy over a model folder with seeded, non-zero adapter weights, and the
version a LoRA learner publishes for it (stages.learner.lora), made by the learner's own code."""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch

from stages.data.model import load_model
from stages.learner.lora import AdapterPublisher, LoraSpec, wrap
from stages.weights.adapter import pack_adapter, unpack_adapter

# every linear module of the tiny Qwen2, its tied output head included
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
LINEAR_TARGETS = TARGETS[:-1]  # without the head (vLLM serves adapters on linear layers only)


def peft_policy(folder: Path, seed: int, lora: LoraSpec | None = None, scale: float = 0.2,
                targets: tuple[str, ...] = TARGETS) -> torch.nn.Module:
    """The model in `folder` with LoRA adapters whose A and B are seeded normals times `scale` (a trained
    adapter: its outputs differ visibly from the base's), in eval mode; `lora` (default: rank 4 on `targets`)."""
    model = wrap(load_model(folder), lora or LoraSpec(rank=4, alpha=8.0, target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def adapter_version(policy: torch.nn.Module, folder: Path, probe: bool = True) -> dict[str, torch.Tensor]:
    """What a LoRA learner publishes for `policy` (its adapter and descriptor; with `probe`, its logprobs)."""
    spec = policy.peft_config["default"]
    lora = LoraSpec(rank=spec.r, alpha=float(spec.lora_alpha), target_modules=tuple(sorted(spec.target_modules)),
                    check_every=1 if probe else 0)
    return AdapterPublisher(lora, folder).version(policy, torch.device("cpu"), version=1)


def with_probe_shifted(version: dict[str, torch.Tensor], by: float) -> dict[str, torch.Tensor]:
    """The same adapter whose probe claims logprobs `by` away from the learner's: what an engine holding
    another adapter than the learner's would see."""
    spec, tensors = unpack_adapter(version)
    probe = msgspec.structs.replace(spec.probe, logprobs=tuple(x + by for x in spec.probe.logprobs))
    return pack_adapter(msgspec.structs.replace(spec, probe=probe), tensors)


def for_base(version: dict[str, torch.Tensor], base: str) -> dict[str, torch.Tensor]:
    """The same adapter, its descriptor naming another base model."""
    spec, tensors = unpack_adapter(version)
    return pack_adapter(msgspec.structs.replace(spec, base=base), tensors)
