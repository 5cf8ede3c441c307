"""The torch engine's continuous batch: requests, the calls they belong to, and the running batch.

A `Call` is one `generate` call; each of its prompts is a `Request` that joins the running `Batch`
on its own and leaves it as soon as it finishes. The batch lives in the engine's decode thread;
a call's caller waits on its event loop and is woken thread-safely once its last request is done.

Batch invariants: row i of every batch tensor (each cache layer's keys and values, the attention
mask, next positions, logits) and of `versions` belongs to `rows[i]`; a row's real tokens are a
contiguous suffix of the cache's columns (rows are left-padded, the mask is 0 on padding), so one
decode step appends one column for every row; at least one row is real in every column (an
all-padding prefix is trimmed when rows leave).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import anyio
import anyio.from_thread
import anyio.lowlevel
import numpy as np
import torch

from stages.data.routing import MoELayout
from stages.engines.base import Completion, SamplingParams

MIN_TEMPERATURE = 1e-5  # temperature 0 means greedy: the engine floors it here


@dataclass(eq=False)
class Request:
    """One prompt of a call, and what has been sampled for it so far (each token with its logprob,
    the weight version whose logits it was sampled from and, for an MoE model, the experts that forward
    routed the sampling position to: [moe layers, top_k])."""

    prompt: list[int]
    params: SamplingParams
    call: Call
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    experts: list[np.ndarray] = field(default_factory=list)
    preempted: bool = False  # it ended because the engine was preempted, not by a stop token or its length

    def append(self, token: int, logprob: float, version: int, experts: np.ndarray | None = None) -> bool:
        """Record one sampled token; True when it ends the request (a stop token, or the last allowed)."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if experts is not None:
            self.experts.append(experts)
        return token in self.params.stop_token_ids or len(self.tokens) >= self.params.max_new_tokens

    def restart(self) -> None:
        """Forget what was sampled: the request is decoded again from its prompt."""
        self.tokens, self.logprobs, self.versions, self.experts = [], [], [], []

    def completion(self) -> Completion:
        stopped = bool(self.tokens) and self.tokens[-1] in self.params.stop_token_ids
        return Completion(
            tokens=np.asarray(self.tokens, dtype=np.int32),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int32),
            finish_reason="preempted" if self.preempted else "stop" if stopped else "length",
            routed_experts=self._routed_experts(),
        )

    def _routed_experts(self) -> np.ndarray | None:
        """[tokens, moe layers, top_k] for an MoE model (its call has a layout), else None."""
        layout = self.call.layout
        if layout is None:
            return None
        if not self.experts:
            return np.zeros((0, len(layout.layers), layout.top_k), dtype=layout.id_dtype)
        return np.stack(self.experts)


class Call:
    """One `generate` call, made on an event loop: its requests, their completions (in prompt order)
    and `finished`, set on that loop once every request is done or the call failed. `cancelled` is
    set by the caller when it stops waiting; the decode thread then drops its requests. `layout` is the
    engine's model's expert layout (None: dense, its completions carry no routed experts)."""

    def __init__(self, prompts: list[list[int]], params: SamplingParams, layout: MoELayout | None = None) -> None:
        self.layout = layout
        self.requests = [Request(list(p), params, self, i) for i, p in enumerate(prompts)]
        self.results: list[Completion | None] = [None] * len(prompts)
        self.error: BaseException | None = None
        self.cancelled = False
        self.generator: torch.Generator | None = None  # its random stream, set by the engine at submission
        self.finished = anyio.Event()
        if params.max_new_tokens <= 0:  # nothing to sample: every request is done already
            self.results = [r.completion() for r in self.requests]
            self.requests = []
        self.remaining = len(self.requests)
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # another anyio backend: wake through its token
            self._loop, self._token = None, anyio.lowlevel.current_token()

    @property
    def dropped(self) -> bool:
        """Nobody waits for this call's requests any more."""
        return self.cancelled or self.error is not None

    def complete(self, request: Request) -> None:
        """(decode thread) `request` finished; wake the caller when it was the call's last."""
        self.results[request.index] = request.completion()
        self.remaining -= 1
        if self.remaining == 0:
            self._wake()

    def fail(self, error: BaseException) -> None:
        """(decode thread) the engine cannot finish this call: the caller raises `error`."""
        if self.error is None and self.remaining > 0:
            self.error = error
            self._wake()

    def _wake(self) -> None:
        if self._loop is None:
            anyio.from_thread.run_sync(self.finished.set, token=self._token)
            return
        try:
            self._loop.call_soon_threadsafe(self.finished.set)
        except RuntimeError:  # the caller's loop has closed: nobody is waiting
            pass


@dataclass
class Sampling:
    """Per-row sampling settings of the batch as column tensors ([rows, 1]); `top_p` is None when
    no row truncates.

    Random draws are counted per call: each step draws `noise_lines` lines of noise, as many per
    call with a row in the batch as the call has prompts (finished ones too), the calls in the order
    their rows appear; `noise_rows` picks each row's line (None: every line, in order). So a lone
    call consumes the generator exactly as a plain batched loop over its prompts does."""

    temperature: torch.Tensor
    top_p: torch.Tensor | None
    noise_lines: int
    noise_rows: torch.Tensor | None
    calls: tuple[Call, ...] = ()  # the calls with a row in the batch, in the order their noise is drawn

    @classmethod
    def of(cls, rows: list[Request], device: torch.device) -> Sampling:
        temperature = torch.tensor([[max(r.params.temperature, MIN_TEMPERATURE)] for r in rows], device=device)
        top_p = None
        if any(r.params.top_p < 1.0 for r in rows):
            top_p = torch.tensor([[r.params.top_p] for r in rows], device=device)
        first_line: dict[Call, int] = {}
        total = 0
        for r in rows:
            if r.call not in first_line:
                first_line[r.call] = total
                total += len(r.call.requests)
        lines = [first_line[r.call] + r.index for r in rows]
        noise_rows = None if lines == list(range(total)) else torch.tensor(lines, device=device)
        return cls(temperature, top_p, total, noise_rows, tuple(first_line))

    def noise(self, like: torch.Tensor) -> torch.Tensor:
        """This step's Exp(1) noise, [noise_lines, vocab]: each call's lines from its own generator, so
        what a request samples depends on its call and the weights, never on which other calls share
        the batch or when they joined (a sync run is reproducible whatever the timing)."""
        return torch.cat([like.new_empty((len(c.requests), like.shape[1])).exponential_(1, generator=c.generator)
                          for c in self.calls])


class Batch:
    """The running batch (decode thread only); see the module docstring for its invariants."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rows: list[Request] = []
        self.versions: list[int] = []  # the weight version that computed each row's `logits`
        self.routes: np.ndarray | None = None  # MoE: the experts of the position that computed `logits`
        self.cache = None  # the model's DynamicCache over all rows
        self.mask = self.next_pos = self.logits = self.last = None
        self._sampling: Sampling | None = None

    @property
    def sampling(self) -> Sampling:
        if self._sampling is None:
            self._sampling = Sampling.of(self.rows, self.device)
        return self._sampling

    def decode_inputs(self) -> dict:
        """The next decode step's inputs: every row's last sampled token at its next position."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], 1)
        return {"input_ids": self.last[:, None], "attention_mask": self.mask, "position_ids": self.next_pos[:, None]}

    def advance(self, cache, logits: torch.Tensor, version: int, routes: np.ndarray | None = None) -> None:
        """Take a decode step's output (after `decode_inputs`)."""
        self.cache, self.logits, self.last, self.routes = cache, logits, None, routes
        self.next_pos = self.next_pos + 1
        self.versions = [version] * len(self.rows)

    def merge(self, rows: list[Request], cache, mask: torch.Tensor, next_pos: torch.Tensor,
              logits: torch.Tensor, version: int, routes: np.ndarray | None = None) -> None:
        """Add prefilled rows: both caches are left-padded to a common width and stacked."""
        if not self.rows:
            self.cache, self.mask, self.next_pos, self.logits, self.routes = cache, mask, next_pos, logits, routes
        else:
            if routes is not None:
                self.routes = np.concatenate([self.routes, routes])
            width = max(self.mask.shape[1], mask.shape[1])
            for mine, theirs in zip(_layers(self.cache), _layers(cache), strict=True):
                mine.keys = torch.cat([_left_pad(mine.keys, width, 2), _left_pad(theirs.keys, width, 2)])
                mine.values = torch.cat([_left_pad(mine.values, width, 2), _left_pad(theirs.values, width, 2)])
            self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(mask, width, 1)])
            self.next_pos = torch.cat([self.next_pos, next_pos])
            self.logits = torch.cat([self.logits, logits])
        self.rows += rows
        self.versions += [version] * len(rows)
        self._sampling = None

    def drop(self, indices: list[int]) -> None:
        """Remove rows (their cache goes with them) and any all-padding prefix left behind."""
        if not indices:
            return
        gone = set(indices)
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in keep]
        self.versions = [self.versions[i] for i in keep]
        self._sampling = None
        if not keep:
            self.cache = self.mask = self.next_pos = self.logits = self.last = self.routes = None
            return
        if self.routes is not None:
            self.routes = self.routes[keep]
        index = torch.tensor(keep, device=self.device)
        self.mask, self.next_pos, self.logits = self.mask[index], self.next_pos[index], self.logits[index]
        if self.last is not None:
            self.last = self.last[index]
        start = int(self.mask.any(0).int().argmax())  # first column some row still uses
        self.mask = self.mask[:, start:]
        for layer in _layers(self.cache):
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]


def _layers(cache) -> list:
    """The cache's per-layer key/value holders; only full-attention layers can be padded and merged."""
    layers = cache.layers
    for layer in layers:
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError("the torch engine's continuous batching needs full-attention layers "
                                      "(a sliding-window layer's cache cannot be merged)")
    return layers


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`t` with zeros prepended along `dim` up to `width`."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim)
