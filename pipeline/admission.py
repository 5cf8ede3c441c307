"""AdmissionGate: producers ask before starting a unit of work.

The gate counts units started and units discarded (work whose result was thrown away, which frees
its slot) and lets a producer start another unit only while `policy.admit(version, started,
discarded, units_per_version)` says so. It re-evaluates whenever the version clock moves or a
unit is discarded. A unit the consumer takes *again* (replay: one result consumed more than once)
counts as started (`replayed`): it fills a slot a new unit would have filled, so the units a version
consumes stay `units_per_version` whether they are new or replayed, and producers do not run ahead of
a consumer that replays. With `last_version` (the run's step count) nothing is admitted once the clock
reaches it: work started then could never be consumed, so a finished run leaves none half-made. The gate
holds no data; its counts are what a checkpoint needs to restore it. An `acquire` that is cancelled
(a producer retired while it waited) took no unit: a unit is counted only where no await follows it.
"""

from __future__ import annotations

from typing import Protocol

import anyio

from pipeline.versions import VersionClock


class AdmissionPolicy(Protocol):
    def admit(self, version: int, started: int, discarded: int, groups_per_step: int) -> bool: ...


class AdmissionGate:
    def __init__(self, clock: VersionClock, policy: AdmissionPolicy, units_per_version: int,
                 last_version: int | None = None) -> None:
        if units_per_version < 1:
            raise ValueError(f"units_per_version must be >= 1, got {units_per_version}")
        self.clock = clock
        self.policy = policy
        self.units_per_version = units_per_version
        self.last_version = last_version
        self.started = 0
        self.discarded = 0
        self._discard_event = anyio.Event()
        self.wait_s = 0.0

    def _open(self) -> bool:
        if self.last_version is not None and self.clock.version >= self.last_version:
            return False
        return self.policy.admit(self.clock.version, self.started, self.discarded, self.units_per_version)

    def try_acquire(self) -> bool:
        """Start a unit if the policy allows it right now."""
        if self._open():
            self.started += 1
            return True
        return False

    async def acquire(self) -> None:
        """Wait until the policy allows one more unit, then count it as started."""
        if self.try_acquire():
            with anyio.CancelScope(shield=True):  # the unit is taken: a cancel here would leak its slot
                await anyio.lowlevel.checkpoint()
            return
        t0 = anyio.current_time()
        while not self.try_acquire():
            seen, event = self.clock.version, self._discard_event
            async with anyio.create_task_group() as tg:

                async def on_version(seen: int = seen) -> None:
                    await self.clock.wait_change(seen)
                    tg.cancel_scope.cancel()

                async def on_discard(event: anyio.Event = event) -> None:
                    await event.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(on_version)
                tg.start_soon(on_discard)
        self.wait_s += anyio.current_time() - t0

    async def acquire_many(self, max_units: int) -> int:
        """Wait for one unit, then take as many more as the policy allows now (up to `max_units`)."""
        await self.acquire()
        taken = 1
        while taken < max_units and self.try_acquire():
            taken += 1
        return taken

    def replayed(self, units: int = 1) -> None:
        """The consumer took `units` already-consumed units again: they count as started units."""
        if units < 0:
            raise ValueError(f"units must be >= 0, got {units}")
        self.started += units

    def discard(self, units: int = 1) -> None:
        """`units` started units were thrown away; their slots are free again."""
        self.discarded += units
        self._discard_event.set()
        self._discard_event = anyio.Event()

    def status(self) -> dict[str, int | bool]:
        """The counts and whether the policy would admit one more unit now (what a hang report shows)."""
        return {
            "version": self.clock.version, "started": self.started, "discarded": self.discarded,
            "live": self.started - self.discarded, "admits_now": self._open(),
        }
