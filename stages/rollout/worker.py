"""The rollout workers: one actor per engine (the Ray runtime gives each its own process).

`ProducerWorker` is what every worker of the producer stage is to the run: it starts and stops its
engine, catches up from the learner's weight snapshot, and tells a checkpoint what it holds. Where
its groups come from is its subclass's loop: `RolloutWorker` (here) generates them from the task;
`stages.rollout.gateway_worker.GatewayWorker` forms them from agents outside.

`RolloutWorker.run` runs one coroutine per episode, with no batch barrier (docs/architecture.md,
"The unit of work: an episode"):
1. while it has room for another group (`batch_groups` groups' worth of episodes in flight), it waits
   at the admission gate and takes as many group slots as the gate allows right now and it has room for;
2. takes the prompts of groups to redo first, else new samples from the task (`PromptStream`);
3. starts each group: `group_size` episode coroutines from one sample (`stages.rollout.episode`) on this
   worker's engine, which batches whatever requests are pending. A finished episode frees its room at once;
4. when a group's episodes are all over, `GroupMaker` scores and stores it, and the `GroupOutbox`
   records and sends the groups of the process in batches.
A group is recorded in the ledger as produced only once its payload is stored. An episode whose engine
fails, or whose tokens grew too old to continue, starts again from its sample (counted); one whose
environment fails is recorded as dropped with its reason; the run goes on.

In an elastic run (`pipeline.fleet`) a worker may join while the run goes on (`joins`): its `start` ends
only once its engine passed the version fence (`stages.rollout.fence`), so it takes no prompt before; and
a `RolloutWorker` may leave (`retire`): it stops asking the gate, lets the groups it admitted finish and
reach the outbox, sends them on, and only then does its `run` return; `stop` then unsubscribes its engine
from the learner's pushes and stops it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from buffers.store import ObjectStore, StoreError
from pipeline.actor import BaseActor
from pipeline.channel import Channel
from pipeline.checkpoint import RandomState
from pipeline.context import RunContext
from pipeline.faults import plan_of
from pipeline.refs import HeldRef
from stages.data.tasks import Prompt, Task
from stages.engines.base import Engine, EngineError, Preemptible
from stages.rollout.episode import (
    Episode,
    EpisodeFailed,
    EpisodeSetup,
    EpisodeStale,
    first_messages,
    run_episode,
    run_single_turns,
)
from stages.rollout.evaluation import EvalSetup, Evaluation, Evaluator
from stages.rollout.fence import Fenced, pass_fence
from stages.rollout.groups import GroupMaker, Scoring
from stages.rollout.outbox import GroupOutbox
from stages.rollout.prompts import PromptStream
from stages.rollout.relay import Relay
from stages.rollout.stats import RolloutStats
from stages.weights.snapshot import load_snapshot, snapshot_key


class GroupsNotStored(StoreError):
    """A group could not be stored (after the store's retries); the rollout worker generates it again."""


class Room:
    """Episodes a worker may have in flight: a new group starts only when `group_size` are free, and
    each episode gives its place back the moment it ends."""

    def __init__(self, episodes: int) -> None:
        self.free = episodes
        self._changed = anyio.Event()

    async def wait_for(self, episodes: int) -> None:
        while self.free < episodes:
            await self._changed.wait()
            self._changed = anyio.Event()

    def take(self, episodes: int) -> None:
        self.free -= episodes

    def give_back(self, episodes: int) -> None:
        self.free += episodes
        self._changed.set()


@dataclass(frozen=True)
class WorkerSettings:
    """What a rollout worker reads of its stage's settings (the `Rollout` fields of the same names)."""

    group_size: int
    batch_groups: int
    max_regenerations: int = 5
    engine_sync_s: float = 30.0
    request_timeout_s: float | None = None  # an evaluation's engine call (an episode's is in its limits)
    max_failed_in_a_row: int = 512  # episodes failed one after another, none kept, before the run fails (0: never)


class ProducerWorker(BaseActor):
    """One engine's worker, as the run and its checkpoints see it (see the module docstring). Its task is its
    own (a dataset's shard); `stats` is its stage's, shared by the stage's workers in this process."""

    def __init__(self, settings: WorkerSettings, task: Task, scoring: Scoring, stats: RolloutStats, engine: Engine,
                 store: ObjectStore, ctx: RunContext, outbox: Channel, index: int = 0, *,
                 receiver: Engine | None = None, joins: bool = False) -> None:
        self.settings, self.task, self.scoring, self.stats = settings, task, scoring, stats
        self.engine, self.store, self.ctx = engine, store, ctx
        # the engine itself (`engine` may be its fault wrapper): what takes the learner's weights
        self.receiver = receiver if receiver is not None else engine
        self.joins = joins  # it joins a running run: its engine passes the version fence in `start`
        self.fenced: Fenced | None = None  # how it passed (None: it did not join, or has not passed yet)
        self._stopped = False
        self.index = index  # the first worker (index 0) runs the evaluations
        self.name = f"rollout:{engine.name}"
        self.rng = ctx.rng(self.name)
        self.log = ctx.log(self.name)
        self.prompts = PromptStream(self.task, ctx, self.rng, stats)
        self.maker = GroupMaker(scoring, stats, engine, store, ctx, settings.max_failed_in_a_row)
        self.groups = GroupOutbox(ctx, outbox, self.prompts.recorded, engine, settings.group_size)
        self.room = Room(settings.batch_groups * settings.group_size)

    async def start(self) -> None:
        resume = self.ctx.resume
        if resume is not None and (state := resume.rng_state(self.name)) is not None:
            self.prompts.restore(state)  # the prompt stream goes on from the checkpoint
        started = anyio.current_time()
        async with anyio.create_task_group() as tg:  # model scorers start beside the engine (shared per process)
            tg.start_soon(self.engine.start)
            for scorer in self.scoring.scorers:
                tg.start_soon(scorer.start, self.ctx.folder.path)
        if self.joins:
            await self._join(anyio.current_time() - started)
            return
        # an engine that starts late (or restarts) catches up from the learner's latest snapshot
        snapshot = await load_snapshot(self.store, snapshot_key(self.ctx.run, self.ctx.folder.path.name))
        # never newer than the clock: a snapshot a crashed attempt wrote after the checkpoint was rolled back
        if snapshot is not None and self.engine.version < snapshot[0] <= await self.ctx.clock.current():
            await self.engine.receive_weights(*snapshot)
            self.log.info("weights from snapshot", version=snapshot[0])

    async def _join(self, load_s: float) -> None:
        """Subscribe the engine to the learner's pushes, then pass the version fence (an event says what it
        cost); a FenceError leaves the worker without work (the fleet stops it)."""
        self.ctx.services.weight_receivers.add(self.receiver)
        key = snapshot_key(self.ctx.run, self.ctx.folder.path.name)
        self.fenced = await pass_fence(self.receiver, self.ctx, self.store, key, self.settings.engine_sync_s)
        self.ctx.event("engine.joined", engine=self.engine.name, version=self.fenced.version,
                       fence_s=self.fenced.seconds, load_s=round(load_s, 3), source=self.fenced.source,
                       checksum=self.fenced.checksum)

    async def stop(self) -> None:
        """Unsubscribe the engine from the learner's pushes, stop it and the scorers (once; a leaving worker
        is stopped by the fleet, then again by the run as it ends)."""
        if self._stopped:
            return
        self._stopped = True
        self.ctx.services.weight_receivers.remove(self.receiver)
        await self.engine.stop()
        for scorer in self.scoring.scorers:
            await scorer.stop()

    def held_refs(self) -> list[HeldRef]:
        """Refs recorded as produced and not yet all sent on (a checkpoint re-uses them on resume)."""
        return [HeldRef(ref=ref, holder=self.name) for ref in self.groups.sending]

    def held_sources(self) -> list[bytes]:
        """The encoded prompts admitted and not yet recorded as produced (a resumed run produces them)."""
        return self.prompts.held_sources()

    def rng_state(self) -> RandomState:
        """Where this worker's prompt stream stands (a checkpoint keeps it; a resume goes on from it)."""
        return self.prompts.state()

    def recording(self) -> list[tuple[str, bytes]]:
        """(group, source) of the groups whose `produced` record is on its way to the ledger: a checkpoint
        owes them unless its ledger has them already (only a ledger in another process can be mid-call)."""
        return list(self.groups.recording)

    def redone(self, stat: str, event: str, error: BaseException) -> None:
        """Count work generated again after `error`: a whole group (stat "regenerated", event
        groups.regenerated) or one episode (stat "episodes_restarted", event episodes.restarted)."""
        cause = type(error).__name__
        self.stats.count(stat, cause)
        self.ctx.event(event, engine=self.engine.name, cause=cause, error=str(error))
        plan = plan_of(self.ctx)
        if plan is not None:  # the fault runner counts these (they never reached the ledger)
            plan.record("regenerated", cause, self.name, groups=1)


class RolloutWorker(ProducerWorker):
    """Generates groups from its task on its engine (see the module docstring): its episodes as
    `episode_setup(policy)` says, and on the first worker the run's `evaluation`."""

    def __init__(self, *parts: Any, episode_setup: Callable[[Any], EpisodeSetup], evaluation: Evaluation | None = None,
                 relay: Relay | None = None, **named: Any) -> None:
        super().__init__(*parts, **named)
        self.episode_setup, self.evaluation = episode_setup, evaluation
        self.relay = relay  # the stage's engines taking work (its episodes' `setup.relay`); None: no carry-over
        self._retiring = False
        self._waiting: anyio.CancelScope | None = None  # its wait for room and admission (a retire cancels it)
        self._drained = anyio.Event()

    @functools.cached_property
    def setup(self) -> EpisodeSetup:
        return self.episode_setup(self.ctx.policy)

    async def start(self) -> None:
        await super().start()
        if self.relay is not None:  # it takes work: a preempted engine's requests may continue on it
            self.relay.add(self.engine)

    async def stop(self) -> None:
        if self.relay is not None:
            self.relay.remove(self.engine)
        await super().stop()

    @functools.cached_property
    def evaluator(self) -> Evaluator | None:
        """The run's evaluations, on the first worker only."""
        if self.evaluation is None or self.index != 0:
            return None
        setup = EvalSetup(self.scoring.tokenizer, self.setup.sampling, self.settings.request_timeout_s, self.stats)
        return Evaluator(self.evaluation, self.engine, self.ctx, self.maker.score, setup)

    async def run(self) -> None:
        """Admit and generate groups until retired; then every admitted group is finished and sent on."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.groups.run)
            async with anyio.create_task_group() as groups:
                while not self._retiring:
                    if self.evaluator is not None:
                        await self.evaluator.run_if_due()
                    await self._admit_next(groups)
            await self.groups.drain()  # every group it admitted is recorded and sent: its outbox may stop
            tg.cancel_scope.cancel()
        self._drained.set()

    async def retire(self, preempt: bool = False) -> None:
        """Take no new groups; return once those admitted are finished and sent on (`run` returns too). With
        `preempt` the engine's requests in flight end at once and continue on the other engines from the tokens
        they have (stages.rollout.relay), where a Preemptible engine and a relay allow it; else they finish here."""
        self._retiring = True
        started, episodes = anyio.current_time(), self.settings.batch_groups * self.settings.group_size - self.room.free
        relay = self.relay
        if relay is not None:
            relay.remove(self.engine)  # nothing is carried onto a leaving engine
        preempted = preempt and relay is not None and isinstance(self.receiver, Preemptible)
        if preempted:
            self.receiver.preempt()
        if self._waiting is not None:
            self._waiting.cancel()  # a cancelled wait at the gate took no unit (pipeline.admission)
        await self._drained.wait()
        carried = dict(relay.counts.get(self.engine.name, {})) if preempted and relay is not None else {}
        self.ctx.event("engine.left", engine=self.engine.name, version=self.engine.version, preempted=preempted,
                       episodes_drained=episodes, drain_s=round(anyio.current_time() - started, 3), **carried)

    async def _admit_next(self, groups: anyio.abc.TaskGroup) -> None:
        """Wait for room and the gate (unless retired meanwhile), then start the groups admitted."""
        group_size = self.settings.group_size
        n, t_gate = 0, anyio.current_time()
        with anyio.CancelScope() as self._waiting:
            if self._retiring:
                self._waiting.cancel()
            await self.room.wait_for(group_size)  # meanwhile the last note says what is generating
            self.ctx.note(self.name, "waiting at the admission gate")
            t_gate = anyio.current_time()
            n = await self.ctx.gate.acquire_many(self.room.free // group_size)
        self._waiting = None
        if n == 0:  # retired while it waited: it took nothing
            return
        admitted_at = await self.ctx.clock.current()
        gate_s = anyio.current_time() - t_gate
        for prompt in await self.prompts.next(n):
            groups.start_soon(self._group, self._admit(prompt), prompt, admitted_at, gate_s)
        self.ctx.note(self.name, f"generating {n} groups ({n * group_size} episodes) on engine "
                      f"{self.engine.name} at version {self.engine.version}")

    async def produce(self, prompts: list[Prompt]) -> None:
        """Run the groups of `prompts` (admitted already) through to the ledger and downstream; returns
        once all are sent. (`run` does this continuously; tests and tools call it directly.)"""
        async with anyio.create_task_group() as tg:
            for prompt in prompts:
                tg.start_soon(self._group, self._admit(prompt), prompt, self.engine.version)
        await self.groups.flush()

    def _admit(self, prompt: Prompt) -> int:
        """Take room for the prompt's episodes and count it as generating; returns its admission number."""
        self.room.take(self.settings.group_size)
        return self.prompts.admit(prompt)

    async def _group(self, admission: int, prompt: Prompt, admitted_at: int, gate_s: float = 0.0) -> None:
        """Run one group to the outbox. Its engine first reaches the admitting version (so a group admitted
        at version v never carries tokens older than v); a group that cannot be stored is generated again,
        counted, up to `max_regenerations` times."""
        await self._engine_at(admitted_at)
        t0 = anyio.current_time()
        for attempt in range(self.settings.max_regenerations + 1):
            episodes = await self._episodes(prompt)
            try:
                finished = await self.maker.finish(prompt, episodes)
                break
            except StoreError as exc:
                if attempt == self.settings.max_regenerations:
                    raise
                self.redone("regenerated", "groups.regenerated", exc)
        finished.admission, finished.gate_s, finished.started = admission, gate_s, t0
        self.groups.put(finished)
        self.maker.raise_if_failing()

    async def _engine_at(self, version: int) -> None:
        deadline = anyio.current_time() + self.settings.engine_sync_s
        while self.engine.version < version and anyio.current_time() < deadline:
            await anyio.sleep(0.002)
        if self.engine.version < version:
            self.ctx.event("engine.behind", engine=self.engine.name, version=self.engine.version, admitted=version)

    async def _episodes(self, prompt: Prompt) -> list[Episode | EpisodeFailed]:
        """The group's episodes: one coroutine each with an environment; without one, the group's single
        turns go to the engine as one call (`stages.rollout.episode.run_single_turns`)."""
        size = self.settings.group_size
        if self.setup.environment is None:
            ids = self.setup.renderer.prompt_ids(first_messages(prompt))
            try:
                single = functools.partial(run_single_turns, self.engine, ids, self.setup, size)
                return await self._attempts(single, whole_group=True)
            except EpisodeFailed as failed:
                return [failed] * size
            finally:
                self.room.give_back(size)
        results: list[Episode | EpisodeFailed] = [EpisodeFailed("not run")] * size
        rerun = list(range(size))
        for attempt in range(self.settings.max_regenerations + 1):
            async with anyio.create_task_group() as tg:
                for i in rerun:
                    tg.start_soon(self._episode, prompt, results, i)
            if attempt == self.settings.max_regenerations or not (rerun := self._aged(results)):
                break
            self.room.take(len(rerun))  # the group's own episodes: they run before any new group
        return results

    def _aged(self, results: list[Episode | EpisodeFailed]) -> list[int]:
        """The ended episodes the staleness policy would refuse to train already at the engine's version (a
        straggler of their group kept them waiting): each starts again from its sample (counted), so under
        pace admission the group is not generated only to be dropped as stale."""
        policy, version = self.setup.policy, self.engine.version
        aged = []
        for i, result in enumerate(results):
            span = result.tokens.version_span() if isinstance(result, Episode) else None
            if policy is not None and span is not None and policy.accept(version, span[0]) != "train":
                stale = EpisodeStale(f"episode from version {span[0]} ended too old for {version}")
                self.redone("episodes_restarted", "episodes.restarted", stale)
                aged.append(i)
        return aged

    async def _episode(self, prompt: Prompt, results: list, i: int) -> None:
        """Episode `i` of a group into `results[i]`: an Episode, or EpisodeFailed (its environment failed)."""
        try:
            results[i] = await self._attempts(lambda: run_episode(self.engine, prompt, self.setup))
        except EpisodeFailed as exc:
            results[i] = exc
        finally:
            self.room.give_back(1)

    async def _attempts(self, run: Any, whole_group: bool = False) -> Any:
        """`await run()`, started again from its sample after an engine failure or a stale restart
        (counted as a regenerated group, or a restarted episode); past `max_regenerations` attempts the
        error ends the run. EpisodeFailed is counted."""
        for attempt in range(self.settings.max_regenerations + 1):
            try:
                return await run()
            except EpisodeFailed as exc:
                self.stats.count("episodes_failed", exc.reason)
                raise
            except EngineError as exc:
                if attempt == self.settings.max_regenerations:
                    raise
                if whole_group:
                    self.redone("regenerated", "groups.regenerated", exc)
                else:
                    self.redone("episodes_restarted", "episodes.restarted", exc)
        raise AssertionError("unreachable")
