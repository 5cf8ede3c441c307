"""The Engine protocol: what the producer needs from an inference engine.

An engine turns token prompts into completions and reports, for every generated token, its
behaviour logprob and the weight version that produced it. It receives new weights through a
weight transport (`receive_weights`) and promises to apply a version whole or not at all, only
between decode steps: a completion's tokens each carry the version that really produced them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np


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
    finish_reason: str = "length"  # "length" | "stop"
    meta: dict = field(default_factory=dict)


class EngineError(RuntimeError):
    """The engine failed to generate; the request may be retried elsewhere."""


@runtime_checkable
class Engine(Protocol):
    name: str

    @property
    def version(self) -> int: ...

    async def start(self) -> None: ...

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    async def receive_weights(self, version: int, tensors: dict) -> None: ...

    async def stop(self) -> None: ...
