"""The Pipeline builder: producer -> buffer -> consumer, wired by bounded channels of refs.

    pipe = Pipeline(name="quickstart", producer=..., buffer=..., consumer=..., staleness=..., steps=60)
    summary = pipe.run()

What the pipeline guarantees, whatever the stages are:
* each stage runs as one or more actors under a runtime; the run ends when the consumer has
  taken `steps` versions, or with `ActorFailed` naming the actor that broke;
* stages exchange only refs, through two bounded channels (`produced`: producer -> buffer,
  `ready`: buffer -> consumer) and a `feedback` channel (consumer -> producer) for work to redo;
* producers start work only through the AdmissionGate, which reads the staleness policy;
* every item's fate lands in the ledger; at the end the run folder holds `config.toml`,
  `metrics.jsonl`, `ledger.json` and `report.png`, and `run()` returns the summary;
* with `checkpoint_every = N` the consumer writes a checkpoint every N versions into the run folder,
  and `resume(run_dir)` continues that run from its latest one (pipeline.checkpoint states the rule:
  the resumed run is the checkpoint's run; nothing in flight is lost uncounted);
* with `watchdog` set, a run that stops making progress is reported (which stage waits on what) and
  then failed with `PipelineHung` (pipeline.watchdog).

This module knows stages only through the small `Stage` protocol: it has no idea what a model,
a reward or a gradient is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import anyio

from pipeline.actor import Actor, ActorFailed
from pipeline.admission import AdmissionGate
from pipeline.channel import Channel
from pipeline.checkpoint import Checkpointer, LocalCut, Resumed
from pipeline.context import LocalClock, LocalGate, LocalLedger, RunContext, VersionPolicy
from pipeline.faults import FaultPlan, FaultSpec, as_plan
from pipeline.faults import install as install_faults
from pipeline.ledger import Ledger
from pipeline.telemetry import Panel, Progress, RunFolder, get_logger, render_report
from pipeline.versions import VersionClock
from pipeline.watchdog import PipelineHung, Watchdog, WatchdogSettings


@runtime_checkable
class Stage(Protocol):
    """A stage contributes actors. `inbox`/`outbox` are None where the stage has none."""

    def actors(self, ctx: RunContext, inbox: Channel | None, outbox: Channel | None) -> Sequence[Actor]: ...


@runtime_checkable
class Consumer(Stage, Protocol):
    units_per_version: int

    def summary(self, records: list[dict]) -> dict[str, Any]:
        """Figures for the run summary, from the consumer's metric records."""
        ...

    def progress(self, last: dict | None) -> dict[str, Any]:
        """Fields for the progress line, from the latest metric record."""
        ...

    def report_panels(self, records: list[dict]) -> list[Panel]: ...


@dataclass
class Pipeline:
    name: str
    producer: Stage
    buffer: Stage
    consumer: Consumer
    staleness: VersionPolicy
    steps: int = 60
    seed: int = 0
    runtime: str = "local"
    run_root: str | Path = "runs"
    produced_channel: tuple[int, int | None] = (64, None)  # (max items, max bytes)
    ready_channel: tuple[int, int | None] = (16, None)
    progress: bool = True
    config_text: str | None = None  # the resolved config, written to the run folder
    max_uses: int = 1
    ray_address: str | None = None  # runtime="ray": attach to this cluster (default: start a local one)
    hooks: list[Callable[[RunContext], Sequence[Actor] | None]] = field(default_factory=list)
    checkpoint_every: int = 0  # versions between checkpoints; 0: none
    checkpoint_keep: int = 2  # complete checkpoints kept in the run folder
    watchdog: WatchdogSettings | None = None  # hang diagnosis; None: off
    faults: FaultPlan | list[FaultSpec] | None = None  # injected faults (pipeline.faults); None: none, no hooks
    run_dir: Path | None = field(default=None, init=False)  # the folder of the latest run (set as it starts)

    def __post_init__(self) -> None:
        # a consumer that trains on an item more than once says so; the ledger must allow it
        self.max_uses = max(self.max_uses, getattr(self.consumer, "max_uses", 1))

    def run(self) -> dict[str, Any]:
        """Run to completion on the chosen runtime and return the summary."""
        if self.runtime not in ("local", "ray"):
            raise ValueError(f"runtime={self.runtime!r}: use 'local' or 'ray'")
        return anyio.run(self.arun)

    def resume(self, run_dir: str | Path) -> dict[str, Any]:
        """Continue the run in `run_dir` from its latest checkpoint (this pipeline must be the one that
        made it: same name, same stages) to `steps`, in the same folder; returns the summary, whose
        `resume` entry says what was rolled back, re-used and regenerated (pipeline.checkpoint)."""
        if self.runtime not in ("local", "ray"):
            raise ValueError(f"runtime={self.runtime!r}: use 'local' or 'ray'")
        return anyio.run(self.arun, run_dir)

    async def arun(self, resume_from: str | Path | None = None) -> dict[str, Any]:
        from pipeline.runtime.local import run_actors

        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 (0: off), got {self.checkpoint_every}")
        resumed = Resumed.open(resume_from, self.name, self.steps) if resume_from is not None else None
        if resumed is not None:
            folder = resumed.folder
        else:
            folder = RunFolder.create(self.run_root, self.name)
            if self.config_text is not None:
                folder.write_text("config.toml", self.config_text)
        self.run_dir = folder.path
        if self.runtime == "ray":
            return await self._arun_ray(folder, resumed)
        if resumed is not None:
            clock, ledger = resumed.clock(), resumed.ledger(self.max_uses)
        else:
            clock, ledger = VersionClock(), Ledger.create(folder.path, max_uses=self.max_uses)
        gate = AdmissionGate(clock, self.staleness, self.consumer.units_per_version)
        if resumed is not None:
            resumed.restore_gate(gate)
        ctx = RunContext(
            run=self.name,
            seed=self.seed,
            steps=self.steps,
            clock=LocalClock(clock),
            ledger=LocalLedger(ledger),
            gate=LocalGate(gate),
            policy=self.staleness,
            feedback=Channel("feedback", max_items=1 << 20),
            folder=folder,
            resume=resumed,
        )
        produced = Channel("produced", max_items=self.produced_channel[0], max_bytes=self.produced_channel[1])
        ready = Channel("ready", max_items=self.ready_channel[0], max_bytes=self.ready_channel[1])
        ctx.channels.update(produced=produced, ready=ready, feedback=ctx.feedback)
        install_faults(ctx, as_plan(self.faults))  # nothing at all when no fault is planned
        if self.checkpoint_every:
            cut = LocalCut(self.name, self.steps, clock, ledger, gate, {"produced": produced, "ready": ready},
                           ctx.feedback)
            ctx.checkpoint = Checkpointer(
                folder.path, self.checkpoint_every, run=self.name, steps=self.steps, cut=cut, keep=self.checkpoint_keep,
            )
        extra: list[Actor] = []
        for hook in self.hooks:  # a hook sees the context and may add actors (watchdogs, fault injectors)
            extra.extend(hook(ctx) or ())

        # the buffer first: it owns the store the others write to and read from
        buffers = list(self.buffer.actors(ctx, produced, ready))
        producers = list(self.producer.actors(ctx, None, produced))
        consumers = list(self.consumer.actors(ctx, ready, None))
        if ctx.checkpoint is not None:  # refs producers are sending and the buffer's index are checkpointed too
            cut.holders = [a for a in (*producers, *buffers) if hasattr(a, "held_refs")]
        if resumed is not None:
            extra.append(resumed.feeder(ctx, produced, ledger))
        actors = [*producers, *buffers, *consumers, *extra]
        if self.watchdog is not None and self.watchdog.enabled:
            actors.append(Watchdog(
                self.watchdog, progress=lambda: (("version", clock.version), *ledger.counts().items()),
                channels=ctx.channels, actors=list(actors), activity=ctx.activity,
                status=ctx.services.setdefault("status", []), gate=lambda: _gate_status(gate), run=self.name,
                folder=folder,
            ))
        log = ctx.log("pipeline")
        log.info("run starting", folder=str(folder.path), actors=[a.name for a in actors], steps=self.steps)

        failure: ActorFailed | None = None
        try:
            with Progress(self.name, enabled=self.progress) as progress:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._show_progress, ctx, clock, progress)
                    try:
                        await run_actors(actors, until=[a.name for a in consumers])
                    except ActorFailed as exc:
                        failure = exc  # raised below, outside the task group, so it is not wrapped
                    finally:
                        tg.cancel_scope.cancel()
        finally:
            for channel in ctx.channels.values():
                channel.close()
            records = self._write_outputs(folder, ledger.to_json())
            if failure is not None:
                log.error("run failed", folder=str(folder.path), ledger=ledger.counts(), error=str(failure))
        if failure is not None:
            if isinstance(failure.__cause__, PipelineHung):
                raise failure.__cause__  # the watchdog's own diagnosis, not "actor 'watchdog' failed"
            raise failure
        extra_summary = {"resume": resumed.summary()} if resumed is not None else {}
        summary = self._summary(
            folder, records, clock.version, ledger.counts(), ledger.balanced(), ctx.started_at, **extra_summary
        )
        log.info("run finished", **{k: summary[k] for k in ("version", "wall_s", "samples_per_s")})
        return summary

    async def _arun_ray(self, folder: RunFolder, resumed: Resumed | None) -> dict[str, Any]:
        from pipeline.runtime.ray import RayRun

        started = time.time()
        get_logger("pipeline").bind(run=self.name).info("run starting on ray", folder=str(folder.path))
        runner = RayRun(self, address=self.ray_address, watchdog=self.watchdog)
        try:
            with Progress(self.name, enabled=self.progress) as progress:
                await runner(folder, progress, resumed)
        finally:
            report = runner.report  # a failed run's too: its ledger.json is what a resume reports against
            records = self._write_outputs(folder, report["ledger_json"] if report is not None else None)
        return self._summary(
            folder, records, report["version"], report["counts"], not report["violations"], started,
            runtime="ray", restarts=report.get("restarts", {}), checkpoint_pause_s=report.get("frozen_s", 0.0),
            **({"resume": resumed.summary()} if resumed is not None else {}),
        )

    def _write_outputs(self, folder: RunFolder, ledger_json: bytes | None) -> list[dict]:
        """ledger.json and report.png (also for a failed run); returns the metric records."""
        if ledger_json is not None:
            folder.write_text("ledger.json", ledger_json.decode())
        records = folder.read_metrics()
        render_report(folder.path / "report.png", records, self.consumer.report_panels(records), title=self.name)
        return records

    async def _show_progress(self, ctx: RunContext, clock: VersionClock, progress: Progress) -> None:
        while True:
            depths = {n: f"{c.depth}/{c.max_items}" for n, c in ctx.channels.items() if n != "feedback"}
            progress.update(
                version=f"{clock.version}/{self.steps}",
                **self.consumer.progress(ctx.folder.latest_metrics()),
                **depths,
            )
            await anyio.sleep(0.25)

    def _summary(
        self, folder: RunFolder, records: list[dict], version: int, counts: dict[str, int], balanced: bool,
        started_at: float, **extra: Any,
    ) -> dict[str, Any]:
        """The run's summary (also written to summary.json); closes the run folder."""
        wall = time.time() - started_at
        summary = {
            "run_dir": str(folder.path),
            "steps": self.steps,
            "version": version,
            **self.consumer.summary(records),
            "staleness_bound": self.staleness.bound,
            "samples": {
                k: counts.get(k, 0)
                for k in ("produced", "trained", "dropped", "lost", "regenerated", "filtered", "reused")
            },
            "in_flight": counts["in_flight"],
            "ledger_balanced": balanced,
            "wall_s": round(wall, 2),
            "samples_per_s": round(counts["trained"] / wall, 1) if wall > 0 else 0.0,
            **extra,
        }
        folder.write_json("summary.json", summary)
        folder.close()
        return summary


def _gate_status(gate: AdmissionGate) -> dict[str, Any]:
    """The admission gate's counts and whether its policy would admit one more unit now."""
    return {
        "version": gate.clock.version, "started": gate.started, "discarded": gate.discarded,
        "live": gate.started - gate.discarded, "admits_now": gate.policy.admit(
            gate.clock.version, gate.started, gate.discarded, gate.units_per_version
        ),
    }
