"""`LearnerActor`: the consumer's loop. Refs in -> accepted groups -> one optimizer step per version.

Each version:
1. the collector (`BatchCollector`) takes the groups to train on from its replay window; the next
   version's groups are received and loaded while this one computes, and judged once their version
   is known;
2. the trainer (`PolicyTrainer`) takes the step in a worker thread, so the engines decode meanwhile;
3. the actor bumps the version, publishes the weights through the transport, advances the clock, and
   only then marks the groups trained (at the version they were trained at). A group with uses left
   (`max_reuse`) goes back into the window; a payload is freed only after its group's last use;
4. every `checkpoint.every` versions, a checkpoint (pipeline.checkpoint): the run's state plus this
   learner's model, optimizer and RNG states (stages.learner.state) and the refs it holds. The run's
   last version is checkpointed too when the run ends (`_keep_final`): at its step count, and when it is
   stopped (Ctrl-C, SIGTERM, the watchdog's stop of a hung run; an actor's crash is not an end but a crash,
   resumed from the latest checkpoint) with the weights between two versions; a step
   that finished computing when the stop came is completed first (clock and ledger, not published: the
   engines stop), so the checkpoint holds exactly the weights the learner had. A resumed
   learner starts from those, publishes the checkpoint's weights to the engines before any
   generation, and takes back the reusable groups of its window whose payloads still exist. Every
   `checkpoint.export_every` versions the checkpoint is also exported as a Hugging Face folder, in a
   worker thread while training goes on (stages.learner.export.ExportsAsRunGoes); the next checkpoint
   waits for it (it may remove the folder being read).

Each metrics record carries what shows a collapse early: `entropy` (mask-averaged, of the step's last
forward), `zero_var_frac` (groups whose rewards are all equal), `clip_frac_low` / `clip_frac_high`
(tokens whose ratio lies below / above the clip range) and `lr`. When the entropy falls below
`warn_entropy_below` while the trailing mean reward (last `warn_window` versions) is still below
`warn_reward_below`, the run reports a `learner.entropy_collapse` event (once per run).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NoReturn

import anyio
import numpy as np

from pipeline.actor import BaseActor
from pipeline.channel import Channel
from pipeline.checkpoint import CONSUMER_DIR, CheckpointError, latest_checkpoint
from pipeline.context import RunContext
from pipeline.events import EventCounts
from pipeline.faults import plan_of
from pipeline.refs import HeldRef
from pipeline.watchdog import PipelineHung
from policies.staleness import staleness
from stages.learner.bias import step_outcomes
from stages.learner.collector import BatchCollector
from stages.learner.export import ExportsAsRunGoes
from stages.learner.ranks import LearnerRankFailed, RankedTrainer, RankGroup
from stages.learner.report import CollapseWatch
from stages.learner.restart import Restarts, ThreadsInFlight, rank_failure
from stages.learner.step import PolicyTrainer
from stages.weights.base import WeightTransport
from stages.weights.snapshot import save_snapshot, snapshot_key


class LearnerActor(BaseActor):
    name = "learner"

    def __init__(
        self, spec: Any, ctx: RunContext, inbox: Channel, transport: WeightTransport, snapshot_every: int = 0
    ) -> None:
        self.spec, self.ctx, self.transport = spec, ctx, transport
        self.snapshot_every = snapshot_every
        self.log = ctx.log("learner")
        self.collector = BatchCollector(spec, ctx, inbox, self.name)
        self.trainer: PolicyTrainer | RankedTrainer | None = None  # made in `start` (loading takes a while)
        self.ranks: RankGroup | None = None  # the other ranks, when world_size > 1 (stages.learner.ranks)
        self._published: dict | None = None  # the weights of the version published last (its snapshot's)
        self.collapse = CollapseWatch(spec, ctx)  # the learner.entropy_collapse event (once per run)
        self.restarts = Restarts(spec.max_restarts, ctx)  # the rank group restarting itself (restart.py)
        self._threads = ThreadsInFlight()  # rank 0's calls in worker threads (a restart waits for them)
        plan = plan_of(ctx)
        self._rank_crash = plan.schedule("learner.rank_crash") if plan is not None else None  # a planned fault
        self._version = 0  # the version this learner's weights are at (kept by _train)
        self._events = EventCounts(ctx.folder.path)  # run events (pipeline.events) so far, for the metrics
        self.exports = ExportsAsRunGoes(spec.export_every, spec.model_path, ctx.folder.path, ctx)
        self._export_tasks: anyio.abc.TaskGroup | None = None  # the exports running (made in `run`)
        self._kept = 0  # the version of this run's latest checkpoint (the resumed one's, or 0)
        self._trained_to = 0  # the version the trainer's weights are at (ahead of `_version` mid-step)
        self._pending: tuple[list, list] | None = None  # (refs, taken) of the step in progress
        self._running = False  # `run` has not returned yet (its task may still be unwinding)

    @property
    def store(self) -> Any:
        return self.ctx.services.store

    async def start(self) -> None:
        resume = self.ctx.resume
        version = await self._begin(resume.consumer_dir if resume is not None else None)
        if resume is not None:
            self._kept = version
            if version != resume.version:
                raise CheckpointError(f"checkpoint {resume.checkpoint}: learner state of version {version}, "
                                      f"run state of version {resume.version}")
            kept = await self.collector.restore(resume.reusable, version)
            self.log.info("learner restored", version=version, checkpoint=str(resume.checkpoint), reusable_groups=kept)
        # every engine starts from exactly the learner's weights of the run's first version (0 or the checkpoint's)
        await self._publish(version)
        if resume is not None and self.snapshot_every and self._published is not None:  # replaces a rolled-back one
            await save_snapshot(self.store, snapshot_key(self.ctx.run, self.ctx.folder.path.name), version,
                                self._published)

    async def _begin(self, state: Path | None, at: int | None = None) -> int:
        """Make the trainer (this process alone, or rank 0 of `world_size` ranks, their processes started
        here), load the learner state in `state` (a checkpoint's consumer folder; None: the model's initial
        weights) and schedule it at version `at` (None: the state's). Returns the state's version (0 for
        none). The one way the learner (re)starts: at the run's start, on `--resume`, and on a restart."""
        spec, steps = self.spec, self.ctx.steps
        if spec.world_size == 1:
            self.trainer = await anyio.to_thread.run_sync(PolicyTrainer, spec, steps)
        else:
            services = self.ctx.services
            self.ranks = RankGroup(spec, steps, services.start_helpers, services.address)
            self.ranks.crash = self._rank_crash
            self.ranks.spawn()  # from the event loop's thread: local followers die with this process
            self.log.info("learner ranks started", world_size=spec.world_size, ranks=self.ranks.names)
            await self._call(self.ranks.join)
            self.trainer = RankedTrainer(await self._call(PolicyTrainer, spec, steps, spec.world_size), self.ranks)
        version = 0 if state is None else await self._call(self.trainer.read_state, state)
        at = version if at is None else at
        await self._call(self.trainer.schedule, at)
        self._trained_to = at
        return version

    async def _call(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` in a worker thread. With several ranks it may block in a collective a dead rank never
        joins: then the run's cancellation abandons the thread rather than wait for it; a collective that
        fails because a rank died is reported as that rank's failure (`LearnerRankFailed`)."""
        if self.ranks is None:
            return await anyio.to_thread.run_sync(fn, *args)
        try:
            return await anyio.to_thread.run_sync(self._threads.wrap(fn), *args, abandon_on_cancel=True)
        except RuntimeError as exc:  # torch.distributed's errors (DistBackendError is one)
            await self._rank_failed(exc)

    async def _rank_failed(self, exc: RuntimeError) -> NoReturn:
        """Raise `LearnerRankFailed` for a collective that failed with `exc`: the dead rank's, naming it, when
        one has exited (its exit code comes soon after its sockets close), else the collective's."""
        assert self.ranks is not None
        with anyio.move_on_after(5):
            while True:
                self.ranks.check()
                await anyio.sleep(0.1)
        world = self.spec.world_size
        raise LearnerRankFailed(f"a collective of the learner's {world} ranks failed: {exc}") from exc

    def held_refs(self) -> list[HeldRef]:
        """The refs this learner holds between steps (what a checkpoint records of it)."""
        return self.collector.held_refs()

    def write_state(self, folder: Path) -> None:
        """The learner's part of a checkpoint (stages.learner.state); called between steps, in a worker thread.
        Every rank writes its own shards into `folder`."""
        assert self.trainer is not None
        self.trainer.write_state(folder, self._version)

    def status(self) -> str:
        """A line for hang reports: what the learner holds and waits for."""
        return (
            f"learner: version {self._version}, window {len(self.collector.window)}/{self.spec.groups_per_step} "
            f"groups, {len(self.collector.fetched)} loaded and not yet judged"
        )

    async def stop(self) -> None:
        try:
            await self._keep_on_stop()
        finally:
            await self.transport.close()
            if self.ranks is not None:
                await anyio.to_thread.run_sync(self.ranks.close)

    async def run(self) -> None:
        """Train to the run's step count; a failed rank group restarts while `max_restarts` allow (restart.py)."""
        self._running = True
        try:
            while True:
                try:
                    await self._run_once()
                    return
                except BaseException as exc:  # noqa: BLE001 - only a rank group's failure is healed, the rest re-raised
                    failure = rank_failure(exc)
                    if failure is None:
                        raise
                    self.restarts.begin(failure)  # re-raises it once max_restarts are spent
                    await self._restart(failure)
        finally:
            self._running = False

    async def _run_once(self) -> None:
        """Train until the step count, the rank group watched (its failure: `LearnerRankFailed`)."""
        try:
            async with anyio.create_task_group() as watch:
                if self.ranks is not None:
                    watch.start_soon(self.ranks.watch)
                async with anyio.create_task_group() as frees:  # payloads freed and checkpoints exported meanwhile
                    self.collector.frees = self._export_tasks = frees
                    await self._train()
                watch.cancel_scope.cancel()
        finally:
            self.collector.frees = self._export_tasks = None

    async def _restart(self, failure: LearnerRankFailed) -> None:
        """A new rank group from the latest checkpoint, the clock where it is (restart.py's rule): the step in
        progress goes back into the window, rank 0's threads leave the old group, the followers end, the new
        group loads the checkpoint (`_begin`, as `--resume` does) at the current version."""
        at, old = self._version, self.ranks
        self.log.warning("learner rank group failed; restarting it", error=str(failure), version=at,
                         restart=self.restarts.done, max_restarts=self.restarts.max_restarts)
        if self._pending is not None:
            self.collector.untake(self._pending[1])
            self._pending = None
        if not await self._threads.settle(self.spec.rank_timeout_s):
            self.log.warning("a learner thread is still in the old group's collective; restarting beside it")
        self.trainer, self.ranks = None, None
        if old is not None:
            await anyio.to_thread.run_sync(old.close)
        checkpoint = latest_checkpoint(self.ctx.folder.path) if self.ctx.checkpoint is not None else None
        restored = await self._begin(checkpoint / CONSUMER_DIR if checkpoint is not None else None, at)
        cost = self.restarts.report(failure, restored, at, checkpoint.name if checkpoint is not None else "")
        self.log.info("learner rank group restarted", **cost)
        if self._rank_crash is not None:
            self._rank_crash.recovered(f"rank group restarted from version {restored} at version {at}")

    async def _keep_on_stop(self) -> None:
        """A run stopped before its step count (Ctrl-C, SIGTERM, the watchdog's stop of a hung run; not an
        actor's crash, which resumes from the latest checkpoint as a killed process would): checkpoint the
        learner's last version (`_keep_final`). A step whose compute finished is completed first, without
        publishing; one whose compute never began (stopped before its thread ran) leaves the weights at the
        version to keep, its groups untrained (in flight: resumed or regenerated); weights caught mid-step (a
        rank's collective abandoned), a dead rank, or a `run` still unwinding leave the latest checkpoint as it is.
        Never raises: the run is stopping anyway."""
        failure = self.ctx.failure  # a crash resumes from the latest checkpoint, as a killed process would
        if failure is not None and not isinstance(failure.__cause__, PipelineHung):
            return
        if self._running or self.trainer is None or self.ctx.checkpoint is None:
            return
        try:
            if self.ranks is not None:
                self.ranks.check()  # a dead rank would fail the checkpoint's collectives
            if self._pending is not None and self._trained_to != self._version:  # the step's compute began
                if self._trained_to != self._version + 1:
                    return  # the weights are mid-step
                refs, taken = self._pending
                await self._advance(self._trained_to, refs)
                self._pending = None
                await self.collector.release(taken, self._version - 1)
            if (written := await self._keep_final()) is not None:
                self.log.info("final version kept on stop", version=self._version, checkpoint=str(written))
        except Exception as exc:  # noqa: BLE001 - the run's own error (if any) is what it reports
            self.log.warning("the final version could not be checkpointed on stop", version=self._version,
                             error=f"{type(exc).__name__}: {exc}")

    async def _keep_final(self) -> Path | None:
        """Checkpoint the learner's version unless it is checkpointed already (the run's end: a checkpoint
        `baton export` and `--resume` find). Returns the checkpoint, or None."""
        if self.ctx.checkpoint is None or self._version <= self._kept:
            return None
        return await self._checkpoint(self._version, export=False)

    def _train_step(self, batches: list, stale: float, version: int) -> dict:
        """The trainer's step from `version` (in a worker thread); records that the weights moved on."""
        stats = self.trainer.train(batches, stale)
        self._trained_to = version + 1
        return stats

    async def _train(self) -> None:
        ctx, collector = self.ctx, self.collector
        t_start, trained_samples = time.perf_counter(), 0
        version = self._version = await ctx.clock.current()  # the learner is the clock's only writer
        last = time.perf_counter()
        while version < ctx.steps:
            ctx.note(self.name, f"collecting {self.spec.groups_per_step} groups for version {version + 1}")
            taken = await collector.collect(version)
            ctx.note(self.name, f"training version {version + 1} on {len(taken)} groups")
            refs, batches = [t.item[0] for t in taken], [t.item[1] for t in taken]
            t0 = time.perf_counter()
            stale = [staleness(version, r.version) for r in refs]
            self._pending = (refs, taken)
            async with anyio.create_task_group() as tg:
                if version + 1 < ctx.steps:  # fetch the next step's groups while this one computes
                    tg.start_soon(collector.prefetch, version)
                stats = await self._call(self._train_step, batches, float(np.mean(stale)), version)
                tg.cancel_scope.cancel()  # a prefetch still waiting for groups must not hold up the version
            step_s = time.perf_counter() - t0
            push_s, pushed = await self._publish(version + 1)
            with anyio.CancelScope(shield=True):  # a published version is completed, even by a failing rank group
                await self._advance(version + 1, refs)
                self._pending = None  # the release's window update happens at once, before its first await
                await collector.release(taken, version)
            self.restarts.trained(version + 1, sum(r.rows for r in refs))
            if self.ranks is not None:
                self.ranks.crash_if_planned(version + 1)
            settled = await ctx.ledger.take_settled()  # trained now, and dropped since the last step
            trained_samples += sum(r.rows for r in refs)
            load_s, loads = collector.take_load_counts()
            ctx.folder.log_metrics({
                "version": version + 1,
                "t": round(time.time() - ctx.started_at, 3),
                "staleness_mean": round(float(np.mean(stale)), 3),
                "staleness_max": int(max(stale)),
                "staleness_hist": stale,
                "outcomes": step_outcomes(settled),
                "groups_reused": sum(t.reused for t in taken),  # trained before, trained again now
                "groups_filtered": collector.filtered,  # refused for equal rewards while collecting this step
                "filtered_frac": round(collector.filtered / collector.examined, 4) if collector.examined else 0.0,
                "samples_per_s": round(trained_samples / (time.perf_counter() - t_start), 1),
                "step_s": round(step_s, 4),  # compute (forward, backward, optimizer)
                "collect_s": round(t0 - last, 4),  # waiting for and loading accepted groups
                "push_s": round(push_s, 4),  # publishing the new version's weights to the engines
                "weights": pushed,  # the transport's counters (stages.weights.base.STATS) for this version
                "load_s": round(load_s, 4), "loads": loads,  # store gets since the last record
                "tokens": int(sum(b.tokens for b in batches)),  # prompt + response tokens trained on
                "version_s": round(time.perf_counter() - last, 4),  # this version, end to end
                **stats,
                **{f"events/{kind}": n for kind, n in self._events.update().items()},  # pipeline.events
            })
            self.collapse.see(version + 1, stats["reward"], stats["entropy"])
            last, version = time.perf_counter(), version + 1
            ctx.note(self.name, f"trained version {version}")
            if ctx.checkpoint is not None and ctx.checkpoint.due(version):
                await self._checkpoint(version)
        await self._keep_final()  # the run's end is checkpointed (and `baton export` finds it)
        if self.exports.every:  # the last version is exported from the live weights
            await self.exports.last(await self._call(self.trainer.weights), version)

    async def _advance(self, version: int, refs: list) -> None:
        """The new version is published: snapshot it when due, advance the run's clock, and only then mark
        the groups trained (at the version they were trained at, `version - 1`)."""
        ctx = self.ctx
        if self.snapshot_every and version % self.snapshot_every == 0 and self._published is not None:
            key = snapshot_key(ctx.run, ctx.folder.path.name)
            await save_snapshot(self.store, key, version, self._published)
        await ctx.clock.advance_to(version)
        await ctx.ledger.trained([i for ref in refs for i in ref.item_ids], at_version=version - 1)
        self._version = version

    async def _checkpoint(self, version: int, export: bool = True) -> Path | None:
        """Write the checkpoint of `version` (and start its export when due and `export`); None if skipped."""
        ctx = self.ctx
        assert ctx.checkpoint is not None
        if self.exports.running():
            ctx.note(self.name, f"waiting for the last export to finish before checkpointing version {version}")
            await self.exports.wait()
        try:  # every rank writes its shards: a rank that dies meanwhile fails the collective
            written = await ctx.checkpoint.save(version, self)
        except RuntimeError as exc:
            if self.ranks is None:
                raise
            await self._rank_failed(exc)
        ctx.note(self.name, f"checkpoint of version {version} {'written' if written else 'skipped'}")
        if written is not None:
            self._kept = version
            self.restarts.kept(version)
            if export and self._export_tasks is not None:
                self.exports.after_checkpoint(self._export_tasks, written, version)
        return written

    async def _publish(self, version: int) -> tuple[float, dict[str, float]]:
        """Publish `version`'s weights: the seconds it took and the transport's counters for it. Refusals
        and unreachable engines the transport handled are reported as run events (`weights.refused`,
        `weights.unreachable`)."""
        started, before = time.perf_counter(), dict(self.transport.stats)
        sharded_push = isinstance(self.trainer, RankedTrainer) and self.transport.pushes_from_shards
        if sharded_push and self.spec.lora is None:  # an adapter is gathered whole: it is small
            self._published = None  # every rank writes its own rows: no rank holds the version whole
            await self.transport.publish_shards(version, self.trainer)
        else:
            self._published = await self._call(self.trainer.weights, version)
            with anyio.CancelScope(shield=True):  # gathered whole: the version reaches the engines or fails
                await self.transport.publish(version, self._published)
        counted = {k: round(v - before.get(k, 0), 4) for k, v in self.transport.stats.items()}
        for key in ("refused", "unreachable"):
            if counted.get(key):
                self.ctx.event(f"weights.{key}", count=int(counted[key]), version=version)
        return time.perf_counter() - started, counted
