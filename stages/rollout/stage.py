"""`Rollout`: the producer stage as the DSL and the config build it. It makes one worker per engine.

A worker (`stages.rollout.worker.RolloutWorker`) generates episodes on its engine from the task's
samples; in gateway mode (`gateway` set) each is a `stages.rollout.gateway_worker.GatewayWorker`,
whose episodes come from agents outside, through the OpenAI API. Either way a group becomes a payload
in the run's store and a Ref sent downstream (docs/architecture.md, "One sample, from prompt to trained").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from buffers.store import ObjectStore
from pipeline.channel import Channel
from pipeline.context import RunContext
from pipeline.contracts import Resources
from pipeline.faults import FaultPlanError, plan_of
from stages.data.model import ModelFolderError, load_tokenizer, stop_token_ids
from stages.data.rewards import RewardFunction, task_reward
from stages.data.tasks import DataTask, Task
from stages.engines.base import Engine, EngineRun, NeedsGPUs, SamplingParams
from stages.engines.faulty import with_engine_faults
from stages.environments import environment_class, make_environment
from stages.environments.render import renderer_for
from stages.rollout.episode import EpisodeLimits, EpisodeSetup
from stages.rollout.evaluation import Evaluation
from stages.rollout.gateway_worker import GatewaySettings, GatewayWorker, RolloutHost
from stages.rollout.groups import Scoring
from stages.rollout.relay import Relay
from stages.rollout.relay_remote import MAILBOX, PeerEngines, serve
from stages.rollout.stats import RolloutStats
from stages.rollout.worker import RolloutWorker, WorkerSettings
from stages.scorers import ComposedReward, Distillation, ModelReward
from stages.weights import engine_mailboxes


@dataclass
class Rollout:
    """The DSL/config object: `Rollout(task, [TorchEngine(model)], tokenizer=model, group_size=8)`.

    `tokenizer` is a tokenizer object or the model folder to load it from; generation stops at its
    EOS and at generation_config.json's `eos_token_id`s. `reward` scores single-turn completions: a
    `stages.data.rewards.RewardFunction`, a callable or a "pkg.module:function" path; None: the task's
    `reward_function` if it has one, else its own `reward(prompt, completion)`; a model reward
    (`stages.scorers`: a classifier, a judge, or a `ComposedReward` of rule and model rewards) is scored
    beside generation, on its own server. A sample whose reward fails is counted in
    `stats["reward_failed"]` by reason and gets what the reward's `on_error` says (scored 0, or its group
    dropped). `teacher` (a `stages.scorers.Distillation`) scores each group's tokens for on-policy
    distillation: its logprobs travel in the batch as `teacher_logprobs`. `environment` makes episodes
    multi-turn: a name or "pkg.module:Class" of `stages.environments` (with `environment_options`), or a
    callable that returns a fresh `Environment`; its rewards replace the reward function. `limits` bound each
    episode (turns, tokens, timeouts). Payloads go to the store the run's buffer stage owns.
    """

    task: Task
    engines: list[Engine]
    tokenizer: Any
    group_size: int = 8  # episodes per sample: a GRPO group, scored against its own mean
    batch_groups: int = 16  # groups' worth of episodes in flight per engine
    temperature: float = 1.0
    top_p: float = 1.0
    request_timeout_s: float | None = None  # an engine call not answered by then is an EngineTimeout; None: wait
    max_regenerations: int = 5  # attempts at work that failed (engine call, put) before the run fails
    # episodes failed one after another on a worker, none kept in between, before the run fails naming their
    # reason (stages.rollout.groups.EpisodesFailing): a run that can never train ends; 0: never
    max_failed_in_a_row: int = 512
    reward: Any = None
    evaluation: Evaluation | None = None  # generate an eval split every few versions (stages.rollout.evaluation)
    environment: Any = None
    environment_options: dict[str, Any] = field(default_factory=dict)
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    gateway: GatewaySettings | None = None  # serve the OpenAI API; episodes come from its agents
    teacher: Distillation | None = None  # on-policy distillation: teacher logprobs of every group's tokens
    transport: str | None = None  # the learner's weight transport: a plug-in's engine side is registered here too
    engine_sync_s: float = 30.0  # at most this long a new group waits for its engine to reach the admitting version
    # an engine for worker `index` of an elastic run (`join`); the config's builder sets it; None: none can join
    engine_factory: Callable[[int], Engine] | None = None
    stats: RolloutStats = field(default_factory=RolloutStats, init=False)  # its workers' counts in this process
    relay: Relay = field(default_factory=Relay, init=False)  # its workers' engines: a preempted one's requests go on

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
        elif isinstance(self.reward, ModelReward):
            self.reward = ComposedReward(None, [(self.reward, 1.0)])
        elif not isinstance(self.reward, RewardFunction | ComposedReward):
            self.reward = RewardFunction(self.reward)
        if isinstance(self.environment, str):
            make_environment(self.environment, **self.environment_options)  # a bad name or option fails now
        if self.limits.request_timeout_s is None and self.request_timeout_s is not None:
            self.limits = replace(self.limits, request_timeout_s=self.request_timeout_s)

    @property
    def scoring(self) -> Scoring:
        """How its groups are scored (single-turn ones by the reward; an environment's episodes bring theirs)."""
        return Scoring(self.reward, self.tokenizer, self.teacher, by_reward=self.environment is None)

    @property
    def workers(self) -> int:
        """One rollout worker per engine, in engine order (the Ray runtime gives each its own process)."""
        return len(self.engines)

    def resources(self, index: int) -> Resources:
        """Worker `index`'s process: one CPU, and the GPUs its engine generates on."""
        engine = self.engines[index]
        return Resources(cpus=1, gpus=engine.gpus if isinstance(engine, NeedsGPUs) else 0)

    def helpers(self) -> list[Resources]:
        return []

    def episode_setup(self, policy: Any) -> EpisodeSetup:
        """How this rollout's episodes run: chat rendering for chat tasks (else plain text), one
        environment per episode (None: single-turn), sampling and limits, the staleness policy."""
        chat = isinstance(self.task, DataTask) and self.task.uses_chat
        renderer = renderer_for(self.tokenizer, chat, self.stop_token_ids)
        environment = self.environment
        if isinstance(environment, str):  # checked whole in __post_init__; here only the class is resolved
            environment = functools.partial(environment_class(environment), **self.environment_options)
        sampling = SamplingParams(max_new_tokens=self.task.max_new_tokens, temperature=self.temperature,
                                  top_p=self.top_p, stop_token_ids=self.stop_token_ids)
        return EpisodeSetup(renderer, environment, sampling, self.limits, policy, self.relay)

    def actors(self, ctx: RunContext, inbox: Channel | None, outbox: Channel | None) -> list[RolloutWorker]:
        """One worker per engine of this process; in gateway mode the first hosts the process's gateway."""
        assert outbox is not None
        for engine in self.engines:
            engine.attach(EngineRun(policy=ctx.policy, log_dir=ctx.folder.path))
        plan = plan_of(ctx)
        if plan is not None and plan.planned("engine.hang") and self.limits.request_timeout_s is None:
            raise FaultPlanError("fault engine.hang needs rollout.request_timeout_s (e.g. 30) to turn a hang into "
                                 "an error; set it, or remove the fault")
        wrapped = [with_engine_faults(engine, plan) for engine in self.engines]
        # engine faults wrap what the worker calls; weight receivers keep the engine itself unless a fault acts on
        # the pushes (engine.server_kill_push, engine.push_refused)
        pushes = plan is not None and plan.planned("engine.server_kill_push", "engine.push_refused")
        receivers = wrapped if pushes else self.engines
        ctx.services.weight_receivers.extend(receivers)
        ctx.services.mailboxes.update(engine_mailboxes(receivers, self.transport))  # weights from other processes
        workers = [self.worker(engine, ctx.services.store, ctx, outbox, self._task_of(i), i, receiver=receivers[i])
                   for i, engine in enumerate(wrapped)]
        if self.gateway is not None:
            workers[0].host = RolloutHost(workers, self.group_size, self.stop_token_ids)
        return workers

    def join(self, ctx: RunContext, outbox: Channel, index: int) -> RolloutWorker:
        """Worker `index` on a new engine (`engine_factory(index)`) joining the running run
        (`pipeline.contracts.Scalable`): its `start` subscribes the engine to the learner's pushes and
        passes the version fence before it takes a prompt (`stages.rollout.fence`). A dataset task gives
        it the shard of worker `index % engines` (a shard then has two readers, each its own stream)."""
        if self.engine_factory is None:
            raise ValueError("an engine cannot join: rollout.engine_factory is not set (the config's builder sets "
                             "it; in the DSL pass engine_factory=lambda index: TorchEngine(model, name=...))")
        if self.gateway is not None:
            raise ValueError("an engine cannot join a gateway-mode run (its gateway lives on worker 0); "
                             "unset max_workers ([rollout] max_engines)")
        engine = self.engine_factory(index)
        engine.attach(EngineRun(policy=ctx.policy, log_dir=ctx.folder.path))
        for box, handler in engine_mailboxes([engine], self.transport).items():  # a process of its own (Ray): the
            ctx.services.mailboxes.setdefault(box, handler)  # learner's pushes reach it here; else the process's own
        worker = self.worker(with_engine_faults(engine, plan_of(ctx)), ctx.services.store, ctx, outbox,
                             self._task_of(index % len(self.engines)), index, receiver=engine, joins=True)
        assert isinstance(worker, RolloutWorker)
        return worker

    def worker(self, engine: Engine, store: ObjectStore, ctx: RunContext, outbox: Channel, task: Task | None = None,
               index: int = 0, **joining: Any) -> RolloutWorker | GatewayWorker:
        """Worker `index` on `engine` (of `task`: default, the whole task), given what it uses of this stage;
        `joining`: the worker's `receiver` (the engine behind a fault wrapper) and whether it `joins`."""
        settings = WorkerSettings(self.group_size, self.batch_groups, self.max_regenerations, self.engine_sync_s,
                                  self.request_timeout_s, self.max_failed_in_a_row)
        parts = (settings, self.task if task is None else task, self.scoring, self.stats, engine, store, ctx, outbox)
        if self.gateway is not None:
            return GatewayWorker(*parts, index, gateway=self.gateway, **joining)
        self._relay_elsewhere(ctx)
        return RolloutWorker(*parts, index, episode_setup=self.episode_setup, evaluation=self.evaluation,
                             relay=self.relay, **joining)

    def _relay_elsewhere(self, ctx: RunContext) -> None:
        """Where the run has other producer processes (Ray): serve this process's relay to them on its mailbox,
        and continue a preempted engine's requests on theirs when none of this process's engines takes work."""
        if not len(ctx.services.producers):
            return
        producers, relay = ctx.services.producers, self.relay
        ctx.services.mailboxes.setdefault(MAILBOX, functools.partial(serve, lambda: list(relay.engines.values())))
        relay.elsewhere = lambda preempted: PeerEngines(lambda: list(producers), preempted.version)

    def _task_of(self, worker: int) -> Task:
        """Worker `worker`'s task: its own shard of a dataset (workers may live in other processes),
        else the task itself."""
        return self.task.shard(worker, len(self.engines)) if isinstance(self.task, DataTask) else self.task
