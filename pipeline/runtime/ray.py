"""The Ray runtime: the same Pipeline, every actor in its own Ray actor process.

Placement. Each actor a stage contributes (one per engine worker, the buffer, the consumer) runs in
a `StageHost`, a Ray async actor with one CPU and one torch thread. The run's shared state lives in
a `Conductor` actor (version clock, admission gate, ledger) and the channels in `ChannelHost`
actors (`pipeline.runtime.ray_channel`), so stages reach all of it through the same awaited calls
as in the local runtime (`pipeline.context`). Only refs and small control messages cross these
calls; payloads go through the store, which each process opens for itself (the buffer's process
as the holder).

Supervision. A producer host that dies is restarted by Ray (`max_restarts`); the conductor frees the
admission slots of the groups it had in flight (they were never produced, so nothing is lost or
trained twice), the consumer re-sends it the latest weights, and it starts producing again. A
buffer or consumer that dies ends the run with `ActorFailed` naming it; with checkpoints
(`checkpoint_every`, cut by `pipeline.runtime.ray_cut`), `Pipeline.resume` continues it in a fresh
cluster: the conductor starts from the checkpoint's ledger, the consumer from its state, and the
driver re-sends (or regenerates) what was in flight. With `watchdog` set, the driver also watches
for hangs across the hosts (`pipeline.runtime.ray_watchdog`).

Networking: `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` keeps a local cluster on 127.0.0.1; give
`address` to attach to a running cluster instead.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import anyio  # noqa: E402
import msgspec  # noqa: E402
import ray  # noqa: E402
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential  # noqa: E402

from pipeline.actor import ActorFailed  # noqa: E402
from pipeline.admission import AdmissionGate  # noqa: E402
from pipeline.context import LocalClock, LocalLedger, Produced, Redo, RunContext, VersionPolicy  # noqa: E402
from pipeline.faults import as_plan  # noqa: E402
from pipeline.faults import install as install_faults  # noqa: E402
from pipeline.ledger import Ledger  # noqa: E402
from pipeline.runtime.ray_channel import RayChannel  # noqa: E402
from pipeline.telemetry import RunFolder, configure_logging, get_logger  # noqa: E402
from pipeline.versions import VersionClock  # noqa: E402


@ray.remote(num_cpus=0)
class Conductor(LocalClock, LocalLedger):
    """Clock, admission gate and ledger of one run, for every process of it. The clock and ledger
    calls are the local runtime's (`LocalClock`, `LocalLedger`); what differs is per-worker
    bookkeeping of admitted units, so a dead producer's slots can be freed."""

    def __init__(self, policy: VersionPolicy, units_per_version: int, max_uses: int, folder: str) -> None:
        self._args = (policy, units_per_version, max_uses)
        self.folder = folder  # the ledger's store is its ledger.sqlite
        self.outstanding: Counter[str] = Counter()  # per producer: admitted units not yet produced

    async def setup(self, resume: bytes | None = None, attempt: int = 0) -> bytes | None:
        """Build the clock, ledger and gate (anyio primitives need the actor's running event loop): new
        ones, or the checkpoint's (`resume`: its msgpack `RunState`), reopened as `pipeline.checkpoint`
        states; then returns the msgpack `Reopened` (the redo requests the driver queues first)."""
        from pipeline.checkpoint import RunState, reopen, restore_gate, resumed_ledger
        from pipeline.runtime.ray_cut import Freezer

        policy, units, max_uses = self._args
        self.freezer = Freezer()
        if resume is None:
            self.clock = VersionClock()
            self.ledger = Ledger.create(self.folder, max_uses=max_uses)
            self.gate = AdmissionGate(self.clock, policy, units)
            return None
        state = msgspec.msgpack.decode(resume, type=RunState)
        self.clock = VersionClock(state.version)
        self.ledger = resumed_ledger(state, self.folder, max_uses)
        self.gate = AdmissionGate(self.clock, policy, units)
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
        """The admission gate's counts and whether it would admit a unit now (`pipeline.dsl._gate_status`),
        msgspec-encoded."""
        from pipeline.dsl import _gate_status

        return msgspec.msgpack.encode(_gate_status(self.gate))

    async def report(self) -> bytes:
        """Everything the driver needs at the end, msgspec-encoded."""
        return msgspec.msgpack.encode(
            {
                "version": self.clock.version,
                "counts": self.ledger.counts(),
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

    async def fates(self, ids: list[str]) -> list[str]:
        return await self.conductor.fates.remote(ids)

    async def take_settled(self) -> dict[str, dict[str, list[float]]]:
        return await self.conductor.take_settled.remote()


@dataclass
class Peer:
    """Another host, as stages see it: `deliver(box, header, blob)` into its mailbox `box`, or
    `ask(box, header)` for the mailbox's reply.

    A peer that is dead or restarting misses the delivery (returns False) instead of failing the
    sender: the runtime asks the sender to re-send its latest state once the peer is back."""

    host: Any

    async def deliver(self, box: str, header: bytes, blob: Any) -> bool:
        try:
            return await self.host.deliver.remote(box, header, blob)
        except ray.exceptions.RayActorError:
            return False

    async def ask(self, box: str, header: bytes) -> bytes | None:
        """The reply of mailbox `box` to `header`; None when the peer is dead or not set up."""
        try:
            return await self.host.ask.remote(box, header)
        except ray.exceptions.RayActorError:
            return None


@dataclass
class Wiring:
    """What a host needs to rebuild its part of the run (sent once, at creation)."""

    run: str
    seed: int
    steps: int
    folder: str
    policy: VersionPolicy
    units_per_version: int
    conductor: Any
    channels: dict[str, RayChannel]
    store: Any  # a StoreSpec or a process-portable store
    started_at: float
    log_format: str = "console"
    peers: dict[str, list[Any]] = field(default_factory=dict)
    faults: Any = None  # a pipeline.faults.FaultPlan, bound in each host (process-level faults kill the host)
    checkpoint_every: int = 0  # the consumer checkpoints every this many versions (pipeline.runtime.ray_cut)
    checkpoint_keep: int = 2
    resume: Any = None  # a pipeline.checkpoint.ResumePoint: the consumer continues from that checkpoint


@ray.remote(num_cpus=1, max_concurrency=64)
class StageHost:
    """One actor of a stage, in this process. `role` is producer | buffer | consumer."""

    def __init__(self, stage: Any, role: str, index: int, wiring: Wiring) -> None:
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
        configure_logging(wiring.log_format)
        self.stage, self.role, self.index, self.wiring = stage, role, index, wiring
        self.name = f"{role}-{index}"
        self.actor: Any = None
        self.ctx: RunContext | None = None
        self._run_task: asyncio.Task | None = None

    def pid(self) -> int:
        return os.getpid()

    async def setup(self, peers: dict[str, list[Any]]) -> str:
        """Build the context and this host's actor (after every host exists, so peers are known)."""
        from buffers.store import open_store

        w = self.wiring
        ctx = RunContext(
            run=w.run, seed=w.seed, steps=w.steps,
            clock=RemoteClock(w.conductor),
            ledger=RemoteLedger(w.conductor, self.name),
            gate=RemoteGate(w.conductor, w.units_per_version, self.name),
            policy=w.policy,
            feedback=w.channels["feedback"],
            folder=RunFolder(w.folder),
            channels={k: v for k, v in w.channels.items() if k != "feedback"},
            started_at=w.started_at,
        )
        plan = install_faults(ctx, w.faults, isolated=True)
        ctx.services["store"] = open_store(w.store, holder=self.role == "buffer", faults=plan)
        ctx.services["producers"] = [Peer(h) for h in peers.get("producer", [])]
        produced, ready = w.channels["produced"], w.channels["ready"]
        inbox, outbox = {
            "producer": (None, produced), "buffer": (produced, ready), "consumer": (ready, None)
        }[self.role]
        ctx.resume = w.resume  # the consumer's state, the producers' random streams
        if self.role == "consumer":
            if w.checkpoint_every:
                from pipeline.checkpoint import Checkpointer
                from pipeline.runtime.ray_cut import RayCut

                cut = RayCut(w.run, w.steps, w.units_per_version, w.conductor, peers.get("producer", []),
                             peers["buffer"][0], w.channels)
                ctx.checkpoint = Checkpointer(w.folder, w.checkpoint_every, run=w.run, steps=w.steps, cut=cut,
                                              keep=w.checkpoint_keep)
        actors = list(self.stage.actors(ctx, inbox, outbox))
        self.actor = actors[self.index] if self.role == "producer" else actors[0]
        self.ctx = ctx
        return self.actor.name

    async def held(self) -> bytes:
        """What this host's actor holds for a checkpoint cut (`pipeline.runtime.ray_cut.HostHeld`, msgpack);
        nothing when it is not set up (a restarting producer holds nothing)."""
        from pipeline.runtime.ray_cut import HostHeld, held_by

        return held_by(self.actor) if self.actor is not None else msgspec.msgpack.encode(HostHeld())

    async def start(self) -> None:
        await self.actor.start()

    async def run(self) -> None:
        self._run_task = asyncio.current_task()
        await self.actor.run()

    async def stop(self) -> None:
        if self._run_task is not None and not self._run_task.done():
            self._run_task.cancel()
        await self.actor.stop()

    async def deliver(self, box: str, header: bytes, blob: Any) -> bool:
        """Hand a message to this host's mailbox `box`; False if the host is not set up (yet, after
        a restart: the sender re-sends its latest once the supervisor says the host is back)."""
        if self.ctx is None:
            return False
        await self.ctx.services["mailboxes"][box](header, blob)
        return True

    async def ask(self, box: str, header: bytes) -> bytes | None:
        """Like `deliver`, returning the mailbox's reply (bytes); None if the host is not set up."""
        if self.ctx is None:
            return None
        return await self.ctx.services["mailboxes"][box](header, None)

    async def diagnose(self) -> bytes:
        """This host's part of a hang report, a msgspec-encoded `pipeline.watchdog.ProcessDiagnosis`: the
        await chains of its actor's tasks (the task running `run()` and those started under it), its
        last events and its status lines. Answers while `run()` is blocked (another call on the loop)."""
        from pipeline.watchdog import ProcessDiagnosis, diagnose_process

        if self.ctx is None or self.actor is None:  # not set up yet, or again after a restart
            return msgspec.msgpack.encode(ProcessDiagnosis(
                host=self.name, pid=os.getpid(), actors=[], status=[f"{self.name}: not set up"]
            ))
        return msgspec.msgpack.encode(diagnose_process(
            self.name, [self.actor], self.ctx.activity, self.ctx.services.get("status", []), root=self._run_task,
        ))

    async def producer_restarted(self, index: int) -> None:
        hook = self.ctx.services.get("on_producer_restart")
        if hook is not None:
            await hook(index)


@dataclass
class RayRun:
    """Runs one Pipeline on Ray (see `Pipeline.run(runtime="ray")`)."""

    pipeline: Any
    address: str | None = None
    max_restarts: int = 3
    log_format: str = "console"
    watchdog: Any = None  # a pipeline.watchdog.WatchdogSettings: hang diagnosis across the hosts; None: off
    restarts: Counter[str] = field(default_factory=Counter)
    _feeder: Any = None  # the resumed run's `_ResumeFeeding`, run by the driver
    report: dict[str, Any] | None = None  # the conductor's final report, once the run ended (or failed)

    async def __call__(self, folder: RunFolder, progress: Any, resumed: Any = None) -> dict[str, Any]:
        """Run the pipeline in `folder`; `resumed` (a `pipeline.checkpoint.Resumed`): continue from its
        checkpoint. Returns the conductor's report."""
        pipe = self.pipeline
        started_ray = not ray.is_initialized()
        hosts_needed = len(pipe.producer.engines) + 2
        if started_ray:
            local = self.address is None
            ray.init(
                # logical CPUs: one per host even on a 2-core machine (each host runs one torch thread)
                num_cpus=max(os.cpu_count() or 1, hosts_needed) if local else None,
                address=self.address, include_dashboard=False, log_to_driver=bool(os.environ.get("BATON_RAY_LOGS")),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}},
            )
        log = get_logger("ray-runtime").bind(run=pipe.name)
        hosts: dict[str, Any] = {}
        conductor = None
        channels: dict[str, RayChannel] = {}
        store = pipe.buffer.store
        serving = store.serve() if hasattr(store, "serve") else contextlib.nullcontext(store)
        try:
            store = serving.__enter__()  # e.g. a Mooncake master started for this run
            conductor = Conductor.remote(
                pipe.staleness, pipe.consumer.units_per_version, pipe.max_uses, str(folder.path)
            )
            reopened = await conductor.setup.remote(
                _STATE_ENCODER.encode(resumed.state) if resumed is not None else None,
                resumed.attempt if resumed is not None else 0,
            )
            channels = {
                "produced": RayChannel.create("produced", pipe.produced_channel[0], pipe.produced_channel[1]),
                "ready": RayChannel.create("ready", pipe.ready_channel[0], pipe.ready_channel[1]),
                "feedback": RayChannel.create("feedback", 1 << 20, None, item_type=Redo),
            }
            wiring = Wiring(
                run=pipe.name, seed=pipe.seed, steps=pipe.steps, folder=str(folder.path), policy=pipe.staleness,
                units_per_version=pipe.consumer.units_per_version, conductor=conductor, channels=channels,
                store=store, started_at=time.time(), log_format=self.log_format, faults=as_plan(pipe.faults),
                checkpoint_every=pipe.checkpoint_every, checkpoint_keep=pipe.checkpoint_keep,
                resume=resumed.point() if resumed is not None else None,
            )
            if resumed is not None:  # the checkpoint's owed work is queued before any producer runs
                from pipeline.checkpoint import Reopened

                reopened = msgspec.msgpack.decode(reopened, type=Reopened)
                resumed.count(reopened)
                await channels["feedback"].send_many(reopened.requests)
                self._feeder = _ResumeFeeding(resumed, wiring)
            n_producers = len(pipe.producer.engines)
            tag = f"baton/{pipe.name}/{folder.path.name}"  # named, so operators (and tests) can find them
            for i in range(n_producers):
                hosts[f"producer-{i}"] = StageHost.options(
                    name=f"{tag}/producer-{i}", max_restarts=self.max_restarts, max_task_retries=0
                ).remote(
                    pipe.producer, "producer", i, wiring
                )
            hosts["buffer-0"] = StageHost.options(name=f"{tag}/buffer-0").remote(pipe.buffer, "buffer", 0, wiring)
            hosts["consumer-0"] = StageHost.options(name=f"{tag}/consumer-0").remote(
                pipe.consumer, "consumer", 0, wiring
            )
            peers = {"producer": [hosts[f"producer-{i}"] for i in range(n_producers)], "buffer": [hosts["buffer-0"]]}
            # the buffer first: it holds the store the others open as clients
            await hosts["buffer-0"].setup.remote(peers)
            await asyncio.gather(*(h.setup.remote(peers) for n, h in hosts.items() if n != "buffer-0"))
            await asyncio.gather(*(h.start.remote() for n, h in hosts.items() if n.startswith("producer")))
            await hosts["buffer-0"].start.remote()
            await hosts["consumer-0"].start.remote()  # publishes version 0 to every producer
            log.info("ray run started", hosts=sorted(hosts), pids=await self._pids(hosts))
            await self._supervise(hosts, conductor, peers, wiring, progress)
        finally:
            report = msgspec.msgpack.decode(await conductor.report.remote()) if conductor is not None else None
            if report is not None:
                report["restarts"] = dict(self.restarts)
            self.report = report  # also when the run failed: its ledger is written all the same
            await self._teardown(hosts, channels, conductor)
            serving.__exit__(None, None, None)
            if started_ray:
                ray.shutdown()
        return report

    async def _pids(self, hosts: dict[str, Any]) -> dict[str, int]:
        return dict(zip(hosts, await asyncio.gather(*(h.pid.remote() for h in hosts.values())), strict=True))

    async def _when_back(self, host: Any, peers: dict[str, list[Any]], timeout_s: float = 120.0) -> None:
        """Set a restarted host up again, waiting while Ray still reports it as restarting."""
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(ray.exceptions.ActorUnavailableError),
            wait=wait_exponential(multiplier=0.1, max=2.0),
            stop=stop_after_delay(timeout_s),
            reraise=True,
        ):
            with attempt:
                await host.setup.remote(peers)

    async def _supervise(self, hosts, conductor, peers, wiring, progress) -> None:
        failure: list[ActorFailed] = []
        done = anyio.Event()

        async def watch_producer(name: str, index: int) -> None:
            host = hosts[name]
            while True:
                try:
                    await host.run.remote()
                    return
                except ray.exceptions.RayActorError as exc:
                    if done.is_set():
                        return
                    if self.restarts[name] >= self.max_restarts:
                        failure.append(ActorFailed(name, "run", exc))
                        done.set()
                        return
                    self.restarts[name] += 1
                    freed = await conductor.worker_died.remote(name)
                    get_logger("ray-runtime").warning(
                        "producer died; restarting it", host=name, restart=self.restarts[name], freed_slots=freed
                    )
                    await self._when_back(host, peers)  # Ray restarts the process; rebuild its actor
                    await host.start.remote()
                    await hosts["consumer-0"].producer_restarted.remote(index)
                except Exception as exc:  # the actor's own error: the run fails, naming it
                    failure.append(ActorFailed(name, "run", exc))
                    done.set()
                    return

        async def watch(name: str, ends_run: bool) -> None:
            try:
                await hosts[name].run.remote()
                if ends_run:
                    done.set()
            except Exception as exc:
                if not done.is_set():
                    failure.append(ActorFailed(name, "run", exc))
                    done.set()

        async def feed() -> None:
            try:
                await self._feeder.run()
            except Exception as exc:
                failure.append(ActorFailed("resume", "run", exc))
                done.set()

        async def show() -> None:
            while True:
                version = await conductor.current.remote()
                progress.update(
                    version=f"{version}/{self.pipeline.steps}",
                    **self.pipeline.consumer.progress(RunFolder(wiring.folder).latest_metrics()),
                )
                await anyio.sleep(0.5)

        async def watch_for_hangs() -> None:
            from pipeline.runtime.ray_watchdog import ray_watchdog
            from pipeline.watchdog import PipelineHung

            dog = ray_watchdog(
                self.watchdog, conductor, wiring.channels, hosts, run=self.pipeline.name,
                folder=RunFolder(wiring.folder),
            )
            try:
                await dog.run()
            except PipelineHung as hung:  # raised as it is, like the local runtime's
                failure.append(hung)
                done.set()

        async with anyio.create_task_group() as tg:
            for i in range(len(peers["producer"])):
                tg.start_soon(watch_producer, f"producer-{i}", i)
            tg.start_soon(watch, "buffer-0", False)
            tg.start_soon(watch, "consumer-0", True)
            tg.start_soon(show)
            if self._feeder is not None:
                tg.start_soon(feed)
            if self.watchdog is not None and self.watchdog.enabled:
                tg.start_soon(watch_for_hangs)
            await done.wait()
            tg.cancel_scope.cancel()
        if failure:
            raise failure[0]

    async def _teardown(self, hosts, channels, conductor) -> None:
        for host in hosts.values():
            try:
                with anyio.move_on_after(15):
                    await host.stop.remote()
            except Exception:  # a dead host has nothing to stop
                pass
        for host in hosts.values():
            ray.kill(host)
        for channel in channels.values():
            channel.kill()
        if conductor is not None:
            ray.kill(conductor)


@dataclass
class _ResumeFeeding:
    """A resumed run's `pipeline.checkpoint.ResumeFeeder`, in the driver: it re-sends the checkpoint's
    refs whose payload the store still holds and regenerates the others, through the conductor."""

    resumed: Any
    wiring: Wiring

    async def run(self) -> None:
        from buffers.store import open_store
        from pipeline.checkpoint import ResumeFeeder

        w = self.wiring
        ctx = RunContext(
            run=w.run, seed=w.seed, steps=w.steps, clock=RemoteClock(w.conductor),
            ledger=RemoteLedger(w.conductor, "resume"), gate=RemoteGate(w.conductor, w.units_per_version, "resume"),
            policy=w.policy, feedback=w.channels["feedback"], folder=RunFolder(w.folder),
            channels={k: v for k, v in w.channels.items() if k != "feedback"}, started_at=w.started_at,
        )
        store = ctx.services["store"] = open_store(w.store, holder=False)
        try:
            await ResumeFeeder(self.resumed, ctx, w.channels["produced"]).run()
        finally:
            await store.close()


_STATE_ENCODER = msgspec.msgpack.Encoder()

__all__ = ["Conductor", "RayRun", "StageHost"]
