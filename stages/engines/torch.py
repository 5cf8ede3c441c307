"""TorchEngine: an in-process HF causal LM as an inference engine (the laptop producer).

Continuous batching: every prompt of every concurrent `generate` call is a request that joins one
running batch at a decode-step boundary (the newcomers are prefilled together and their KV cache is
merged into the batch's, left-padded to a common width with the attention mask and explicit
positions) and leaves it the step it finishes; a call returns as soon as its own requests are done.
At most `max_running` requests decode at once; the rest wait in FIFO order. One decode thread per
engine runs the batch while there is work and exits when idle. Each request has its own sampling
params (temperature, top-p, stop tokens, max-tokens); every token carries its behaviour logprob (of
the tempered distribution, before top-p truncation) and the weight version that computed its logits.
A single call on an idle engine samples exactly the tokens a plain batched loop over its prompts
would (same seed, same random draws: see `Sampling`); logprobs agree up to float rounding once some
of its rows have left the batch. On a mixture-of-experts model every token also carries the experts its
sampling position was routed to at each MoE layer (`Completion.routed_experts`, recorded by forward hooks
on the routers, `stages.data.routing.RoutingCapture`); a dense model gets no hook at all.

An `AdapterVersion` (`stages.weights.adapter`: a LoRA run publishes the adapter alone) is merged into
the engine's own base weights, W + alpha/r B A for each adapted module, once per version, before it is
staged: decoding then runs the plain model at full speed (no LoRA matmuls per token), the rest of the
version is the base's tensors themselves (no copy), and the base is kept untouched for the next merge.
Its probe, when it has one, runs on the merged weights before they are staged: logprobs that differ
from the learner's refuse the version (EngineError; `stats["adapters_refused"]`).

New weights are staged by `receive_weights` and swapped in between decode steps of the running
batch, so a long generation spans versions honestly instead of blocking the push. Swapping means the
parameters become the received tensors (zero-copy: views over a transport's receive slot stay the
live weights until the next version); a tensor of another dtype or device is copied instead.
`receive_weights` returns once the engine reads no earlier version's tensors: at once when it is
idle or not started, else after the running batch's next decode step. That is the release a
double-buffered transport waits for before it rewrites the other slot.
When the run's staleness policy says a running request must `restart` on the staged version (its
sample could no longer be trained, or would span too many versions), that request alone is decoded
again from its prompt on the new weights (counted in `stats["interrupted"]`); the others continue.

`preempt()` (a node taken away): at the next step boundary every running and queued request ends with the
tokens it has, `finish_reason` "preempted" (a rollout continues them on another engine, `stages.rollout.relay`),
and every later call raises EnginePreempted.
"""

from __future__ import annotations

import collections
import inspect
import threading
import time
from pathlib import Path

import anyio
import numpy as np
import torch
from transformers import Qwen2ForCausalLM

from stages.data.model import load_model
from stages.data.routing import RoutingCapture, moe_layout
from stages.engines.base import Completion, EngineError, EnginePreempted, EngineRun, SamplingParams
from stages.engines.torch_adapter import AdapterMerger
from stages.engines.torch_batch import Batch, Call, Request, Sampling
from stages.weights.adapter import AdapterVersion
from stages.weights.layout import state_checksum

CALL_SEED_STRIDE = 1_000_003  # call n's stream is seeded with seed + n * stride (call 0: the engine's seed)

# transformers 5.x renamed `past_key_values` to `cache` (the old name warns); accept both
_CACHE_KWARG = "cache" if "cache" in inspect.signature(Qwen2ForCausalLM.forward).parameters else "past_key_values"


def _cache_of(out):
    return out["cache"] if "cache" in out else out["past_key_values"]


class TorchEngine:
    def __init__(self, model_path: str | Path, name: str = "torch-0", seed: int = 0, dtype: str = "float32",
                 device: str = "cpu", max_running: int = 256) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {max_running}")
        self.name = name
        self.model_path = Path(model_path)
        self.seed, self.dtype, self.device, self.max_running = seed, dtype, device, max_running
        self._model: torch.nn.Module | None = None
        self._version = 0
        self._staged: tuple[int, dict[str, torch.Tensor] | AdapterVersion] | None = None
        self._lock = threading.Lock()  # guards _staged, _queue, _serving and _stopping
        self._queue: collections.deque[Request] = collections.deque()  # FIFO, beyond max_running
        self._running = 0  # requests in the batch
        self._serving = False  # a decode thread is running
        self._stopping = False
        self._weights_lock = threading.Lock()  # a swap never happens inside a forward pass
        self._calls = 0  # generate calls so far: call n samples from its own stream, seeded from (seed, n)
        self.busy_s = 0.0
        self.policy = None  # the run's staleness policy (its `interrupt`), from `attach`
        self._preempted = False  # `preempt` was called: requests end where they are, no new ones
        self.stats = {"interrupted": 0, "prefills": 0, "decode_steps": 0}  # forward passes of each kind
        self._adapters = AdapterMerger(name, self.model_path, self.stats)
        self._capture: RoutingCapture | None = None  # an MoE model's router hooks (a dense one has none)
        # an MoE model's completions carry their tokens' routed experts (the folder's config says before start)
        self.returns_routed_experts = _folder_is_moe(self.model_path)
        self.gpus = int(str(device).startswith("cuda"))  # what its process asks the runtime for

    @property
    def version(self) -> int:
        return self._version

    @property
    def load(self) -> int:
        """Requests queued or decoding (the rollout sends a new episode to the least loaded engine)."""
        return len(self._queue) + self._running

    def attach(self, run: EngineRun) -> None:
        """The run's staleness policy decides which running requests restart on new weights."""
        self.policy = run.policy

    def __getstate__(self) -> dict:
        """What another process needs to make this engine there: its path, name, seed and settings."""
        if self._model is not None:
            raise RuntimeError(f"engine {self.name} is started; only an unstarted engine can move to another process")
        return {"model_path": self.model_path, "name": self.name, "seed": self.seed, "dtype": self.dtype,
                "device": self.device, "max_running": self.max_running}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state.pop("model_path"), **state)

    async def start(self) -> None:
        if self._model is None:
            model = await anyio.to_thread.run_sync(load_model, self.model_path, self.dtype)
            self._model = model.to(self.device).eval()
            layout = moe_layout(self._model)
            self._capture = RoutingCapture(self._model, layout) if layout is not None else None
            self.returns_routed_experts = self._capture is not None
            self._adapters.keep_base(self._model, self._weights_lock)
            with self._lock:
                staged = self._staged
            if staged is not None and isinstance(staged[1], AdapterVersion):  # an adapter that came before start
                self._stage(staged[0], await anyio.to_thread.run_sync(self._adapters.merge, *staged), replace=True)

    async def stop(self) -> None:
        """Fail what is queued or decoding (EngineError: retry elsewhere) and release the model."""
        with self._lock:
            self._stopping = True
        while self._serving:
            await anyio.sleep(0.002)
        self._model = None
        if self._capture is not None:
            self._capture.remove()
            self._capture = None
        self._adapters.keep_base(None, self._weights_lock)
        self._stopping = False

    async def receive_weights(self, version: int, tensors: dict[str, torch.Tensor] | AdapterVersion) -> None:
        """Take a whole version (the engine may read `tensors` until a newer version replaces it);
        returns once no earlier version's tensors are read (see the module docstring). A version that
        does not fit the model raises EngineError here, before it is staged: the engine and its
        running requests stay on their version."""
        if self._model is not None and version > self._version:
            if isinstance(tensors, AdapterVersion):
                tensors = await anyio.to_thread.run_sync(self._adapters.merge, version, tensors)
            _check_fit(self._model, version, tensors)
        self._stage(version, tensors)
        while True:
            with self._lock:
                settled = self._model is None or self._version >= version or self._staged is None
                idle = not self._serving
            if settled:
                return
            if idle:
                await anyio.to_thread.run_sync(self._apply_staged)
            else:
                await anyio.sleep(0.002)  # the running batch applies it after its current decode step

    def weights_checksums(self, weights: dict[str, torch.Tensor]) -> tuple[int, int]:
        """(its live weights', `weights`' cast to its own dtypes) checksums under `weights`' names (a tied
        head is its embedding); a version fence compares them (`stages.engines.base.ChecksumsWeights`)."""
        if self._model is None:
            raise EngineError(f"engine {self.name} is not started: it holds no weights to check")
        with self._weights_lock:
            live = self._model.state_dict(keep_vars=False)
            mine = {n: live[n] for n in weights if n in live}
            theirs = {n: t.to(dtype=live[n].dtype, device="cpu") for n, t in weights.items() if n in live}
            if len(mine) != len(weights):
                return state_checksum(mine), state_checksum(weights)  # names it lacks: never equal
            return state_checksum(mine), state_checksum(theirs)

    def _stage(self, version: int, tensors: dict[str, torch.Tensor] | AdapterVersion, replace: bool = False) -> None:
        """Keep `version` for the next decode-step boundary (any thread; a newer one wins, or this one when
        it `replace`s the staged version by its merged weights)."""
        with self._lock:
            if self._staged is None or version > self._staged[0] or (replace and version == self._staged[0]):
                self._staged = (version, tensors)

    def _apply_staged(self) -> None:
        """Adopt the staged version (any thread). It leaves `_staged` only once `_version` says it is
        applied, so that `receive_weights` never sees neither the staged nor the applied version."""
        if self._staged is None:  # every decode step asks: nothing staged takes no lock
            return
        with self._weights_lock:
            with self._lock:
                staged = self._staged
            try:
                if staged is not None and staged[0] > self._version:
                    assert self._model is not None
                    _adopt(self._model, *staged)
                    self._version = staged[0]
            finally:  # a version that does not fit is dropped with the batch that raised
                with self._lock:
                    if self._staged is staged:
                        self._staged = None

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Completions of `prompts` (in order), each decoded as a request of the running batch."""
        if self._model is None:
            raise RuntimeError(f"engine {self.name} is not started")
        if self._preempted:
            raise EnginePreempted(f"engine {self.name} was preempted: it takes no request")
        call = Call(prompts, params, self._capture.layout if self._capture is not None else None)
        call.generator = torch.Generator(device=self.device).manual_seed(self.seed + self._calls * CALL_SEED_STRIDE)
        self._calls += 1  # in call order on the event loop: the same calls get the same streams in every run
        if call.requests:
            if self._submit(call.requests):
                try:  # calls made in this event-loop tick (a batch of groups admitted together) join this one's
                    await anyio.lowlevel.checkpoint()  # first prefill: one forward pass instead of one each
                finally:
                    threading.Thread(target=self._serve, name=f"{self.name}-decode", daemon=True).start()
            try:
                await call.finished.wait()
            except BaseException:
                call.cancelled = True  # the decode thread drops its running requests at the next step boundary
                with self._lock:
                    self._queue = collections.deque(r for r in self._queue if r.call is not call)
                raise
        if call.error is not None:
            raise call.error
        return call.results

    def _submit(self, requests: list[Request]) -> bool:
        """Queue `requests`; True when no decode thread serves them yet (the caller starts one)."""
        with self._lock:
            self._queue.extend(requests)
            if self._serving:
                return False
            self._serving = True
            return True

    def _serve(self) -> None:
        """The decode thread: step the batch until nothing is running or queued, then exit. An error
        fails every call with a request in the batch or the queue."""
        t0 = time.perf_counter()
        batch = Batch(self._model.device if self._model is not None else torch.device(self.device))
        if self._capture is not None:
            self._capture.own_thread()
        try:
            with torch.no_grad():
                while self._boundary(batch):
                    self._step(batch)
        except BaseException as exc:  # noqa: BLE001 - handed to the callers, who raise it
            with self._lock:
                queued, self._serving = list(self._queue), False
                self._queue.clear()
            for request in batch.rows + queued:
                request.call.fail(exc)
            self._running = 0
        finally:
            self.busy_s += time.perf_counter() - t0

    def _boundary(self, batch: Batch) -> bool:
        """Between two decode steps: drop abandoned rows, restart the rows the policy says must
        restart, apply a staged version, compute the running rows' next logits, admit queued requests.
        False (and the thread's exit is recorded) when there is nothing left to decode."""
        if self._stopping or self._model is None:
            raise EngineError(f"engine {self.name} stopped")
        if self._preempted:  # every running and queued request ends where it is; the thread exits
            with self._lock:
                requests = [r for r in batch.rows + list(self._queue) if not r.call.dropped]
                self._queue.clear()
                self._running, self._serving = 0, False
            for request in requests:
                request.preempted = True
                request.call.complete(request)
            return False
        batch.drop([i for i, r in enumerate(batch.rows) if r.call.dropped])
        with self._lock:
            staged = self._staged[0] if self._staged is not None else None
        restart = _rows_to_restart(batch, staged, self._version, self.policy)
        if restart:
            self.stats["interrupted"] += len(restart)
            requests = [batch.rows[i] for i in restart]
            batch.drop(restart)
            for request in requests:
                request.restart()
            with self._lock:
                self._queue.extendleft(reversed(requests))  # first in line, in order: they had a slot
        self._apply_staged()
        if batch.rows:
            self.stats["decode_steps"] += 1
            out, version, routes = self._forward(**batch.decode_inputs(), use_cache=True, **{_CACHE_KWARG: batch.cache})
            batch.advance(_cache_of(out), out.logits[:, -1], version, routes)
        with self._lock:
            new = []
            while self._queue and len(batch.rows) + len(new) < self.max_running:
                request = self._queue.popleft()
                if not request.call.dropped:
                    new.append(request)
            self._running = len(batch.rows) + len(new)
            if not self._running:
                self._serving = False
                return False
        if new:  # one forward pass over the newcomers' prompts: their KV cache, logits, version and (MoE) experts
            self.stats["prefills"] += 1
            ids, mask, positions, next_pos = _prefill_inputs(self._model, [r.prompt for r in new])
            out, version, routes = self._forward(input_ids=ids, attention_mask=mask, position_ids=positions,
                                                 use_cache=True, logits_to_keep=1)
            batch.merge(new, _cache_of(out), mask, next_pos, out.logits[:, -1], version, routes)
        return True

    def preempt(self) -> None:
        """See the module docstring: requests in flight end with what they have (`finish_reason` "preempted"),
        at the decode thread's next step boundary (nothing is in flight without one)."""
        with self._lock:
            self._preempted = True

    def _step(self, batch: Batch) -> None:
        """Sample one token for every row; finished rows leave the batch and their calls hear of it."""
        nxt, logp = self._sample(batch.logits, batch.sampling)
        batch.last = nxt
        finished = []
        routes = batch.routes
        for i, (request, token, lp, version) in enumerate(
            zip(batch.rows, nxt.tolist(), logp.tolist(), batch.versions, strict=True)
        ):
            if request.append(token, lp, version, None if routes is None else routes[i]):
                finished.append(i)
        done = [batch.rows[i] for i in finished]
        batch.drop(finished)
        self._running = len(batch.rows)
        for request in done:
            request.call.complete(request)

    def _forward(self, **inputs):
        """One forward pass under the weights lock; returns its output, the version it ran and, for an MoE
        model, the experts each row's last position was routed to ([rows, moe layers, top_k]; else None)."""
        with self._weights_lock:
            out = self._model(**inputs)
            routes = None if self._capture is None else self._capture.last_ids(inputs["input_ids"].shape[0])
            return out, self._version, routes

    def _sample(self, logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row at its own temperature and top-p, and its logprob (tempered, before top-p)."""
        logp = torch.log_softmax(logits.float() / sampling.temperature, -1)
        probs = logp.exp()
        if sampling.top_p is not None:
            sorted_p, order = probs.sort(-1, descending=True)
            keep = (sorted_p.cumsum(-1) - sorted_p < sampling.top_p) | (sampling.top_p >= 1.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p * keep)
        # torch.multinomial's own method for one sample (argmax of p / Exp(1) noise), with the noise
        # drawn per call (see `Sampling`)
        noise = sampling.noise(probs)
        if sampling.noise_rows is not None:
            noise = noise[sampling.noise_rows]
        nxt = (probs / noise).argmax(-1)
        return nxt, logp.gather(1, nxt[:, None]).squeeze(1)


def _prefill_inputs(model: torch.nn.Module, prompts: list[list[int]]) -> tuple[torch.Tensor, ...]:
    """The prompts left-padded so every row's next token sits in the last column: ids, attention mask, positions
    and each row's next position, on the model's device."""
    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), model.config.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return ids, mask, positions, torch.tensor([len(p) for p in prompts], device=device)


def _rows_to_restart(batch: Batch, staged: int | None, version: int, policy) -> list[int]:
    """The rows whose oldest token the policy will not carry over to the staged version."""
    if staged is None or staged <= version or policy is None:
        return []
    return [i for i, r in enumerate(batch.rows) if policy.interrupt(r.versions[0], staged) == "restart"]


def _folder_is_moe(folder: Path) -> bool:
    """Whether the model folder's config describes a mixture of experts (False when it cannot be read:
    `start` says what is wrong with the folder)."""
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():  # never a hub id: nothing is downloaded
        return False
    try:
        return moe_layout(AutoConfig.from_pretrained(folder)) is not None
    except (OSError, ValueError, KeyError):
        return False


def _check_fit(model: torch.nn.Module, version: int, tensors: dict[str, torch.Tensor]) -> None:
    """EngineError naming what does not fit unless `tensors` is a whole version of the model's
    weights: every parameter, each of its shape (a tied head may be left out: it is the embedding)."""
    params = dict(model.named_parameters())  # tied parameters appear once
    buffers = dict(model.named_buffers())
    missing = [n for n in params if n not in tensors]
    # a tied head is the embedding: sent under its own name too, but not a parameter of its own
    unexpected = [n for n in tensors if n not in params and n not in buffers and not n.endswith("lm_head.weight")]
    wrong = [n for n, p in params.items() if n in tensors and tensors[n].shape != p.shape]
    if missing or unexpected or wrong:
        raise EngineError(
            f"weights of version {version} do not fit: missing={missing} unexpected={unexpected} wrong shape={wrong}"
        )


def _adopt(model: torch.nn.Module, version: int, tensors: dict[str, torch.Tensor]) -> None:
    """Make `tensors` the model's weights: each parameter becomes its tensor (zero-copy) when dtype
    and device match, else it is copied in; nothing is changed unless the whole version fits."""
    _check_fit(model, version, tensors)
    _untie_head(model, tensors)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    for name, param in params.items():
        t = tensors[name]
        if t.dtype == param.dtype and t.device == param.device:
            param.data = t
        else:
            param.data.copy_(t)
    for name, buffer in buffers.items():
        if name in tensors:
            buffer.copy_(tensors[name])


def _untie_head(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """A version whose output head is not its embedding (an adapter on `lm_head`, merged) unties a tied
    head: it becomes a parameter of its own, the embedding stays what it is."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is not embedding.weight or "lm_head.weight" not in tensors:
        return
    embedding_name = next(n for n, p in model.named_parameters() if p is embedding.weight)
    if tensors["lm_head.weight"].data_ptr() != tensors[embedding_name].data_ptr():
        head.weight = torch.nn.Parameter(tensors["lm_head.weight"], requires_grad=False)


def prompt_logprobs(engine: TorchEngine, tokens: list[int]) -> np.ndarray:
    """log p(token i | the tokens before it) under `engine`'s live weights, float32 [len(tokens)], NaN at position
    0 (nothing precedes it): a prompt scored by the weights the engine samples with (Tinker's compute_logprobs).
    Held off a weight swap by the engine's weights lock, as a decode step is."""
    model = engine._model
    if model is None:
        raise EngineError(f"engine {engine.name} is not started: it holds no weights to score with")
    ids = torch.tensor([list(tokens)], device=model.device)
    with engine._weights_lock, torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).squeeze(1).cpu().numpy()
    return np.concatenate([[np.nan], logp]).astype(np.float32)
