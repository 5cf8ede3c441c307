"""`Fleet`: the producer's workers, grown and shrunk while the run goes on (an elastic run).

A run made with `Pipeline(max_workers=N)` whose producer is `Scalable` gets a fleet, on either runtime: the
runtime gives it a `WorkerLauncher` (how a joining worker is made: in this process, or as a Ray actor), the
fleet's logic is this one. It holds the workers taking work and answers `scale(target)`, from the control endpoint
(`pipeline.control`), `Pipeline.scale` or a fault (`engine.join`, `engine.leave`). The invariants:
* a joining worker is made by the launcher (`WorkerLauncher.join`) with an index never used before in the
  run, and is given work only once its `start` returned (the producer's own fence, e.g. an engine on the
  current weights); a start that fails is an event (`fleet.join_failed`) and the fleet stays as it was;
* a leaving worker (`Retiring.retire`) takes no new work; the fleet stops it only once the work it took
  has left it, so a leave loses nothing and the ledger stays balanced;
* `1 <= target <= max_workers`; the newest workers leave first; joins still starting when the target
  drops are retired as soon as they are up, never given work;
* every join and leave is an event with its cost (`fleet.joined`: seconds from the request until the
  worker may take work; `fleet.left`: seconds to drain), and the live count (`live`).
Admission capacity follows the live workers: each worker asks the gate only for the room it has.
"""

from __future__ import annotations

from typing import Any

import anyio

from pipeline.actor import Actor, ActorFailed
from pipeline.contracts import Retiring, WorkerLauncher


class FleetError(ValueError):
    """A scale request the run cannot honour; the message names the limit and the fix."""


class Fleet:
    """The live workers of a `Scalable` producer (see the module docstring). `workers` are those the
    runtime already runs; the fleet runs and stops the ones that join (made by `launcher`). `ctx` needs
    `event` (and `clock`, `services.faults` for `ScaleFaults`)."""

    name = "fleet"

    def __init__(self, launcher: WorkerLauncher, ctx: Any, workers: list[Actor], max_workers: int) -> None:
        if max_workers < len(workers):
            raise FleetError(f"max_workers = {max_workers} is below the {len(workers)} workers the run starts with; "
                             "raise it (config: [rollout] max_engines)")
        self.launcher, self.ctx, self.max_workers = launcher, ctx, max_workers
        self.workers: list[Actor] = list(workers)  # started, taking work or draining
        self.leaving: set[str] = set()
        self.joining = 0
        self._excess = 0  # joins still starting that are to leave as soon as they are up
        self._next_index = len(workers)
        self._joined: list[Actor] = []  # started by the fleet: it stops them
        self._group: anyio.abc.TaskGroup | None = None
        self._ready = anyio.Event()
        self._changed = anyio.Event()

    @property
    def target(self) -> int:
        """What the fleet is heading for: live workers, plus joins starting, less those leaving."""
        return len(self.workers) - len(self.leaving) + self.joining - self._excess

    def status(self) -> dict[str, Any]:
        """The fleet now: live (taking work), joining, leaving, target, max and the live workers' names."""
        live = [w.name for w in self.workers if w.name not in self.leaving]
        return {"live": len(live), "joining": self.joining, "leaving": len(self.leaving), "target": self.target,
                "max": self.max_workers, "workers": live}

    async def scale(self, target: int, wait: bool = False, preempt: bool = False) -> dict[str, Any]:
        """Head for `target` live workers; with `wait`, return once every join and leave has settled. `preempt`:
        the leaving workers' work in flight stops now and goes on with the others (`Retiring.retire`)."""
        if not 1 <= target <= self.max_workers:
            raise FleetError(f"scale to {target} workers: the run allows 1 to {self.max_workers} "
                             "(its max_workers; config: [rollout] max_engines)")
        await self._ready.wait()
        assert self._group is not None
        while self.target < target:
            if self._excess:
                self._excess -= 1
                continue
            self.joining += 1
            self._group.start_soon(self._join, self._next_index, anyio.current_time())
            self._next_index += 1
        while self.target > target:
            live = [w for w in reversed(self.workers) if w.name not in self.leaving]
            if len(live) <= target:
                self._excess += 1
                continue
            if not isinstance(live[0], Retiring):
                raise FleetError(f"worker {live[0].name} cannot leave a running run (it is not Retiring, e.g. a "
                                 f"gateway worker); the fleet stays at {self.target}")
            self.leaving.add(live[0].name)
            self._group.start_soon(self._retire, live[0], preempt)
        if wait:
            await self.settled()
        return self.status()

    async def settled(self) -> None:
        """Wait until no worker is joining or leaving."""
        while self.joining or self.leaving:
            await self._changed.wait()

    async def start(self) -> None:
        return None

    async def run(self) -> None:
        async with anyio.create_task_group() as group:
            self._group = group
            self._ready.set()
            await anyio.sleep_forever()

    async def stop(self) -> None:
        with anyio.CancelScope(shield=True):
            for worker in reversed(self._joined):
                await worker.stop()
            self._joined.clear()

    async def _join(self, index: int, asked_at: float) -> None:
        worker: Actor | None = None
        try:
            worker = self.launcher.join(index)
            await worker.start()
        except anyio.get_cancelled_exc_class():  # the run ends while it starts: what it started is stopped
            if worker is not None:
                with anyio.CancelScope(shield=True):
                    await worker.stop()
            raise
        except Exception as exc:  # noqa: BLE001 - the run goes on without it; the event says why
            self.joining -= 1
            self._signal()
            self.ctx.event("fleet.join_failed", index=index, error=f"{type(exc).__name__}: {exc}")
            if worker is not None:
                with anyio.CancelScope(shield=True):
                    await worker.stop()
            return
        self.joining -= 1
        self.workers.append(worker)
        self._joined.append(worker)
        if self._excess:  # the target dropped while it started: it leaves before taking work
            self._excess -= 1
            self.leaving.add(worker.name)
            self._group.start_soon(self._retire, worker)  # type: ignore[union-attr]
        else:
            self.ctx.event("fleet.joined", worker=worker.name, join_s=round(anyio.current_time() - asked_at, 3),
                           live=self.status()["live"])
        self._signal()
        try:
            await worker.run()
        except Exception as exc:
            raise ActorFailed(worker.name, "run", exc) from exc

    async def _retire(self, worker: Actor, preempt: bool = False) -> None:
        started = anyio.current_time()
        assert isinstance(worker, Retiring)  # scale() chose it as one
        await worker.retire(preempt)
        self.workers[:] = [w for w in self.workers if w is not worker]  # in place: checkpoint cuts read this list
        self._joined = [w for w in self._joined if w is not worker]
        await worker.stop()
        self.leaving.discard(worker.name)
        self.ctx.event("fleet.left", worker=worker.name, drain_s=round(anyio.current_time() - started, 3),
                       live=self.status()["live"], preempted=preempt)
        self._signal()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


class ScaleFaults:
    """The fault kinds `engine.join` and `engine.leave` (`pipeline.faults`): at each scheduled version the
    fleet grows (or shrinks) by one worker; the firing recovers once the fleet has settled. A version the clock
    passed while an earlier firing settled still fires, late (at most once: `Schedule.hit`)."""

    name = "fault:scale"

    def __init__(self, ctx: Any, fleet: Fleet, schedules: dict[int, Any]) -> None:
        self.ctx, self.fleet, self.schedules = ctx, fleet, schedules  # {+1 or -1: Schedule}

    async def start(self) -> None:
        return None

    async def run(self) -> None:
        seen = await self.ctx.clock.current()
        while True:
            now = await self.ctx.clock.wait_change(seen)
            for version in range(seen + 1, now + 1):  # each version passed, also while a scale settled
                for step, schedule in self.schedules.items():
                    if schedule.hit(occurrence=version):
                        target = min(self.fleet.max_workers, max(1, self.fleet.target + step))
                        await self.fleet.scale(target, wait=True)
                        schedule.recovered(f"{self.fleet.status()['live']} workers live at version {version}")
            seen = now

    async def stop(self) -> None:
        return None


def scale_faults(ctx: Any, fleet: Fleet | None) -> ScaleFaults | None:
    """The actor that fires `engine.join` / `engine.leave` where a fault plan has them, else None."""
    plan = ctx.services.faults
    if plan is None or fleet is None:
        return None
    schedules = {step: s for step, kind in ((1, "engine.join"), (-1, "engine.leave"))
                 if (s := plan.schedule(kind)) is not None}
    return ScaleFaults(ctx, fleet, schedules) if schedules else None


__all__ = ["Fleet", "FleetError", "ScaleFaults", "scale_faults"]
