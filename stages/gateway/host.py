"""What the gateway asks of the run that hosts it (`Host`), and `EngineHost`, a small real host over
started engines and a task, in memory (tests, the benchmark, a standalone gateway).

The gateway owns HTTP, the chat template and the token record of each episode; the host owns
everything the run decides: which sample an episode gets and which GRPO group it joins, whether the
staleness budget lets it start, which engine serves a request, and what happens to a finished
episode (trained, or counted as dropped with its reason). Invariants a host keeps:
- `open` either returns a new episode (its id unique for the host's life) or raises `OverBudget`;
  with `wait=True` it waits for budget instead of raising.
- `generate(episode_id, ...)` sends every request of one episode to the same engine (its prefix cache
  holds the conversation) and a new episode's first request to the least loaded one;
  `episode_id=None` is a request outside any episode (never recorded).
  A failed generation raises `EngineError` (the client gets a 503; the episode's record is unchanged,
  so the agent may resend).
- The gateway calls `finish` exactly once per opened episode: with its reward (`reason=None`) or with
  the reason it was dropped (`reward=None`), and every segment of its token record (one, unless the
  agent edited its history; none when it made no request; each an `EpisodeTokens` whose `row()` is a
  codec row).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from stages.data.tasks import Prompt
from stages.engines.base import Completion, Engine, SamplingParams

if TYPE_CHECKING:
    from stages.environments.tokens import EpisodeTokens


@dataclass(frozen=True)
class OpenedEpisode:
    """A new episode: its id, the sample it starts from, and its GRPO group (episodes of one sample)."""

    id: str
    sample: Prompt
    group: int


class OverBudget(Exception):
    """No episode may start now (the staleness budget is spent); try again after `retry_after_s`."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"over the staleness budget; retry after {retry_after_s:.1f} s")
        self.retry_after_s = retry_after_s


@runtime_checkable
class Host(Protocol):
    async def open(self, wait: bool) -> OpenedEpisode: ...

    async def generate(self, episode_id: str | None, prompt_ids: list[int], params: SamplingParams) -> Completion: ...

    async def finish(self, episode_id: str, segments: list[EpisodeTokens], reward: float | None,
                     reason: str | None) -> None: ...


@dataclass
class FinishedEpisode:
    """What `EngineHost.finish` keeps of an episode."""

    id: str
    group: int
    segments: list[EpisodeTokens]
    reward: float | None
    reason: str | None


class EngineHost:
    """A host over started `engines` and `task.sample`: `group_size` consecutive episodes share a
    sample (one GRPO group), at most `max_open` episodes are open at once (the budget), requests
    route sticky per episode and least-loaded (requests in flight, then open episodes) otherwise.
    Finished episodes are kept in `finished` (id -> record); `finish_calls` counts calls per id, so
    a test can check that every episode was finished exactly once."""

    def __init__(self, engines: list[Engine], task, group_size: int = 1, max_open: int = 64,
                 retry_after_s: float = 1.0, seed: int = 0) -> None:
        if not engines:
            raise ValueError("EngineHost needs at least one started engine")
        self.engines, self.task, self.group_size = list(engines), task, group_size
        self.max_open, self.retry_after_s = max_open, retry_after_s
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._group: tuple[int, Prompt] | None = None
        self._group_members = 0
        self._groups = itertools.count()
        self._engine_of: dict[str, int] = {}
        self._group_of: dict[str, int] = {}
        self._slot_freed = asyncio.Condition()
        self.finished: dict[str, FinishedEpisode] = {}
        self.finish_calls: Counter[str] = Counter()

    @property
    def open_episodes(self) -> int:
        return len(self._engine_of)

    async def open(self, wait: bool) -> OpenedEpisode:
        async with self._slot_freed:
            if not wait and self.open_episodes >= self.max_open:
                raise OverBudget(self.retry_after_s)
            await self._slot_freed.wait_for(lambda: self.open_episodes < self.max_open)
            episode_id = f"ep-{next(self._ids)}"
            self._engine_of[episode_id] = self._least_loaded()
            group, sample = self._next_group_member()
            self._group_of[episode_id] = group
            return OpenedEpisode(episode_id, sample, group)

    def _next_group_member(self) -> tuple[int, Prompt]:
        if self._group is None or self._group_members == self.group_size:
            self._group = (next(self._groups), self.task.sample(self._rng))
            self._group_members = 0
        self._group_members += 1
        return self._group

    def _least_loaded(self) -> int:
        """The engine with the fewest requests (its own `load`: it counts other callers' too), then the
        fewest open episodes of this host."""
        episodes = Counter(self._engine_of.values())
        return min(range(len(self.engines)), key=lambda i: (self.engines[i].load, episodes[i]))

    async def generate(self, episode_id: str | None, prompt_ids: list[int], params: SamplingParams) -> Completion:
        index = self._engine_of.get(episode_id, None) if episode_id is not None else None
        if index is None:
            index = self._least_loaded()
        (completion,) = await self.engines[index].generate([list(prompt_ids)], params)
        return completion

    async def finish(self, episode_id: str, segments: list[EpisodeTokens], reward: float | None,
                     reason: str | None) -> None:
        self.finish_calls[episode_id] += 1
        async with self._slot_freed:
            self._engine_of.pop(episode_id, None)
            group = self._group_of.pop(episode_id, -1)
            self.finished[episode_id] = FinishedEpisode(episode_id, group, segments, reward, reason)
            self._slot_freed.notify_all()
