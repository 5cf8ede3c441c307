"""`Samplers`: baton's torch engine serving the base model and each adapter a client saved for sampling.

Each saved adapter (`save_weights_for_sampler`) is kept as received and served by an engine of its own, started on
its first sample: the engine merges the adapter into its base and checks the learner's probe before it serves it
(`stages.engines.torch_adapter`), so a sample is drawn from exactly the weights that were saved. At most `keep`
engines stay loaded; the least recently used one is stopped and made again from its adapter when asked.
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

BASE = "base"  # the key of the base model's sampler


class Samplers:
    def __init__(self, model_path: Path, seed: int = 0, keep: int = 2, device: str = "cpu") -> None:
        self.model_path, self.seed, self.keep, self.device = model_path, seed, keep, device
        self.adapters: dict[str, AdapterVersion | None] = {BASE: None}
        self.engines: collections.OrderedDict[str, TorchEngine] = collections.OrderedDict()
        self.default_stops = stop_token_ids(load_tokenizer(model_path))
        self.lock = anyio.Lock()

    def save(self, path: str, adapter: AdapterVersion) -> None:
        """Keep `adapter` as the weights of the checkpoint `path`."""
        self.adapters[path] = adapter

    def knows(self, path: str) -> bool:
        return path in self.adapters

    async def _engine(self, path: str) -> TorchEngine:
        async with self.lock:
            if path in self.engines:
                self.engines.move_to_end(path)
                return self.engines[path]
            engine = TorchEngine(self.model_path, name=f"sampler-{len(self.adapters)}", seed=self.seed,
                                 device=self.device)
            await engine.start()
            adapter = self.adapters[path]
            if adapter is not None:
                await engine.receive_weights(1, adapter)  # merged and probed before it serves anything
            self.engines[path] = engine
            while len(self.engines) > self.keep:
                _, old = self.engines.popitem(last=False)
                await old.stop()
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
