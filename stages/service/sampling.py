"""`Samplers`: the base model and each set of weights a client saved for sampling, served by one engine kind
(`SamplerSettings.engine`: `torch`, the default, `sglang` or `vllm`; `stages.service.sampler_engine.EngineSampler`,
one file per kind).

Each save (`save_weights_for_sampler`) is kept as received (a LoRA model's adapter, a fully fine-tuned model's
safetensors file) and served from exactly those weights; a save under a path saved before replaces it: what served
the old weights is dropped and its file, if it had one, removed. How many saves stay loaded at once, and which goes
first (the least recently used), is the engine kind's (`sampler_torch`, `sampler_sglang`, `sampler_vllm`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import anyio
import numpy as np

from stages.data.model import load_tokenizer, stop_token_ids
from stages.engines.base import SamplingParams
from stages.learner.lora import LoraSpec
from stages.service.sampler_engine import EngineSampler, Saved
from stages.weights.disk import DiskNotice

BASE = "base"  # the key of the base model's sampler
ENGINES = ("torch", "sglang", "vllm")


class EngineUnavailable(RuntimeError):
    """The engine kind asked for cannot run here (its environment is missing)."""


@dataclass(frozen=True)
class SamplerSettings:
    """`baton serve --engine KIND`: torch keeps at most `keep` engines (full copies) loaded; an SGLang or vLLM
    server is launched with LoRA up to `max_lora_rank`, holding at most `max_loaded` adapters at once."""

    engine: str = "torch"
    keep: int = 2
    max_lora_rank: int = 32
    max_loaded: int = 4

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.keep < 1 or self.max_lora_rank < 1 or self.max_loaded < 2:
            raise ValueError(f"need keep >= 1, max_lora_rank >= 1 and max_loaded >= 2, got {self}")


def engine_sampler(settings: SamplerSettings, model_path: Path, seed: int, device: str,
                   log_dir: Path | None = None) -> EngineSampler:
    """The sampler of `settings.engine` (the one place that maps a kind to its implementation). EngineUnavailable,
    saying how to install it, when its environment is missing."""
    if settings.engine == "torch":
        from stages.service.sampler_torch import TorchSampler

        return TorchSampler(model_path, seed, device, settings.keep)
    if settings.engine == "sglang":
        from stages.engines.sglang_server import SGLangUnavailable
        from stages.service.sampler_sglang import SGLangSampler

        try:
            return SGLangSampler(model_path, seed, device, settings.max_lora_rank, settings.max_loaded, log_dir)
        except SGLangUnavailable as exc:
            raise EngineUnavailable(f"--engine sglang: {exc}") from None
    from stages.engines.vllm_server import VLLMUnavailable
    from stages.service.sampler_vllm import VLLMSampler

    try:
        return VLLMSampler(model_path, seed, device, settings.max_lora_rank, settings.max_loaded, log_dir)
    except VLLMUnavailable as exc:
        raise EngineUnavailable(f"--engine vllm: {exc}") from None


def cut_at_stop_strings(tokens: np.ndarray, stops: list[str], decode: Callable[[list[int]], str]) -> int | None:
    """How many of `tokens` to keep so that the text ends with the first stop string it contains (the tokens up to
    and including the one that completes it, as a stop token is kept), or None if the text contains none. The
    engine generates to its token budget (or an EOS); the cut is made on the decoded text, so a stop string split
    across tokens is found. The kept prefix is the shortest whose text contains a stop (a binary search: the
    decoded text of a longer prefix contains that of a shorter one)."""
    text = decode([int(t) for t in tokens])
    if not any(stop in text for stop in stops):
        return None
    low, high = 1, len(tokens)
    while low < high:
        middle = (low + high) // 2
        if any(stop in decode([int(t) for t in tokens[:middle]]) for stop in stops):
            high = middle
        else:
            low = middle + 1
    return low


class SaveInfo(NamedTuple):
    """When a checkpoint was saved for sampling (time.time()) and the model's step then (its version)."""

    at: float
    version: int | None


class Samplers:
    def __init__(self, model_path: Path, seed: int = 0, device: str = "cpu",
                 settings: SamplerSettings | None = None, log_dir: Path | None = None) -> None:
        self.saved: dict[str, Saved] = {BASE: None}  # path -> its weights
        self.when: dict[str, SaveInfo] = {BASE: SaveInfo(0.0, None)}  # path -> when it was saved, the step then
        self.engine = engine_sampler(settings or SamplerSettings(), model_path, seed, device, log_dir)
        self.tokenizer = load_tokenizer(model_path)
        self.default_stops = stop_token_ids(self.tokenizer)
        self.lock = anyio.Lock()

    def refusal(self, lora: LoraSpec | None) -> str | None:
        """Why the engine cannot sample a save of a model with `lora` (None: fully fine-tuned); None if it can."""
        return self.engine.refusal(lora)

    async def save(self, path: str, weights: Saved, at: float | None = None, version: int | None = None) -> None:
        """Keep `weights` (an adapter, or a full version's file) as the weights of the checkpoint `path`, saved at
        `at` (time.time(); now by default); a save under a path saved before replaces it: what served it is dropped
        and its file, if it had one, removed."""
        async with self.lock:
            before = self.saved.get(path)
            self.saved[path] = weights
            self.when[path] = SaveInfo(time.time() if at is None else at, version)
            await self.engine.forget(path)
            if isinstance(before, DiskNotice) and (not isinstance(weights, DiskNotice) or before.path != weights.path):
                Path(before.path).unlink(missing_ok=True)  # each save has a file of its own: this one is not named

    def knows(self, path: str) -> bool:
        return path in self.saved

    async def prompt_logprobs(self, path: str, prompt: list[int]) -> np.ndarray:
        """Each prompt token's logprob under the checkpoint `path` (NaN for the first: nothing precedes it)."""
        return await self.engine.prompt_logprobs(path, self.saved[path], list(prompt))

    async def sample(self, path: str, prompt: list[int], num_samples: int, params: dict
                     ) -> list[tuple[np.ndarray, np.ndarray, str]]:
        """`num_samples` completions of `prompt` from the checkpoint `path`: (tokens, logprobs, stop reason) each;
        `params` are Tinker's checked `sampling_params` (`stop` None: the model's EOS ids; [] : none)."""
        stop = params.get("stop")
        texts = [stop] if isinstance(stop, str) else [s for s in stop or () if isinstance(s, str)]
        ids = self.default_stops if stop is None or texts else tuple(int(s) for s in stop)
        sampling = SamplingParams(max_new_tokens=int(params["max_tokens"]), temperature=float(params.get(
            "temperature", 1.0)), top_p=float(params.get("top_p", 1.0)), stop_token_ids=ids)
        completions = await self.engine.sample(path, self.saved[path], [list(prompt)] * num_samples, sampling)
        out = []
        for c in completions:
            end = cut_at_stop_strings(c.tokens, texts, self.tokenizer.decode) if texts else None
            if end is not None:
                out.append((c.tokens[:end], c.logprobs[:end], "stop"))
            else:
                out.append((c.tokens, c.logprobs, "stop" if c.finish_reason == "stop" else "length"))
        return out

    async def close(self) -> None:
        await self.engine.close()
