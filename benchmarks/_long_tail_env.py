"""`LongTailFeedback`: the environment of `benchmarks/long_tail.py`, plugged by dotted path as
`"benchmarks._long_tail_env:LongTailFeedback"`.

It is `stages.environments.feedback.DigitFeedback` (so reward can rise) with the two long tails of
agentic work added, both seeded:
- a turn budget per episode, a discrete Pareto draw in [min_turns, max_turns]: P(turns >= t) =
  (min_turns / t) ** turn_alpha, so with alpha = 1 on [1, 16] half the episodes have one turn, one in
  sixteen has all sixteen, and the mean is about 3.4. The episode ends at the budget, or earlier at a
  right attempt (the feedback task's own rule);
- an `anyio.sleep` per step, log-uniform in [latency_min_s, latency_max_s] (10 ms to 1 s by default:
  mean 0.215 s, and one step in five takes over 0.4 s), as tools and sandboxes have.

Episode n of a process (counted from `reset`) draws from its own stream seeded by (seed, n), so
which budgets and latencies a run meets does not depend on how its episodes interleave: the sync and
the async run of the benchmark meet the same sequence of episodes.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import anyio

from stages.data.tasks import Prompt
from stages.environments.base import Message, ModelTurn, Step, Tool
from stages.environments.feedback import DigitFeedback


def pareto_turns(rng: random.Random, low: int, high: int, alpha: float) -> int:
    """A discrete Pareto draw in [low, high]: P(turns >= t) = (low / t) ** alpha, the rest at `high`."""
    u = 1.0 - rng.random()  # in (0, 1]
    return min(high, int(low * u ** (-1.0 / alpha)))


def log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


class LongTailFeedback:
    """DigitFeedback with a heavy-tailed turn budget and a heavy-tailed latency per step (module docstring)."""

    tools: tuple[Tool, ...] = ()
    _episodes = itertools.count()  # episodes made in this process since `reset`

    def __init__(self, seed: int = 0, min_turns: int = 1, max_turns: int = 16, turn_alpha: float = 1.0,
                 latency_min_s: float = 0.01, latency_max_s: float = 1.0, **feedback: Any) -> None:
        """`feedback`: DigitFeedback's own options (turn_discount, right, show ...), whatever the base config
        (configs/agent-feedback.toml) sets; its max_turns is this episode's turn budget."""
        if not 1 <= min_turns <= max_turns:
            raise ValueError(f"need 1 <= min_turns <= max_turns, got {min_turns}, {max_turns}")
        if turn_alpha <= 0:
            raise ValueError(f"turn_alpha must be > 0, got {turn_alpha}")
        if not 0 < latency_min_s <= latency_max_s:
            raise ValueError(f"need 0 < latency_min_s <= latency_max_s, got {latency_min_s}, {latency_max_s}")
        self.rng = random.Random(f"{seed}/{next(LongTailFeedback._episodes)}")
        self.turn_budget = pareto_turns(self.rng, min_turns, max_turns, turn_alpha)
        self.latency = (latency_min_s, latency_max_s)
        self.inner = DigitFeedback(max_turns=self.turn_budget, **feedback)

    @classmethod
    def reset(cls) -> None:
        """Start the episode count again (a second run in the same process meets the same episodes)."""
        cls._episodes = itertools.count()

    async def start(self, sample: Prompt) -> list[Message]:
        return await self.inner.start(sample)

    async def step(self, turn: ModelTurn) -> Step:
        await anyio.sleep(log_uniform(self.rng, *self.latency))
        step = await self.inner.step(turn)
        if step.done:
            step.info["turn_budget"] = float(self.turn_budget)
        return step

    async def close(self) -> None:
        await self.inner.close()
