"""What an export of a LoRA run needs from a checkpoint: the adapter as a PEFT folder, or the base with the
adapter merged in. Both read the checkpoint's `consumer/` folder (DCP shards of any world size, the adapter
alone: stages.learner.state.read_adapter) and the model folder the run trained on; neither loads a model.

`merged_checkpoint` gives whole weights keyed as the model holds them in memory (W + alpha/r B A for
each adapted module, as peft's `merge_and_unload` computes it): the model folder's safetensors, with a
mixture of experts' per-expert tensors fused as transformers 5 fuses them (`fused_tensors`), so an
adapter on the fused experts merges per expert. An adapter on a tied `lm_head` unties it: the head is
then a tensor of its own and the folder's config must say `tie_word_embeddings = false`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from stages.engines.sglang_moe import fused_tensors
from stages.learner.state import read_adapter
from stages.weights.adapter import (
    AdapterSpec,
    adapter_pairs,
    base_fingerprint,
    from_peft_names,
    merged_weights,
    write_peft_folder,
)


def checkpoint_adapter(consumer: Path, base: Path) -> tuple[AdapterSpec, dict[str, torch.Tensor]]:
    """The checkpoint's adapter (named as a version names it: `stages.weights.adapter`) and its descriptor for
    the model folder `base`."""
    lora, tensors = read_adapter(consumer)
    spec = lora.descriptor(base_fingerprint(base))
    return spec, from_peft_names(spec, tensors)


def write_adapter_folder(consumer: Path, base: Path, out: Path) -> Path:
    """The checkpoint's adapter as a PEFT folder at `out` (`peft.PeftModel.from_pretrained(model, out)` and
    SGLang's `/load_lora_adapter` read it; its config names `base` as the base model)."""
    spec, tensors = checkpoint_adapter(consumer, base)
    return write_peft_folder(out, spec, tensors, base)


def merged_checkpoint(consumer: Path, base: Path) -> tuple[dict[str, torch.Tensor], bool]:
    """(every weight of `base` with the checkpoint's adapter merged in, whether a tied head came untied)."""
    return merged_adapter(base, *checkpoint_adapter(consumer, base))


def merged_adapter(base: Path, spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                                                             bool]:
    """(every weight of `base` with the adapter `tensors` merged in, whether a tied head came untied)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(Path(base).glob("*.safetensors")):
        weights.update(load_file(file))
    weights = fused_tensors(weights)  # a mixture of experts' experts as the model holds them (dense: unchanged)
    pairs = adapter_pairs(spec, tensors, {name: tuple(t.shape) for name, t in weights.items()})
    untied = "lm_head.weight" in pairs and "lm_head.weight" not in weights
    if untied:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return {**weights, **merged_weights(weights, spec, pairs)}, untied


__all__ = ["checkpoint_adapter", "merged_adapter", "merged_checkpoint", "write_adapter_folder"]
