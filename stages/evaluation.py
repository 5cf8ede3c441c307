"""Evaluation during training: every `every` versions, a rollout engine generates the eval prompts and
the rollout's reward scores them.

The first rollout worker evaluates, between two engine calls of its own, once its engine's weight
version reaches the next multiple of `every` (version 0 included: the baseline); the other workers and
the learner go on meanwhile, so an asynchronous run does not stop training. Greedy by default
(`temperature = 0`). Each evaluation is one line of the run folder's `eval.jsonl` (and the latest is
the rollout's `stats["eval"]`): `version` and `version_max`, the oldest and newest weight version of
the tokens it generated (equal unless new weights landed mid-generation), and `eval/reward_mean`,
`eval/pass_rate` (the fraction of samples whose reward reached `pass_reward`), `eval/length_mean`,
`eval/n` (samples) and `eval/s` (seconds).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stages.tasks import Prompt

EVAL_FILE = "eval.jsonl"


@dataclass
class Evaluation:
    """`Evaluation(task.eval_task(), every=20)`: what to evaluate and how often.

    `task` is a task with a fixed list of `prompts` (a `DatasetTask`'s eval split: every row, in file
    order), or any Task, of which `sample_prompts` seeded samples are taken once."""

    task: Any
    every: int = 20
    samples: int = 1  # completions per prompt
    temperature: float = 0.0  # 0: greedy
    sample_prompts: int = 64  # how many prompts to sample from a task without a fixed list
    pass_reward: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"eval.every must be >= 1, got {self.every}")
        if self.samples < 1:
            raise ValueError(f"eval.samples must be >= 1, got {self.samples}")
        if self.temperature < 0:
            raise ValueError(f"eval.temperature must be >= 0, got {self.temperature}")

    def prompt_list(self) -> list[Prompt]:
        fixed = getattr(self.task, "prompts", None)
        if fixed is not None:
            return list(fixed)
        rng = random.Random(self.seed)
        return [self.task.sample(rng) for _ in range(self.sample_prompts)]

    def next_due(self, version: int) -> int:
        """The version after `version` at which the next evaluation is due."""
        return (version // self.every + 1) * self.every

    def record(self, versions: Sequence[np.ndarray], rewards: Sequence[float], seconds: float,
               fallback_version: int) -> dict[str, Any]:
        """The `eval.jsonl` line for one evaluation (`versions`: each sample's token versions)."""
        tokens = [v for v in versions if len(v)]
        lo = min((int(v.min()) for v in tokens), default=fallback_version)
        hi = max((int(v.max()) for v in tokens), default=fallback_version)
        n = len(rewards)
        return {
            "version": lo, "version_max": hi, "eval/n": n,
            "eval/reward_mean": round(float(np.mean(rewards)), 4) if n else 0.0,
            "eval/pass_rate": round(sum(r >= self.pass_reward for r in rewards) / n, 4) if n else 0.0,
            "eval/length_mean": round(float(np.mean([len(v) for v in versions])), 2) if n else 0.0,
            "eval/s": round(seconds, 3),
        }


def read_evaluations(run_dir: str | Path | None) -> list[dict[str, Any]]:
    """The run folder's evaluations, oldest first (empty when the run evaluated nothing)."""
    path = Path(run_dir) / EVAL_FILE if run_dir is not None else None
    if path is None or not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
