"""The simulation itself: one run of a config's pipeline in virtual time (`Simulation`, `simulate`), the
config it reads (`load_simulation_config`) and its outputs (a run folder, a table). See baton.simulate
for what is real and what is modelled."""

from __future__ import annotations

import random
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baton.builder import make_part, make_selection_policy
from baton.config import ConfigError, load_toml, validate
from baton.schema import RunConfig, SimulateSpec, default_of
from baton.simulate.calibrate import steady_figures
from baton.simulate.costs import Costs, DeclaredCosts
from baton.simulate.events import TIMEOUT, EventLoop, Process, Wait, channel_receive_many, channel_send
from baton.simulate.fleet import Fleet, LearnerRestarts
from baton.simulate.schedule import phase_figures, phases_of, print_phases
from pipeline.admission import AdmissionGate
from pipeline.channel import Channel
from pipeline.versions import VersionClock
from policies.selection import ReplayWindow
from stages.rollout import Rollout

SIMULATE_TABLE = "simulate"


def load_simulation_config(path: str | Path, overrides: Sequence[str] = ()) -> tuple[RunConfig, SimulateSpec]:
    """The run config and the `[simulate]` table of the TOML at `path`."""
    data = load_toml(path, overrides)
    if data.get("runtime") == "ray":  # a run folder's resolved config.toml lists their defaults; not simulated
        for section in ("checkpoint", "watchdog"):
            data.pop(section, None)
    table = data.pop(SIMULATE_TABLE, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [simulate] must be a table, e.g. [simulate] decode_tokens_per_s = 2000")
    spec = validate(SimulateSpec, table, source=f"{path} [simulate]")
    return validate(RunConfig, data, source=str(path)), spec


@dataclass(slots=True)
class SimGroup:
    """What a ref says of a group: its oldest token version, payload bytes, tokens, (instead of rewards)
    whether its rewards differ, and its engine."""

    id: int
    version: int
    nbytes: int
    tokens: int
    signal: bool
    engine: int = 0  # the engine that generated it


@dataclass
class SimResult:
    records: list[dict]  # one per version, metrics.jsonl-like
    figures: dict[str, float]
    staleness_hist: dict[int, int]
    counts: dict[str, int]
    events: int
    wall_s: float
    engines: int
    k: int
    phases: list[dict]  # per phase of the engine schedule and learner restarts (baton.simulate.schedule)
    restarts: list[dict]  # per learner restart: when, at which version, versions rolled back, seconds


class Simulation:
    """One simulated run: the real policy, gate, clock, channels and replay window, cost-modelled stages."""

    def __init__(self, cfg: Any, spec: SimulateSpec, costs: Costs, engines: int | None = None,
                 steps: int | None = None) -> None:
        self.cfg, self.spec, self.costs = cfg, spec, costs
        at_zero = [n for at, n in spec.engine_schedule if at == 0]
        self.engines = at_zero[0] if at_zero else engines or spec.engines or cfg.engine_count
        self.steps = steps or spec.steps or cfg.steps
        self.rng = random.Random(spec.seed)
        self.groups_per_step = cfg.learner.groups_per_step
        self.group_size = cfg.rollout.group_size
        self.batch_groups = cfg.engine_sampling().get("batch_groups", default_of(Rollout, "batch_groups"))
        self.policy = make_part("staleness", cfg)  # the object `baton run` builds for this config
        self.selection = make_selection_policy(cfg)
        self.clock = VersionClock()
        self.gate = AdmissionGate(self.clock, self.policy, self.groups_per_step)
        b = cfg.buffer
        self.produced: Channel[SimGroup] = Channel("produced", b.produced_channel, int(b.produced_bytes))
        self.ready: Channel[SimGroup] = Channel("ready", b.ready_channel, int(b.ready_bytes))
        self.window: ReplayWindow[SimGroup] = ReplayWindow(self.selection, self.policy)
        self.loop = EventLoop()
        self.index: deque[SimGroup] = deque()  # the buffer's index
        self.index_bytes = 0
        self.fetched: list[SimGroup] = []
        self.records: list[dict] = []
        self.trained_staleness: list[int] = []
        self.counts: Counter[str] = Counter()
        self.engine_busy_s = 0.0
        self._ids = 0
        self._prefetch_loading = False
        self.fleet = Fleet(self.loop, spec, self._engine)  # engines joining and leaving (engine_schedule)
        self.restarts = LearnerRestarts(self.loop, spec, cfg.checkpoint.every,
                                        self.groups_per_step * self.group_size)

    # -- shared -------------------------------------------------------------------------------------
    def _discard(self, units: int = 1) -> None:
        self.gate.discard(units)
        self.loop.notify((self.gate, "discard"))

    def _acquire_many(self, max_units: int, engine: int) -> Process:
        """AdmissionGate.acquire_many: wait (for a version change or a discard) until the policy admits one
        unit, then take as many more as it admits now; 0 when `engine` is told to leave while it waits."""
        while True:
            if engine in self.fleet.leaving:
                return 0
            if self.gate.try_acquire():
                break
            yield Wait((self.clock, "changed"), (self.gate, "discard"), ("leave", engine))
        taken = 1
        while taken < max_units and self.gate.try_acquire():
            taken += 1
        return taken

    # -- producers ------------------------------------------------------------------------------------
    def _engine(self, index: int, join_s: float = 0.0) -> Process:
        """One engine: joins (after `join_s`: model, snapshot, fence; it then holds the current version),
        generates until told to leave, and leaves once its call in flight is stored and sent (drained)."""
        # each engine draws from its own stream, so adding engines leaves the others' costs as they were
        costs, rng, loop = self.costs, random.Random(f"{self.spec.seed}/engine/{index}"), self.loop
        if join_s:
            yield join_s
        loaded = self.clock.version
        while index not in self.fleet.leaving:
            n = yield from self._acquire_many(self.batch_groups, index)
            if not n:
                break
            self.fleet.admitted[index] += n
            call = costs.engine_call(rng, n)
            yield call.overhead_s
            busy_from = loop.now
            if loaded < self.clock.version:  # weights that arrived while idle
                loaded = self.clock.version
                yield costs.engine_load_s
            oldest = self.clock.version
            end = loop.now + call.generate_s
            while True:
                woke = yield Wait((self.clock, "changed"), timeout=max(0.0, end - loop.now))
                if woke == TIMEOUT:
                    break
                loaded = self.clock.version  # a new version reached this engine mid-call: pause, load
                end += costs.engine_load_s
                if self.policy.interrupt(oldest, self.clock.version) == "restart":
                    self.counts["restarted"] += n
                    oldest = self.clock.version
                    end = loop.now + costs.engine_load_s + costs.engine_call(rng, n).generate_s
            yield call.put_s
            self.engine_busy_s += loop.now - busy_from
            for tokens, nbytes in zip(call.group_tokens, call.group_nbytes, strict=True):
                self._ids += 1
                signal = rng.random() >= self.spec.zero_signal_fraction
                group = SimGroup(self._ids, oldest, nbytes, tokens, signal, index)
                self.counts["produced"] += 1
                self.fleet.produced_by[index] += 1
                yield from channel_send(loop, self.produced, group)
        self.fleet.gone(index)

    # -- buffer -----------------------------------------------------------------------------------------
    def _index_full(self, group: SimGroup) -> bool:
        if len(self.index) >= self.cfg.buffer.max_refs:
            return True
        return bool(self.index) and self.index_bytes + group.nbytes > int(self.cfg.buffer.max_bytes)

    def _buffer_intake(self) -> Process:
        while True:
            groups = yield from channel_receive_many(self.loop, self.produced, self.cfg.buffer.max_refs)
            yield self.costs.hop_s
            for group in groups:
                while self._index_full(group):
                    yield Wait(("index", "changed"))
                self.index.append(group)
                self.index_bytes += group.nbytes
                self.loop.notify(("index", "changed"))

    def _buffer_forward(self) -> Process:
        while True:
            while not self.index:
                yield Wait(("index", "changed"))
            batch = [self.index.popleft() for _ in range(min(len(self.index), self.ready.max_items))]
            self.index_bytes -= sum(g.nbytes for g in batch)
            self.loop.notify(("index", "changed"))
            yield self.costs.hop_s
            for group in batch:
                yield from channel_send(self.loop, self.ready, group)

    def _buffer_evict(self, version: int) -> None:
        """RefBufferActor._evict_on_version: refuse the indexed refs the policy no longer accepts."""
        expired = [g for g in self.index if self.policy.accept(version, g.version) != "train"]
        if not expired:
            return
        gone = {g.id for g in expired}
        self.index = deque(g for g in self.index if g.id not in gone)
        self.index_bytes = sum(g.nbytes for g in self.index)
        self.loop.notify(("index", "changed"))
        for group in expired:
            self._refuse(group, version)

    def _refuse(self, group: SimGroup, version: int) -> None:
        verdict = self.policy.accept(version, group.version)
        self.counts["requeued" if verdict == "requeue" else "dropped"] += 1
        self.fleet.settled_by[group.engine] += 1
        self._discard(1)

    # -- learner ----------------------------------------------------------------------------------------
    def _load(self, groups: list[SimGroup]) -> Process:
        for group in groups:
            yield self.costs.load_s(self.rng, group.nbytes)
            self.fetched.append(group)

    def _admit_fetched(self) -> None:
        fetched, self.fetched = self.fetched, []
        for group in fetched:
            if self.selection.admit([1.0, 0.0] if group.signal else [0.5, 0.5]):
                self.window.add(group, group.version)
            else:
                self.counts["filtered"] += 1
                self.fleet.settled_by[group.engine] += 1
                self._discard(1)

    def _collect(self, version: int) -> Process:
        wanted = self.groups_per_step
        while True:
            self._admit_fetched()
            for entry in self.window.expire(version):
                if not entry.reused:
                    self._refuse(entry.item, version)
            if len(self.window) >= wanted:
                break
            groups = yield from channel_receive_many(self.loop, self.ready, wanted - len(self.window))
            yield self.costs.hop_s
            yield from self._load(groups)
        taken = self.window.take(version, wanted)
        replays = sum(t.reused for t in taken)
        if replays:
            self.gate.replayed(replays)
        return taken

    def _prefetch(self) -> Process:
        room = self.groups_per_step - len(self.fetched) - len(self.window)
        groups = yield from channel_receive_many(self.loop, self.ready, max(room, 1))
        self._prefetch_loading = True  # holding refs now: the step waits for their loads (shielded)
        yield self.costs.hop_s
        yield from self._load(groups)
        self._prefetch_loading = False
        self.loop.notify(("prefetch", "done"))

    def _learner(self) -> Process:
        costs, rng, loop = self.costs, self.rng, self.loop
        version = 0
        last = loop.now
        samples = 0
        while version < self.steps:
            taken = yield from self._collect(version)
            t0 = loop.now
            prefetch = loop.spawn(self._prefetch()) if version + 1 < self.steps else None
            lost_s = yield from self.restarts.train(costs.step_s(rng, sum(t.item.tokens for t in taken)), version)
            step_s = loop.now - t0 - lost_s
            if prefetch is not None and loop.alive(prefetch):
                if self._prefetch_loading:
                    while self._prefetch_loading:
                        yield Wait(("prefetch", "done"))
                else:
                    loop.cancel(prefetch)
            t_push = loop.now
            yield costs.push_s(rng, self.fleet.live())
            push_s = loop.now - t_push
            self.clock.advance(version + 1)
            loop.notify((self.clock, "changed"))
            self._buffer_evict(version + 1)
            stale = [version - t.item.version for t in taken]
            self.trained_staleness.extend(stale)
            self.counts["trained"] += len(taken)
            self.fleet.settled_by.update(t.item.engine for t in taken if not t.reused)
            self.window.returned(taken, version)
            samples += len(taken) * self.group_size
            version += 1
            yield costs.learner_overhead_s(rng)
            self.records.append({
                "version": version, "t": round(loop.now, 6),
                "staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale),
                "samples_per_s": round(samples / loop.now, 2) if loop.now > 0 else 0.0,
                "step_s": step_s, "collect_s": t0 - last, "push_s": push_s, "version_s": loop.now - last,
                "engine_busy_s": self.engine_busy_s,
                "engines": self.fleet.live(), "engine_s": self.fleet.engine_seconds(),
                "dropped": self.counts["dropped"] + self.counts["requeued"], "restart_s": lost_s,
                "depth_produced": self.produced.depth, "depth_buffer": len(self.index),
                "depth_ready": self.ready.depth, "window": len(self.window),
                "live_groups": self.gate.started - self.gate.discarded - self.counts["trained"],
            })
            last = loop.now

    # -- running ------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        started = time.perf_counter()
        learner = self.loop.spawn(self._learner())
        self.fleet.start(self.engines)
        if self.fleet.steps:
            self.loop.spawn(self.fleet.run())
        if self.spec.learner_restarts:
            self.loop.spawn(self.restarts.run())
        self.loop.spawn(self._buffer_intake())
        self.loop.spawn(self._buffer_forward())
        self.loop.run(stop=lambda: not self.loop.alive(learner))
        if len(self.records) < self.steps:
            raise RuntimeError(
                f"the simulation stalled at version {len(self.records)} of {self.steps} (virtual t = "
                f"{self.loop.now:.3f} s): no stage can move; check the config's channel and buffer bounds"
            )
        samples_per_version = self.groups_per_step * self.group_size
        figures = steady_figures(self.records, samples_per_version, self.spec.warmup,
                                self.fleet.mean_engines(self.records, self.engines))
        judged = self.counts["trained"] + self.counts["dropped"] + self.counts["requeued"]
        figures["dropped_frac"] = round((self.counts["dropped"] + self.counts["requeued"]) / max(1, judged), 4)
        figures["max_staleness"] = max(self.trained_staleness, default=0)
        phases = phases_of(self.engines, self.fleet.steps, self.spec.learner_restarts, self.records[-1]["t"])
        counts = {**self.counts, **({"fleet_changes": self.fleet.changes} if self.fleet.changes else {}),
                  **({"learner_restarts": len(self.restarts.done)} if self.restarts.done else {})}
        return SimResult(
            records=self.records, figures=figures, staleness_hist=dict(sorted(Counter(self.trained_staleness).items())),
            counts=counts, events=self.loop.events, wall_s=round(time.perf_counter() - started, 3),
            engines=self.engines, k=self.policy.bound, phases=phase_figures(self.records, phases, samples_per_version),
            restarts=self.restarts.done,
        )


def simulate(cfg: Any, spec: SimulateSpec, costs: Costs | None = None, engines: int | None = None,
             steps: int | None = None) -> SimResult:
    """Run one simulation of `cfg`; declared costs from `spec` unless `costs` is given."""
    if costs is None:
        ranks = spec.learners or cfg.learner_ranks
        costs = DeclaredCosts(spec, cfg.rollout.group_size, cfg.weights.transport, cfg.runtime, ranks)
    return Simulation(cfg, spec, costs, engines=engines, steps=steps).run()


def write_run(root: str | Path, name: str, result: SimResult, extra: dict | None = None) -> Path:
    """A run folder with metrics.jsonl (one record per simulated version), summary.json and report.png."""
    from pipeline.telemetry import Panel, RunFolder, render_report

    with RunFolder.create(root, f"{name}-simulate") as folder:
        for record in result.records:
            folder.log_metrics(record)
        summary = {"figures": result.figures, "staleness_hist": result.staleness_hist, "counts": result.counts,
                   "engines": result.engines, "k": result.k, "events": result.events, "sim_wall_s": result.wall_s,
                   "phases": result.phases, "learner_restarts": result.restarts,
                   **(extra or {})}
        folder.write_json("summary.json", summary)
        trained = [s for s, n in result.staleness_hist.items() for _ in range(n)]
        panels = [
            Panel("throughput (trained samples/s, cumulative)", "line", x="t", y=["samples_per_s"]),
            Panel("staleness of trained groups", "hist", values=trained, bins=max(trained, default=0) + 1),
            Panel("queue depths (groups)", "line", x="t",
                  y=["depth_produced", "depth_buffer", "depth_ready", "window", "live_groups"]),
            Panel("learner time per version (s)", "line", x="version", y=["version_s", "step_s", "collect_s"]),
        ]
        if len(result.phases) > 1:
            panels.append(Panel("engines (live) over the schedule", "line", x="t", y=["engines"]))
        render_report(folder.path / "report.png", result.records, panels, title=f"{name}: simulated")
    return folder.path


def print_result(result: SimResult, measured: dict | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    start = " at the start (the schedule's phases below)" if len(result.phases) > 1 else ""
    table = Table(title=f"simulated: {result.engines} engines{start}, k = {result.k} ({result.events} events, "
                        f"{result.wall_s:.2f} s)")
    table.add_column("figure")
    table.add_column("simulated", justify="right")
    if measured:
        table.add_column("measured", justify="right")
        table.add_column("error", justify="right")
    for key, value in result.figures.items():
        row = [key, f"{value:g}"]
        if measured:
            m = measured.get(key)
            row += ["" if m is None else f"{m:g}", "" if not m else f"{(value - m) / m:+.1%}"]
        table.add_row(*row)
    table.add_row("staleness histogram", str(result.staleness_hist))
    Console(stderr=True, width=120).print(table)
    if len(result.phases) > 1:
        print_phases(result.phases, (measured or {}).get("phases"))
