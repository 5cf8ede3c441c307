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

import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import anyio
import numpy as np

from pipeline.context import RunContext
from stages.data.model import prompt_token_ids
from stages.data.rewards import Scores
from stages.data.tasks import Prompt
from stages.engines.base import Completion, Engine, EngineError, SamplingParams
from stages.rollout.stats import RolloutStats
from stages.runfiles import EVAL_FILE


@runtime_checkable
class FixedPrompts(Protocol):
    """A task whose evaluation is a fixed list of prompts (a dataset's eval split)."""

    prompts: Sequence[Prompt]


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
        fixed = self.task.prompts if isinstance(self.task, FixedPrompts) else None
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


Score = Callable[[Prompt, list[Completion], str], Awaitable[Scores]]  # a group's rewards, failures counted by name


@dataclass(frozen=True)
class EvalSetup:
    """What an evaluation takes from its rollout (the sampling gets its temperature; its record goes to `stats`)."""

    tokenizer: Any
    sampling: SamplingParams
    request_timeout_s: float | None
    stats: RolloutStats


class Evaluator:
    """Runs `evaluation` on one worker's engine between its own engine calls (see the module docstring).

    An engine failure or timeout skips that evaluation (logged); it never ends the run."""

    def __init__(self, evaluation: Evaluation, engine: Engine, ctx: RunContext, score: Score, setup: EvalSetup) -> None:
        self.evaluation, self.engine, self.ctx, self.score, self.setup = evaluation, engine, ctx, score, setup
        self.name = f"rollout:{engine.name}"
        self.log = ctx.log(self.name)
        self._next = 0  # the engine version at which the next evaluation is due
        self._prompts: list[Prompt] | None = None

    async def run_if_due(self) -> None:
        """Generate and score the eval prompts once the engine reaches the next due version."""
        evaluation, setup, version = self.evaluation, self.setup, self.engine.version
        if version < self._next:
            return
        self._next = evaluation.next_due(version)
        if self._prompts is None:
            self._prompts = evaluation.prompt_list()
        prompts, n = self._prompts, evaluation.samples
        ids = [prompt_token_ids(setup.tokenizer, p.text, p.messages) for p in prompts]
        self.ctx.note(self.name, f"evaluating {len(prompts)} prompts at version {version}")
        t0 = anyio.current_time()
        try:
            with anyio.fail_after(setup.request_timeout_s):
                completions = await self.engine.generate(
                    [i for i in ids for _ in range(n)], replace(setup.sampling, temperature=evaluation.temperature)
                )
        except (EngineError, TimeoutError) as exc:
            self.log.warning("evaluation skipped", version=version, error=repr(exc))
            return
        rewards: list[float] = []
        for g, prompt in enumerate(prompts):
            rewards += (await self.score(prompt, completions[g * n : (g + 1) * n], "eval_reward_failed")).rewards
        record = evaluation.record([c.versions for c in completions], rewards, anyio.current_time() - t0, version)
        setup.stats.eval = record
        self.log.info("evaluated", **{k.replace("/", "_"): v for k, v in record.items()})
        self.ctx.folder.append_record(EVAL_FILE, {"t": round(time.time() - self.ctx.started_at, 4), **record})
