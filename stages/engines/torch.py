"""TorchEngine: an in-process HF causal LM as an inference engine (the laptop producer).

Batched sampling with a KV cache, temperature and top-p, stop tokens and max-tokens; per-token
behaviour logprobs (of the tempered distribution, before top-p truncation) and per-token
weight versions. New weights are staged by `receive_weights` and swapped in between decode steps
of a running batch, so a long generation spans versions honestly instead of blocking the push.
Swapping means the parameters become the received tensors (zero-copy: views over a transport's
receive slot stay the live weights until the next version); a tensor of another dtype or device
is copied instead. `receive_weights` returns once the engine reads no earlier version's tensors:
at once when it is idle or not started, else after the running batch's next decode step. That is
the release a double-buffered transport waits for before it rewrites the other slot.
When the run's staleness policy says a running batch must `restart` on the new version (its
samples could no longer be trained, or would span too many versions), the batch is decoded again
from its prompts on the new weights.
"""

from __future__ import annotations

import inspect
import threading
import time
from pathlib import Path

import anyio
import numpy as np
import torch
from transformers import Qwen2ForCausalLM

from stages.engines.base import Completion, SamplingParams
from stages.model import load_model

# transformers 5.x renamed `past_key_values` to `cache` (the old name warns); accept both
_CACHE_KWARG = "cache" if "cache" in inspect.signature(Qwen2ForCausalLM.forward).parameters else "past_key_values"


def _cache_of(out):
    return out["cache"] if "cache" in out else out["past_key_values"]


class TorchEngine:
    def __init__(self, model_path: str | Path, name: str = "torch-0", seed: int = 0, dtype: str = "float32") -> None:
        self.name = name
        self.model_path = Path(model_path)
        self.seed, self.dtype = seed, dtype
        self._model: torch.nn.Module | None = None
        self._version = 0
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()  # guards _staged and _active
        self._active = 0  # generations running (in worker threads)
        self._weights_lock = threading.Lock()  # a swap never happens inside a forward pass
        self._generator = torch.Generator().manual_seed(seed)
        self.busy_s = 0.0
        self.policy = None  # the run's staleness policy (its `interrupt`); set by the rollout stage
        self.stats = {"interrupted": 0}

    @property
    def version(self) -> int:
        return self._version

    def __getstate__(self) -> dict:
        """What another process needs to make this engine there: its path, name and seed."""
        if self._model is not None:
            raise RuntimeError(f"engine {self.name} is started; only an unstarted engine can move to another process")
        return {"model_path": self.model_path, "name": self.name, "seed": self.seed, "dtype": self.dtype}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"], name=state["name"], seed=state["seed"], dtype=state["dtype"])

    async def start(self) -> None:
        if self._model is None:
            self._model = await anyio.to_thread.run_sync(load_model, self.model_path, self.dtype)
            self._model.eval()

    async def stop(self) -> None:
        self._model = None

    async def receive_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Take a whole version (the engine may read `tensors` until a newer version replaces it);
        returns once no earlier version's tensors are read (see the module docstring)."""
        self._stage(version, tensors)
        while True:
            with self._lock:
                settled = self._model is None or self._version >= version or self._staged is None
                idle = self._active == 0
            if settled:
                return
            if idle:
                await anyio.to_thread.run_sync(self._apply_staged)
            else:
                await anyio.sleep(0.002)  # the running batch applies it after its current decode step

    def _stage(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Keep `version` for the next decode-step boundary (any thread; a newer one wins)."""
        with self._lock:
            if self._staged is None or version > self._staged[0]:
                self._staged = (version, tensors)

    def _apply_staged(self) -> None:
        with self._lock:
            staged, self._staged = self._staged, None
        if staged is None or staged[0] <= self._version:
            return
        version, tensors = staged
        assert self._model is not None
        with self._weights_lock:
            _adopt(self._model, version, tensors)
            self._version = version

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if self._model is None:
            raise RuntimeError(f"engine {self.name} is not started")
        return await anyio.to_thread.run_sync(self._generate, prompts, params)

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        t0 = time.perf_counter()
        with self._lock:
            self._active += 1
        try:
            self._apply_staged()
            return self._decode(prompts, params)
        finally:
            with self._lock:
                self._active -= 1
            self.busy_s += time.perf_counter() - t0

    def _forward(self, **inputs):
        with self._weights_lock:
            return self._model(**inputs)

    def _decode(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample up to `max_new_tokens` for every prompt, applying staged versions between decode
        steps; when the policy says the batch must `restart` on a staged version, decode it again
        from the prompts on that version."""
        n = len(prompts)
        cache, logits, mask, next_pos = self._prefill(prompts)
        tokens = torch.zeros((n, params.max_new_tokens), dtype=torch.long)
        logps = torch.zeros((n, params.max_new_tokens))
        versions = torch.zeros((n, params.max_new_tokens), dtype=torch.int32)
        done = torch.zeros(n, dtype=torch.bool)
        count = torch.zeros(n, dtype=torch.long)
        stops = torch.tensor(params.stop_token_ids, dtype=torch.long) if params.stop_token_ids else None

        oldest = logits_version = self._version
        for step in range(params.max_new_tokens):
            nxt, lp = self._sample(logits, params)
            tokens[:, step], logps[:, step], versions[:, step] = nxt, lp, logits_version
            count += (~done).long()
            if stops is not None:
                done |= torch.isin(nxt, stops)
            if bool(done.all()) or step + 1 == params.max_new_tokens:
                break
            # a staged version lands between decode steps, never inside one; the next token's
            # logits come from the new weights (over a KV cache the older weights wrote)
            if self._must_restart(oldest):
                self.stats["interrupted"] += n
                self._apply_staged()
                return self._decode(prompts, params)
            self._apply_staged()
            logits_version = self._version
            mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], 1)
            out = self._forward(
                input_ids=nxt[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                use_cache=True, **{_CACHE_KWARG: cache},
            )
            cache, logits = _cache_of(out), out.logits[:, -1]
            next_pos += 1
        return _completions(tokens, logps, versions, count, stops)

    def _prefill(self, prompts: list[list[int]]):
        """One forward pass over the prompts, left-padded so every row's next token sits in the last
        column: the KV cache, the next token's logits, the attention mask and each row's next position."""
        model = self._model
        assert model is not None
        lengths = torch.tensor([len(p) for p in prompts])
        width = int(lengths.max())
        ids = torch.full((len(prompts), width), model.config.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        out = self._forward(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        return _cache_of(out), out.logits[:, -1], mask, lengths.clone()

    def _must_restart(self, oldest: int) -> bool:
        with self._lock:
            staged = self._staged[0] if self._staged is not None else None
        if staged is None or staged <= self._version or self.policy is None:
            return False
        return self.policy.interrupt(oldest, staged) == "restart"

    def _sample(self, logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(logits.float() / max(params.temperature, 1e-5), -1)
        probs = logp.exp()
        if params.top_p < 1.0:
            sorted_p, order = probs.sort(-1, descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < params.top_p
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
        nxt = torch.multinomial(probs, 1, generator=self._generator).squeeze(1)
        return nxt, logp.gather(1, nxt[:, None]).squeeze(1)


def _completions(tokens, logps, versions, count, stops) -> list[Completion]:
    """Each row's first `count` sampled tokens; it finished by "stop" when its last one is a stop token."""
    results = []
    for i, k in enumerate(count.tolist()):
        stopped = stops is not None and k > 0 and bool(torch.isin(tokens[i, k - 1], stops))
        results.append(
            Completion(
                tokens=tokens[i, :k].numpy().astype(np.int32),
                logprobs=logps[i, :k].numpy().astype(np.float32),
                versions=versions[i, :k].numpy(),
                finish_reason="stop" if stopped else "length",
            )
        )
    return results


def _adopt(model: torch.nn.Module, version: int, tensors: dict[str, torch.Tensor]) -> None:
    """Make `tensors` the model's weights: each parameter becomes its tensor (zero-copy) when dtype
    and device match, else it is copied in. Every parameter must be given (a tied head may be
    left out: it is the embedding); nothing is changed unless the whole version fits."""
    params = dict(model.named_parameters())  # tied parameters appear once
    buffers = dict(model.named_buffers())
    missing = [n for n in params if n not in tensors]
    # a tied head is the embedding: sent under its own name too, but not a parameter of its own
    unexpected = [n for n in tensors if n not in params and n not in buffers and not n.endswith("lm_head.weight")]
    wrong = [n for n, p in params.items() if n in tensors and tensors[n].shape != p.shape]
    if missing or unexpected or wrong:
        raise RuntimeError(
            f"weights of version {version} do not fit: missing={missing} unexpected={unexpected} wrong shape={wrong}"
        )
    for name, param in params.items():
        t = tensors[name]
        if t.dtype == param.dtype and t.device == param.device:
            param.data = t
        else:
            param.data.copy_(t)
    for name, buffer in buffers.items():
        if name in tensors:
            buffer.copy_(tensors[name])
