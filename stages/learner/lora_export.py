"""What an export of a LoRA run needs from a checkpoint: the adapter as a PEFT folder, or the base with the
adapter merged in. Both read the checkpoint's `consumer/` folder (DCP shards of any world size, the adapter
alone: stages.learner.state.read_adapter) and the model folder the run trained on; neither loads a model.

`merged_checkpoint` gives whole weights keyed as the model folder's safetensors are (W + alpha/r B A for
each adapted module, as peft's `merge_and_unload` computes it); an adapter on a tied `lm_head` unties it:
the head is then a tensor of its own and the folder's config must say `tie_word_embeddings = false`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from stages.learner.state import read_adapter
from stages.weights.adapter import AdapterSpec, adapter_pairs, base_fingerprint, merged_weights, write_peft_folder


def checkpoint_adapter(consumer: Path, base: Path) -> tuple[AdapterSpec, dict[str, torch.Tensor]]:
    """The checkpoint's adapter (peft's names) and its descriptor for the model folder `base`."""
    lora, tensors = read_adapter(consumer)
    return AdapterSpec(lora.rank, float(lora.alpha), tuple(lora.target_modules), base_fingerprint(base)), tensors


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
    pairs = adapter_pairs(spec, tensors, {name: tuple(t.shape) for name, t in weights.items()})
    untied = "lm_head.weight" in pairs and "lm_head.weight" not in weights
    if untied:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return {**weights, **merged_weights(weights, spec, pairs)}, untied


__all__ = ["checkpoint_adapter", "merged_adapter", "merged_checkpoint", "write_adapter_folder"]
