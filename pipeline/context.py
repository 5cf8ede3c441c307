"""RunContext: what the stages of one run share, behind small async interfaces.

Stage code talks to the run's clock, admission gate and ledger only through `await`ed calls, so the
same code runs whether they live in this process (local runtime: thin async facades over
`VersionClock`, `AdmissionGate` and `Ledger`) or in another one (Ray runtime: proxies of a conductor
actor). Channels have the same async surface either way.

It also holds the one place that decides what happens to a unit of work that will not be consumed
(`refuse`, `redo`), used by the buffer (eviction) and the consumer (acceptance, lost payloads) alike.
"""

from __future__ import annotations

import inspect
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.admission import AdmissionGate
from pipeline.contracts import Clock, Gate, LedgerClient, Services, VersionPolicy
from pipeline.events import report_event
from pipeline.ledger import Ledger
from pipeline.refs import Produced, Redo, Ref
from pipeline.telemetry import RunFolder, get_logger
from pipeline.versions import VersionClock
from pipeline.watchdog import Activity


class LocalClock:
    def __init__(self, clock: VersionClock) -> None:
        self.clock = clock

    async def current(self) -> int:
        return self.clock.version

    async def advance_to(self, version: int) -> None:
        self.clock.advance(version)

    async def wait_change(self, seen: int) -> int:
        return await self.clock.wait_change(seen)

    async def wait_until(self, version: int) -> int:
        return await self.clock.wait_until(version)


class LocalGate:
    def __init__(self, gate: AdmissionGate) -> None:
        self.gate = gate
        self.units_per_version = gate.units_per_version

    async def acquire_many(self, max_units: int) -> int:
        return await self.gate.acquire_many(max_units)

    async def discard(self, units: int) -> None:
        self.gate.discard(units)

    async def replayed(self, units: int) -> None:
        self.gate.replayed(units)


class LocalLedger:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    async def produced(self, groups: list[Produced]) -> None:
        for g in groups:
            self.ledger.produced(g.ids, g.group, g.versions, g.source, g.values)

    async def take_source(self, group: str) -> bytes:
        return self.ledger.take_source(group)

    async def trained(self, ids: list[str], at_version: int) -> None:
        self.ledger.trained(ids, at_version)

    async def finished(self, fate: str, ids: list[str], reason: str) -> None:
        getattr(self.ledger, fate)(ids, reason)

    async def take_settled(self) -> dict[str, dict[str, list[float]]]:
        return self.ledger.take_settled()


@dataclass
class RunContext:
    """Everything the stages of one run share. `services` is per process (store, receivers, mailboxes)."""

    run: str
    seed: int
    steps: int
    clock: Clock
    ledger: LedgerClient
    gate: Gate
    policy: VersionPolicy
    feedback: Any  # a Channel of Redo (local or Ray-hosted)
    folder: RunFolder
    channels: dict[str, Any] = field(default_factory=dict)
    services: Services = field(default_factory=Services)
    started_at: float = field(default_factory=time.time)  # wall clock: comparable across processes
    checkpoint: Any = None  # a pipeline.checkpoint.Checkpointer where the run checkpoints (the consumer's process)
    resume: Any = None  # a pipeline.resume.Resume (Ray: its PortableResume) when the run continues from one
    activity: Activity = field(default_factory=Activity)  # each actor's last event, for the watchdog
    failure: BaseException | None = None  # the actor failure ending the run (set by the local runtime, before stops)

    def note(self, actor: str, event: str) -> None:
        """Record `actor`'s latest event (what a hang report shows, with its age). Cheap; never awaits."""
        self.activity.note(actor, event)

    def add_status(self, line: Any) -> None:
        """Contribute a status line to hang reports: `line()` returns one string describing a stage."""
        self.services.status.append(line)

    def rng(self, stream: str) -> random.Random:
        """A reproducible random stream per named user, derived from the run seed."""
        return random.Random(f"{self.seed}:{stream}")

    def log(self, name: str):
        return get_logger(name).bind(run=self.run)

    def event(self, kind: str, count: int = 1, **fields: Any) -> None:
        """Something went wrong and was handled: a warning now, a count in the metrics and summary
        (`pipeline.events`)."""
        report_event(self.folder, kind, count, run=self.run, **fields)

    async def poll_feedback(self) -> Redo | None:
        """The next Redo waiting in the feedback channel, or None (never waits)."""
        found = await self.poll_feedback_many(1)
        return found[0] if found else None

    async def poll_feedback_many(self, max_items: int) -> list[Redo]:
        """Up to `max_items` Redos waiting in the feedback channel, in one call (never waits)."""
        if max_items < 1:
            return []
        got = self.feedback.receive_many_nowait(max_items)
        return await got if inspect.isawaitable(got) else got  # a Ray-hosted channel answers async


async def redo(ctx: RunContext, ref: Ref, fate: str, reason: str, store: Any, frees: Any = None) -> None:
    """`ref`'s unit will not be consumed: record its items as `fate` ("lost" or "regenerated"),
    free its admission slot, ask the producer to make it again, and free its payload."""
    await ctx.ledger.finished(fate, ref.item_ids, reason)
    if fate == "lost":
        ctx.event("payload.lost", count=ref.rows, key=ref.key, reason=reason)
    await ctx.gate.discard(1)
    await ctx.feedback.send(Redo(ref.group, reason))
    await free(ctx, ref, store, frees)


async def refuse(ctx: RunContext, ref: Ref, version: int, store: Any, frees: Any = None) -> str:
    """Apply the policy's verdict on a unit it does not accept at `version`; returns the verdict.

    drop: its items are recorded dropped (with the staleness in the reason) and the slot freed;
    requeue: they are recorded regenerated and the producer makes the unit again."""
    verdict = ctx.policy.accept(version, ref.version)
    if verdict == "train":
        raise ValueError(f"refuse() called for {ref.key}, which the policy accepts at version {version}")
    reason = f"stale: {version - ref.version} > {ctx.policy.bound}"
    if verdict == "requeue":
        await redo(ctx, ref, "regenerated", reason, store, frees)
    else:
        await ctx.ledger.finished("dropped", ref.item_ids, reason)
        await ctx.gate.discard(1)
        await free(ctx, ref, store, frees)
    return verdict


async def free(ctx: RunContext, ref: Ref, store: Any, frees: Any = None) -> None:
    """Remove `ref`'s payload; in the background when given a task group `frees` (a store may
    hold a read lease for a while, and nobody should wait for that)."""
    if frees is not None:
        frees.start_soon(_remove, ctx, ref, store)
    else:
        await _remove(ctx, ref, store)


async def _remove(ctx: RunContext, ref: Ref, store: Any) -> None:
    try:
        await store.remove(ref.key)
    except Exception as exc:  # a leaked key costs memory, not correctness
        ctx.log("free").warning("could not remove payload", key=ref.key, error=f"{type(exc).__name__}: {exc}")


__all__: Sequence[str] = [
    "LocalClock", "LocalGate", "LocalLedger", "RunContext", "free", "redo", "refuse",
]
