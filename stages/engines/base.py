"""The Engine protocol: what the producer needs from an inference engine.

An engine turns token prompts into completions and reports, for every generated token, its
behaviour logprob and the weight version that produced it. It receives new weights through a
weight transport (`receive_weights`) and promises to apply a version whole or not at all, only
between decode steps: a completion's tokens each carry the version that really produced them.
A version is either whole weights (a dict of named tensors) or, in a LoRA run, an adapter: an
`AdapterVersion` (`stages.weights.adapter`), its descriptor decoded once where the version was received.
The version says which it is; the engine never inspects tensor names to tell an adapter. It applies an
adapter to its base model, never on top of an earlier version, and serves it only once its probe (when
it carries one) reproduces the learner's logprobs; an adapter it cannot apply raises `EngineError` like
any version that does not fit.

An engine on a mixture-of-experts model may also return, for every generated token, the experts it
was routed to (`Completion.routed_experts`, what the learner's routing replay needs); it says so with
`returns_routed_experts` (`ReturnsRoutedExperts`; an engine that does not say returns none).

Lifecycle: the rollout stage hands each engine the run's part in it (`attach(EngineRun)`) before
`start`; `stop` fails whatever is still in flight with `EngineError`. A new engine kind passes
`tests/contracts/test_engine_contract.py` by adding itself to its `ENGINES` list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from pipeline.contracts import VersionPolicy

if TYPE_CHECKING:
    import torch

    from stages.weights.adapter import AdapterVersion


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Completion:
    tokens: np.ndarray  # int32, generated tokens (a stop token, if hit, is the last one)
    logprobs: np.ndarray  # float32, behaviour logprob of each generated token
    versions: np.ndarray  # int32, weight version that produced each token
    finish_reason: str = "length"  # "length" | "stop" | "preempted" (the engine was preempted: tokens so far)
    meta: dict = field(default_factory=dict)
    # an MoE model's routed experts of each generated token, [tokens, moe layers, top_k] (uint8, int16 beyond
    # 256 experts): row i is the routing of the position whose logits sampled token i (the prompt's last
    # token for i = 0), at every MoE layer; None from a dense model or an engine that does not return them
    routed_experts: np.ndarray | None = None


def preempted_before_start() -> Completion:
    """What a request generated on an engine preempted before it began there (or whose tokens it could not give
    back): nothing."""
    return Completion(np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(0, np.int32), "preempted")


class EngineError(RuntimeError):
    """The engine failed to generate; the request may be retried elsewhere."""


class EnginePreempted(EngineError):
    """The engine was preempted (`Preemptible.preempt`): it takes no request; a rollout sends its requests to
    another engine (stages.rollout.relay)."""


class ContextFull(EngineError):
    """The prompt alone fills the engine's context: the request's fault, not the engine's, and no other engine of
    the run takes it either (the gateway answers 400 `context_length_exceeded`, as OpenAI's API does)."""


@dataclass(frozen=True)
class EngineRun:
    """What a run hands each of its engines (`Engine.attach`) before starting it."""

    policy: VersionPolicy | None = None  # asked what a request in flight does when new weights arrive
    log_dir: Path | None = None  # where the engine writes logs of its own (a server's output)


@runtime_checkable
class NeedsGPUs(Protocol):
    """An engine that generates on GPUs of its own host (the Ray runtime gives its process that many)."""

    @property
    def gpus(self) -> int: ...


@runtime_checkable
class ReturnsRoutedExperts(Protocol):
    """An engine that can say whether its completions carry `routed_experts` (routing replay needs them)."""

    @property
    def returns_routed_experts(self) -> bool:
        """True when every completion carries its tokens' routed experts (an MoE model it records them for)."""
        ...


def returns_routed_experts(engine: object) -> bool:
    """Whether `engine`'s completions carry routed experts; False for an engine that does not say."""
    return isinstance(engine, ReturnsRoutedExperts) and bool(engine.returns_routed_experts)


@runtime_checkable
class Preemptible(Protocol):
    """An engine that can be preempted: its requests in flight end at once with what they generated."""

    def preempt(self) -> None:
        """Every request in flight (decoding or queued) ends now with the tokens it has (`finish_reason`
        "preempted"), so they may continue elsewhere from there; later `generate` calls raise EnginePreempted."""
        ...


@runtime_checkable
class ChecksumsWeights(Protocol):
    """An engine that can prove which weights it generates with (a joining engine's version fence)."""

    def weights_checksums(self, weights: dict[str, torch.Tensor]) -> tuple[int, int]:
        """(its live weights', `weights`' each in the dtype it holds that tensor in) checksums
        (`stages.weights.layout.state_checksum`) under `weights`' names: equal when it holds exactly them."""
        ...


@runtime_checkable
class Engine(Protocol):
    name: str
    stats: dict[str, float]  # the engine's own counters (each generation record carries them)

    @property
    def version(self) -> int:
        """The weight version the engine generates with now."""
        ...

    @property
    def load(self) -> int:
        """Requests queued or generating (new episodes go to the least loaded engine)."""
        ...

    def attach(self, run: EngineRun) -> None: ...

    async def start(self) -> None: ...

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    async def receive_weights(self, version: int, weights: dict[str, torch.Tensor] | AdapterVersion) -> None: ...

    async def stop(self) -> None: ...
