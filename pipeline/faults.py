"""Fault injection: named points at the run's boundaries, switched on by a `FaultPlan`.

    plan = FaultPlan([FaultSpec("store.get_fail", at=(5, 6, 7)), FaultSpec("channel.stall", probability=0.01)])
    Pipeline(..., faults=plan)                        # or [[faults]] in a config

Each boundary asks the plan for the `Schedule` of its kind (`plan.schedule(kind, scope)`); when the
kind is not planned the answer is None and the boundary installs nothing, so a run without faults
pays one dict lookup per boundary at build time and, per call, at most one `is None` check (a
channel's `before_send`). The hooks live where the boundary is (a store wrapper in `buffers.faulty`,
engine and weight wrappers in `stages.engines.faulty` / `stages.weights.faulty`, the clock wrapper
and the channels' `before_send` here); this module decides *when* (generic, no RL in it):

    engine.crash, engine.hang         per engine `generate` call      stages.engines.faulty
    engine.server_kill                per engine `generate` call      stages.engines.faulty_server
    engine.server_kill_push, engine.push_refused  per version pushed  stages.engines.faulty_server
    store.put_fail, store.master_restart, store.holder_crash  per put  buffers.faulty
    store.get_fail, store.corrupt     per get                         buffers.faulty
    weights.push_fail                 per publish attempt             stages.weights.faulty
    learner.crash                     at the learner versions in `at` CrashingClock (here)
    learner.rank_crash                after the learner versions in `at`: its last rank is SIGKILLed
                                      (world_size > 1; healed by a restart)   stages.learner.ranks
    channel.stall                     per send, per channel           stall_hook (here; local and Ray channels)
    engine.join, engine.leave         at the versions in `at`: the fleet grows / shrinks by one   pipeline.fleet
    engine.join_in_push               at the published versions in `at`: a join while it goes out  stages.weights.faulty
    engine.preempt_in_push            at the published versions in `at`: a preempted leave while it goes out
                                                                      stages.weights.faulty

Invariants of a schedule:
* occurrences are counted per (kind, scope) and per process, 1-based; a spec with `at` fires on
  exactly those occurrences (for `learner.crash`, on those learner versions), one with
  `probability` on each occurrence with that probability from a stream seeded by (seed, kind, scope);
* a (kind, scope, occurrence) fires at most once per run folder, even across processes and restarts
  (a marker file under `faults/` is created exclusively), so a restarted process does not crash again
  at the same point;
* every firing and every recovery (the boundary's first success after a firing) is appended as one
  JSON line to `faults.jsonl` in the run folder, with a wall-clock time: what the fault runner reads
  to measure recovery.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from pipeline.channel import Channel

FAULT_KINDS: tuple[str, ...] = (
    "engine.crash", "engine.hang", "store.put_fail", "store.get_fail", "store.corrupt",
    "store.master_restart", "store.holder_crash", "weights.push_fail", "learner.crash", "channel.stall",
    "learner.rank_crash",
    "engine.join", "engine.leave", "engine.join_in_push", "engine.preempt_in_push",  # an elastic run's fleet
    "engine.server_kill", "engine.server_kill_push", "engine.push_refused",
)
# the kinds that act on an inference server the engine launched (SIGKILL by pid, a damaged version file)
SERVER_FAULT_KINDS: tuple[str, ...] = ("engine.server_kill", "engine.server_kill_push", "engine.push_refused")
EVENTS_FILE = "faults.jsonl"


class FaultPlanError(ValueError):
    """A fault spec that cannot be scheduled; the message names the field and the fix."""


class InjectedFault(RuntimeError):
    """Raised at an injection point; `kind` names it. Recovery paths catch their boundary's own
    typed error (a subclass also derives from it), never this base."""

    kind = ""


class LearnerCrashed(InjectedFault):
    kind = "learner.crash"


@dataclass(frozen=True)
class FaultSpec:
    """One planned fault: `kind`, and when: `at` (occurrences, 1-based; learner versions for
    learner.crash) or `probability` (per occurrence, seeded by `seed`). `delay_s`: how long a hang
    or stall lasts."""

    kind: str
    at: tuple[int, ...] = ()
    probability: float = 0.0
    seed: int = 0
    delay_s: float = 5.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise FaultPlanError(f"faults.kind = {self.kind!r}: unknown fault kind; allowed: {', '.join(FAULT_KINDS)}")
        if not self.at and not self.probability:
            raise FaultPlanError(f"fault {self.kind}: give `at` (occurrences, e.g. at = [3]) or `probability` (0..1]")
        if self.at and self.probability:
            raise FaultPlanError(f"fault {self.kind}: give either `at` or `probability`, not both")
        if any(n < 1 for n in self.at):
            raise FaultPlanError(f"fault {self.kind}: at = {list(self.at)}: occurrences count from 1")
        if not 0.0 <= self.probability <= 1.0:
            raise FaultPlanError(f"fault {self.kind}: probability = {self.probability}: must be within [0, 1]")
        if self.delay_s <= 0:
            raise FaultPlanError(f"fault {self.kind}: delay_s = {self.delay_s}: must be > 0")


class Schedule:
    """When one kind fires at one scope (see the module docstring for the invariants)."""

    def __init__(self, spec: FaultSpec, scope: str, plan: FaultPlan) -> None:
        self.spec, self.scope, self.plan = spec, scope, plan
        self.occurrences = 0
        self.fired = 0
        self._at = frozenset(spec.at)
        self._rng = random.Random(f"{spec.seed}:{spec.kind}:{scope}")
        # fired, and the boundary has not succeeded since; a process that starts (or restarts, or resumes)
        # after a firing it did not see recover, e.g. the process the fault killed, takes it over
        self._pending = plan.folder is not None and unrecovered(plan.folder, spec.kind, scope)

    def hit(self, occurrence: int | None = None) -> bool:
        """Count one occurrence (or use the given one, e.g. a version); True when the fault fires now."""
        self.occurrences += 1
        n = self.occurrences if occurrence is None else occurrence
        wanted = n in self._at if self._at else self._rng.random() < self.spec.probability
        if not wanted or not self.plan.claim(self.spec.kind, self.scope, n):
            return False
        self.fired += 1
        self._pending = True
        self.plan.record("fired", self.spec.kind, self.scope, occurrence=n)
        return True

    def recovered(self, detail: str = "", **fields: Any) -> None:
        """The boundary succeeded again after a firing: record it once per firing (with `fields`, its evidence)."""
        if self._pending:
            self._pending = False
            self.plan.record("recovered", self.spec.kind, self.scope, detail=detail, **fields)


@dataclass
class FaultPlan:
    """The faults of one run. `targets` holds the processes an infrastructure fault acts on
    (e.g. "master" with `restart()`, "holder" with `kill()`), supplied by whoever owns them.
    `isolated` is True where every actor has its own process (Ray): process-level faults then kill
    the process instead of raising."""

    specs: list[FaultSpec] = field(default_factory=list)
    targets: dict[str, Any] = field(default_factory=dict)
    folder: Path | None = None
    isolated: bool = False

    def __post_init__(self) -> None:
        self.specs = [s if isinstance(s, FaultSpec) else FaultSpec(**s) for s in self.specs]
        self._by_kind: dict[str, FaultSpec] = {}
        for spec in self.specs:
            if spec.kind in self._by_kind:
                raise FaultPlanError(f"fault {spec.kind} is planned twice; merge its `at` lists into one entry")
            self._by_kind[spec.kind] = spec
        self._schedules: dict[tuple[str, str], Schedule] = {}
        self._claimed: set[tuple[str, str, int]] = set()

    def __getstate__(self) -> dict[str, Any]:  # counters are per process: a copy starts afresh
        return {"specs": self.specs, "targets": self.targets, "folder": self.folder, "isolated": self.isolated}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def __bool__(self) -> bool:
        return bool(self.specs)

    def planned(self, *prefixes: str) -> bool:
        """Whether any planned kind starts with one of `prefixes` ("store.", "engine.crash" ...)."""
        return any(kind.startswith(prefixes) for kind in self._by_kind)

    def schedule(self, kind: str, scope: str = "") -> Schedule | None:
        """The schedule of `kind` at `scope`, or None when `kind` is not planned (install nothing)."""
        if kind not in FAULT_KINDS:
            raise FaultPlanError(f"unknown fault kind {kind!r}; allowed: {', '.join(FAULT_KINDS)}")
        spec = self._by_kind.get(kind)
        if spec is None:
            return None
        key = (kind, scope)
        if key not in self._schedules:
            self._schedules[key] = Schedule(spec, scope, self)
        return self._schedules[key]

    def bound(self, folder: Path | str, isolated: bool = False) -> FaultPlan:
        """A copy for one process of the run whose folder is `folder` (fresh counters)."""
        return FaultPlan(list(self.specs), dict(self.targets), Path(folder), isolated)

    def claim(self, kind: str, scope: str, occurrence: int) -> bool:
        """True once per (kind, scope, occurrence) per run folder (exclusive marker file)."""
        key = (kind, scope, occurrence)
        if key in self._claimed:
            return False
        self._claimed.add(key)
        if self.folder is None:
            return True
        marks = self.folder / "faults"
        marks.mkdir(exist_ok=True)
        name = f"{kind}@{scope or '-'}#{occurrence}".replace("/", "_")
        try:
            os.close(os.open(marks / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def record(self, event: str, kind: str, scope: str, **fields: Any) -> None:
        """Append one event line to faults.jsonl (one write call: lines from processes do not mix)."""
        line = json.dumps({"t": time.time(), "event": event, "kind": kind, "scope": scope, "pid": os.getpid(),
                           **fields})
        if self.folder is not None:
            with open(self.folder / EVENTS_FILE, "a", encoding="utf-8") as f:
                f.write(line + "\n")


def as_plan(faults: FaultPlan | Iterable[FaultSpec | Mapping[str, Any]] | None) -> FaultPlan | None:
    """A FaultPlan from what the DSL or config gives (None or empty: no faults)."""
    if faults is None:
        return None
    plan = faults if isinstance(faults, FaultPlan) else FaultPlan(list(faults))  # type: ignore[arg-type]
    return plan or None


def read_events(folder: Path | str) -> list[dict[str, Any]]:
    """The events of a run folder's faults.jsonl, in order (a torn last line is ignored)."""
    path = Path(folder) / EVENTS_FILE
    if not path.exists():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return sorted(events, key=lambda e: e["t"])


def unrecovered(folder: Path | str, kind: str, scope: str = "") -> bool:
    """Whether `kind` fired at `scope` in this run folder after its last recovery there."""
    pending = False
    for event in read_events(folder):
        if event["kind"] == kind and event["scope"] == scope and event["event"] in ("fired", "recovered"):
            pending = event["event"] == "fired"
    return pending


# -- generic hooks: the clock (learner.crash) and channels (channel.stall) ------------------------
class CrashingClock:
    """A Clock whose `advance_to(v)` raises `LearnerCrashed` when the schedule fires at version v:
    the learner dies after publishing v but before recording it (what resume must repair). Where the
    learner has its own process (`kill_process`, the Ray runtime), that process is SIGKILLed instead."""

    def __init__(self, clock: Any, schedule: Schedule, kill_process: bool = False) -> None:
        self._clock, self._schedule, self._kill_process = clock, schedule, kill_process

    def __getattr__(self, name: str) -> Any:
        return getattr(self._clock, name)

    async def advance_to(self, version: int) -> None:
        if self._schedule.hit(occurrence=version):
            if self._kill_process:
                os.kill(os.getpid(), signal.SIGKILL)
            raise LearnerCrashed(f"injected fault learner.crash at version {version}")
        await self._clock.advance_to(version)
        self._schedule.recovered(f"advanced to version {version}")  # a resumed run's first step after a crash


def stall_hook(schedule: Schedule) -> Callable[[], Awaitable[None]]:
    """A channel's `before_send`: when the schedule fires, the send waits `delay_s` first."""

    async def before_send() -> None:
        if schedule.hit():
            await anyio.sleep(schedule.spec.delay_s)
            schedule.recovered(f"stalled {schedule.spec.delay_s} s")

    return before_send


def install(ctx: Any, faults: FaultPlan | None, isolated: bool = False) -> FaultPlan | None:
    """Bind `faults` to this process of the run whose context is `ctx`: put the plan in
    `ctx.services.faults` (stages look there for their boundary's schedule), wrap the clock for
    learner.crash and hook the local channels for channel.stall. Returns the bound plan, or None
    (and changes nothing) when no fault is planned."""
    if not faults:
        return None
    plan = faults.bound(ctx.folder.path, isolated=isolated)
    ctx.services.faults = plan
    crash = plan.schedule("learner.crash")
    if crash is not None:
        ctx.clock = CrashingClock(ctx.clock, crash, kill_process=isolated)
    if plan.planned("channel.stall"):
        for name, channel in ctx.channels.items():
            if name != "feedback" and isinstance(channel, Channel):  # this process's own (Ray's are actors)
                channel.before_send = stall_hook(plan.schedule("channel.stall", name))
    return plan


def plan_of(ctx: Any) -> FaultPlan | None:
    """This process's bound plan (None: no faults)."""
    return ctx.services.faults


__all__ = [
    "EVENTS_FILE", "FAULT_KINDS", "SERVER_FAULT_KINDS", "CrashingClock", "FaultPlan", "FaultPlanError", "FaultSpec",
    "InjectedFault", "LearnerCrashed", "Schedule", "as_plan", "install", "plan_of", "read_events", "stall_hook",
]
