"""Pace admission drops nothing because of a straggler (issue 18, item 7): an episode that ended while
a sibling of its group kept running for longer than the staleness bound starts again from its sample
(counted) instead of reaching the learner too old to train."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import anyio
import numpy as np
import pytest

from policies import MaxStaleness
from stages import Rollout, make_tiny_model, tasks
from stages.engines.base import Completion
from stages.environments.feedback import DigitFeedback
from stages.rollout.episode import Episode, EpisodeLimits


class SteppedEngine:
    """Answers every request at once with two tokens of its current `version`."""

    name = "stepped"

    def __init__(self) -> None:
        self.version = 0

    async def generate(self, prompts: list[list[int]], params) -> list[Completion]:
        await anyio.sleep(0)
        return [Completion(np.array([5, 6], np.int32), np.zeros(2, np.float32),
                           np.full(2, self.version, np.int32)) for _ in prompts]


class StragglerFeedback(DigitFeedback):
    """One turn; the first episode to end waits until the engine is 3 versions on (its siblings, and its
    own tokens, are from version 0)."""

    straggled = False

    def __init__(self, engine: SteppedEngine) -> None:
        super().__init__(max_turns=1)
        self.engine = engine

    async def step(self, turn):
        step = await super().step(turn)
        if not StragglerFeedback.straggled:
            StragglerFeedback.straggled = True
            await anyio.sleep(0.05)  # its siblings end meanwhile
            self.engine.version = 3
        return step


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.mark.anyio
async def test_episodes_that_aged_waiting_for_a_straggler_start_again(model: Path) -> None:
    engine = SteppedEngine()
    spec = Rollout(tasks.ReverseDigits(digits=3), [engine], tokenizer=model, group_size=4, batch_groups=1,
                   environment=lambda: StragglerFeedback(engine), limits=EpisodeLimits(max_turns=1))
    events: list[tuple[str, dict]] = []
    ctx = SimpleNamespace(rng=lambda name: random.Random(0), log=lambda name: None, policy=MaxStaleness(k=2),
                          services=SimpleNamespace(faults=None, producers=()),
                          event=lambda kind, **f: events.append((kind, f)))
    worker = spec.worker(engine, None, ctx, None)
    worker._admit(spec.task.sample(random.Random(1)))
    results = await worker._episodes(spec.task.sample(random.Random(1)))
    assert all(isinstance(r, Episode) for r in results)
    spans = [r.tokens.version_span() for r in results]
    # all four were made at version 0 and were 3 > k versions old when the straggler ended: made again
    assert spans == [(3, 3)] * 4
    assert spec.stats["episodes_restarted"] == {"EpisodeStale": 4}
    assert [kind for kind, _ in events] == ["episodes.restarted"] * 4
    assert worker.room.free == spec.group_size * spec.batch_groups, "every episode gave its room back"
