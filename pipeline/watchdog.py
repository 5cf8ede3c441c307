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
* status lines stages contribute through the small hook `ctx.services["status"]` (callables returning
  a line each, e.g. "learner: window 3/16 groups for version 12").

Each report is logged with structured fields (channel depths, the gate, what each actor awaits, its
last event; one line each, so JSON logs stay one object per line) and, with a run folder, written as
text to `hang-report.txt` there (replaced atomically by each new report).

The watchdog watches `run()`: an actor whose `start()` hangs is not covered. Task introspection needs
the asyncio backend (under another backend the `awaiting` chains are empty).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Sequence
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
            event = f"last event {a.last_event!r} {a.last_event_age_s:.1f}s ago" if a.last_event else "no event noted"
            lines.append(f"  {a.name}: {event}")
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
        return {
            "idle_s": self.idle_s, "at": self.progress, "channels": channels, "gate": self.gate,
            "waiting": waiting, "last_events": events, "status": self.status,
        }


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


class Watchdog:
    """The watchdog actor (see the module docstring). It never returns; the run cancels it at the end."""

    name = "watchdog"

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
        self.settings, self.progress, self.channels = settings, progress, channels
        self.actors, self.activity = list(actors), activity
        self.status = status if status is not None else []
        self.gate = gate
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
        seen, since, warned_at = self.progress(), time.monotonic(), None
        while True:
            await anyio.sleep(s.poll_s)
            self._track_channels()
            now, current = time.monotonic(), self.progress()
            if current != seen:
                seen, since, warned_at = current, now, None
                continue
            idle = now - since
            if s.fail_after_s and idle >= s.fail_after_s:
                report = self._publish(idle, seen, "pipeline hung: failing the run", "error")
                raise PipelineHung(report, s.fail_after_s)
            if s.warn_after_s and idle >= s.warn_after_s and (warned_at is None or now - warned_at >= s.warn_after_s):
                self._publish(idle, seen, "pipeline stalled", "warning")
                warned_at = now

    def _publish(self, idle: float, progress: Hashable, event: str, level: str) -> HangReport:
        report = self.report(idle, progress)
        self.reports.append(report)
        fields = report.log_fields()
        if self.folder is not None:
            try:
                fields["report_file"] = str(self.folder.write_text("hang-report.txt", report.text() + "\n"))
            except OSError as exc:  # the report still reaches the log
                fields["report_file"] = f"<not written: {exc}>"
        getattr(self.log, level)(event, **fields)
        return report

    def _track_channels(self) -> None:
        now = time.monotonic()
        for name, channel in self.channels.items():
            stats = channel.stats()
            last = self._moved.get(name)
            if last is None or (stats.sent, stats.received) != last[:2]:
                self._moved[name] = (stats.sent, stats.received, now)

    def report(self, idle_s: float, progress: Hashable) -> HangReport:
        """Where the pipeline stands now (see the module docstring)."""
        self._track_channels()
        now = time.monotonic()
        channels = []
        for name, channel in self.channels.items():
            st = channel.stats()
            channels.append(ChannelLine(
                name=name, depth=st.depth, max_items=st.max_items, nbytes=st.nbytes, max_bytes=st.max_bytes,
                closed=st.closed, idle_s=round(now - self._moved[name][2], 1),
            ))
        chains = _awaiting_by_actor(self.actors)
        events = self.activity.last()
        names = [a.name for a in self.actors] + sorted(set(events) - {a.name for a in self.actors})
        actors = []
        for name in names:
            event, age = events.get(name, (None, None))
            actors.append(ActorLine(
                name=name, awaiting=chains.get(name, []), last_event=event,
                last_event_age_s=round(age, 1) if age is not None else None,
            ))
        status = []
        for line in self.status:
            try:
                status.append(str(line()))
            except Exception as exc:  # a broken status line must not hide the report
                status.append(f"<status failed: {type(exc).__name__}: {exc}>")
        if isinstance(progress, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in progress):
            progress = ", ".join(f"{k}={v}" for k, v in progress)  # (("version", 3), ("produced", 96), ...)
        return HangReport(
            idle_s=round(idle_s, 1), progress=str(progress), channels=channels,
            gate=self.gate() if self.gate is not None else {}, actors=actors, status=status,
        )


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
    Library frames (asyncio, anyio, site-packages) are left out except the innermost one."""
    coro: Any = task.get_coro()
    frames = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            break
        frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
    owners = [f.f_locals.get("self") for f in frames]
    kept = [f for i, f in enumerate(frames) if not _is_library(f) or i == len(frames) - 1]
    return [_frame_label(f) for f in kept], owners


def _awaiting_by_actor(actors: Sequence[Any]) -> dict[str, list[list[str]]]:
    """{actor name: frame chains of its tasks}: the task named `actor:{name}` (local runtime), and every
    other task whose frames run a method of that actor (its task groups' children)."""
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:  # not under asyncio
        return {}
    by_id = {id(a): a.name for a in actors}
    names = {a.name for a in actors}
    found: dict[str, list[list[str]]] = {}
    for task in tasks:
        if task is asyncio.current_task() or task.done():
            continue
        labels, owners = await_chain(task)
        task_name = task.get_name()
        owner = task_name.split(":", 1)[1] if task_name.startswith("actor:") else None
        if owner not in names:
            owner = next((by_id[id(o)] for o in owners if id(o) in by_id), None)
        if owner is not None and owner != "watchdog" and labels:
            found.setdefault(owner, []).append(labels)
    return found


__all__ = [
    "Activity", "ActorLine", "ChannelLine", "HangReport", "PipelineHung", "Watchdog", "WatchdogSettings", "await_chain",
]
