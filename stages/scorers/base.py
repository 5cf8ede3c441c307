"""What a scorer is to the rollout: the protocols the model-scored rewards and the teachers implement.

A scorer runs beside the producer's engines, never on them: a group is scored after its episodes gave
their engine room back (`stages.rollout.worker`), so scoring overlaps generation. Two kinds:

- a **model reward** (`ModelReward`: the classifier, the judge) scores a group's samples like a
  `stages.data.rewards.RewardFunction` and never raises: a sample it could not score carries a reason
  in `Scores.failures`, and the reward's `on_error` decides (scored 0, or the group dropped);
- a **teacher** (`Teacher`) returns the per-token logprobs of token sequences under its model, for
  on-policy distillation (`stages.scorers.teacher.Distillation`).

Both are started by each producer process that uses them (`start`, idempotent and counted: the
workers of one process share one scorer, which stops with the last of them), and both keep `stats`:
calls, failures by reason, seconds spent, the scoring server's restarts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from stages.data.rewards import Sample, Scores


class ScorerError(RuntimeError):
    """A scoring request failed after its retries; `reason` is the short form counted in the stats."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@runtime_checkable
class Lifecycle(Protocol):
    """A part the producer starts with its workers and stops with them (`log_dir`: the run folder)."""

    async def start(self, log_dir: Path | None = None) -> None: ...

    async def stop(self) -> None: ...


@runtime_checkable
class ModelReward(Lifecycle, Protocol):
    """A reward a model computes; composable with rule rewards (`stages.scorers.compose.ComposedReward`)."""

    name: str
    stats: dict

    async def score(self, samples: Sequence[Sample]) -> Scores: ...


@runtime_checkable
class Teacher(Lifecycle, Protocol):
    """A model that scores token sequences: for each, the logprob of every token after the first given
    the tokens before it (`len(ids) - 1` values, float32), at temperature 1."""

    name: str
    stats: dict

    async def logprobs(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]: ...


def record(stats: dict, seconds: float, failure: str | None = None) -> None:
    """One more call in a scorer's `stats`: its seconds, and its failure's reason when it failed."""
    stats["calls"] = stats.get("calls", 0) + 1
    stats["seconds"] = stats.get("seconds", 0.0) + seconds
    if failure is not None:
        failures = stats.setdefault("failures", {})
        failures[failure] = failures.get(failure, 0) + 1
