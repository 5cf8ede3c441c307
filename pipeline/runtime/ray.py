"""The Ray runtime: the same Pipeline, every actor in its own Ray actor process.

Placement. Each actor a stage contributes (one per engine worker, the buffer, the consumer) runs in
a `StageHost`, a Ray async actor with one CPU and one torch thread. The run's shared state lives in
a `Conductor` actor (`ray_conductor`: version clock, admission gate, ledger) and the channels in `ChannelHost`
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
`address` to attach to a running cluster instead. Every host (and helper) sets `BATON_HOST` to the
address of the Ray node it runs on, the address its servers advertise (the learner's rendezvous,
TransferEngine, a Mooncake segment); the driver, to its own node's unless set, so a Mooncake master
it starts is reachable from the other nodes (docs/guides/multi-node.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Awaitable, Callable, Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import anyio  # noqa: E402
import msgspec  # noqa: E402
import ray  # noqa: E402

from pipeline.context import RunContext  # noqa: E402
from pipeline.contracts import Placed, StoreOpener, VersionPolicy  # noqa: E402
from pipeline.faults import as_plan  # noqa: E402
from pipeline.faults import install as install_faults  # noqa: E402
from pipeline.logs import attach_run_log  # noqa: E402
from pipeline.placement import ROLE_OF_HOST, Placement  # noqa: E402
from pipeline.refs import Redo  # noqa: E402
from pipeline.roster import Roster  # noqa: E402
from pipeline.runtime import RunReport, share_the_gil  # noqa: E402
from pipeline.runtime.memory import MemorySettings, watch_memory  # noqa: E402
from pipeline.runtime.ray_channel import RayChannel  # noqa: E402
from pipeline.runtime.ray_conductor import Conductor, RemoteClock, RemoteGate, RemoteLedger  # noqa: E402
from pipeline.runtime.ray_placement import (  # noqa: E402
    PLACEMENT_TIMEOUT_S,
    Needs,
    adopt_node_address,
    await_placed,
    check_feasible,
    driver_node_address,
    host_options,
    resources_of,
    start_ray_helpers,
)
from pipeline.runtime.ray_supervision import Supervision  # noqa: E402
from pipeline.telemetry import RunFolder, configure_logging, get_logger  # noqa: E402


@dataclass
class Peer:
    """Another host, as stages see it: `deliver(box, header, blob)` into its mailbox `box`, or
    `ask(box, header)` for the mailbox's reply.

    A peer that is dead or restarting misses the delivery (returns False) instead of failing the
    sender: the runtime asks the sender to re-send its latest state once the peer is back."""

    host: Any
    name: str = ""  # its host's name, producer-<index> (an elastic run's joins and leaves name it)

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
    store: StoreOpener  # opens the run's store in each process (the buffer's as holder)
    started_at: float
    log_format: str = "console"
    faults: Any = None  # a pipeline.faults.FaultPlan, bound in each host (process-level faults kill the host)
    checkpoint_every: int = 0  # the consumer checkpoints every this many versions (pipeline.runtime.ray_cut)
    checkpoint_keep: int = 2
    resume: Any = None  # a pipeline.resume.PortableResume: the consumer continues from that checkpoint
    placement_timeout_s: float = PLACEMENT_TIMEOUT_S  # helper processes not placed by then fail the run
    helper_resources: dict[str, float] = field(default_factory=dict)  # custom resources of the helpers (ranks)

    def context(self, worker: str) -> RunContext:
        """`worker`'s context in this process: the conductor's clock, gate and ledger, the channel actors."""
        return RunContext(
            run=self.run, seed=self.seed, steps=self.steps, clock=RemoteClock(self.conductor),
            ledger=RemoteLedger(self.conductor, worker),
            gate=RemoteGate(self.conductor, self.units_per_version, worker),
            policy=self.policy, feedback=self.channels["feedback"], folder=RunFolder(self.folder),
            channels={k: v for k, v in self.channels.items() if k != "feedback"}, started_at=self.started_at,
        )


RUN_UNWIND_S = 10.0  # a host's stop waits this long for its cancelled run to unwind (the driver waits 15 s)


@ray.remote(num_cpus=1, max_concurrency=64)
class StageHost:
    """One actor of a stage, in this process. `role` is producer | buffer | consumer."""

    def __init__(self, stage: Any, role: str, index: int, wiring: Wiring) -> None:
        os.environ["OMP_NUM_THREADS"] = "1"
        adopt_node_address()
        import torch

        torch.set_num_threads(1)
        share_the_gil()
        configure_logging(wiring.log_format)
        with contextlib.suppress(OSError):  # a node without the run folder: its events stay in Ray's logs only
            attach_run_log(wiring.folder)  # this host's events in the run's run.log too (it serves this run only)
        self.stage, self.role, self.index, self.wiring = stage, role, index, wiring
        self.name = f"{role}-{index}"
        self.actor: Any = None
        self.ctx: RunContext | None = None
        self._run_task: asyncio.Task | None = None
        self._memory = watch_memory(self.name)  # opt-in (BATON_TRACEMALLOC): None, and nothing runs, without it

    def pid(self) -> int:
        return os.getpid()

    async def setup(self, peers: dict[str, list[Any]], joins: bool = False) -> str:
        """Build the context and this host's actor (after every host exists, so peers are known); `joins`: a
        producer worker joining the running run (`Scalable.join`: its `start` passes the version fence)."""
        w = self.wiring
        ctx = w.context(self.name)
        plan = install_faults(ctx, w.faults, isolated=True)
        ctx.services.store = w.store.open(holder=self.role == "buffer", faults=plan)
        ctx.services.producers = Roster(Peer(h, f"producer-{i}") for i, h in enumerate(peers.get("producer", [])))
        ctx.services.start_helpers = functools.partial(start_ray_helpers, timeout_s=w.placement_timeout_s,
                                                       custom=w.helper_resources)
        ctx.services.address = os.environ["BATON_HOST"]  # this node's (adopt_node_address)
        where = getattr(ctx.services.store, "where", dict)()  # a Mooncake client's addresses (buffers.mooncake)
        get_logger("ray-runtime").info("host placed", host=self.name, node=ctx.services.address, pid=os.getpid(),
                                       **where)
        produced, ready = w.channels["produced"], w.channels["ready"]
        inbox, outbox = {
            "producer": (None, produced), "buffer": (produced, ready), "consumer": (ready, None)
        }[self.role]
        ctx.resume = w.resume  # the consumer's state, the producers' random streams
        if self.role == "consumer":
            if w.checkpoint_every:
                from pipeline.checkpoint import Checkpointer
                from pipeline.runtime.ray_cut import RayCut

                producers = ctx.services.producers  # joiners are added to it before their fence (`add_producer`)
                cut = RayCut(w.run, w.steps, w.units_per_version, w.conductor, lambda: [p.host for p in producers],
                             peers["buffer"][0], w.channels)
                ctx.checkpoint = Checkpointer(w.folder, w.checkpoint_every, run=w.run, steps=w.steps, cut=cut,
                                              keep=w.checkpoint_keep)
        if joins:
            self.actor = self.stage.join(ctx, outbox, self.index)
        else:
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
            self._run_task.cancel()  # then let it unwind, so the actor stops from where its run left off
            await asyncio.wait([self._run_task], timeout=RUN_UNWIND_S)
        if self._memory is not None:
            self._memory.close()
        await self.actor.stop()

    async def retire(self, preempt: bool = False, peers: dict[str, Any] | None = None) -> None:
        """This producer worker leaves the run (`pipeline.contracts.Retiring`): returns once it drained. `peers`
        (name: host): the producer hosts live now, where a preempted worker's requests may continue."""
        known = {p.name for p in self.ctx.services.producers}
        self.ctx.services.producers.extend(Peer(h, n) for n, h in (peers or {}).items() if n not in known)
        await self.actor.retire(preempt)

    async def producer_joined(self, name: str, host: Any) -> None:
        """(The consumer's host) producer host `name` joined: the learner subscribes its engines now."""
        self.ctx.services.producers.add(Peer(host, name))

    async def producer_left(self, name: str) -> None:
        """(The consumer's host) producer host `name` leaves: the learner sends it nothing more."""
        producers = self.ctx.services.producers
        for peer in [p for p in producers if p.name == name]:
            producers.remove(peer)

    async def deliver(self, box: str, header: bytes, blob: Any) -> bool:
        """Hand a message to this host's mailbox `box`; False if the host is not set up (yet, after
        a restart: the sender re-sends its latest once the supervisor says the host is back)."""
        if self.ctx is None:
            return False
        await self.ctx.services.mailboxes[box](header, blob)
        return True

    async def ask(self, box: str, header: bytes) -> bytes | None:
        """Like `deliver`, returning the mailbox's reply (bytes); None if the host is not set up."""
        if self.ctx is None:
            return None
        return await self.ctx.services.mailboxes[box](header, None)

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
            self.name, [self.actor], self.ctx.activity, self.ctx.services.status, root=self._run_task,
        ))

    async def producer_restarted(self, index: int) -> None:
        hook = self.ctx.services.on_producer_restart
        if hook is not None:
            await hook(index)


@dataclass
class RayRun:
    """Runs one Pipeline on Ray (`Pipeline(runtime="ray")`), in the local runtime's shape: `run` builds
    the run's shared state (here a `Conductor` actor and channel actors), opens the store, starts a
    host per actor and supervises them until the consumer returns; `report` is left set either way."""

    address: str | None = None
    watchdog: Any = None  # a pipeline.watchdog.WatchdogSettings: hang diagnosis across the hosts; None: off
    max_restarts: int = 3
    placement_timeout_s: float = PLACEMENT_TIMEOUT_S  # an actor not placed by then fails the run (ray_placement)
    placement: Placement = field(default_factory=Placement)  # which nodes each role's processes go to
    log_format: str = "console"
    restarts: Counter[str] = field(default_factory=Counter)
    report: RunReport | None = None  # the conductor's final report, once the run ended (or failed)
    fleet: Any = None  # the producer's live workers while an elastic run runs (Pipeline.scale; pipeline.fleet)

    async def run(self, pipe: Any, folder: RunFolder, progress: Any, resume: Any = None) -> None:
        """Run `pipe` in `folder`; `resume` (a `pipeline.resume.Resume`): continue from its checkpoint."""
        started_ray = not ray.is_initialized()
        if started_ray:
            stages = (pipe.producer, pipe.buffer, pipe.consumer)
            helpers = sum(len(s.helpers()) for s in stages if isinstance(s, Placed))
            self._start_ray(hosts_needed=max(pipe.producer.workers, pipe.max_workers or 0) + 2 + helpers)
        log = get_logger("ray-runtime").bind(run=pipe.name)
        log.info("run starting on ray", folder=str(folder.path))
        started_at = time.time()
        self._hosts: dict[str, Any] = {}
        self._conductor: Any = None
        self._channels: dict[str, RayChannel] = {}
        try:
            with driver_node_address(), pipe.buffer.serve_store() as opener:  # e.g. a Mooncake master for this run
                try:
                    wiring, feeder = await self._shared_state(pipe, folder, opener, resume)
                    peers, names = await self._start_hosts(pipe, folder, wiring)
                    log.info("ray run started", hosts=sorted(self._hosts), pids=await self._pids())
                    extra = self._elastic(pipe, folder, wiring, peers, names)
                    await Supervision(self, pipe, wiring, peers, progress, feeder, extra).run()
                finally:
                    self.fleet = None
                    await self._finish(started_at)
        finally:
            if started_ray:
                ray.shutdown()

    def _start_ray(self, hosts_needed: int) -> None:
        """Without an address, a new local cluster of this run's own ("local": never one that `ray start`
        left behind, live or dead); with one, that cluster, or an error naming ray.address."""
        with _keeping_the_sigterm_handler():
            self._init_ray(hosts_needed)

    def _init_ray(self, hosts_needed: int) -> None:
        options: dict[str, Any] = dict(
            log_to_driver=bool(os.environ.get("BATON_RAY_LOGS")),
            # MALLOC_ARENA_MAX: glibc's arena per thread lets a host's heap creep up long after warm-up
            # (measured, 40k samples: the learner's process +54 MB per 100k over the second half, +39 with 2)
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                                      "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2"),
                                      **_memory_report_env()}},
        )
        if self.address is None:
            # logical CPUs: one per host even on a 2-core machine (each host runs one torch thread).
            # Ray's GCS keeps an event record of every actor call for its state API, which baton never
            # reads; a run makes millions of calls, so a cluster of its own records none (measured:
            # +150 MB of GCS per 50k calls by default, +24 MB capped at 10k tasks, +1 MB off)
            init_own_cluster(max(os.cpu_count() or 1, hosts_needed),
                             _system_config={"task_events_report_interval_ms": 0}, **options)
            return
        try:
            ray.init(address=self.address, include_dashboard=False, **options)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise ConnectionError(f"ray.address = {self.address!r}: could not join that Ray cluster ({exc})") from exc

    async def _shared_state(
        self, pipe: Any, folder: RunFolder, opener: StoreOpener, resume: Any
    ) -> tuple[Wiring, Callable[[], Awaitable[None]] | None]:
        """The conductor (from the checkpoint when resuming), the channel actors and the wiring every host
        gets; a resumed run's owed work is queued before any producer runs."""
        self._conductor = Conductor.remote(
            pipe.staleness, pipe.consumer.units_per_version, pipe.max_uses, str(folder.path), pipe.steps
        )
        reopened = await self._conductor.setup.remote(
            _STATE_ENCODER.encode(resume.state) if resume is not None else None,
            resume.attempt if resume is not None else 0,
        )
        self._channels = {
            "produced": RayChannel.create("produced", *pipe.produced_channel),
            "ready": RayChannel.create("ready", *pipe.ready_channel),
            "feedback": RayChannel.create("feedback", 1 << 20, None, item_type=Redo),
        }
        wiring = Wiring(
            run=pipe.name, seed=pipe.seed, steps=pipe.steps, folder=str(folder.path), policy=pipe.staleness,
            units_per_version=pipe.consumer.units_per_version, conductor=self._conductor, channels=self._channels,
            store=opener, started_at=time.time(), log_format=self.log_format, faults=as_plan(pipe.faults),
            checkpoint_every=pipe.checkpoint_every, checkpoint_keep=pipe.checkpoint_keep,
            resume=resume.portable() if resume is not None else None, placement_timeout_s=self.placement_timeout_s,
            helper_resources=self.placement.of("learner_ranks"),
        )
        if resume is None:
            return wiring, None
        from pipeline.resume import OwedWork

        reopened = msgspec.msgpack.decode(reopened, type=OwedWork)
        resume.count(reopened)
        await self._channels["feedback"].send_many(reopened.requests)
        return wiring, functools.partial(feed_resume, resume, wiring)

    async def _start_hosts(self, pipe: Any, folder: RunFolder,
                           wiring: Wiring) -> tuple[dict[str, list[Any]], list[str]]:
        """One host per actor, set up (the buffer first: it holds the store the others open as clients) and
        started (the consumer last: it publishes version 0 to every producer). Returns the peers, and the
        producer hosts' actor names."""
        tag = f"baton/{pipe.name}/{folder.path.name}"  # named, so operators (and tests) can find them
        hosts, needs = self._hosts, {}
        roles = [("producer", pipe.producer, i) for i in range(pipe.producer.workers)]
        roles += [("buffer", pipe.buffer, 0), ("consumer", pipe.consumer, 0)]
        for role, stage, i in roles:
            needs[f"{role}-{i}"] = Needs(resources_of(stage, i), self.placement.of(ROLE_OF_HOST[role]))
        check_feasible(needs)
        for role, stage, i in roles:
            restarts = {"max_restarts": self.max_restarts, "max_task_retries": 0} if role == "producer" else {}
            hosts[f"{role}-{i}"] = StageHost.options(
                name=f"{tag}/{role}-{i}", **host_options(needs[f"{role}-{i}"]), **restarts
            ).remote(stage, role, i, wiring)
        producers = [h for n, h in hosts.items() if n.startswith("producer")]
        peers = {"producer": producers, "buffer": [hosts["buffer-0"]]}
        await await_placed({"buffer-0": hosts["buffer-0"].setup.remote(peers)}, needs, self.placement_timeout_s)
        others = {n: h.setup.remote(peers) for n, h in hosts.items() if n != "buffer-0"}
        names = dict(zip(others, await await_placed(others, needs, self.placement_timeout_s), strict=True))
        await asyncio.gather(*(h.start.remote() for h in producers))
        await hosts["buffer-0"].start.remote()
        await hosts["consumer-0"].start.remote()
        return peers, [names[f"producer-{i}"] for i in range(len(producers))]

    def _elastic(self, pipe: Any, folder: RunFolder, wiring: Wiring, peers: dict[str, list[Any]],
                 names: list[str]) -> list[Any]:
        """An elastic run's fleet (`pipe.max_workers`; `pipeline.runtime.ray_fleet`), its control endpoint and
        its engine.join / engine.leave faults, all run in the driver; [] for a fixed fleet."""
        if not pipe.max_workers:
            return []
        from pipeline.control import ControlServer
        from pipeline.fleet import Fleet, scale_faults
        from pipeline.runtime.ray_fleet import RayLauncher

        launcher = RayLauncher(pipe.producer, wiring, peers, self._hosts, f"baton/{pipe.name}/{folder.path.name}",
                               StageHost, self.placement_timeout_s, self.placement.of("engine"))
        ctx = wiring.context("fleet")
        if wiring.faults:
            ctx.services.faults = wiring.faults.bound(folder.path, isolated=True)
        self.fleet = Fleet(launcher, ctx, launcher.first_workers(names), pipe.max_workers)
        return [a for a in (self.fleet, ControlServer(self.fleet, folder.path), scale_faults(ctx, self.fleet)) if a]

    async def _finish(self, started_at: float) -> None:
        """Keep the conductor's report (also when the run failed: its ledger is written all the same), then
        stop and kill every actor of the run."""
        if self._conductor is not None:
            final = msgspec.msgpack.decode(await self._conductor.report.remote())
            self.report = RunReport(
                final["version"], final["counts"], not final["violations"], final["ledger_json"], started_at,
                extra={"runtime": "ray", "restarts": dict(self.restarts), "checkpoint_pause_s": final["frozen_s"]},
                reasons=final["reasons"],
            )
        for host in self._hosts.values():
            try:
                with anyio.move_on_after(15):
                    await host.stop.remote()
            except Exception:  # a dead host has nothing to stop
                pass
        for host in self._hosts.values():
            ray.kill(host)
        for channel in self._channels.values():
            channel.kill()
        if self._conductor is not None:
            ray.kill(self._conductor)

    async def _pids(self) -> dict[str, int]:
        hosts = self._hosts
        return dict(zip(hosts, await asyncio.gather(*(h.pid.remote() for h in hosts.values())), strict=True))


async def feed_resume(resume: Any, wiring: Wiring) -> None:
    """A resumed run's `pipeline.resume.ResumeFeeder`, run in the driver: it re-sends the checkpoint's
    refs whose payload the store still holds and regenerates the others, through the conductor."""
    from pipeline.resume import ResumeFeeder

    ctx = wiring.context("resume")
    ctx.services.store = wiring.store.open(holder=False, faults=None)
    try:
        await ResumeFeeder(resume, ctx, wiring.channels["produced"]).run()
    finally:
        await ctx.services.store.close()


def init_own_cluster(num_cpus: int | None = None, **options: Any) -> None:
    """Start a new local Ray cluster of this process's own and connect to it (`ray.init(address="local")`),
    never one that `ray start` left behind, live or dead: plain `ray.init()` joins the cluster RAY_ADDRESS
    names, else the one whose address /tmp/ray/ray_current_cluster still holds after its head stopped (and
    then fails: "num_cpus ... must not be provided"). Its listeners are on 127.0.0.1 (this module sets
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing ray), there is no dashboard, and the caller's
    SIGTERM handler stays. `options`: more `ray.init` keywords. Every local cluster baton or its
    benchmarks start comes from here."""
    with _keeping_the_sigterm_handler():
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **options)


@contextlib.contextmanager
def _keeping_the_sigterm_handler() -> Iterator[None]:
    """`ray.init` replaces the process's SIGTERM handler (with `sys.exit`, and then its core worker's crash
    handler, which aborts the process); the caller's is put back, so a kill unwinds the run the caller's
    way and stops what the run started. Only the main thread can install handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, handler if handler is not None else signal.SIG_DFL)


def _memory_report_env() -> dict[str, str]:
    """The driver's `BATON_TRACEMALLOC*` settings (`pipeline.runtime.memory`), for every worker; {} when off."""
    settings = MemorySettings.from_env()
    return settings.env() if settings is not None else {}


_STATE_ENCODER = msgspec.msgpack.Encoder()

__all__ = ["Conductor", "RayRun", "StageHost", "init_own_cluster"]
