"""`AdapterSampler`: what the server-backed `EngineSampler`s share (`sampler_sglang`, `sampler_vllm`): one inference
server, launched with LoRA at the first sample, serving the base and each LoRA save as an adapter of its own.

Each save is loaded under a name of its own (`sampler-N`; N is also its version tag and prefix-cache key: no prompt's
KV computed under one adapter serves another's request) and checked by its probe before it serves (the engine's
`add_adapter`). At most `max_loaded` adapters are loaded (the engine's `lora.max_loaded`): the least recently used one
is unloaded first, once the requests under it ended (none is aborted), and loaded again from its save when asked. A
server that was restarted holds none: each is loaded again at its next use. What a server cannot serve (fully
fine-tuned saves, ranks or targets beyond its launch) is each kind's `refusal`, given before any work.

The engine is a server engine that serves adapters by name (`SGLangEngine`, `VLLMEngine`): `start`, `stop`,
`add_adapter(name, version, adapter)`, `generate(prompts, params, adapter=name)`, `lora.max_loaded` and `adapters`
(`loaded`, `remove(name)`, `scored(tokens, name, version)`).
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

import anyio
import numpy as np

from stages.engines.base import Completion, SamplingParams
from stages.learner.lora import LoraSpec
from stages.service.sampler_engine import Saved
from stages.weights.adapter import AdapterVersion


class AdapterSampler:
    """The adapter bookkeeping of `EngineSampler` over one server engine (see the module docstring), and the
    refusals every such server shares (a kind adds its own to `refusal`)."""

    def __init__(self, engine: Any, kind: str, max_rank: int) -> None:
        self.engine, self.kind, self.max_rank = engine, kind, max_rank
        # path -> its adapter's name and cache key, least recently used first; path -> the calls using it
        self.adapters: collections.OrderedDict[str, tuple[str, int]] = collections.OrderedDict()
        self.users: collections.Counter[str] = collections.Counter()
        self.numbers = itertools.count(1)
        self.started = False
        self.lock = anyio.Lock()

    def refusal(self, lora: LoraSpec | None) -> str | None:
        """A fully fine-tuned model (the server serves adapters over its base) and a rank above the server's."""
        flag = self.kind.lower()
        if lora is None:
            return (f"sampling a fully fine-tuned model is not supported by baton serve --engine {flag} (its server "
                    "serves adapters over the base); start baton serve with --engine torch to sample it")
        if lora.rank > self.max_rank:
            return (f"lora_config.rank {lora.rank} is above the {self.kind} server's --max-lora-rank {self.max_rank}; "
                    f"start baton serve with --max-lora-rank {lora.rank} or more")
        return None

    async def _use(self, path: str, saved: Saved) -> tuple[str | None, int]:
        """The adapter serving `path` (None: the base) and its cache key, loaded if it is not; counted in `users`
        until `_done`, so that it is not unloaded before its requests reach the server."""
        async with self.lock:
            if not self.started:
                await self.engine.start()
                self.started = True
            if saved is None:
                return None, 0
            if not isinstance(saved, AdapterVersion):
                raise TypeError(f"{path}: the {self.kind} sampler serves adapters only, not {type(saved).__name__}")
            held = self.adapters.get(path)
            if held is None or held[0] not in self.engine.adapters.loaded:  # new, evicted, or the server restarted
                held = await self._load(path, saved)
            self.adapters.move_to_end(path)
            self.users[path] += 1
            return held

    async def _load(self, path: str, saved: AdapterVersion) -> tuple[str, int]:
        self.adapters.pop(path, None)
        while len(self.engine.adapters.loaded) >= self.engine.lora.max_loaded and self.adapters:
            await self._unload(next(iter(self.adapters)))  # the least recently used
        number = next(self.numbers)
        await self.engine.add_adapter(f"sampler-{number}", number, saved)
        self.adapters[path] = (f"sampler-{number}", number)
        return self.adapters[path]

    async def _unload(self, path: str) -> None:
        """Unload `path`'s adapter once no call uses it (under `lock`: no new call can start using it)."""
        name, _ = self.adapters.pop(path)
        while self.users[path]:
            await anyio.sleep(0.01)
        if name in self.engine.adapters.loaded:
            await self.engine.adapters.remove(name)

    def _done(self, path: str, saved: Saved) -> None:
        if saved is not None:
            self.users[path] -= 1

    async def sample(self, path: str, saved: Saved, prompts: list[list[int]], params: SamplingParams
                     ) -> list[Completion]:
        name, _ = await self._use(path, saved)
        try:
            return await self.engine.generate(prompts, params, adapter=name)
        finally:
            self._done(path, saved)

    async def prompt_logprobs(self, path: str, saved: Saved, prompt: list[int]) -> np.ndarray:
        name, key = await self._use(path, saved)
        try:
            scored = await self.engine.adapters.scored(prompt, name, key)
        finally:
            self._done(path, saved)
        return np.array([np.nan, *scored], dtype=np.float32)

    async def forget(self, path: str) -> None:
        async with self.lock:
            if path in self.adapters:
                await self._unload(path)

    async def close(self) -> None:
        await self.engine.stop()
