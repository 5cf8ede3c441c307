"""`EngineSampler`: what the service's `Samplers` ask of one engine kind (torch, SGLang, vLLM; one file
each: `sampler_torch`, `sampler_sglang`, `sampler_vllm`; the server-backed two share `sampler_adapters`), and
`Saved`, what a save holds.

Invariants every kind keeps: a sample or a prompt's logprobs under `path` come from exactly the weights `saved`
(None: the base model's); what it loads for a path it may drop and load again from `saved` (it bounds what it keeps
loaded); after `forget(path)` nothing it serves is the weights saved there before (a new save replaces them).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from stages.engines.base import Completion, SamplingParams
from stages.learner.lora import LoraSpec
from stages.weights.adapter import AdapterVersion
from stages.weights.disk import DiskNotice

Saved = AdapterVersion | DiskNotice | None  # a LoRA save's adapter, a full save's file, or None: the base


class EngineSampler(Protocol):
    def refusal(self, lora: LoraSpec | None) -> str | None:
        """Why this engine cannot sample what a model with `lora` (None: fully fine-tuned) saves; None if it can.
        The service refuses `save_weights_for_sampler` with it, before any work."""
        ...

    async def sample(self, path: str, saved: Saved, prompts: list[list[int]], params: SamplingParams
                     ) -> list[Completion]:
        """A completion of each of `prompts` (tokens, their logprobs, finish reason) under the weights of `path`."""
        ...

    async def prompt_logprobs(self, path: str, saved: Saved, prompt: list[int]) -> np.ndarray:
        """Each token's teacher-forced logprob under the weights of `path`, float32, NaN at position 0."""
        ...

    async def forget(self, path: str) -> None:
        """Drop what serves the weights saved under `path` (they are replaced), once its requests end."""
        ...

    async def close(self) -> None: ...
