"""The local runtime: every actor is a task in one event loop (anyio task group).

`LocalRun` builds the run's shared state in this process (version clock, ledger, admission gate,
channels), opens the store once as its holder, asks each stage for its actors (the buffer first: it
owns the store), adds the checkpoint feeder and the watchdog where they apply, and runs them all
until the consumer returns. Blocking compute inside an actor belongs in `anyio.to_thread.run_sync`,
so that two actors can compute at once (torch releases the GIL in its kernels).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from pipeline.actor import Actor, ActorFailed
from pipeline.admission import AdmissionGate
from pipeline.channel import Channel
from pipeline.checkpoint import Checkpointer, LocalCut
from pipeline.context import LocalClock, LocalGate, LocalLedger, RunContext
from pipeline.contracts import Helper, RefHolder, Resources, Scalable
from pipeline.control import ControlServer
from pipeline.faults import as_plan
from pipeline.faults import install as install_faults
from pipeline.fleet import Fleet, FleetError, scale_faults
from pipeline.ledger import Ledger
from pipeline.lifetime import die_with_parent
from pipeline.resume import Resume
from pipeline.runtime import RunReport, share_the_gil
from pipeline.telemetry import Progress, RunFolder
from pipeline.versions import VersionClock
from pipeline.watchdog import PipelineHung, Watchdog


@dataclass
class LocalRun:
    """Runs one Pipeline in this process (`Pipeline(runtime="local")`)."""

    report: RunReport | None = None
    fleet: Fleet | None = None  # the producer's live workers while an elastic run runs (Pipeline.scale)

    async def run(self, pipe: Any, folder: RunFolder, progress: Progress, resume: Resume | None) -> None:
        share_the_gil()
        clock = resume.clock() if resume is not None else VersionClock()
        if resume is not None:
            ledger = resume.ledger(pipe.max_uses)
        else:
            ledger = Ledger.create(folder.path, max_uses=pipe.max_uses)
        gate = AdmissionGate(clock, pipe.staleness, pipe.consumer.units_per_version, last_version=pipe.steps)
        if resume is not None:
            resume.restore_gate(gate)
        ctx = self._context(pipe, folder, clock, ledger, gate, resume)
        log = ctx.log("pipeline")
        with pipe.buffer.serve_store() as opener:
            ctx.services.store = opener.open(holder=True, faults=ctx.services.faults)
            actors, until = self._actors(pipe, ctx, clock, ledger, gate, resume)
            log.info("run starting", folder=str(folder.path), actors=[a.name for a in actors], steps=pipe.steps)
            try:
                failure = await self._run(pipe, ctx, clock, actors, until, progress)
            finally:
                self.fleet = None
                for channel in ctx.channels.values():
                    channel.close()
                self.report = RunReport(clock.version, ledger.counts(), ledger.balanced(), ledger.to_json(),
                                        ctx.started_at, reasons=ledger.reasons())
        if failure is not None:
            log.error("run failed", folder=str(folder.path), ledger=ledger.counts(), error=str(failure))
            if isinstance(failure.__cause__, PipelineHung):
                raise failure.__cause__  # the watchdog's own diagnosis, not "actor 'watchdog' failed"
            raise failure

    def _context(
        self, pipe: Any, folder: RunFolder, clock: VersionClock, ledger: Ledger, gate: AdmissionGate,
        resume: Resume | None,
    ) -> RunContext:
        """The run's context with its channels, faults bound and checkpointer set."""
        ctx = RunContext(
            run=pipe.name, seed=pipe.seed, steps=pipe.steps, clock=LocalClock(clock), ledger=LocalLedger(ledger),
            gate=LocalGate(gate), policy=pipe.staleness, feedback=Channel("feedback", max_items=1 << 20),
            folder=folder, resume=resume,
        )
        (items, nbytes), (ready_items, ready_bytes) = pipe.produced_channel, pipe.ready_channel
        ctx.channels.update(
            produced=Channel("produced", max_items=items, max_bytes=nbytes),
            ready=Channel("ready", max_items=ready_items, max_bytes=ready_bytes), feedback=ctx.feedback,
        )
        ctx.services.start_helpers = start_local_helpers
        install_faults(ctx, as_plan(pipe.faults))  # nothing at all when no fault is planned
        if pipe.checkpoint_every:
            cut = LocalCut(pipe.name, pipe.steps, clock, ledger, gate,
                           {"produced": ctx.channels["produced"], "ready": ctx.channels["ready"]}, ctx.feedback)
            ctx.checkpoint = Checkpointer(
                folder.path, pipe.checkpoint_every, run=pipe.name, steps=pipe.steps, cut=cut,
                keep=pipe.checkpoint_keep,
            )
        return ctx

    def _actors(
        self, pipe: Any, ctx: RunContext, clock: VersionClock, ledger: Ledger, gate: AdmissionGate,
        resume: Resume | None,
    ) -> tuple[list[Actor], list[str]]:
        """Every actor of the run, and the names of those whose return ends it (the consumer's)."""
        produced, ready = ctx.channels["produced"], ctx.channels["ready"]
        extra: list[Actor] = []
        for hook in pipe.hooks:  # a hook sees the context and may add actors (watchdogs, fault injectors)
            extra.extend(hook(ctx) or ())
        buffers = list(pipe.buffer.actors(ctx, produced, ready))  # first: the others use its store
        producers = list(pipe.producer.actors(ctx, None, produced))
        self.fleet = fleet = _fleet(pipe, ctx, produced, producers)  # before the consumer's actors: they read it
        consumers = list(pipe.consumer.actors(ctx, ready, None))
        if ctx.checkpoint is not None:  # refs producers are sending and the buffer's index are checkpointed too
            ctx.checkpoint.cut.holders = LiveHolders(fleet.workers if fleet is not None else producers, buffers)
        if resume is not None:
            extra.append(resume.feeder(ctx, produced, ledger))
        if fleet is not None:
            extra.extend(a for a in (fleet, ControlServer(fleet, ctx.folder.path), scale_faults(ctx, fleet)) if a)
        actors = [*producers, *buffers, *consumers, *extra]
        if pipe.watchdog is not None and pipe.watchdog.enabled:
            actors.append(Watchdog(
                pipe.watchdog, progress=lambda: (("version", clock.version), *ledger.counts().items()),
                channels=ctx.channels, actors=list(actors), activity=ctx.activity, status=ctx.services.status,
                gate=gate.status, run=pipe.name, folder=ctx.folder,
            ))
        return actors, [a.name for a in consumers]

    async def _run(
        self, pipe: Any, ctx: RunContext, clock: VersionClock, actors: list[Actor], until: list[str],
        progress: Progress,
    ) -> ActorFailed | None:
        """Run the actors with the progress line; the failure is returned, not raised, so the task group
        does not wrap it."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(_show_progress, pipe, ctx, clock, progress)
            try:
                await run_actors(actors, until=until, on_failure=lambda exc: setattr(ctx, "failure", exc))
            except ActorFailed as exc:
                return exc
            finally:
                tg.cancel_scope.cancel()
        return None


def _fleet(pipe: Any, ctx: RunContext, outbox: Channel, producers: list[Actor]) -> Fleet | None:
    """The run's fleet (`pipeline.fleet`) where it may grow (`max_workers`), else None."""
    if not pipe.max_workers:
        return None
    if not isinstance(pipe.producer, Scalable):
        raise FleetError(f"max_workers = {pipe.max_workers}, but the producer {type(pipe.producer).__name__} cannot "
                         "make workers while the run goes on (it is not pipeline.contracts.Scalable); unset it")
    ctx.services.fleet = Fleet(LocalLauncher(pipe.producer, ctx, outbox), ctx, producers, pipe.max_workers)
    return ctx.services.fleet


@dataclass
class LocalLauncher:
    """The local runtime's `WorkerLauncher`: a joining worker is the producer's own (`Scalable.join`), in this
    process, beside the others, so a preempted worker's requests may go on with them (its relay)."""

    stage: Scalable
    ctx: RunContext
    outbox: Channel

    def join(self, index: int) -> Actor:
        return self.stage.join(self.ctx, self.outbox, index)



class LiveHolders:
    """The ref holders a checkpoint cut asks: the producer's workers live now (`workers`, a fleet's list,
    read at each cut), then the buffer's actors."""

    def __init__(self, workers: list[Actor], buffers: list[Actor]) -> None:
        self._owner, self._buffers = workers, buffers

    def __iter__(self) -> Any:
        return (a for a in (*self._owner, *self._buffers) if isinstance(a, RefHolder))


async def _show_progress(pipe: Any, ctx: RunContext, clock: VersionClock, progress: Progress) -> None:
    while True:
        depths = {n: f"{c.depth}/{c.max_items}" for n, c in ctx.channels.items() if n != "feedback"}
        progress.update(
            version=f"{clock.version}/{pipe.steps}", **pipe.consumer.progress(ctx.folder.latest_metrics()), **depths
        )
        await anyio.sleep(0.25)


def _check_names(actors: Sequence[Actor], until: Sequence[str]) -> None:
    names = [a.name for a in actors]
    if len(set(names)) != len(names):
        raise ValueError(f"actor names must be unique, got {names}")
    if missing := set(until) - set(names):
        raise ValueError(f"until names unknown actors: {sorted(missing)}")


async def run_actors(actors: Sequence[Actor], until: Sequence[str],
                     on_failure: Callable[[ActorFailed], None] | None = None) -> None:
    """Start all actors, run them until every actor named in `until` has returned, then stop all.

    Raises ActorFailed (cause chained) if any start() or run() raises. Other actors are cancelled
    and every started actor is stopped either way; `on_failure` hears of the first failure before any
    actor is stopped (so a stop can tell a crash from an interrupt).
    """
    _check_names(actors, until)
    started: list[Actor] = []
    failure: list[ActorFailed] = []

    def failed(err: ActorFailed) -> ActorFailed:
        if not failure and on_failure is not None:
            on_failure(err)
        failure.append(err)
        return err

    try:
        for actor in actors:
            try:
                await actor.start()
            except Exception as exc:
                raise failed(ActorFailed(actor.name, "start", exc)) from exc
            started.append(actor)

        pending = set(until)

        async with anyio.create_task_group() as tg:

            async def supervise(actor: Actor) -> None:
                try:
                    await actor.run()
                except anyio.get_cancelled_exc_class():
                    raise
                except Exception as exc:
                    err = ActorFailed(actor.name, "run", exc)
                    err.__cause__ = exc
                    failed(err)
                    tg.cancel_scope.cancel()
                    return
                pending.discard(actor.name)
                if not pending:
                    tg.cancel_scope.cancel()

            for actor in actors:
                tg.start_soon(supervise, actor, name=f"actor:{actor.name}")
        if failure:
            raise failure[0]
    finally:
        with anyio.CancelScope(shield=True):
            stop_errors = []
            for actor in reversed(started):
                try:
                    await actor.stop()
                except Exception as exc:  # keep stopping the others; report after
                    stop_errors.append(ActorFailed(actor.name, "stop", exc))
            if stop_errors and not failure:
                raise stop_errors[0]


__all__ = ["LocalRun", "run_actors"]


class ProcessHelper:
    """A stage's helper process on this host (`start_local_helpers`)."""

    def __init__(self, name: str, process: multiprocessing.process.BaseProcess) -> None:
        self.name, self.process = name, process

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def exitcode(self) -> int | None:
        return self.process.exitcode

    def stop(self, timeout_s: float) -> None:
        self.process.join(timeout=timeout_s)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()


def start_local_helpers(name: str, fn: Callable[..., None], args: Sequence[tuple],
                        resources: Resources) -> list[Helper]:
    """One fresh interpreter per args tuple (spawn) on this host, each ending with this process (also when
    it is SIGKILLed). Call it from a thread that lives as long as the run (pipeline.lifetime). Resources
    are this host's: a process may use whatever the machine has."""
    context = multiprocessing.get_context("spawn")
    helpers = []
    for i, arguments in enumerate(args):
        process = context.Process(target=_helper_main, args=(fn, arguments), name=f"{name}-{i}", daemon=True)
        process.start()
        helpers.append(ProcessHelper(f"{name}-{i}", process))
    return helpers


def _helper_main(fn: Callable[..., None], args: tuple) -> None:
    die_with_parent()
    fn(*args)
