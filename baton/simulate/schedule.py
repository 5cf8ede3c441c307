"""A run whose shape changes over virtual time (`baton simulate` with `[simulate] engine_schedule` and
`learner_restarts`): its phases and the figures of each, for a simulated run and a real one alike.

A phase runs from one change (an engine-count step after 0, a learner restart) to the next, the last one
to the run's last version. Its figures are wall-clock ones, what a user timing that stretch of the run
sees: the samples of the versions published in it over its length (the first versions after a join pay
the joiner's fence, those after a restart its seconds), the staleness of what it trained, its longest
time between two versions, and (simulated records only) the groups it dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from baton.config import ConfigError


@dataclass(frozen=True)
class Phase:
    """[start_s, end_s) of virtual (or run) time; `engines`: the target count in it; `restart`: it begins
    with a learner restart."""

    start_s: float
    end_s: float
    engines: int
    restart: bool


def phases_of(engines: int, steps: list[tuple[float, int]], restarts: list[float], end_s: float) -> list[Phase]:
    """The phases of a run starting with `engines`, changed by `steps` ((time_s, count), increasing) and
    `restarts` (times), ending at `end_s`. Invariant: they tile [0, end_s) in order."""
    def count_at(t: float) -> int:
        return next((n for at, n in reversed(steps) if at <= t), engines)

    changes = sorted({at for at, _ in steps if 0 < at < end_s} | {at for at in restarts if 0 < at < end_s})
    starts = [0.0, *changes]
    ends = [*changes, end_s]
    out = [Phase(a, b, count_at(a), a in restarts) for a, b in zip(starts, ends, strict=True)]
    return out


def phase_figures(records: list[dict], phases: list[Phase], samples_per_version: int) -> list[dict[str, Any]]:
    """Per phase: its span and engines, the versions published in it, samples/s over its length, the mean
    and most staleness trained, the longest gap between versions (from the last version before it), and
    `dropped` when the records carry the cumulative count."""
    out = []
    for phase in phases:
        inside = [r for r in records if phase.start_s <= r["t"] < phase.end_s or
                  (phase is phases[-1] and r["t"] == phase.end_s)]
        before = [r["t"] for r in records if r["t"] < phase.start_s]
        times = [max(before, default=0.0), *(r["t"] for r in inside)]
        length = phase.end_s - phase.start_s
        row: dict[str, Any] = {
            "start_s": round(phase.start_s, 3), "end_s": round(phase.end_s, 3), "engines": phase.engines,
            "restart": phase.restart, "versions": len(inside),
            "samples_per_s": round(samples_per_version * len(inside) / length, 2) if length > 0 else 0.0,
            "mean_staleness": round(sum(r["staleness_mean"] for r in inside) / len(inside), 4) if inside else None,
            "max_staleness": max((r["staleness_max"] for r in inside), default=None),
            "max_gap_s": round(max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0), 3),
        }
        if inside and "dropped" in inside[-1]:
            first = [r for r in records if r["t"] < phase.start_s]
            row["dropped"] = inside[-1]["dropped"] - (first[-1]["dropped"] if first else 0)
        out.append(row)
    return out


def print_phases(simulated: list[dict], measured: list[dict] | None = None) -> None:
    """The per-phase table on stderr; with a real run's phases, its figures and the error beside."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="per phase (engine schedule, learner restarts)")
    for col in ("from s", "to s", "engines", "restart", "versions", "samples/s", "mean staleness", "max staleness",
                "max gap s", *(("measured samples/s", "error") if measured else ())):
        table.add_column(col, justify="right")
    for i, p in enumerate(simulated):
        row = [f"{p['start_s']:.1f}", f"{p['end_s']:.1f}", str(p["engines"]), "yes" if p["restart"] else "",
               str(p["versions"]), f"{p['samples_per_s']:.1f}", _fmt(p["mean_staleness"]), _fmt(p["max_staleness"]),
               f"{p['max_gap_s']:.2f}"]
        if measured:
            m = measured[i]["samples_per_s"] if i < len(measured) else None
            row += [_fmt(m), f"{(p['samples_per_s'] - m) / m:+.1%}" if m else ""]
        table.add_row(*row)
    Console(stderr=True, width=140).print(table)


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:g}"


def schedule_overrides(engine_schedule: str | None, learner_restarts: str | None) -> list[str]:
    """`--engine-schedule 0:1,60:2,120:1` and `--learner-restarts 40,90` as `--set simulate.*` overrides."""
    sets = []
    if engine_schedule:
        try:
            steps = [(float(t), int(n)) for t, n in (item.split(":") for item in engine_schedule.split(","))]
        except ValueError:
            raise ConfigError(f"--engine-schedule {engine_schedule!r}: expected TIME_S:ENGINES,..., e.g. "
                              "--engine-schedule 0:1,60:2,120:1") from None
        sets.append(f"simulate.engine_schedule={[[t, n] for t, n in steps]}")
    if learner_restarts:
        try:
            times = [float(t) for t in learner_restarts.split(",")]
        except ValueError:
            raise ConfigError(f"--learner-restarts {learner_restarts!r}: expected TIME_S,..., e.g. "
                              "--learner-restarts 40,90") from None
        sets.append(f"simulate.learner_restarts={times}")
    return sets


@dataclass(frozen=True)
class ObservedSchedule:
    """A real run's shape, from its events: the engine count (a step at 0, then each scale request), the
    learner restarts' start times, and the mean join and restart costs. Times are run-relative seconds."""

    engine_schedule: list[tuple[float, int]]
    engine_join_s: float
    learner_restarts: list[float]
    learner_restart_s: float

    def overrides(self) -> list[str]:
        """As `--set simulate.*` overrides (the restart keys only when the run restarted)."""
        sets = [f"simulate.engine_schedule={[[t, n] for t, n in self.engine_schedule]}",
                f"simulate.engine_join_s={self.engine_join_s}"]
        if self.learner_restarts:
            sets += [f"simulate.learner_restarts={self.learner_restarts}",
                     f"simulate.learner_restart_s={self.learner_restart_s}"]
        return sets


# a generation.jsonl record's seconds from the gate to the record: its episodes' puts and scoring lie inside gen_s
CALL_SPAN = ("gate_s", "gen_s", "send_s")


def observe_schedule(events: list[dict], calls: list[dict], records: list[dict]) -> ObservedSchedule | None:
    """The schedule a real run followed, or None when its fleet never changed and its learner never restarted.

    Events carry wall-clock times, the run's files run-relative ones: a `fleet.joined` event is reported just
    before the joiner asks the gate, so its first call (generation.jsonl: recorded at its end, with the seconds
    of its span) began then, and a `fleet.left` event just after the leaver recorded its last call; these give
    the offset (their mean). A run without either takes it from its first restart: the failure is noticed by
    the step after version `at_version`, whose record then was written. A join or leave
    was asked `join_s` / `drain_s` before its event; a restart began `seconds` before its event."""
    fleet = [e for e in events if e.get("kind") in ("fleet.joined", "fleet.left")]
    restarts = [e for e in events if e.get("kind") == "learner.restart"]
    if not fleet and not restarts:
        return None
    offset = _clock_offset(fleet, restarts, calls, records)
    joined = {_engine_of(e) for e in fleet if e["kind"] == "fleet.joined"}
    steps = [(0.0, len({c["engine"] for c in calls} - joined) or 1)]
    for e in sorted(fleet, key=lambda e: e["t"]):  # one request for several engines: one step, its last count
        steps.append((max(0.0, round(e["t"] - offset - e.get("join_s", e.get("drain_s", 0.0)), 3)), int(e["live"])))
    join_s = [e["join_s"] for e in fleet if e["kind"] == "fleet.joined"]
    started = [max(0.0, round(e["t"] - offset - e["seconds"], 3)) for e in restarts]
    return ObservedSchedule(_increasing(steps), round(sum(join_s) / len(join_s), 3) if join_s else 0.0, started,
                            round(sum(e["seconds"] for e in restarts) / len(restarts), 3) if restarts else 0.0)


def _clock_offset(fleet: list[dict], restarts: list[dict], calls: list[dict], records: list[dict]) -> float:
    """Wall-clock time minus run-relative time (see observe_schedule)."""
    offsets = []
    for e in fleet:
        own = [c for c in calls if c["engine"] == _engine_of(e)]
        if own and e["kind"] == "fleet.joined":
            offsets.append(e["t"] - (own[0]["t"] - sum(own[0].get(k, 0.0) for k in CALL_SPAN)))
        elif own:
            offsets.append(e["t"] - own[-1]["t"])
    if offsets:
        return sum(offsets) / len(offsets)
    for e in restarts:
        at = next((r for r in records if r["version"] == e.get("at_version")), None)
        if at is not None:
            return e["t"] - e["seconds"] - at["t"]
    raise ConfigError("the run's events.jsonl has fleet or restart events, but neither a joiner's calls in "
                      "generation.jsonl nor a restart's version in metrics.jsonl to place them in the run's time")


def _increasing(steps: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """Steps with strictly increasing times: of steps at one time, the last count."""
    out: list[tuple[float, int]] = []
    for at, n in steps:
        if out and at <= out[-1][0]:
            out[-1] = (out[-1][0], n)
        else:
            out.append((at, n))
    return out


def _engine_of(event: dict) -> str:
    """The engine name of a fleet event's worker (`rollout:torch-1` -> `torch-1`, as generation.jsonl names it)."""
    return str(event["worker"]).rsplit(":", 1)[-1]
