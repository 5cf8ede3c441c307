"""The simulated run's shape over virtual time (`baton simulate`, `[simulate] engine_schedule` and
`learner_restarts`), two parts a `Simulation` holds: its engine fleet (`Fleet`: engines that join and
leave) and its learner's restarts (`LearnerRestarts`).

Follows pipeline/fleet.py and stages/learner/restart.py:

* **Join** (`baton scale --engines N` up): a new engine (an index never used before in the run) pays
  `engine_join_s` (model load, weight snapshot, version fence), then holds the clock's version and asks
  the gate for work like the others.
* **Leave** (down): the newest engines leave first; a leaver stops asking the gate (a wait at the gate
  ends at once), finishes the call in flight, stores and sends its groups, and only then is gone (its
  groups are trained or dropped by the staleness rule, counted, like any other). A joiner told to leave
  before it took work leaves without any.
* **Learner restart**: a failure at a given time is noticed by the next (or current) step's collectives:
  the step's time so far is lost, nothing trains for `learner_restart_s`, the same groups are trained at
  the same version afterwards; the clock goes on, and the versions since the latest checkpoint
  (`[checkpoint] every`) lose their update (counted, as the `learner.restart` event says). The engines
  keep generating meanwhile, up to what the gate admits.

Assumes: a joiner is as fast as the engines that were there; the push goes to the live engines (joiners
included: they are subscribed as they start); a failure while the learner waits for data or pushes is
noticed at its next step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from baton.schema import SimulateSpec
from baton.simulate.calibrate import steady_window
from baton.simulate.events import TIMEOUT, EventLoop, Process, Wait


class Fleet:
    """The engines of a simulated run over time. `start(n)` starts n engines; `run()` is the schedule's
    process. Invariants: an engine's index is never reused; `leaving` is a subset of `members`; each engine
    leaves `members` only once its last call's groups are sent."""

    def __init__(self, loop: EventLoop, spec: SimulateSpec, engine: Callable[[int, float], Process]) -> None:
        self.loop, self.spec, self._engine = loop, spec, engine
        self.steps = [(at, n) for at, n in spec.engine_schedule if at > 0]
        self.members: list[int] = []  # engines joining, live or draining, by index
        self.leaving: set[int] = set()
        self.admitted: Counter[int] = Counter()  # per engine: gate units it took
        self.produced_by: Counter[int] = Counter()  # groups it generated and sent
        self.settled_by: Counter[int] = Counter()  # its groups trained (first time), dropped or filtered
        self.left_at: dict[int, float] = {}  # engines gone: when their drain ended
        self.changes = 0
        self._seconds, self._since, self._next = 0.0, 0.0, 0

    def _change(self, change: Callable[[], Any]) -> None:
        """Apply `change` to the members, keeping the engine-seconds integral of their count."""
        self._seconds += len(self.members) * (self.loop.now - self._since)
        self._since = self.loop.now
        change()

    def engine_seconds(self) -> float:
        """Seconds of engine time so far: every member (joining, live, draining) counts."""
        return self._seconds + len(self.members) * (self.loop.now - self._since)

    def live(self) -> int:
        """Engines not leaving (joining ones included: they are subscribed to the pushes)."""
        return len(self.members) - len(self.leaving)

    def start(self, count: int, join_s: float = 0.0) -> None:
        """Start `count` engines with new indices; each pays `join_s` before asking the gate."""
        for _ in range(count):
            index, self._next = self._next, self._next + 1
            self._change(lambda index=index: self.members.append(index))
            self.loop.spawn(self._engine(index, join_s))

    def gone(self, index: int) -> None:
        """Engine `index` has drained and stopped."""
        self.left_at[index] = self.loop.now
        self._change(lambda: (self.members.remove(index), self.leaving.discard(index)))

    def scale_to(self, target: int) -> None:
        """`baton scale --engines target`: joiners get new indices; the newest engines leave first."""
        staying = [i for i in self.members if i not in self.leaving]
        self.start(max(0, target - len(staying)), self.spec.engine_join_s)
        for index in sorted(staying, reverse=True)[: max(0, len(staying) - target)]:
            self.leaving.add(index)
            self.loop.notify(("leave", index))

    def run(self) -> Process:
        for at, target in self.steps:
            yield max(0.0, at - self.loop.now)
            self.scale_to(target)
            self.changes += 1

    def mean_engines(self, records: list[dict], fixed: int) -> float:
        """The engine count the steady window's engine-idle figure divides by: `fixed` without a schedule,
        else the mean of the members' count over the window (records carry `engine_s`)."""
        if not self.steps:
            return fixed
        window, start = steady_window(records, self.spec.warmup)
        t0, s0 = (start["t"], start["engine_s"]) if start is not None else (0.0, 0.0)
        return (window[-1]["engine_s"] - s0) / max(1e-12, window[-1]["t"] - t0)


class LearnerRestarts:
    """The learner group's failures at the schedule's times and what each restart costs. `run()` is the
    failures' process; the learner trains through `train()`."""

    def __init__(self, loop: EventLoop, spec: SimulateSpec, checkpoint_every: int, samples_per_version: int) -> None:
        self.loop, self.spec = loop, spec
        self.every, self.samples_per_version = checkpoint_every, samples_per_version
        self.pending = 0  # failures not yet noticed by a step
        self.done: list[dict] = []  # one per restart: when, at which version, what it rolled back, seconds

    def run(self) -> Process:
        for at in self.spec.learner_restarts:
            yield max(0.0, at - self.loop.now)
            self.pending += 1
            self.loop.notify(("learner", "failed"))

    def train(self, seconds: float, version: int) -> Process:
        """The step's compute. A learner failure before or during it (noticed by the step's collectives)
        loses the time spent and costs a restart; then the step runs again on the same groups at the same
        version (the real learner puts them back in the replay window). Returns the seconds lost."""
        began = self.loop.now
        while True:
            if self.pending:
                self.pending -= 1
                yield from self._restart(version)
                continue
            if not self.spec.learner_restarts:
                yield seconds
                break
            if (yield Wait(("learner", "failed"), timeout=seconds)) == TIMEOUT:
                break
        return self.loop.now - began - seconds

    def _restart(self, version: int) -> Process:
        """stages/learner/restart.py: a new group from the latest checkpoint; the clock goes on, the versions
        since the checkpoint lose their update (counted, as its `learner.restart` event does)."""
        started = self.loop.now
        yield self.spec.learner_restart_s
        rolled = version % self.every if self.every else version
        self.done.append({"at_s": round(started, 6), "at_version": version, "rolled_back_versions": rolled,
                          "rolled_back_trainings": rolled * self.samples_per_version,
                          "seconds": round(self.loop.now - started, 6)})
