"""`Samplers`: baton's torch engine serving the base model and each set of weights a client saved for sampling.

Each save (`save_weights_for_sampler`) is kept and served by an engine of its own, started on its first sample, so
a sample is drawn from exactly the weights that were saved. A LoRA model's save is its adapter, kept in memory as
received: the engine merges it into its base and checks the learner's probe before it serves it
(`stages.engines.torch_adapter`). A fully fine-tuned model's save is a safetensors file (`stages.weights.disk`),
named by its path and checksum: the engine loads it, checksum verified, and adopts those tensors (zero-copy where
its dtype is theirs, else copied and the loaded ones dropped), so the only full copies in memory are the loaded
engines'. At most `keep` engines stay loaded (at
most `keep` full copies); the least recently used one is stopped and made again from its save when asked.
"""

from __future__ import annotations

import collections
from pathlib import Path

import anyio
import numpy as np

from stages.data.model import load_tokenizer, stop_token_ids
from stages.engines.base import SamplingParams
from stages.engines.torch import TorchEngine, prompt_logprobs
from stages.weights.adapter import AdapterVersion
from stages.weights.disk import DiskNotice, load_verified

BASE = "base"  # the key of the base model's sampler


class Samplers:
    def __init__(self, model_path: Path, seed: int = 0, keep: int = 2, device: str = "cpu") -> None:
        self.model_path, self.seed, self.keep, self.device = model_path, seed, keep, device
        self.saved: dict[str, AdapterVersion | DiskNotice | None] = {BASE: None}  # path -> its weights
        self.engines: collections.OrderedDict[str, TorchEngine] = collections.OrderedDict()
        self.default_stops = stop_token_ids(load_tokenizer(model_path))
        self.lock = anyio.Lock()

    async def save(self, path: str, weights: AdapterVersion | DiskNotice) -> None:
        """Keep `weights` (an adapter, or a full version's file) as the weights of the checkpoint `path`; a save
        under a path saved before replaces it: its engine is stopped and its file, if it had one, removed."""
        async with self.lock:
            before = self.saved.get(path)
            self.saved[path] = weights
            if path in self.engines:
                await self.engines.pop(path).stop()
            if isinstance(before, DiskNotice) and (not isinstance(weights, DiskNotice) or before.path != weights.path):
                Path(before.path).unlink(missing_ok=True)  # each save has a file of its own: this one is not named

    def knows(self, path: str) -> bool:
        return path in self.saved

    async def _engine(self, path: str) -> TorchEngine:
        async with self.lock:
            if path in self.engines:
                self.engines.move_to_end(path)
                return self.engines[path]
            while len(self.engines) >= self.keep:  # stopped first: never more than `keep` loaded, even briefly
                _, old = self.engines.popitem(last=False)
                await old.stop()
            engine = TorchEngine(self.model_path, name=f"sampler-{len(self.saved)}", seed=self.seed,
                                 device=self.device)
            await engine.start()
            saved = self.saved[path]
            try:
                if isinstance(saved, DiskNotice):  # checksum verified, then every weight checked to fit
                    await engine.receive_weights(1, await anyio.to_thread.run_sync(load_verified, saved))
                elif saved is not None:
                    await engine.receive_weights(1, saved)  # merged and probed before it serves anything
            except BaseException:
                await engine.stop()
                raise
            self.engines[path] = engine
            return engine

    async def prompt_logprobs(self, path: str, prompt: list[int]) -> np.ndarray:
        """Each prompt token's logprob under the checkpoint `path` (NaN for the first: nothing precedes it)."""
        engine = await self._engine(path)
        return await anyio.to_thread.run_sync(prompt_logprobs, engine, prompt)

    async def sample(self, path: str, prompt: list[int], num_samples: int, params: dict
                     ) -> list[tuple[np.ndarray, np.ndarray, str]]:
        """`num_samples` completions of `prompt` from the checkpoint `path`: (tokens, logprobs, stop reason) each;
        `params` are Tinker's checked `sampling_params` (`stop` None: the model's EOS ids; [] : none)."""
        stop = params.get("stop")
        sampling = SamplingParams(max_new_tokens=int(params["max_tokens"]), temperature=float(params.get(
            "temperature", 1.0)), top_p=float(params.get("top_p", 1.0)),
            stop_token_ids=self.default_stops if stop is None else tuple(int(s) for s in stop))
        engine = await self._engine(path)
        completions = await engine.generate([list(prompt)] * num_samples, sampling)
        return [(c.tokens, c.logprobs, "stop" if c.finish_reason == "stop" else "length") for c in completions]

    async def close(self) -> None:
        for engine in self.engines.values():
            await engine.stop()
        self.engines.clear()
