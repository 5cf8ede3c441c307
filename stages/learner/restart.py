"""A learner group that restarts itself: `[learner] max_restarts` (world_size > 1).

When a rank of the learner dies, or a collective of its ranks fails (`LearnerRankFailed`), the learner
actor (rank 0) does not end the run while restarts are left: it lets its worker threads leave the broken
group, ends every follower, starts a new group (new processes, a new rendezvous) and loads the run's
latest checkpoint into it with the code `--resume` uses (`LearnerActor._begin`: the trainer's
`read_state`, DCP resharding included); without a checkpoint yet, the group starts from the model's
initial weights. Meanwhile the producer keeps generating: its groups wait in the channels (bounded by
the admission gate) and are judged by the staleness policy like any others when the learner takes them.

What continues and what is lost (the rule, unlike `--resume`'s "the resumed run is the checkpoint's run"):
- the version clock continues: the next version trained is the one after the last published, so no
  version number is trained or published twice and the engines keep the weights they hold until it
  arrives (one step; their samples are judged by the staleness rule as always);
- the ledger is not rewound: every sample settled so far keeps its fate and is counted once. The
  versions after the checkpoint (`rolled_back_versions`) are redone in effect: their updates are not in
  the restored weights, and the samples trained in them (`rolled_back_trainings`) keep their fate
  `trained` without their gradient in the final model. Both are stated in the restart's event;
- the step in progress when the group died is not trained: its groups go back into the replay window
  with their use counts and are trained at the next version.

Each restart is a `learner.restart` event (pipeline.events): its cause, the checkpoint's version, the
version it happened at, the versions and trainings rolled back, and its seconds; the run's summary lists
them (`learner_restarts`). When `max_restarts` are spent, the next failure ends the run as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import anyio

from stages.learner.ranks import LearnerRankFailed

RESTART_EVENT = "learner.restart"


def rank_failure(exc: BaseException) -> LearnerRankFailed | None:
    """The `LearnerRankFailed` that `exc` is, or that a task group raised alone (with nothing else failing
    beside it); None for any other error."""
    if isinstance(exc, LearnerRankFailed):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        found, rest = exc.split(LearnerRankFailed)
        if found is not None and rest is None:
            while isinstance(found, BaseExceptionGroup):
                found = found.exceptions[0]
            return found  # type: ignore[return-value]
    return None


class ThreadsInFlight:
    """Counts rank 0's calls running in worker threads, so a restart waits for them to leave the broken
    group before destroying it (a thread abandoned in a collective ends when the collective fails)."""

    def __init__(self) -> None:
        self._lock, self._running = threading.Lock(), 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any) -> Any:
            with self._lock:
                self._running += 1
            try:
                return fn(*args)
            finally:
                with self._lock:
                    self._running -= 1
        return counted

    async def settle(self, timeout_s: float) -> bool:
        """Wait until no call runs (True) or `timeout_s` passed (False)."""
        with anyio.move_on_after(timeout_s):
            while self._running:
                await anyio.sleep(0.05)
        return not self._running


class Restarts:
    """The run's learner restarts: the budget (`max_restarts`), the samples trained per version since the
    latest checkpoint (what a restart rolls back), and the events. Invariant: `done` <= `max_restarts`."""

    def __init__(self, max_restarts: int, ctx: Any) -> None:
        self.max_restarts, self.ctx, self.done = max_restarts, ctx, 0
        self._trained: dict[int, int] = {}  # version -> samples trained at it, since the latest checkpoint
        self._started = 0.0

    def trained(self, version: int, samples: int) -> None:
        self._trained[version] = samples

    def kept(self, version: int) -> None:
        """A checkpoint of `version` was written: versions up to it can no longer be rolled back."""
        self._trained = {v: n for v, n in self._trained.items() if v > version}

    def begin(self, failure: LearnerRankFailed) -> None:
        """Start restart `done + 1` for `failure`, or re-raise it (`max_restarts` spent) saying so."""
        if self.done >= self.max_restarts:
            raise LearnerRankFailed(f"{failure} (learner.max_restarts = {self.max_restarts}: "
                                    f"{self.done} restart(s) done, none left)") from failure
        self.done += 1
        self._started = time.perf_counter()

    def report(self, failure: LearnerRankFailed, restored: int, at: int, checkpoint: str) -> dict[str, Any]:
        """The restart is done: the group holds version `restored`'s state (0: the initial weights) while
        the clock is at `at`. Reports the `learner.restart` event and returns its fields."""
        rolled_back = {v: n for v, n in self._trained.items() if v > restored}
        fields = {
            "restart": self.done, "max_restarts": self.max_restarts, "cause": str(failure),
            "checkpoint": checkpoint, "restored_version": restored, "at_version": at,
            "rolled_back_versions": at - restored, "rolled_back_trainings": sum(rolled_back.values()),
            "seconds": round(time.perf_counter() - self._started, 3),
        }
        self._trained = {}
        self.ctx.event("learner.restart", **fields)  # RESTART_EVENT
        return fields
