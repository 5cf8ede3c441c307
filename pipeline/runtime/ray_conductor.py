"""The shared state of a Ray run: the `Conductor` actor holds its version clock, admission gate and
ledger (the local runtime's, `pipeline.context`), and `RemoteClock` / `RemoteGate` / `RemoteLedger` are
how a stage in any process of the run reaches them, through the same awaited calls as locally.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import msgspec
import ray

from pipeline.admission import AdmissionGate
from pipeline.context import LocalClock, LocalLedger
from pipeline.contracts import VersionPolicy
from pipeline.ledger import Ledger
from pipeline.refs import Produced
from pipeline.versions import VersionClock

__all__ = ["Conductor", "RemoteClock", "RemoteGate", "RemoteLedger"]


@ray.remote(num_cpus=0)
class Conductor(LocalClock, LocalLedger):
    """Clock, admission gate and ledger of one run, for every process of it. The clock and ledger
    calls are the local runtime's (`LocalClock`, `LocalLedger`); what differs is per-worker
    bookkeeping of admitted units, so a dead producer's slots can be freed."""

    def __init__(self, policy: VersionPolicy, units_per_version: int, max_uses: int, folder: str,
                 steps: int | None = None) -> None:
        self._args = (policy, units_per_version, max_uses, steps)
        self.folder = folder  # the ledger's store is its ledger.sqlite
        self.outstanding: Counter[str] = Counter()  # per producer: admitted units not yet produced

    async def setup(self, resume: bytes | None = None, attempt: int = 0) -> bytes | None:
        """Build the clock, ledger and gate (anyio primitives need the actor's running event loop): new
        ones, or the checkpoint's (`resume`: its msgpack `RunState`), reopened as `pipeline.checkpoint`
        states; then returns the msgpack `OwedWork` (the redo requests the driver queues first)."""
        from pipeline.checkpoint import RunState
        from pipeline.resume import reopen, restore_gate, resumed_ledger
        from pipeline.runtime.ray_cut import Freezer

        policy, units, max_uses, steps = self._args
        self.freezer = Freezer()
        if resume is None:
            self.clock = VersionClock()
            self.ledger = Ledger.create(self.folder, max_uses=max_uses)
            self.gate = AdmissionGate(self.clock, policy, units, last_version=steps)
            return None
        state = msgspec.msgpack.decode(resume, type=RunState)
        self.clock = VersionClock(state.version)
        self.ledger = resumed_ledger(state, self.folder, max_uses)
        self.gate = AdmissionGate(self.clock, policy, units, last_version=steps)
        restore_gate(state, self.gate)
        return msgspec.msgpack.encode(reopen(state, attempt, self.ledger))

    # checkpoint cuts (pipeline.runtime.ray_cut): while frozen, the ledger does not change
    async def freeze(self, lease_s: float) -> bytes:
        from pipeline.runtime.ray_cut import frozen_run

        gate = self.gate
        return frozen_run(self.freezer, lease_s, self.clock.version, self.ledger, gate.started, gate.discarded)

    async def thaw(self, token: str) -> bool:
        return self.freezer.thaw(token)

    # gate
    async def acquire_many(self, worker: str, max_units: int) -> int:
        taken = await self.gate.acquire_many(max_units)
        self.outstanding[worker] += taken
        return taken

    async def discard(self, units: int) -> None:
        self.gate.discard(units)

    async def replayed(self, units: int) -> None:
        self.gate.replayed(units)

    async def worker_died(self, worker: str) -> int:
        """Free the slots of the units `worker` had admitted but not produced; returns how many."""
        lost = self.outstanding.pop(worker, 0)
        if lost:
            self.gate.discard(lost)
        return lost

    # ledger
    async def produced(self, worker: str, groups: list[Produced]) -> None:  # type: ignore[override]
        await self.freezer.open()
        await LocalLedger.produced(self, groups)
        self.outstanding[worker] -= len(groups)

    async def take_source(self, group: str) -> bytes:
        await self.freezer.open()
        return await LocalLedger.take_source(self, group)

    async def trained(self, ids: list[str], at_version: int) -> None:
        await self.freezer.open()
        await LocalLedger.trained(self, ids, at_version)

    async def finished(self, fate: str, ids: list[str], reason: str) -> None:
        await self.freezer.open()
        await LocalLedger.finished(self, fate, ids, reason)

    async def watch_progress(self) -> bytes:
        """The watchdog's progress, msgspec-encoded: [("version", v), (count, n), ...], as the local runtime's."""
        return msgspec.msgpack.encode([("version", self.clock.version), *self.ledger.counts().items()])

    async def gate_status(self) -> bytes:
        """The admission gate's counts and whether it would admit a unit now (`AdmissionGate.status`),
        msgspec-encoded."""
        return msgspec.msgpack.encode(self.gate.status())

    async def report(self) -> bytes:
        """Everything the driver needs at the end, msgspec-encoded."""
        return msgspec.msgpack.encode(
            {
                "version": self.clock.version,
                "counts": self.ledger.counts(),
                "reasons": self.ledger.reasons(),
                "violations": self.ledger.violations(),
                "ledger_json": self.ledger.to_json(),
                "gate": {"started": self.gate.started, "discarded": self.gate.discarded, "wait_s": self.gate.wait_s},
                "frozen_s": round(self.freezer.frozen_s, 3),  # ledger paused for checkpoint cuts, in all
            }
        )


@dataclass
class RemoteClock:
    conductor: Any

    async def current(self) -> int:
        return await self.conductor.current.remote()

    async def advance_to(self, version: int) -> None:
        await self.conductor.advance_to.remote(version)

    async def wait_change(self, seen: int) -> int:
        return await self.conductor.wait_change.remote(seen)

    async def wait_until(self, version: int) -> int:
        return await self.conductor.wait_until.remote(version)


@dataclass
class RemoteGate:
    conductor: Any
    units_per_version: int
    worker: str

    async def acquire_many(self, max_units: int) -> int:
        return await self.conductor.acquire_many.remote(self.worker, max_units)

    async def discard(self, units: int) -> None:
        await self.conductor.discard.remote(units)

    async def replayed(self, units: int) -> None:
        await self.conductor.replayed.remote(units)


@dataclass
class RemoteLedger:
    conductor: Any
    worker: str

    async def produced(self, groups: list[Produced]) -> None:
        await self.conductor.produced.remote(self.worker, groups)

    async def take_source(self, group: str) -> bytes:
        return await self.conductor.take_source.remote(group)

    async def trained(self, ids: list[str], at_version: int) -> None:
        await self.conductor.trained.remote(ids, at_version)

    async def finished(self, fate: str, ids: list[str], reason: str) -> None:
        await self.conductor.finished.remote(fate, ids, reason)

    async def take_settled(self) -> dict[str, dict[str, list[float]]]:
        return await self.conductor.take_settled.remote()
