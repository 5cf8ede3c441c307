"""Every contract between the runtime and the stages, in one file.

Read this to know every method a stage may implement and every call it may make on the run. The
runtimes (`pipeline.runtime.local`, `pipeline.runtime.ray`) rely on nothing else: no string keys, no
`hasattr` probes. Capabilities a stage offers are `runtime_checkable` Protocols, so a runtime asks
`isinstance(actor, RefHolder)` where an actor may or may not hold something.

What the run offers each stage, through its `RunContext` (`pipeline.context`):
  `Clock`, `Gate`, `LedgerClient`, the `VersionPolicy`, channels, and this process's `Services`.
What a stage offers the run:
  `Stage` (every stage), `Producer` (how many workers, each its own process on Ray), `Buffer` (opens
  the run's object store), `Consumer` (ends the run, summarises it), `Placed` (what each of its
  processes needs: CPUs, GPUs), `Scalable` (a producer that makes another worker while the run goes
  on), and, per actor, `Retiring` (a worker that drains and leaves), `RefHolder`, `CheckpointedProducer`,
  `CheckpointingConsumer` for checkpoint cuts.
A stage may start helper processes of its own (a sharded learner's other ranks) through
`Services.start_helpers`: the runtime places them (local: this host; Ray: a placement group).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pipeline.refs import HeldRef, Produced
from pipeline.roster import Roster

if TYPE_CHECKING:  # annotations only
    from pipeline.actor import Actor
    from pipeline.context import RunContext
    from pipeline.faults import FaultPlan
    from pipeline.telemetry import Panel

# -- what the run offers the stages ------------------------------------------------------------------


class VersionPolicy(Protocol):
    """What the pipeline needs of a staleness policy (see policies.staleness)."""

    @property
    def bound(self) -> int: ...

    def admit(self, version: int, started: int, discarded: int, groups_per_step: int) -> bool: ...

    def accept(self, learner_version: int, oldest_version: int) -> str:
        """"train" | "drop" | "requeue" for a unit whose oldest token has `oldest_version`."""
        ...

    def interrupt(self, oldest_version: int, new_version: int) -> str:
        """"continue" | "restart": for work in flight when `new_version` reaches its worker."""
        ...


class Clock(Protocol):
    """The run's version clock; the consumer alone advances it."""

    async def current(self) -> int: ...

    async def advance_to(self, version: int) -> None: ...

    async def wait_change(self, seen: int) -> int: ...

    async def wait_until(self, version: int) -> int: ...


class Gate(Protocol):
    """The admission gate: producers start a unit only after acquiring it."""

    units_per_version: int

    async def acquire_many(self, max_units: int) -> int:
        """Wait for at least one unit, take up to `max_units`; returns how many were taken."""
        ...

    async def discard(self, units: int) -> None: ...

    async def replayed(self, units: int) -> None:
        """The consumer took `units` already-consumed units again (see `AdmissionGate.replayed`)."""
        ...


class LedgerClient(Protocol):
    """The run's ledger: every item's fate."""

    async def produced(self, groups: list[Produced]) -> None: ...

    async def take_source(self, group: str) -> bytes: ...

    async def trained(self, ids: list[str], at_version: int) -> None: ...

    async def finished(self, fate: str, ids: list[str], reason: str) -> None:
        """fate: "dropped" | "lost" | "regenerated"."""
        ...

    async def take_settled(self) -> dict[str, dict[str, list[float]]]:
        """{outcome: {name: values}} of the items settled since the last call (see `Ledger.take_settled`)."""
        ...


@dataclass(frozen=True)
class Resources:
    """What one process of a stage asks the runtime for (the Ray runtime places the process by it)."""

    cpus: float = 1.0
    gpus: float = 0.0


class Helper(Protocol):
    """A process a stage started through `Services.start_helpers`."""

    name: str

    def exitcode(self) -> int | None:
        """None while it runs; else how it ended (negative: the signal that killed it)."""
        ...

    def stop(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for it to end by itself, then kill it."""
        ...


HelperStarter = Callable[[str, Callable[..., None], Sequence[tuple], Resources], list[Helper]]
"""`start(name, fn, args_per_helper, resources)`: one process per args tuple, each running `fn(*args)`
and each given `resources`, started together (all placed, or an error naming what could not be)."""

Mailbox = Callable[[bytes, Any], Awaitable[bytes | None]]
"""A message handler a stage registers in its process: `await handler(header, blob)` -> reply or None."""


class Peer(Protocol):
    """Another process of the run (Ray runtime), reached through its mailboxes. A dead or restarting
    peer misses the message (False / None) instead of failing the sender."""

    async def deliver(self, box: str, header: bytes, blob: Any) -> bool: ...

    async def ask(self, box: str, header: bytes) -> bytes | None: ...


@dataclass
class Services:
    """What stages in one process share with each other and with the runtime. One per process."""

    store: Any = None  # this process's buffers.store.ObjectStore, opened by the runtime
    faults: FaultPlan | None = None  # the bound fault plan (pipeline.faults); None: no fault planned
    # producer processes (Ray runtime, each a Peer named producer-<index>; an elastic run's come and go); empty locally
    producers: Roster = field(default_factory=Roster)
    # engines living in this process; they come and go in an elastic run (the learner watches it)
    weight_receivers: Roster = field(default_factory=Roster)
    mailboxes: dict[str, Mailbox] = field(default_factory=dict)  # handlers other processes reach by name
    status: list[Callable[[], str]] = field(default_factory=list)  # one-line states for hang reports
    on_producer_restart: Callable[[int], Awaitable[None]] | None = None  # a restarted producer process catches up
    start_helpers: HelperStarter | None = None  # the runtime's way to start a stage's helper processes
    address: str = "127.0.0.1"  # where helper processes reach this process (a rendezvous host)
    fleet: Any = None  # the producer's live workers where the run may grow and shrink (pipeline.fleet.Fleet)


# -- what a stage offers the run ---------------------------------------------------------------------


@runtime_checkable
class Stage(Protocol):
    """A stage contributes actors. `inbox`/`outbox` are None where the stage has none."""

    def actors(self, ctx: RunContext, inbox: Any, outbox: Any) -> Sequence[Actor]: ...


@runtime_checkable
class Producer(Stage, Protocol):
    """The producer stage: `workers` actors, in that order; the Ray runtime gives each its own process."""

    @property
    def workers(self) -> int: ...


@runtime_checkable
class Scalable(Producer, Protocol):
    """A producer whose workers may join while the run goes on (`pipeline.fleet`)."""

    def join(self, ctx: RunContext, outbox: Any, index: int) -> Actor:
        """A new worker numbered `index` (never used before in this run), built like the others; the fleet
        starts it (its `start` returns once it may be given work) and runs it."""
        ...


class WorkerLauncher(Protocol):
    """How a runtime starts a producer worker that joins a running run (`pipeline.fleet`): the local runtime
    makes it in this process (`Scalable.join`), the Ray runtime in a Ray actor of its own. The fleet's
    logic (targets, drains, events) is the same on both; only this differs."""

    def join(self, index: int) -> Actor:
        """Worker `index` (never used before in the run), not yet started: the fleet starts, runs and stops it."""
        ...



@runtime_checkable
class Retiring(Protocol):
    """A producer worker that can leave a running run without losing what it holds."""

    async def retire(self, preempt: bool = False) -> None:
        """Take no new work; return once the work it took is finished and sent on (its `run` returns too).
        Its `stop` then releases what it holds; nothing it admitted is left without a fate. `preempt`: the
        work in flight stops now and goes on elsewhere from where it is (a node taken away), where the worker
        can move it; else it finishes here."""
        ...


class StoreOpener(Protocol):
    """Opens the run's object store in the calling process; travels to every process of the run."""

    def open(self, holder: bool, faults: FaultPlan | None) -> Any:
        """The store (a buffers.store.ObjectStore); `holder`: this process keeps the data (the buffer's)."""
        ...


@runtime_checkable
class Buffer(Stage, Protocol):
    """The buffer stage: it owns the run's object store."""

    def serve_store(self) -> AbstractContextManager[StoreOpener]:
        """Start what the store needs for this run (e.g. a Mooncake master) for the `with` block."""
        ...


@runtime_checkable
class Consumer(Stage, Protocol):
    """The consumer stage: the run ends when it has taken `steps` versions."""

    units_per_version: int
    max_uses: int  # most times one item may be consumed (the ledger enforces it)

    def summary(self, records: list[dict], run_dir: Path | None = None) -> dict[str, Any]:
        """Figures for the run summary, from the consumer's metric records (and files in `run_dir`)."""
        ...

    def progress(self, last: dict | None) -> dict[str, Any]:
        """Fields for the progress line, from the latest metric record."""
        ...

    def report_panels(self, records: list[dict], run_dir: Path | None = None) -> list[Panel]: ...


@runtime_checkable
class Placed(Protocol):
    """A stage whose processes need other resources than one CPU each (GPUs for engines or learner ranks)."""

    def resources(self, index: int) -> Resources:
        """What the process of its actor `index` needs."""
        ...

    def helpers(self) -> list[Resources]:
        """What each helper process it will start (`Services.start_helpers`) needs; [] for none."""
        ...


@runtime_checkable
class RefHolder(Protocol):
    """An actor that holds refs between channels (a buffer's index, a consumer's replay window)."""

    name: str

    def held_refs(self) -> list[HeldRef]: ...


@runtime_checkable
class CheckpointedProducer(RefHolder, Protocol):
    """A producer actor's part of a checkpoint cut."""

    def held_sources(self) -> list[bytes]:
        """What it was asked to make and has not recorded as produced (the sources the ledger would get)."""
        ...

    def recording(self) -> list[tuple[str, bytes]]:
        """(group, source) of the groups whose `produced` record is on its way to the ledger."""
        ...

    def rng_state(self) -> Any:
        """Where its random stream stands (a `pipeline.checkpoint.RandomState`)."""
        ...


class CheckpointingConsumer(RefHolder, Protocol):
    """What a consumer gives a checkpoint: the refs it holds and its own state."""

    def write_state(self, folder: Path) -> None:
        """Write everything needed to continue into `folder` (runs in a worker thread while the consumer
        awaits the checkpoint, so its state does not change meanwhile)."""
        ...


__all__ = [
    "Buffer", "CheckpointedProducer", "CheckpointingConsumer", "Clock", "Consumer", "Gate", "Helper", "HelperStarter",
    "LedgerClient", "Mailbox", "Peer", "Placed", "Producer", "RefHolder", "Resources", "Retiring", "Scalable",
    "Services", "Stage",
    "StoreOpener", "VersionPolicy", "WorkerLauncher",
]
