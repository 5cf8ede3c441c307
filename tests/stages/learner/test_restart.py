"""The learner group's restart budget and cost (stages.learner.restart): which failures it heals, when the
budget is spent, and what a restart reports as rolled back. The restart itself, on real rank processes:
tests/e2e/test_sharded_learner.py."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from stages.learner.ranks import LearnerRankFailed
from stages.learner.restart import RESTART_EVENT, Restarts, ThreadsInFlight, rank_failure
from stages.learner.stage import GRPOLearner


class Events:
    """A run context's `event`, kept (the one method `Restarts` calls)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def event(self, kind: str, count: int = 1, **fields: Any) -> None:
        self.seen.append((kind, fields))


def test_only_a_rank_group_failure_alone_is_healed() -> None:
    dead = LearnerRankFailed("learner rank 1 exited with code -9")
    assert rank_failure(dead) is dead
    assert rank_failure(BaseExceptionGroup("tasks", [BaseExceptionGroup("inner", [dead])])) is dead
    assert rank_failure(BaseExceptionGroup("tasks", [dead, ValueError("other")])) is None
    assert rank_failure(RuntimeError("not a rank")) is None


def test_the_budget_is_spent_then_the_failure_ends_the_run_saying_so() -> None:
    restarts = Restarts(1, Events())
    dead = LearnerRankFailed("learner rank 1 exited with code -9")
    restarts.begin(dead)
    with pytest.raises(LearnerRankFailed, match=r"learner rank 1 .*learner.max_restarts = 1: 1 restart\(s\) done"):
        restarts.begin(dead)
    with pytest.raises(LearnerRankFailed, match="max_restarts = 0"):
        Restarts(0, Events()).begin(dead)


def test_a_restart_reports_the_versions_and_trainings_after_the_restored_checkpoint() -> None:
    events = Events()
    restarts = Restarts(2, events)
    for version in range(1, 9):
        restarts.trained(version, 128)
        if version == 5:
            restarts.kept(5)  # a checkpoint of version 5
    restarts.begin(LearnerRankFailed("learner rank 1 exited with code -9"))
    cost = restarts.report(LearnerRankFailed("learner rank 1 exited with code -9"), restored=5, at=8,
                           checkpoint="v00000005-x")
    assert events.seen == [(RESTART_EVENT, cost)]
    assert cost["rolled_back_versions"] == 3 and cost["rolled_back_trainings"] == 3 * 128
    assert cost["restart"] == 1 and cost["restored_version"] == 5 and cost["seconds"] >= 0
    restarts.begin(LearnerRankFailed("again"))  # nothing trained since: nothing rolled back
    assert restarts.report(LearnerRankFailed("again"), 8, 8, "")["rolled_back_trainings"] == 0


def test_a_restart_waits_for_the_threads_in_the_old_group() -> None:
    threads = ThreadsInFlight()

    async def main() -> tuple[bool, bool]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, threads.wrap(time.sleep), 0.3)
            await anyio.sleep(0.05)
            early = await threads.settle(0.01)
            late = await threads.settle(5)
        return early, late

    assert anyio.run(main) == (False, True)


def test_a_negative_budget_names_the_key() -> None:
    with pytest.raises(ValueError, match="learner.max_restarts must be >= 0"):
        GRPOLearner("model", max_restarts=-1)
