"""The policy's placement on the learner's ranks: FSDP2 when there are several, the plain model on one.

With `world_size` > 1 every rank has joined one `torch.distributed` group (gloo on CPU, NCCL on
CUDA; `stages.learner.ranks`) and the model is sharded with FSDP2 (`fully_shard`): each decoder layer,
then the root, so a parameter is a DTensor whose rows are split over the ranks (Shard(0)). On CUDA
the compute runs in bf16 with fp32 reduction and fp32 master weights (`MixedPrecisionPolicy`); on
CPU everything stays fp32. Every function here that touches sharded parameters is a collective:
every rank calls it, in the same order.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from stages.data.model import load_model
from stages.learner.lora import LoraSpec, is_peft, wrap


def pick_device(device: str, world_size: int = 1) -> torch.device:
    """"auto": cuda when a GPU is visible, else cpu. Several ranks on CUDA take one GPU each, by
    `LOCAL_RANK` (or the rank)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and world_size > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank())) % torch.cuda.device_count())
    return torch.device(device)


def load_policy(folder: str | Path, device: torch.device, world_size: int = 1,
                activation_checkpointing: bool = False, shard: bool | None = None,
                lora: LoraSpec | None = None, expert_parallel: int = 1) -> torch.nn.Module:
    """The model in `folder`, in fp32, on `device`; with `lora`, wrapped with peft adapters (its base
    frozen) before anything else; sharded over the ranks with FSDP2 when `world_size` > 1 (or `shard`: a
    group of one, as the GPU check runs FSDP2 on its one GPU). With `expert_parallel` > 1 each rank keeps
    only its share of every MoE layer's experts (`stages.learner.experts`) and FSDP2 shards the rest."""
    model = load_model(folder)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if lora is not None:
        model = wrap(model, lora)
    if not (world_size > 1 if shard is None else shard):
        return model.to(device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else MixedPrecisionPolicy()
    experts: set[torch.nn.Parameter] = set()
    if expert_parallel > 1:
        from stages.learner.experts import shard_experts

        experts = set(shard_experts(model.to(device), mesh, expert_parallel))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mixed, ignored_params=experts or None)
    fully_shard(model, mesh=mesh, mp_policy=mixed, ignored_params=experts or None)
    return model.to(device) if device.type == "cuda" else model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (`model.model.layers` for Qwen2, Llama, ...), also
    under a peft wrapper."""
    if is_peft(model):
        model = model.get_base_model()
    inner = getattr(model, "model", None)  # a transformers model's base model; not one of baton's types
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: baton shards decoder-only HF models "
                         "(Qwen2, Llama, Mistral, ...); use learner.world_size = 1 for this one")
    return list(layers)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer gathered whole, one at a time, into rank 0's host memory (a device
    never holds more than its shard and one parameter); {} on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the gradients to `max_norm` over every rank; the norm before clipping."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def sum_over_ranks(values: list[float]) -> list[float]:
    """`values` summed element-wise over every rank (a collective)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor)
    return tensor.cpu().tolist()
