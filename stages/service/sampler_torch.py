"""`TorchSampler`: baton's torch engine serving the base and each saved version, one engine per save.

A LoRA model's save is its adapter, kept in memory as received: the engine merges it into its base and checks the
learner's probe before it serves it (`stages.engines.torch_adapter`). A fully fine-tuned model's save is a
safetensors file (`stages.weights.disk`), named by its path and checksum: the engine loads it, checksum verified, and
adopts those tensors (zero-copy where its dtype is theirs, else copied and the loaded ones dropped), so the only full
copies in memory are the loaded engines'. At most `keep` engines stay loaded (at most `keep` full copies); the least
recently used one that serves no request is stopped before another starts (a request for another save waits for
one to be free), and made again from its save when asked. An engine serving requests is never stopped under them.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import numpy as np

from stages.engines.base import Completion, SamplingParams
from stages.engines.torch import TorchEngine, prompt_logprobs
from stages.learner.lora import LoraSpec
from stages.service.sampler_engine import Saved
from stages.weights.disk import DiskNotice, load_verified


class TorchSampler:
    """`EngineSampler` on torch engines: every save served, LoRA or full."""

    def __init__(self, model_path: Path, seed: int = 0, device: str = "cpu", keep: int = 2) -> None:
        self.model_path, self.seed, self.device, self.keep = model_path, seed, device, keep
        self.engines: collections.OrderedDict[str, TorchEngine] = collections.OrderedDict()  # LRU order
        self.made = 0
        self.users: collections.Counter[str] = collections.Counter()  # path -> its requests running now
        self.free = anyio.Condition()  # held around every change of `engines` and `users`; notified as one ends

    def refusal(self, lora: LoraSpec | None) -> str | None:
        return None  # the torch engine samples every model the service trains

    async def forget(self, path: str) -> None:
        async with self.free:
            while self.users[path]:  # once its requests end
                await self.free.wait()
            if path in self.engines:
                await self.engines.pop(path).stop()

    @contextlib.asynccontextmanager
    async def _using(self, path: str, saved: Saved) -> AsyncIterator[TorchEngine]:
        """The engine of `path` (made if need be), not stopped until the caller is done with it."""
        engine = await self._engine(path, saved)
        try:
            yield engine
        finally:
            async with self.free:
                self.users[path] -= 1
                self.free.notify_all()

    async def _engine(self, path: str, saved: Saved) -> TorchEngine:
        async with self.free:
            while path not in self.engines and len(self.engines) >= self.keep:  # stopped first: never more
                idle = next((p for p in self.engines if not self.users[p]), None)  # than `keep` loaded
                if idle is None:
                    await self.free.wait()
                    continue
                await self.engines.pop(idle).stop()
            self.users[path] += 1
            if path in self.engines:
                self.engines.move_to_end(path)
                return self.engines[path]
            self.made += 1
            engine = TorchEngine(self.model_path, name=f"sampler-{self.made}", seed=self.seed, device=self.device)
            try:
                await engine.start()
                if isinstance(saved, DiskNotice):  # checksum verified, then every weight checked to fit
                    await engine.receive_weights(1, await anyio.to_thread.run_sync(load_verified, saved))
                elif saved is not None:
                    await engine.receive_weights(1, saved)  # merged and probed before it serves anything
            except BaseException:
                self.users[path] -= 1
                await engine.stop()
                raise
            self.engines[path] = engine
            return engine

    async def sample(self, path: str, saved: Saved, prompts: list[list[int]], params: SamplingParams
                     ) -> list[Completion]:
        async with self._using(path, saved) as engine:
            return await engine.generate(prompts, params)

    async def prompt_logprobs(self, path: str, saved: Saved, prompt: list[int]) -> np.ndarray:
        async with self._using(path, saved) as engine:
            return await anyio.to_thread.run_sync(prompt_logprobs, engine, prompt)

    async def close(self) -> None:
        for engine in self.engines.values():
            await engine.stop()
        self.engines.clear()
