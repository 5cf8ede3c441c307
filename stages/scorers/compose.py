"""`ComposedReward`: rule rewards and model rewards in one weighted sum, scored at once.

`[reward] weights = { classifier = 1.0, exact_match = 0.5 }`: the rule part (exact_match here, a
`stages.data.rewards.RewardFunction` over the weighted sum of the rule rewards) and each model reward
(`classifier`, `judge`: `stages.scorers.base.ModelReward`) score the group concurrently; a sample's
reward is the rule part plus each model reward times its weight. A sample fails when any part failed
for it; its reason is that part's ("classifier timeout", "judge unparsed", "timeout" for the rule part),
and `on_error` says what the rollout does with it, exactly as for a reward function alone: "zero" scores
it 0, "drop" drops its group. Like a RewardFunction, `score` never raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from stages.data.rewards import ON_ERROR, RewardFunction, Sample, Scores
from stages.scorers.base import ModelReward


@dataclass
class ComposedReward:
    """`rule` (None: no rule part) plus `models`, each `(model reward, weight)`."""

    rule: RewardFunction | None
    models: list[tuple[ModelReward, float]] = field(default_factory=list)
    on_error: str = "zero"

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ValueError(f"reward.on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.rule is None and not self.models:
            raise ValueError("a composed reward needs a rule part or a model reward")

    async def start(self, log_dir: Path | None = None) -> None:
        for model, _ in self.models:
            await model.start(log_dir)

    async def stop(self) -> None:
        for model, _ in self.models:
            await model.stop()

    async def score(self, samples: Sequence[Sample]) -> Scores:
        parts: list[tuple[Scores, float] | None] = [None] * (len(self.models) + 1)
        scorers = [(self.rule, 1.0)] if self.rule is not None else []
        scorers += self.models

        async def one(i: int) -> None:
            scorer, weight = scorers[i]
            parts[i] = (await scorer.score(samples), weight)

        async with anyio.create_task_group() as tg:
            for i in range(len(scorers)):
                tg.start_soon(one, i)
        done = [p for p in parts if p is not None]
        rewards = [sum(weight * scores.rewards[i] for scores, weight in done) for i in range(len(samples))]
        failures = [next((scores.failures[i] for scores, _ in done if scores.failures[i]), None)
                    for i in range(len(samples))]
        return Scores([0.0 if f else r for r, f in zip(rewards, failures, strict=True)], failures)

    @property
    def stats(self) -> dict[str, dict]:
        """Each model reward's stats, by its name."""
        return {model.name: model.stats for model, _ in self.models}
