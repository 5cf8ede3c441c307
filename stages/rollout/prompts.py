"""`PromptStream`: what one rollout worker is asked to make, and what it owes a checkpoint.

Prompts come from the feedback channel first (groups to redo: their payload was lost, or the policy
requeued them; one poll for all), then as new samples of the worker's task from its own random
stream. Invariants:
- every prompt handed out is `admit`ted (counted as generating, with an admission number) until the
  outbox says its group is on its way to the ledger (`recorded`); a checkpoint owes exactly the
  admitted ones (`held_sources`), so a resumed run makes them again and none is lost;
- the stream's position (random state, and a dataset task's cursor) is what `state` returns and
  `restore` goes on from: a resumed run draws the samples the interrupted one would have drawn next.
"""

from __future__ import annotations

import random

import msgspec

from pipeline.checkpoint import RandomState, python_random_state, random_state
from pipeline.context import RunContext
from stages.data.tasks import DataTask, Prompt, Task
from stages.rollout.outbox import Finished
from stages.rollout.stats import RolloutStats

_PROMPT = msgspec.json.Decoder(Prompt)
encode_prompt = msgspec.json.encode
decode_prompt = _PROMPT.decode

_MT_WORDS = len(random.Random().getstate()[1])  # a Mersenne Twister state's length


class PromptStream:
    """The prompts of one worker (see the module docstring); redone groups are counted in `stats`."""

    def __init__(self, task: Task, ctx: RunContext, rng: random.Random, stats: RolloutStats) -> None:
        self.task, self.ctx, self.rng, self.stats = task, ctx, rng, stats
        self._generating: dict[int, Prompt] = {}  # admitted, not yet recorded as produced (by admission number)
        self._admitted = 0

    async def next(self, n: int) -> list[Prompt]:
        """`n` prompts: groups to redo first (one feedback poll for all), then new samples."""
        redos = await self.ctx.poll_feedback_many(n)
        if redos:
            self.stats.redone += len(redos)
        prompts = [decode_prompt(await self.ctx.ledger.take_source(r.group)) for r in redos]
        return prompts + [self.task.sample(self.rng) for _ in range(n - len(redos))]

    def admit(self, prompt: Prompt) -> int:
        """Count an admitted prompt as generating (a checkpoint owes it until it is recorded); returns its
        admission number."""
        self._admitted += 1
        self._generating[self._admitted] = prompt
        return self._admitted

    def recorded(self, finished: list[Finished]) -> None:
        """These groups are on their way to the ledger: no longer owed as generating."""
        for item in finished:
            self._generating.pop(item.admission, None)

    def held_sources(self) -> list[bytes]:
        """The encoded prompts admitted and not yet recorded as produced (a resumed run produces them)."""
        return [encode_prompt(p) for p in self._generating.values()]

    def state(self) -> RandomState:
        """Where the stream stands: its random state, and a dataset task's position (`state()`) appended
        to the state's words."""
        version, words, gauss = random_state(self.rng.getstate())
        return version, [*words, *self.task.state()] if isinstance(self.task, DataTask) else words, gauss

    def restore(self, state: RandomState) -> None:
        version, words, gauss = state
        self.rng.setstate(python_random_state((version, words[:_MT_WORDS], gauss)))
        if len(words) > _MT_WORDS and isinstance(self.task, DataTask):
            self.task.restore(tuple(words[_MT_WORDS:]))
