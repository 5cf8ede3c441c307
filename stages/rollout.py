"""Rollout: the producer stage. Samples -> episodes (engine <-> environment) -> reward -> group -> store -> Ref.

One worker actor per engine (the Ray runtime gives each its own process). Each worker runs one
coroutine per episode, with no batch barrier (DESIGN.md, "The unit of work: an episode"):
1. while it has room for another group (`batch_groups` groups' worth of episodes in flight), it waits
   at the admission gate and takes as many group slots as the gate allows right now and it has room for;
2. takes the prompts of groups to redo from the feedback channel first (one poll for all of them:
   their payload was lost, or the policy requeued them), else new samples from the task;
3. starts each group: `group_size` episode coroutines from one sample (`stages.episode`), each on this
   worker's engine, which batches whatever requests are pending (all turns of an episode go to the
   engine that holds its prefix; an idle worker is the one that takes new groups, so new episodes go
   to the least loaded engine). A finished episode frees its room at once;
4. when a group's episodes are all over, scores it (single-turn: the reward function over the group;
   multi-turn: the environment's rewards), encodes and stores it under a versioned key, and hands it
   to the `GroupOutbox`, which records and sends the groups of the process in batches.
A group is recorded in the ledger as produced only once its payload is stored. An episode whose engine
fails, or whose tokens grew too old to continue, starts again from its sample (counted); one whose
environment fails is recorded as dropped with its reason; the run goes on.
"""

from __future__ import annotations

import functools
import random
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import msgspec

from buffers.codec import encode, peek
from buffers.retry import with_retries
from buffers.store import ObjectStore, StoreError
from pipeline.actor import BaseActor
from pipeline.channel import Channel
from pipeline.checkpoint import RandomState, python_random_state, random_state
from pipeline.context import RunContext
from pipeline.faults import FaultPlanError, plan_of
from pipeline.refs import HeldRef, Produced, Ref, make_key
from stages.engines.base import Completion, Engine, EngineError, SamplingParams
from stages.engines.faulty import with_engine_faults
from stages.environments import environment_class, make_environment
from stages.environments.render import renderer_for
from stages.episode import (
    Episode,
    EpisodeFailed,
    EpisodeLimits,
    EpisodeSetup,
    EpisodeStale,
    first_messages,
    run_episode,
    run_single_turns,
)
from stages.evaluation import EVAL_FILE, Evaluation
from stages.gateway.episodes import Limits
from stages.gateway.run_host import GatewaySettings, RolloutHost, as_agent
from stages.gateway.server import Gateway, make_token_file
from stages.group_output import Finished, GroupOutbox, encode_group, version_span
from stages.model import ModelFolderError, decode_many, load_tokenizer, prompt_token_ids, stop_token_ids
from stages.rewards import RewardFunction, Sample, Scores, task_reward
from stages.tasks import DataTask, Prompt, Task
from stages.weights import engine_mailboxes
from stages.weights.snapshot import load_snapshot, snapshot_key


@dataclass
class Rollout:
    """The DSL/config object: `Rollout(task, [TorchEngine(model)], tokenizer=model, group_size=8)`.

    `tokenizer` is a tokenizer object or the model folder to load it from; generation stops at its
    EOS and at generation_config.json's `eos_token_id`s. `reward` scores single-turn completions: a
    `stages.rewards.RewardFunction`, a callable or a "pkg.module:function" path; None: the task's
    `reward_function` if it has one, else its own `reward(prompt, completion)`. A sample whose reward
    fails is counted in `stats["reward_failed"]` by reason and gets what the reward's `on_error` says
    (scored 0, or its group dropped). `environment` makes episodes multi-turn: a name or
    "pkg.module:Class" of `stages.environments` (with `environment_options`), or a callable that
    returns a fresh `Environment`; its rewards replace the reward function. `limits` bound each
    episode (turns, tokens, timeouts). Payloads go to the store the run's buffer stage owns.
    """

    task: Task
    engines: list[Engine]
    tokenizer: Any
    group_size: int = 8
    batch_groups: int = 16  # groups' worth of episodes in flight per engine
    temperature: float = 1.0
    top_p: float = 1.0
    request_timeout_s: float | None = None  # an engine call not answered by then is an EngineTimeout; None: wait
    max_regenerations: int = 5  # attempts at work that failed (engine call, put) before the run fails
    reward: Any = None
    evaluation: Evaluation | None = None  # generate an eval split every few versions (stages.evaluation)
    environment: Any = None
    environment_options: dict[str, Any] = field(default_factory=dict)
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    gateway: GatewaySettings | None = None  # serve the OpenAI API; episodes come from its agents
    engine_sync_s: float = 30.0  # at most this long a new group waits for its engine to reach the admitting version
    stats: dict = field(default_factory=lambda: {"groups": 0, "gen_s": 0.0, "tokens": 0, "regenerated": {}})

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"rollout.group_size must be >= 2 (GRPO needs a group), got {self.group_size}")
        if self.batch_groups < 1:
            raise ValueError(f"rollout.batch_groups must be >= 1, got {self.batch_groups}")
        if not self.engines:
            raise ValueError("rollout needs at least one engine")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"rollout.request_timeout_s must be > 0 (or unset), got {self.request_timeout_s}")
        if isinstance(self.tokenizer, str | Path):
            self.tokenizer = load_tokenizer(self.tokenizer)
        data = self.task if isinstance(self.task, DataTask) else None
        if data is not None and data.uses_chat and not self.tokenizer.chat_template:
            raise ModelFolderError(f"task {self.task.name!r} gives chat prompts, and the tokenizer of "
                                   f"{self.tokenizer.name_or_path!r} has no chat template; use a chat checkpoint "
                                   "or plain prompts (task.chat = false)")
        self.stop_token_ids = stop_token_ids(self.tokenizer)
        if self.reward is None:
            self.reward = data.reward_function if data is not None else task_reward(self.task)
        elif not isinstance(self.reward, RewardFunction):
            self.reward = RewardFunction(self.reward)
        if isinstance(self.environment, str):
            make_environment(self.environment, **self.environment_options)  # a bad name or option fails now
        if self.limits.request_timeout_s is None and self.request_timeout_s is not None:
            self.limits = replace(self.limits, request_timeout_s=self.request_timeout_s)

    @property
    def workers(self) -> int:
        """One rollout worker per engine, in engine order (the Ray runtime gives each its own process)."""
        return len(self.engines)

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.task.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stop_token_ids=self.stop_token_ids,
        )

    def episode_setup(self, policy: Any) -> EpisodeSetup:
        """How this rollout's episodes run: chat rendering for chat tasks (else plain text), one
        environment per episode (None: single-turn), sampling and limits, the staleness policy."""
        chat = isinstance(self.task, DataTask) and self.task.uses_chat
        renderer = renderer_for(self.tokenizer, chat, self.stop_token_ids)
        environment = self.environment
        if isinstance(environment, str):  # checked whole in __post_init__; here only the class is resolved
            environment = functools.partial(environment_class(environment), **self.environment_options)
        return EpisodeSetup(renderer, environment, self.sampling(), self.limits, policy)

    def actors(self, ctx: RunContext, inbox: Channel | None, outbox: Channel | None):
        assert outbox is not None
        ctx.services.weight_receivers.extend(self.engines)
        ctx.services.mailboxes.update(engine_mailboxes(self.engines))  # weights from other processes
        store: ObjectStore = ctx.services.store
        for engine in self.engines:
            if hasattr(engine, "policy"):  # engines ask the policy what to do with requests in flight
                engine.policy = ctx.policy
            if hasattr(engine, "log_dir"):  # server logs go to the run folder
                engine.log_dir = ctx.folder.path
        plan = plan_of(ctx)
        if plan is not None and plan.planned("engine.hang") and self.limits.request_timeout_s is None:
            raise FaultPlanError("fault engine.hang needs rollout.request_timeout_s (e.g. 30) to turn a hang into "
                                 "an error; set it, or remove the fault")
        # engine faults wrap only what the worker calls; weight receivers keep the engine itself
        workers = [
            RolloutWorker(self, with_engine_faults(engine, plan), store, ctx, outbox, task=self._task_of(i), index=i)
            for i, engine in enumerate(self.engines)
        ]
        if self.gateway is not None:  # one gateway per process, in front of the process's engines
            workers[0].gateway_host = RolloutHost(workers)
        return workers

    def _task_of(self, worker: int) -> Task:
        """Worker `worker`'s task: its own shard of a dataset (workers may live in other processes),
        else the task itself."""
        return self.task.shard(worker, len(self.engines)) if isinstance(self.task, DataTask) else self.task


GENERATION_FILE = "generation.jsonl"  # per finished group: what `baton simulate --calibrate` reads of generation


class GroupsNotStored(StoreError):
    """A group could not be stored (after the store's retries); the rollout worker generates it again."""


_PROMPT = msgspec.json.Decoder(Prompt)
_ENCODE = msgspec.json.encode


_MT_WORDS = len(random.Random().getstate()[1])  # a Mersenne Twister state's length


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


class RolloutWorker(BaseActor):
    def __init__(self, spec: Rollout, engine: Engine, store: ObjectStore, ctx: RunContext, outbox: Channel,
                 task: Task | None = None, index: int = 0) -> None:
        self.spec, self.engine, self.store, self.ctx, self.outbox = spec, engine, store, ctx, outbox
        self.task = task if task is not None else spec.task
        self.index = index  # the first worker (index 0) runs the evaluations
        self._next_eval = 0  # the engine version at which the next evaluation is due
        self._eval_prompts: list[Prompt] | None = None
        self.name = f"rollout:{engine.name}"
        self.groups_made = 0
        self.incarnation = uuid.uuid4().hex[:8]
        self.rng = ctx.rng(self.name)
        self.log = ctx.log(self.name)
        self._generating: dict[int, Prompt] = {}  # admitted, not yet recorded as produced (by admission number)
        self._admitted = 0
        self.groups = GroupOutbox(ctx, outbox, self._recorded, self._log_generation)
        self.gateway_host: RolloutHost | None = None  # set on the process's first worker in gateway mode

    @functools.cached_property
    def setup(self) -> EpisodeSetup:
        return self.spec.episode_setup(self.ctx.policy)

    @functools.cached_property
    def room(self) -> Room:
        return Room(self.spec.batch_groups * self.spec.group_size)

    async def start(self) -> None:
        resume = self.ctx.resume
        if resume is not None and (state := resume.rng_state(self.name)) is not None:
            self._restore_stream(state)  # the prompt stream goes on from the checkpoint
        await self.engine.start()
        # an engine that starts late (or restarts) catches up from the learner's latest snapshot
        snapshot = await load_snapshot(self.store, snapshot_key(self.ctx.run, self.ctx.folder.path.name))
        # never newer than the clock: a snapshot a crashed attempt wrote after the checkpoint was rolled back
        if snapshot is not None and self.engine.version < snapshot[0] <= await self.ctx.clock.current():
            await self.engine.receive_weights(*snapshot)
            self.log.info("weights from snapshot", version=snapshot[0])

    async def stop(self) -> None:
        await self.engine.stop()

    def held_refs(self) -> list[HeldRef]:
        """Refs recorded as produced and not yet all sent on (a checkpoint re-uses them on resume)."""
        return [HeldRef(ref=ref, holder=self.name) for ref in self.groups.sending]

    def held_sources(self) -> list[bytes]:
        """The encoded prompts admitted and not yet recorded as produced (a resumed run produces them)."""
        return [_ENCODE(p) for p in self._generating.values()]

    def rng_state(self) -> RandomState:
        """Where this worker's prompt stream stands (a checkpoint keeps it; a resume goes on from it):
        its random state, and a dataset task's position (`state()`) appended to the state's words."""
        version, words, gauss = random_state(self.rng.getstate())
        return version, [*words, *self.task.state()] if isinstance(self.task, DataTask) else words, gauss

    def _restore_stream(self, state: RandomState) -> None:
        version, words, gauss = state
        self.rng.setstate(python_random_state((version, words[:_MT_WORDS], gauss)))
        if len(words) > _MT_WORDS and isinstance(self.task, DataTask):
            self.task.restore(tuple(words[_MT_WORDS:]))

    def recording(self) -> list[tuple[str, bytes]]:
        """(group, source) of the groups whose `produced` record is on its way to the ledger: a checkpoint
        owes them unless its ledger has them already (only a ledger in another process can be mid-call)."""
        return list(self.groups.recording)

    async def run(self) -> None:
        if self.spec.gateway is not None:
            await self._serve_gateway()
            return
        group_size = self.spec.group_size
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.groups.run)
            while True:
                await self._evaluate_if_due()
                await self.room.wait_for(group_size)  # meanwhile the last note says what is generating
                self.ctx.note(self.name, "waiting at the admission gate")
                t_gate = anyio.current_time()
                n = await self.ctx.gate.acquire_many(self.room.free // group_size)
                admitted_at = await self.ctx.clock.current()
                gate_s = anyio.current_time() - t_gate
                for prompt in await self._next_prompts(n):
                    tg.start_soon(self._group, self._admit(prompt), prompt, admitted_at, gate_s)
                self.ctx.note(self.name, f"generating {n} groups ({n * group_size} episodes) on engine "
                              f"{self.engine.name} at version {self.engine.version}")

    async def _serve_gateway(self) -> None:
        """Gateway mode: episodes come from outside (stages.gateway.run_host); the first worker of the
        process serves the gateway and runs the configured agent functions, every worker stores,
        records and sends the groups formed on its engine."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.groups.run)
            if self.gateway_host is None:
                return
            gateway = await self._start_gateway()
            try:
                settings = self.spec.gateway
                if settings.agent is not None:
                    agent = as_agent(settings.agent)
                    for _ in range(settings.agents or self.spec.batch_groups * self.spec.group_size):
                        tg.start_soon(self._run_agents, gateway, agent)
                await anyio.sleep_forever()
            finally:
                with anyio.CancelScope(shield=True):
                    await gateway.stop()

    async def _start_gateway(self) -> Gateway:
        settings, folder = self.spec.gateway, self.ctx.folder.path
        token_file = folder / f"gateway-{self.engine.name}.token"
        limits = Limits(max_tokens=settings.max_tokens, max_episode_tokens=settings.max_episode_tokens,
                        max_episode_s=settings.max_episode_s, reward_timeout_s=settings.reward_timeout_s)
        gateway = Gateway(self.gateway_host, make_token_file(token_file), settings.port, settings.bind, limits,
                          tokenizer=self.spec.tokenizer, renderer=renderer_for(self.spec.tokenizer, True),
                          model=self.ctx.run)
        await gateway.start()
        (folder / f"gateway-{self.engine.name}.json").write_text(msgspec.json.encode(
            {"base_url": gateway.base_url, "token_file": str(token_file)}).decode())
        self.log.info("gateway serving", base_url=gateway.base_url, token_file=str(token_file))
        return gateway

    async def _run_agents(self, gateway: Gateway, agent) -> None:
        while True:
            await gateway.run_agent(agent)

    async def produce(self, prompts: list[Prompt]) -> None:
        """Run the groups of `prompts` (admitted already) through to the ledger and downstream; returns
        once all are sent. (`run` does this continuously; tests and tools call it directly.)"""
        async with anyio.create_task_group() as tg:
            for prompt in prompts:
                tg.start_soon(self._group, self._admit(prompt), prompt, self.engine.version)
        await self.groups.flush()

    def _admit(self, prompt: Prompt) -> int:
        """Take room for the prompt's episodes and count it as generating; returns its admission number."""
        self.room.take(self.spec.group_size)
        return self._generating_admission(prompt)

    def _generating_admission(self, prompt: Prompt) -> int:
        """Count an admitted prompt as generating (a checkpoint owes it until it is recorded)."""
        self._admitted += 1
        self._generating[self._admitted] = prompt
        return self._admitted

    async def finish_outside_group(self, admission: int, prompt: Prompt, results: list) -> None:
        """Store, record and send a group whose episodes ran outside (the gateway's agents): rewards
        are theirs. A group that cannot be stored cannot be generated again here: it is dropped."""
        try:
            finished = await self._finish_group(prompt, results, rewarded=True)
        except StoreError as exc:
            self._count("episodes_failed", "store failed")
            finished = self._dropped(self._new_group_id(), (self.engine.version,) * 2, _ENCODE(prompt),
                                     len(results), f"store failed: {exc}")
        finished.admission = admission
        self.groups.put(finished)

    async def _next_prompts(self, n: int) -> list[Prompt]:
        """`n` prompts: groups to redo first (one feedback poll for all), then new samples."""
        redos = await self.ctx.poll_feedback_many(n)
        if redos:
            self.spec.stats["redone"] = self.spec.stats.get("redone", 0) + len(redos)
        prompts = [_PROMPT.decode(await self.ctx.ledger.take_source(r.group)) for r in redos]
        return prompts + [self.task.sample(self.rng) for _ in range(n - len(redos))]

    def _recorded(self, finished: list[Finished]) -> None:
        for item in finished:
            self._generating.pop(item.admission, None)

    async def _group(self, admission: int, prompt: Prompt, admitted_at: int, gate_s: float = 0.0) -> None:
        """Run one group to the outbox. Its engine first reaches the admitting version (so a group admitted
        at version v never carries tokens older than v); a group that cannot be stored is generated again,
        counted, up to `max_regenerations` times."""
        await self._engine_at(admitted_at)
        t0 = anyio.current_time()
        for attempt in range(self.spec.max_regenerations + 1):
            episodes = await self._episodes(prompt)
            try:
                finished = await self._finish_group(prompt, episodes)
                break
            except StoreError as exc:
                if attempt == self.spec.max_regenerations:
                    raise
                self._redone("regenerated", "groups.regenerated", exc)
        finished.admission, finished.gate_s, finished.started = admission, gate_s, t0
        self.groups.put(finished)

    async def _engine_at(self, version: int) -> None:
        deadline = anyio.current_time() + self.spec.engine_sync_s
        while self.engine.version < version and anyio.current_time() < deadline:
            await anyio.sleep(0.002)
        if self.engine.version < version:
            self.ctx.event("engine.behind", engine=self.engine.name, version=self.engine.version, admitted=version)

    async def _episodes(self, prompt: Prompt) -> list[Episode | EpisodeFailed]:
        """The group's episodes: one coroutine each with an environment; without one, the group's single
        turns go to the engine as one call (`stages.episode.run_single_turns`)."""
        size = self.spec.group_size
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
        for attempt in range(self.spec.max_regenerations + 1):
            async with anyio.create_task_group() as tg:
                for i in rerun:
                    tg.start_soon(self._episode, prompt, results, i)
            if attempt == self.spec.max_regenerations or not (rerun := self._aged(results)):
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
                self._redone("episodes_restarted", "episodes.restarted", stale)
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

    async def _attempts(self, run, whole_group: bool = False):
        """`await run()`, started again from its sample after an engine failure or a stale restart
        (counted as a regenerated group, or a restarted episode); past `max_regenerations` attempts the
        error ends the run. EpisodeFailed is counted."""
        for attempt in range(self.spec.max_regenerations + 1):
            try:
                return await run()
            except EpisodeFailed as exc:
                self._count("episodes_failed", exc.reason)
                raise
            except EngineError as exc:
                if attempt == self.spec.max_regenerations:
                    raise
                if whole_group:
                    self._redone("regenerated", "groups.regenerated", exc)
                else:
                    self._redone("episodes_restarted", "episodes.restarted", exc)
        raise AssertionError("unreachable")

    def _redone(self, stat: str, event: str, error: BaseException) -> None:
        """Count work generated again after `error`: a whole group (stat "regenerated", event
        groups.regenerated) or one episode (stat "episodes_restarted", event episodes.restarted)."""
        cause = type(error).__name__
        self._count(stat, cause)
        self.ctx.event(event, engine=self.engine.name, cause=cause, error=str(error))
        plan = plan_of(self.ctx)
        if plan is not None:  # the fault runner counts these (they never reached the ledger)
            plan.record("regenerated", cause, self.name, groups=1)

    def _count(self, stat: str, key: str) -> None:
        counts = self.spec.stats.setdefault(stat, {})
        counts[key] = counts.get(key, 0) + 1

    async def _finish_group(self, prompt: Prompt, results: list[Episode | EpisodeFailed],
                            rewarded: bool = False) -> Finished:
        """Score and store a group whose episodes are over. Failed episodes (environment) are recorded as
        dropped with their reason; the rest are stored as one group. A group with nothing left to train
        (every episode failed, or a failed reward with on_error = "drop") is recorded and dropped whole."""
        episodes = [r for r in results if isinstance(r, Episode)]
        failed = [r for r in results if isinstance(r, EpisodeFailed)]
        group_id, source = self._new_group_id(), _ENCODE(prompt)
        span = version_span(episodes, self.engine.version)
        self.spec.stats["tokens"] += sum(e.tokens.model_tokens for e in episodes)
        if self.setup.environment is None and episodes and not rewarded:
            scores = await self._score(prompt, [e.last for e in episodes if e.last is not None])
            if self.spec.reward.on_error == "drop" and any(scores.failures):
                reason = next(f for f in scores.failures if f)
                self.log.warning("reward failed; group dropped", group=group_id, reason=reason)
                return self._dropped(group_id, span, source, len(results), "reward failed",
                                     {"reward_failed": [float(f is not None) for f in scores.failures]})
        else:
            scores = Scores([e.reward for e in episodes], [None] * len(episodes))
        if not episodes:
            return self._dropped(group_id, span, source, len(results), f"episode failed: {failed[0].reason}")
        t_put = anyio.current_time()
        ref, values = await self._store_group(group_id, prompt, episodes, scores, span)
        finished = Finished([Produced(ref.item_ids, group_id, span, source, values)], ref, source=source,
                            lengths=[e.tokens.model_tokens for e in episodes], put_s=anyio.current_time() - t_put)
        if failed:
            ids = [f"{group_id}/failed-{i}" for i in range(len(failed))]
            finished.records.append(Produced(ids, f"{group_id}.failed", span, source, {}))
            finished.dropped.append((ids, f"episode failed: {failed[0].reason}"))
        return finished

    def _dropped(self, group_id: str, span: tuple[int, int], source: bytes, n: int, reason: str,
                 values: dict | None = None) -> Finished:
        """A whole group recorded and dropped with `reason` (nothing stored; its slot is freed)."""
        ids = [f"{group_id}/{i}" for i in range(n)]
        return Finished([Produced(ids, group_id, span, source, values or {})], None, [(ids, reason)], source)

    async def _evaluate_if_due(self) -> None:
        """Generate and score the eval prompts once the engine reaches the next due version
        (`stages.evaluation`); an engine failure skips this evaluation, it never ends the run."""
        evaluation, spec = self.spec.evaluation, self.spec
        if evaluation is None or self.index != 0 or self.engine.version < self._next_eval:
            return
        self._next_eval = evaluation.next_due(self.engine.version)
        if self._eval_prompts is None:
            self._eval_prompts = evaluation.prompt_list()
        prompts, n = self._eval_prompts, evaluation.samples
        ids = [prompt_token_ids(spec.tokenizer, p.text, p.messages) for p in prompts]
        self.ctx.note(self.name, f"evaluating {len(prompts)} prompts at version {self.engine.version}")
        t0 = anyio.current_time()
        try:
            with anyio.fail_after(spec.request_timeout_s):
                completions = await self.engine.generate(
                    [i for i in ids for _ in range(n)], replace(spec.sampling(), temperature=evaluation.temperature)
                )
        except (EngineError, TimeoutError) as exc:
            self.log.warning("evaluation skipped", version=self.engine.version, error=repr(exc))
            return
        rewards: list[float] = []
        for g, prompt in enumerate(prompts):
            rewards += (await self._score(prompt, completions[g * n : (g + 1) * n], "eval_reward_failed")).rewards
        record = evaluation.record([c.versions for c in completions], rewards, anyio.current_time() - t0,
                                   self.engine.version)
        spec.stats["eval"] = record
        self.log.info("evaluated", **{k.replace("/", "_"): v for k, v in record.items()})
        folder = getattr(self.ctx, "folder", None)
        if folder is not None and hasattr(folder, "append_record"):
            folder.append_record(EVAL_FILE, {"t": round(time.time() - self.ctx.started_at, 4), **record})

    async def _score(self, prompt: Prompt, group: list[Completion], failures: str = "reward_failed") -> Scores:
        """The group's rewards (never raises); failed samples are counted in `stats[failures]` by reason."""
        tokens = [c.tokens.tolist() for c in group]
        scores = await self.spec.reward.score([
            Sample(prompt=prompt.text, completion=text, tokens=ids, answer=prompt.answer,
                   metadata=prompt.metadata or {}, messages=prompt.messages, source=prompt)
            for text, ids in zip(decode_many(self.spec.tokenizer, tokens), tokens, strict=True)
        ])
        counts = self.spec.stats.setdefault(failures, {}) if any(scores.failures) else {}
        for reason in filter(None, scores.failures):
            counts[reason] = counts.get(reason, 0) + 1
        if any(scores.failures):  # a warning now, counts in the metrics and the summary (pipeline.events)
            failed = [f for f in scores.failures if f]
            self.ctx.event(failures.replace("_", "."), count=len(failed), engine=self.engine.name, reason=failed[0])
        return scores

    def _new_group_id(self) -> str:
        # unique across workers, processes and restarts: engine name, this incarnation, a counter
        group_id = f"{self.engine.name}.{self.incarnation}.{self.groups_made:08d}"
        self.groups_made += 1
        return group_id

    def _log_generation(self, batch: list[Finished], engine_s: float, record_s: float) -> None:
        """One line per recorded batch of groups in the run folder's generation.jsonl (`baton simulate
        --calibrate` reads it as an engine call): groups, the longest wait at the gate of their
        admissions, the engine's wall time for them (`gen_s`: since the previous batch was ready, or since
        the earliest of them started if the engine was idle meanwhile), the slowest put, the seconds to
        record and send them, response tokens and their lengths, bytes stored."""
        folder = getattr(self.ctx, "folder", None)
        if folder is None or not hasattr(folder, "append_record"):
            return
        lengths = [n for f in batch for n in f.lengths]
        folder.append_record(GENERATION_FILE, {
            "engine": self.engine.name, "t": round(time.time() - self.ctx.started_at, 4), "groups": len(batch),
            "group_size": self.spec.group_size, "gate_s": round(max(f.gate_s for f in batch), 5),
            "gen_s": round(engine_s, 5), "put_s": round(max(f.put_s for f in batch), 5),
            "send_s": round(record_s, 5), "tokens": int(sum(lengths)), "lengths": lengths,
            "nbytes": int(sum(f.ref.nbytes for f in batch if f.ref is not None)),
            **{f"engine/{k}": v for k, v in getattr(self.engine, "stats", {}).items()},  # the engine's own counts
        })

    async def _store_group(self, group_id: str, prompt: Prompt, episodes: list[Episode], scores: Scores,
                           span: tuple[int, int]) -> tuple[Ref, dict[str, list[float]]]:
        """Encode and store one scored group; returns its Ref (not yet recorded or sent) and, per sample,
        the values the ledger keeps for bias accounting: `reward`, `length` (model tokens) and, when a
        reward failed (scored 0), `reward_failed` (1 for those samples)."""
        ctx = self.ctx
        lo, hi = span
        batch = encode_group(episodes, scores.rewards, span,
                             {"run": ctx.run, "group": group_id, "prompt": prompt.text, "answer": prompt.answer})
        payload = encode(batch, pool=getattr(self.store, "pool", None))  # straight into the store's memory
        key = make_key(ctx.run, lo, group_id, f"0-{len(episodes) - 1}")
        await with_retries(lambda: self.store.put(key, payload))
        self.spec.stats["groups"] += 1
        ref = Ref(
            store=self.store.name, key=key, version=lo, version_max=hi, rows=len(episodes),
            nbytes=payload.nbytes, checksum=peek(payload).checksum, group=group_id,
        )
        values = {"reward": [float(r) for r in scores.rewards],
                  "length": [float(e.tokens.model_tokens) for e in episodes]}
        if any(scores.failures):
            values["reward_failed"] = [float(f is not None) for f in scores.failures]
        return ref, values
