"""The watchdog on the Ray runtime: `pipeline.watchdog.HangWatch` in the driver, probing the run's processes.

* progress and the gate: the conductor (`Conductor.watch_progress()`, `Conductor.gate_status()`,
  msgspec-encoded), the same values the local runtime reads in process;
* channels: each `RayChannel`'s `stats()` (its channel host);
* actors and status lines: every stage host's `StageHost.diagnose()`, a msgspec-encoded
  `ProcessDiagnosis` of that process (await chains of its actor's tasks, last events, status lines).

Every remote call is bounded by `timeout_s` and asked of all hosts at once, so a wedged or dead host
costs one timeout, not one per host, and cannot wedge the watchdog. A host that is dead, restarting
or silent answers nothing and is shown as an `ActorLine` with `unreachable` set; a channel host that
does not answer is left out of the channels, with a status line saying so.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Any

import anyio
import msgspec

from pipeline.channel import ChannelStats
from pipeline.watchdog import ActorLine, HangWatch, Probes, ProcessDiagnosis, WatchdogSettings

PROBE_TIMEOUT_S = 5.0


async def _bounded(call: Callable[[], Awaitable[Any]], timeout_s: float) -> tuple[Any, str]:
    """(the call's result, "") or (None, why there is none): the call failed or took over `timeout_s`."""
    with anyio.move_on_after(timeout_s):
        try:
            return await call(), ""
        except Exception as exc:  # e.g. ray.exceptions.RayActorError / ActorUnavailableError
            return None, f"no answer: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    return None, f"no answer within {timeout_s:g}s"


async def _all(calls: dict[str, Callable[[], Awaitable[Any]]], timeout_s: float) -> dict[str, tuple[Any, str]]:
    """Every call at once, each bounded: {name: (result, why there is none)}."""
    answers: dict[str, tuple[Any, str]] = {}

    async def one(name: str, call: Callable[[], Awaitable[Any]]) -> None:
        answers[name] = await _bounded(call, timeout_s)

    async with anyio.create_task_group() as tg:
        for name, call in calls.items():
            tg.start_soon(one, name, call)
    return {name: answers[name] for name in calls}


def ray_probes(conductor: Any, channels: dict[str, Any], hosts: dict[str, Any], timeout_s: float) -> Probes:
    """Probes over one Ray run: its conductor, its `RayChannel`s and its stage hosts ({name: handle})."""

    async def progress() -> Hashable:
        pairs = msgspec.msgpack.decode(await conductor.watch_progress.remote())
        return tuple((name, value) for name, value in pairs)

    async def channel_stats() -> dict[str, ChannelStats | None]:
        answers = await _all({name: ch.stats for name, ch in channels.items()}, timeout_s)
        return {name: stats for name, (stats, _) in answers.items()}

    async def gate() -> dict[str, Any]:
        return msgspec.msgpack.decode(await conductor.gate_status.remote())

    async def actors() -> tuple[list[ActorLine], list[str]]:
        answers = await _all({name: host.diagnose.remote for name, host in hosts.items()}, timeout_s)
        lines: list[ActorLine] = []
        status: list[str] = []
        for name, (encoded, why) in answers.items():
            if encoded is None:
                lines.append(ActorLine(
                    name=name, awaiting=[], last_event=None, last_event_age_s=None, host=name,
                    unreachable=f"{why} (dead, restarting or wedged)",
                ))
                continue
            diagnosis = msgspec.msgpack.decode(encoded, type=ProcessDiagnosis)
            lines.extend(diagnosis.actors)
            status.extend(diagnosis.status)
        return lines, status

    return Probes(progress=progress, channels=channel_stats, gate=gate, actors=actors)


def ray_watchdog(
    settings: WatchdogSettings, conductor: Any, channels: dict[str, Any], hosts: dict[str, Any], run: str,
    folder: Any, timeout_s: float = PROBE_TIMEOUT_S,
) -> HangWatch:
    """The driver's watchdog for one Ray run; `run()` raises `PipelineHung` when the run stops moving."""
    probes = ray_probes(conductor, channels, hosts, timeout_s)
    # the loop's own bound on a probe: above the per-call bound, so a probe's own message wins
    return HangWatch(settings, probes, run=run, folder=folder, probe_timeout_s=timeout_s + 2.0)


__all__ = ["PROBE_TIMEOUT_S", "ray_probes", "ray_watchdog"]
