"""Hang diagnosis: a watchdog that says which stage waits on what, and fails a run that stopped moving.

Progress is whatever `progress()` returns changing (the pipeline passes the version clock and the
ledger's counts: a step taken, a group produced, dropped, lost or regenerated). When it has not
changed for `warn_after_s` seconds the watchdog logs a `HangReport` (again every `warn_after_s` while
the stall lasts); once it has not changed for `fail_after_s` seconds it raises `PipelineHung` carrying
that report, so the run fails with a diagnosis instead of hanging. 0 turns either limit off.

A report holds, generically (nothing here knows what a stage does):
* every channel: depth / capacity in items and bytes, closed or not, and how long since an item last
  went in or out;
* the admission gate: units started, discarded, live, and whether the policy would admit one now;
* every actor: what its tasks are awaiting right now (the chain of coroutine frames, innermost last,
  with the `name` of each object that has one, e.g. `Channel.send('produced')`), and the last event
  it noted (`RunContext.note`) with its age;
* status lines stages contribute through the small hook `ctx.services.status` (callables returning
  a line each, e.g. "learner: window 3/16 groups for version 12").

Each report is logged with structured fields (channel depths, the gate, what each actor awaits, its
last event; one line each, so JSON logs stay one object per line) and, with a run folder, written as
text to `hang-report.txt` there (replaced atomically by each new report).

Both runtimes run the same loop, `HangWatch`, over awaitable `Probes`: the local runtime's `Watchdog`
actor adapts its in-process objects (sync callables, local channels, `asyncio.all_tasks()`); the Ray
runtime's driver (`pipeline.runtime.ray_watchdog`) asks the conductor, the channel hosts and every
stage host (`StageHost.diagnose()`, a msgspec-encoded `ProcessDiagnosis` of that process) and names
each actor line's host and pid. Every probe is bounded (`probe_timeout_s`) and a probe that fails or
does not answer never fails the watchdog: a dead or restarting host is shown as such.

The watchdog watches `run()`: an actor whose `start()` hangs is not covered. Task introspection needs
the asyncio backend (under another backend the `awaiting` chains are empty).
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec

from pipeline.actor import ActorFailed
from pipeline.telemetry import get_logger


class Activity:
    """The last event each actor noted, with when (monotonic). Cheap: one dict write per note."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[str, float]] = {}

    def note(self, actor: str, event: str) -> None:
        self._last[actor] = (event, time.monotonic())

    def last(self) -> dict[str, tuple[str, float]]:
        """{actor: (event, age in seconds)}."""
        now = time.monotonic()
        return {actor: (event, now - at) for actor, (event, at) in self._last.items()}


class ChannelLine(msgspec.Struct, frozen=True):
    name: str
    depth: int
    max_items: int
    nbytes: int
    max_bytes: int | None
    closed: bool
    idle_s: float  # since an item last went in or out


class ActorLine(msgspec.Struct, frozen=True):
    name: str
    awaiting: list[list[str]]  # one frame chain per task of the actor, innermost last
    last_event: str | None
    last_event_age_s: float | None
    host: str = ""  # the process the actor runs in, where actors have their own (Ray: e.g. "producer-0")
    pid: int | None = None
    unreachable: str = ""  # why the host could not be asked (dead, restarting, no answer); "" when it answered

    def where(self) -> str:
        """The suffix naming the actor's process, ' [producer-0, pid 4242]'; '' where it has none."""
        return f" [{self.host}" + (f", pid {self.pid}" if self.pid is not None else "") + "]" if self.host else ""


class ProcessDiagnosis(msgspec.Struct, frozen=True):
    """One process's part of a report (what a Ray `StageHost.diagnose()` returns, msgspec-encoded)."""

    host: str
    pid: int
    actors: list[ActorLine]
    status: list[str]


class HangReport(msgspec.Struct, frozen=True):
    idle_s: float
    progress: str
    channels: list[ChannelLine]
    gate: dict[str, Any]
    actors: list[ActorLine]
    status: list[str]

    def text(self) -> str:
        lines = [f"no progress for {self.idle_s:.1f}s (still at {self.progress})", "channels:"]
        for c in self.channels:
            size = f", {c.nbytes}/{c.max_bytes} bytes" if c.max_bytes else ""
            state = ", closed" if c.closed else ""
            lines.append(f"  {c.name}: {c.depth}/{c.max_items} items{size}{state}; last moved {c.idle_s:.1f}s ago")
        if self.gate:
            lines.append("admission gate: " + ", ".join(f"{k}={v}" for k, v in self.gate.items()))
        lines.append("actors:")
        for a in self.actors:
            if a.unreachable:
                lines.append(f"  {a.name}{a.where()}: {a.unreachable}")
                continue
            event = f"last event {a.last_event!r} {a.last_event_age_s:.1f}s ago" if a.last_event else "no event noted"
            lines.append(f"  {a.name}{a.where()}: {event}")
            for chain in a.awaiting:
                lines.append(f"    awaiting {' -> '.join(chain)}")
        if self.status:
            lines.append("status:")
            lines.extend(f"  {line}" for line in self.status)
        return "\n".join(lines)

    def log_fields(self) -> dict[str, Any]:
        """The report as structured log fields, one short string per channel and actor."""
        channels = {
            c.name: f"{c.depth}/{c.max_items} items" + (f", {c.nbytes}/{c.max_bytes} bytes" if c.max_bytes else "")
            + (", closed" if c.closed else "") + f", moved {c.idle_s:.1f}s ago"
            for c in self.channels
        }
        waiting = {
            a.name: " | ".join(" -> ".join(chain[-3:]) for chain in a.awaiting) for a in self.actors if a.awaiting
        }
        events = {
            a.name: f"{a.last_event} ({a.last_event_age_s:.1f}s ago)" for a in self.actors if a.last_event is not None
        }
        fields = {
            "idle_s": self.idle_s, "at": self.progress, "channels": channels, "gate": self.gate,
            "waiting": waiting, "last_events": events, "status": self.status,
        }
        hosts = {a.name: a.where().strip(" []") for a in self.actors if a.host}
        unreachable = {a.name: a.unreachable for a in self.actors if a.unreachable}
        if hosts:
            fields["hosts"] = hosts
        if unreachable:
            fields["unreachable"] = unreachable
        return fields


class PipelineHung(ActorFailed):
    """No progress for `fail_after_s`: the run was stopped; `report` says which stage waits on what."""

    def __init__(self, report: HangReport, fail_after_s: float) -> None:
        self.report = report
        self.actor, self.phase = "watchdog", "run"
        RuntimeError.__init__(
            self,
            f"the pipeline made no progress for {report.idle_s:.1f}s (watchdog.fail_after_s = {fail_after_s:g}); "
            f"raise watchdog.fail_after_s if a step really takes this long. Where it stands:\n{report.text()}",
        )


@dataclass
class WatchdogSettings:
    warn_after_s: float = 60.0
    fail_after_s: float = 300.0
    poll_s: float = 1.0

    def __post_init__(self) -> None:
        if self.warn_after_s < 0 or self.fail_after_s < 0:
            raise ValueError(
                f"watchdog.warn_after_s and watchdog.fail_after_s must be >= 0 (0: off), got "
                f"{self.warn_after_s}, {self.fail_after_s}"
            )
        if self.poll_s <= 0:
            raise ValueError(f"watchdog.poll_s must be > 0, got {self.poll_s}")

    @property
    def enabled(self) -> bool:
        return bool(self.warn_after_s or self.fail_after_s)


@dataclass
class Probes:
    """What the watchdog reads, each an awaitable (the local runtime's are in-process reads, Ray's are
    remote calls). `HangWatch` bounds every call; one that raises or does not answer in time counts as
    no progress (`progress`) or leaves its part of the report empty with a status line saying why.

    * progress: a hashable that changes whenever the run moves (version clock, ledger counts);
    * channels: {name: stats}, each with the fields of `pipeline.channel.ChannelStats` (None: that
      channel did not answer);
    * gate: the admission gate's counts and whether it would admit a unit now ({} when there is none);
    * actors: every actor's line (await chains, last event) and the stages' status lines.
    """

    progress: Callable[[], Awaitable[Hashable]]
    channels: Callable[[], Awaitable[dict[str, Any]]]
    gate: Callable[[], Awaitable[dict[str, Any]]]
    actors: Callable[[], Awaitable[tuple[list[ActorLine], list[str]]]]


class HangWatch:
    """The watchdog's loop over `probes` (see the module docstring); the same for every runtime. `run()`
    never returns: it raises `PipelineHung` after `fail_after_s` without progress, or is cancelled."""

    name = "watchdog"

    def __init__(
        self, settings: WatchdogSettings, probes: Probes, run: str = "", folder: Any = None,
        probe_timeout_s: float = 10.0,
    ) -> None:
        self.settings, self.probes, self.probe_timeout_s = settings, probes, probe_timeout_s
        self.folder = folder  # a RunFolder: each report is also written to hang-report.txt there
        self.log = get_logger("watchdog").bind(run=run)
        self._moved: dict[str, tuple[int, int, float]] = {}  # channel -> (sent, received, when they last moved)
        self.reports: list[HangReport] = []

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def run(self) -> None:
        s = self.settings
        seen, since, warned_at = await self._progress(None), time.monotonic(), None
        while True:
            await anyio.sleep(s.poll_s)
            await self._channels()  # keeps "last moved" current between reports
            current = await self._progress(seen)
            now = time.monotonic()
            if current != seen:
                seen, since, warned_at = current, now, None
                continue
            idle = now - since
            if s.fail_after_s and idle >= s.fail_after_s:
                report = await self._publish(idle, seen, "pipeline hung: failing the run", "error")
                raise PipelineHung(report, s.fail_after_s)
            if s.warn_after_s and idle >= s.warn_after_s and (warned_at is None or now - warned_at >= s.warn_after_s):
                await self._publish(idle, seen, "pipeline stalled", "warning")
                warned_at = now

    async def _ask(self, what: str, probe: Callable[[], Awaitable[Any]], problems: list[str]) -> Any:
        """`await probe()` within `probe_timeout_s`; None (and a line in `problems`) if it fails or times out."""
        with anyio.move_on_after(self.probe_timeout_s):
            try:
                return await probe()
            except Exception as exc:  # a broken probe must not hide the rest of the report
                problems.append(f"<{what} failed: {type(exc).__name__}: {exc}>")
                return None
        problems.append(f"<{what}: no answer within {self.probe_timeout_s:g}s>")
        return None

    async def _progress(self, seen: Hashable) -> Hashable:
        current = await self._ask("progress", self.probes.progress, [])
        return seen if current is None else current  # no answer: no progress seen

    async def _channels(self, problems: list[str] | None = None) -> dict[str, Any]:
        answers = await self._ask("channels", self.probes.channels, problems if problems is not None else []) or {}
        stats = {name: st for name, st in answers.items() if st is not None}
        if problems is not None:
            problems.extend(f"<channel {name!r}: no answer>" for name, st in answers.items() if st is None)
        now = time.monotonic()
        for name, st in stats.items():
            last = self._moved.get(name)
            if last is None or (st.sent, st.received) != last[:2]:
                self._moved[name] = (st.sent, st.received, now)
        return stats

    async def _publish(self, idle: float, progress: Hashable, event: str, level: str) -> HangReport:
        report = await self.report(idle, progress)
        self.reports.append(report)
        fields = report.log_fields()
        if self.folder is not None:
            try:
                fields["report_file"] = str(self.folder.write_text("hang-report.txt", report.text() + "\n"))
            except OSError as exc:  # the report still reaches the log
                fields["report_file"] = f"<not written: {exc}>"
        getattr(self.log, level)(event, **fields)
        return report

    async def report(self, idle_s: float, progress: Hashable) -> HangReport:
        """Where the pipeline stands now (see the module docstring)."""
        problems: list[str] = []
        stats = await self._channels(problems)
        now = time.monotonic()
        channels = [
            ChannelLine(
                name=name, depth=st.depth, max_items=st.max_items, nbytes=st.nbytes, max_bytes=st.max_bytes,
                closed=st.closed, idle_s=round(now - self._moved[name][2], 1),
            )
            for name, st in stats.items()
        ]
        gate = await self._ask("gate", self.probes.gate, problems) or {}
        actors, status = await self._ask("actors", self.probes.actors, problems) or ([], [])
        if isinstance(progress, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in progress):
            progress = ", ".join(f"{k}={v}" for k, v in progress)  # (("version", 3), ("produced", 96), ...)
        return HangReport(
            idle_s=round(idle_s, 1), progress=str(progress), channels=channels, gate=gate, actors=list(actors),
            status=[*status, *problems],
        )


class Watchdog(HangWatch):
    """The local runtime's watchdog actor: `HangWatch` over this process's objects (sync callables,
    `Channel`s, the actors' asyncio tasks). It never returns; the run cancels it at the end."""

    def __init__(
        self,
        settings: WatchdogSettings,
        progress: Callable[[], Hashable],
        channels: dict[str, Any],
        actors: Sequence[Any],
        activity: Activity,
        status: list[Callable[[], str]] | None = None,
        gate: Callable[[], dict[str, Any]] | None = None,
        run: str = "",
        folder: Any = None,
    ) -> None:
        self.channels, self.actors, self.activity = channels, list(actors), activity
        self.status = status if status is not None else []  # read at each report: stages append to it

        async def read_progress() -> Hashable:
            return progress()

        async def read_channels() -> dict[str, Any]:
            return {name: channel.stats() for name, channel in self.channels.items()}

        async def read_gate() -> dict[str, Any]:
            return gate() if gate is not None else {}

        async def read_actors() -> tuple[list[ActorLine], list[str]]:
            return actor_lines(self.actors, self.activity, _awaiting_by_actor(self.actors)), status_lines(self.status)

        super().__init__(settings, Probes(read_progress, read_channels, read_gate, read_actors), run, folder)


def actor_lines(
    actors: Sequence[Any], activity: Activity, chains: dict[str, list[list[str]]], host: str = "",
    pid: int | None = None,
) -> list[ActorLine]:
    """A line per actor (and per other name that noted an event): what its tasks await (`chains`, by
    actor name), its last event."""
    events = activity.last()
    names = [a.name for a in actors] + sorted(set(events) - {a.name for a in actors})
    lines = []
    for name in names:
        event, age = events.get(name, (None, None))
        lines.append(ActorLine(
            name=name, awaiting=chains.get(name, []), last_event=event,
            last_event_age_s=round(age, 1) if age is not None else None, host=host, pid=pid,
        ))
    return lines


def status_lines(status: Sequence[Callable[[], str]]) -> list[str]:
    """Each status callable's line; one that raises says so instead of hiding the others."""
    lines = []
    for line in status:
        try:
            lines.append(str(line()))
        except Exception as exc:  # a broken status line must not hide the report
            lines.append(f"<status failed: {type(exc).__name__}: {exc}>")
    return lines


def diagnose_process(
    host: str, actors: Sequence[Any], activity: Activity, status: Sequence[Callable[[], str]],
    root: asyncio.Task | None = None,
) -> ProcessDiagnosis:
    """This process's part of a report, for the actors it hosts. The tasks looked at are `root` (the
    task running the actors, e.g. a Ray actor method's), the tasks anyio task groups started under it,
    and any other task of the loop whose frames run a method of one of `actors`; so a process whose
    event loop also serves other calls (a Ray async actor) reports only its actors' tasks. With one
    actor, every task under `root` is that actor's, whatever object's method it runs."""
    under, others = _tasks_under(root)
    chains = _awaiting_by_actor(actors, under, owner_of_rest=actors[0].name if len(actors) == 1 else None)
    for name, found in _awaiting_by_actor(actors, others).items():
        chains.setdefault(name, []).extend(found)
    return ProcessDiagnosis(
        host=host, pid=os.getpid(), actors=actor_lines(actors, activity, chains, host, os.getpid()),
        status=status_lines(status),
    )


def _tasks_under(root: asyncio.Task | None) -> tuple[list[asyncio.Task], list[asyncio.Task]]:
    """(`root` and its descendants through anyio task groups, by anyio's parent task ids; every other
    task of the loop)."""
    tasks = {id(t): t for t in asyncio.all_tasks() if not t.done()}
    parents = {info.id: info.parent_id for info in anyio.get_running_tasks()}
    under = {id(root)} if root is not None and id(root) in tasks else set()
    grew = True
    while grew:
        grew = False
        for task_id, parent in parents.items():
            if parent in under and task_id not in under and task_id in tasks:
                under.add(task_id)
                grew = True
    return [t for tid, t in tasks.items() if tid in under], [t for tid, t in tasks.items() if tid not in under]


def _frame_label(frame: Any) -> str:
    code = frame.f_code
    label = getattr(code, "co_qualname", code.co_name)
    owner = frame.f_locals.get("self")
    name = getattr(owner, "name", None) if owner is not None else None
    return f"{label}({name!r})" if isinstance(name, str) else label


def _is_library(frame: Any) -> bool:
    path = frame.f_code.co_filename
    return "site-packages" in path or "/asyncio/" in path or "/anyio/" in path


def await_chain(task: asyncio.Task) -> tuple[list[str], list[Any]]:
    """The frames `task` is suspended in, outermost first: (labels, the objects bound to `self` in them).
    Library frames (asyncio, anyio, site-packages) are left out except the innermost one. Compiled
    coroutines without a frame (Ray's Cython wrappers around an actor method) are stepped through."""
    coro: Any = task.get_coro()
    frames = []
    for _ in range(_MAX_AWAIT_DEPTH):
        if coro is None:
            break
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            frames.append(frame)
        awaited = next((a for a in (getattr(coro, n, None) for n in _AWAITED) if a is not None), None)
        coro = awaited if awaited is not None or frame is not None else _wrapped_coroutine(coro)
    owners = [f.f_locals.get("self") for f in frames]
    kept = [f for i, f in enumerate(frames) if not _is_library(f) or i == len(frames) - 1]
    return [_frame_label(f) for f in kept], owners


_MAX_AWAIT_DEPTH = 200
_AWAITED = ("cr_await", "gi_yieldfrom", "ag_await")  # what a coroutine, generator, async generator awaits


def _wrapped_coroutine(awaitable: Any) -> Any:
    """The one coroutine a frameless awaitable holds (e.g. Cython's `coroutine_wrapper`, which exposes
    it only to the garbage collector), or None."""
    inner = [r for r in gc.get_referents(awaitable) if hasattr(r, "cr_await") or hasattr(r, "gi_yieldfrom")]
    return inner[0] if len(inner) == 1 else None


def _awaiting_by_actor(
    actors: Sequence[Any], tasks: Sequence[asyncio.Task] | None = None, owner_of_rest: str | None = None
) -> dict[str, list[list[str]]]:
    """{actor name: frame chains of its tasks} among `tasks` (default: all of the loop's): the task named
    `actor:{name}` (local runtime), and every other task whose frames run a method of that actor (its
    task groups' children); a task that runs no actor's method is `owner_of_rest`'s (if given)."""
    try:
        current = asyncio.current_task()
        tasks = asyncio.all_tasks() if tasks is None else tasks
    except RuntimeError:  # not under asyncio
        return {}
    by_id = {id(a): a.name for a in actors}
    names = {a.name for a in actors}
    found: dict[str, list[list[str]]] = {}
    for task in tasks:
        if task is current or task.done():
            continue
        labels, owners = await_chain(task)
        task_name = task.get_name()
        owner = task_name.split(":", 1)[1] if task_name.startswith("actor:") else None
        if owner not in names:
            owner = next((by_id[id(o)] for o in owners if id(o) in by_id), owner_of_rest)
        if owner is not None and owner != "watchdog" and labels:
            found.setdefault(owner, []).append(labels)
    return found


__all__ = [
    "Activity", "ActorLine", "ChannelLine", "HangReport", "HangWatch", "PipelineHung", "Probes", "ProcessDiagnosis",
    "Watchdog", "WatchdogSettings", "actor_lines", "await_chain", "diagnose_process", "status_lines",
]
