"""`SGLangSampler`: one SGLang server (`stages.engines.sglang.SGLangEngine`, launched with LoRA at the first sample)
serving the base and each LoRA save as an adapter of its own (what stays loaded, and the least recently used
unloaded first: `stages.service.sampler_adapters`).

Fully fine-tuned saves are refused by name (`refusal`): the server serves adapters over its one base. Ranks above
`max_rank` (the server's --max-lora-rank) are refused the same way.
"""

from __future__ import annotations

from pathlib import Path

from stages.engines.sglang import SGLangEngine
from stages.engines.sglang_lora import LoraServing
from stages.engines.sglang_server import sglang_python
from stages.service.sampler_adapters import AdapterSampler
from stages.service.training import ATTENTION, MLP

TARGETS = (*ATTENTION, *MLP, "lm_head")  # every module a Tinker LoraConfig may train


class SGLangSampler(AdapterSampler):
    """`EngineSampler` on one SGLang server: LoRA saves and the base (see the module docstring)."""

    def __init__(self, model_path: Path, seed: int = 0, device: str = "cpu", max_rank: int = 32,
                 max_loaded: int = 4, log_dir: Path | None = None) -> None:
        sglang_python()  # SGLangUnavailable now, naming how to install it, rather than at the first sample
        super().__init__(SGLangEngine(model_path, name="service-sglang", device=device, log_dir=log_dir,
                                      lora=LoraServing(max_rank, TARGETS, max_loaded),
                                      extra_args=("--random-seed", str(seed))), "SGLang", max_rank)
