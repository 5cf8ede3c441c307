"""The simulated run's shape over virtual time (`baton simulate`, `[simulate] engine_schedule` and
`learner_restarts`), as a part of `Simulation`: engines that join and leave, a learner group that restarts.

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
from typing import Any

from baton.schema import SimulateSpec
from baton.simulate.calibrate import steady_window
from baton.simulate.events import TIMEOUT, EventLoop, Process, Wait


class FleetOverTime:
    """The engine fleet and learner restarts of a `Simulation` (which sets every attribute below)."""

    spec: SimulateSpec
    cfg: Any
    loop: EventLoop
    counts: Counter[str]
    records: list[dict]
    engines: int
    fleet_steps: list[tuple[float, int]]
    members: list[int]  # engines joining, live or draining, by index (never reused)
    leaving: set[int]
    restarts: list[dict]
    groups_per_step: int
    group_size: int
    _fleet_s: float
    _fleet_at: float
    _next_engine: int
    _failures: int

    def _engine(self, index: int, join_s: float = 0.0) -> Process: ...

    def _fleet_change(self, change: Any) -> None:
        """Apply `change` to the members, keeping the engine-seconds integral of their count."""
        self._fleet_s += len(self.members) * (self.loop.now - self._fleet_at)
        self._fleet_at = self.loop.now
        change()

    def engine_seconds(self) -> float:
        return self._fleet_s + len(self.members) * (self.loop.now - self._fleet_at)

    def live_engines(self) -> int:
        """Engines not leaving (joining ones included: they are subscribed to the pushes)."""
        return len(self.members) - len(self.leaving)

    def _spawn_engine(self, join_s: float) -> None:
        index, self._next_engine = self._next_engine, self._next_engine + 1
        self._fleet_change(lambda: self.members.append(index))
        self.loop.spawn(self._engine(index, join_s))

    def _scale_to(self, target: int) -> None:
        """`baton scale --engines target`: joiners get new indices; the newest engines leave first."""
        staying = [i for i in self.members if i not in self.leaving]
        for _ in range(target - len(staying)):
            self._spawn_engine(self.spec.engine_join_s)
        for index in sorted(staying, reverse=True)[: max(0, len(staying) - target)]:
            self.leaving.add(index)
            self.loop.notify(("leave", index))

    def _fleet(self) -> Process:
        for at, target in self.fleet_steps:
            yield max(0.0, at - self.loop.now)
            self._scale_to(target)
            self.counts["fleet_changes"] += 1

    def _learner_failures(self) -> Process:
        for at in self.spec.learner_restarts:
            yield max(0.0, at - self.loop.now)
            self._failures += 1
            self.loop.notify(("learner", "failed"))

    def _train(self, seconds: float, version: int) -> Process:
        """The step's compute. A learner failure before or during it (noticed by the step's collectives)
        loses the time spent and costs a restart; then the step runs again on the same groups at the same
        version (the real learner puts them back in the replay window). Returns the seconds lost."""
        began = self.loop.now
        while True:
            if self._failures:
                self._failures -= 1
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
        every = self.cfg.checkpoint.every
        rolled = version % every if every else version
        self.counts["learner_restarts"] += 1
        self.restarts.append({"at_s": round(started, 6), "at_version": version, "rolled_back_versions": rolled,
                              "rolled_back_trainings": rolled * self.groups_per_step * self.group_size,
                              "seconds": round(self.loop.now - started, 6)})

    def _mean_engines(self) -> float:
        """The engine count the steady window's engine-idle figure divides by: the fixed one, else the mean
        of the members' count over the window."""
        if not self.fleet_steps:
            return self.engines
        window, start = steady_window(self.records, self.spec.warmup)
        t0, s0 = (start["t"], start["engine_s"]) if start is not None else (0.0, 0.0)
        return (window[-1]["engine_s"] - s0) / max(1e-12, window[-1]["t"] - t0)
