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
  `metrics.jsonl`, `ledger.json`, `run.log` and `report.png`, and `run()` returns the summary;
* a run's first lines on stderr name its folder and the `baton watch` command to follow it, and
  `<run_root>/latest` links to it (`pipeline.telemetry.announce_run`);
* with `checkpoint_every = N` the consumer writes a checkpoint every N versions into the run folder,
  and one of its last version when the run ends (at `steps`, on Ctrl-C / SIGTERM, when an actor fails;
  the summary's `checkpoint` names it), and `resume(run_dir)` continues that run from its latest one
  (pipeline.checkpoint states the rule: the resumed run is the checkpoint's run; nothing in flight is
  lost uncounted; a finished run resumes only to a higher `steps`);
* `run()` prepares this process as `baton run` does (`pipeline.process.prepare_process`);
* with `watchdog` set, a run that stops making progress is reported (which stage waits on what) and
  then failed with `PipelineHung` (pipeline.watchdog);
* with `max_workers = N` the producer's workers may grow to N and shrink to 1 while
  the run goes on (`pipeline.fleet`): `scale(n)` from another thread, `await ascale(n)` from the run's
  own event loop, or `baton scale RUN_DIR --engines n` through the control endpoint the run serves
  (`pipeline.control`).

This module knows stages only through `pipeline.contracts` (Producer, Buffer, Consumer): it has no
idea what a model, a reward or a gradient is. `arun` reads as the whole story: validate, open the run
folder, hand the pipeline to its runtime (`pipeline.runtime.local` or `.ray`), write the outputs.
"""

from __future__ import annotations

import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from pipeline.actor import Actor
from pipeline.checkpoint import checkpoint_summary
from pipeline.context import RunContext
from pipeline.contracts import Buffer, Consumer, Producer, VersionPolicy
from pipeline.events import EventCounts
from pipeline.faults import FaultPlan, FaultSpec
from pipeline.logs import run_log
from pipeline.placement import Placement
from pipeline.process import prepare_process
from pipeline.reasons import by_kind
from pipeline.resume import Resume
from pipeline.runtime import RunReport, Runtime
from pipeline.sinks import metric_sinks
from pipeline.telemetry import Panel, Progress, RunFolder, announce_run, get_logger, render_report
from pipeline.watchdog import WatchdogSettings

RUNTIMES = ("local", "ray")


@dataclass
class Pipeline:
    name: str
    producer: Producer
    buffer: Buffer
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
    ray_placement_timeout_s: float = 120.0  # runtime="ray": an actor the cluster cannot place by then fails the run
    ray_resources: dict[str, dict[str, float]] = field(default_factory=dict)  # runtime="ray": pipeline.placement
    hooks: list[Callable[[RunContext], Sequence[Actor] | None]] = field(default_factory=list)
    checkpoint_every: int = 0  # versions between checkpoints; 0: none
    checkpoint_keep: int = 2  # complete checkpoints kept in the run folder
    watchdog: WatchdogSettings | None = None  # hang diagnosis; None: off
    faults: FaultPlan | list[FaultSpec] | None = None  # injected faults (pipeline.faults); None: none, no hooks
    sinks: list[str] = field(default_factory=lambda: ["jsonl"])  # where metrics go (pipeline.sinks)
    max_workers: int | None = None  # the producer may grow to this many workers while it runs; None: fixed
    run_dir: Path | None = field(default=None, init=False)  # the folder of the latest run (set as it starts)
    _live_runtime: Any = field(default=None, init=False, repr=False)  # the runtime while it runs (scale() asks it)
    _loop_token: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # a consumer that trains on an item more than once says so; the ledger must allow it
        self.max_uses = max(self.max_uses, self.consumer.max_uses)

    def run(self) -> dict[str, Any]:
        """Run to completion on the chosen runtime and return the summary."""
        prepare_process()
        return anyio.run(self.arun)

    def scale(self, workers: int, wait: bool = True, preempt: bool = False) -> dict[str, Any]:
        """Grow or shrink the running run's producer to `workers` (from another thread than the run's: the
        run's own loop awaits `ascale`); with `wait`, return once the joins and leaves have settled; with
        `preempt`, the leaving workers' requests in flight stop now and continue on the others from the tokens
        they have (a node taken away) instead of finishing where they are. Returns the fleet's status
        (`pipeline.fleet.Fleet.status`)."""
        fleet, token = self._running_fleet()
        return anyio.from_thread.run(fleet.scale, workers, wait, preempt, token=token)

    async def ascale(self, workers: int, wait: bool = True, preempt: bool = False) -> dict[str, Any]:
        """`scale`, awaited in the run's own event loop (a hook's actor, say)."""
        fleet, _ = self._running_fleet()
        return await fleet.scale(workers, wait, preempt)

    def _running_fleet(self) -> tuple[Any, Any]:
        from pipeline.fleet import FleetError

        fleet = getattr(self._live_runtime, "fleet", None)
        if fleet is None:
            raise FleetError("scale() needs a running pipeline made with max_workers = N; "
                             "this one is not running or cannot grow")
        return fleet, self._loop_token

    def resume(self, run_dir: str | Path) -> dict[str, Any]:
        """Continue the run in `run_dir` from its latest checkpoint (this pipeline must be the one that
        made it: same name, same stages) to `steps`, in the same folder; returns the summary, whose
        `resume` entry says what was rolled back, re-used and regenerated (pipeline.checkpoint)."""
        prepare_process()
        return anyio.run(self.arun, run_dir)

    async def arun(self, resume_from: str | Path | None = None) -> dict[str, Any]:
        self._validate()
        resume = Resume.open(resume_from, self.name, self.steps, self.config_text) if resume_from is not None else None
        folder = resume.folder if resume is not None else self._new_folder()
        self.run_dir = folder.path
        announce_run(folder.path)  # the first lines: where the run is, how to follow it; `latest` points at it
        runtime = self._runtime()
        self._live_runtime, self._loop_token = runtime, anyio.lowlevel.current_token()
        config = tomllib.loads(self.config_text or "")
        with run_log(folder.path):  # every event also in run.log, routine ones only there (pipeline.logs)
            if resume is not None:
                resume.log_start()
            async with metric_sinks(folder.path, self.sinks, run_name=self.name, config=config) as sinks:
                try:
                    with Progress(self.name, enabled=self.progress) as progress:
                        await runtime.run(self, folder, progress, resume)
                finally:  # a failed run's ledger.json too: it is what a resume reports against
                    records = self._write_outputs(folder, runtime.report)
                summary = self._summary(folder, records, runtime.report, resume)
                sinks.finish(summary)
            get_logger("pipeline").bind(run=self.name).info(
                "run finished", **{k: summary[k] for k in ("version", "wall_s", "samples_per_s")}
            )
        return summary

    def _validate(self) -> None:
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime={self.runtime!r}: use 'local' or 'ray'")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 (0: off), got {self.checkpoint_every}")
        if self.max_workers is not None and self.max_workers < self.producer.workers:
            raise ValueError(f"max_workers = {self.max_workers} is below the producer's {self.producer.workers} "
                             "workers; raise it, or unset it for a fixed fleet")

    def _new_folder(self) -> RunFolder:
        folder = RunFolder.create(self.run_root, self.name)
        if self.config_text is not None:
            folder.write_text("config.toml", self.config_text)
        return folder

    def _runtime(self) -> Runtime:
        if self.runtime == "ray":
            from pipeline.runtime.ray import RayRun  # imports ray: only when asked for

            return RayRun(address=self.ray_address, watchdog=self.watchdog,
                          placement_timeout_s=self.ray_placement_timeout_s,
                          placement=Placement(self.ray_resources))
        from pipeline.runtime.local import LocalRun

        return LocalRun()

    def _write_outputs(self, folder: RunFolder, report: RunReport | None) -> list[dict]:
        """ledger.json and report.png (also for a failed run); returns the metric records."""
        if report is not None and report.ledger_json is not None:
            folder.write_text("ledger.json", report.ledger_json.decode())
        records = folder.read_metrics()
        panels = self.consumer.report_panels(records, folder.path) + reasons_panels(report.reasons if report else {})
        render_report(folder.path / "report.png", records, panels, title=self.name)
        return records

    def _summary(
        self, folder: RunFolder, records: list[dict], report: RunReport, resume: Resume | None
    ) -> dict[str, Any]:
        """The run's summary (also written to summary.json); closes the run folder."""
        wall = time.time() - report.started_at
        counts = report.counts
        summary = {
            "run_dir": str(folder.path),
            "steps": self.steps,
            "version": report.version,
            **self.consumer.summary(records, folder.path),
            "staleness_bound": self.staleness.bound,
            "samples": {
                k: counts.get(k, 0)
                for k in ("produced", "trained", "dropped", "lost", "regenerated", "filtered", "reused")
            },
            "reasons": report.reasons,  # why samples were dropped, lost or regenerated (pipeline.reasons)
            "in_flight": counts["in_flight"],
            "ledger_balanced": report.balanced,
            "wall_s": round(wall, 2),
            "samples_per_s": round(counts["trained"] / wall, 1) if wall > 0 else 0.0,
            **report.extra,
            **({"events": events} if (events := EventCounts(folder.path).update()) else {}),
            **({"resume": resume.summary()} if resume is not None else {}),
            **({"checkpoint": kept} if (kept := checkpoint_summary(folder.path)) else {}),  # the run's last one
        }
        folder.write_json("summary.json", summary)
        folder.close()
        return summary


def reasons_panels(reasons: Mapping[str, Mapping[str, int]]) -> list[Panel]:
    """The report's panel of why samples were not trained, from `RunReport.reasons`: per fate (dropped,
    lost, regenerated), the fraction of its samples per reason kind (a reason up to its first ':'); none
    when every sample trained."""
    counts = {f"{fate} (n={sum(items.values())})": by_kind(items) for fate, items in reasons.items()}
    if not counts:
        return []
    return [Panel("samples not trained, by reason", "hist", counts=counts, xlabel="reason (up to its first ':')")]


__all__ = ["Pipeline", "RunContext", "reasons_panels"]
