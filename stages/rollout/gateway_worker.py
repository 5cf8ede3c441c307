"""Gateway mode: a run's episodes come from agents outside, through the OpenAI API (stages.gateway).

`GatewayWorker` is the producer's worker in that mode: the first worker of a process serves the
gateway in front of the process's engines and runs the configured agent functions; every worker
stores, records and sends the groups formed on its engine. `RolloutHost` is the gateway's host inside
a run. Episodes opened from outside become the rollout's GRPO groups: admitted by the staleness gate,
sampled like any group (redo requests first), generated on the engine of the worker that formed the
group, stored, recorded and sent by that worker.

Invariants (with those of `stages.gateway.host.Host`):
- the first episode of a group takes an admission slot (waiting at the gate, or `OverBudget` when the
  caller will not wait); the next `group_size - 1` episodes opened join it and get the same sample;
- a new group forms on the worker with the most room (the least loaded engine); every request of an
  episode goes to its group's engine (its prefix cache holds the conversation);
- a group is finished once all its episodes are: each segment of an episode that brought its reward
  is a row with that reward; an episode dropped (reward timeout, agent failure, limits) is recorded as
  dropped with its reason; a group with no row left is dropped whole and frees its slot.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from buffers.store import StoreError
from pipeline import plugins
from pipeline.net import make_token_file
from stages.data.tasks import Prompt
from stages.engines.base import Completion, EngineError, SamplingParams
from stages.environments.render import renderer_for
from stages.gateway.episodes import Limits
from stages.gateway.host import OpenedEpisode, OverBudget
from stages.gateway.server import Gateway
from stages.rollout.episode import Episode, EpisodeFailed
from stages.rollout.prompts import encode_prompt
from stages.rollout.worker import ProducerWorker

if TYPE_CHECKING:
    from stages.environments.tokens import EpisodeTokens

GATE_POLL_S = 0.05  # how long `open(wait=False)` gives the gate before answering 429
RETRY_AFTER_S = 1.0


@dataclass
class FormingGroup:
    """A group whose episodes are being opened and run from outside."""

    worker: GatewayWorker
    admission: int
    prompt: Prompt
    number: int
    opened: int = 0
    results: list[Episode | EpisodeFailed] = field(default_factory=list)
    finished: int = 0


class RolloutHost:
    """The host over this process's rollout workers (see the module docstring)."""

    def __init__(self, workers: list[GatewayWorker], group_size: int, stop_token_ids: Sequence[int]) -> None:
        self.workers, self.group_size, self.stop_token_ids = workers, group_size, tuple(stop_token_ids)
        self._forming: FormingGroup | None = None
        self._episodes: dict[str, FormingGroup] = {}
        self._numbers = itertools.count()
        self._lock = anyio.Lock()
        self.failing: GatewayWorker | None = None  # a worker whose episodes failed too often in a row to train
        self.failed = anyio.Event()  # set with `failing`: the serving worker's `run` raises its EpisodesFailing

    async def open(self, wait: bool) -> OpenedEpisode:
        async with self._lock:
            group = self._forming
            if group is None or group.opened == self.group_size:
                group = self._forming = await self._new_group(wait)
            group.opened += 1
            episode_id = f"{group.worker.engine.name}.{group.number}.{group.opened - 1}"
            self._episodes[episode_id] = group
            group.worker.room.take(1)
            return OpenedEpisode(episode_id, group.prompt, group.number)

    async def _new_group(self, wait: bool) -> FormingGroup:
        worker = max(self.workers, key=lambda w: w.room.free)
        admitted = 0
        with anyio.move_on_after(None if wait else GATE_POLL_S):
            admitted = await worker.ctx.gate.acquire_many(1)
        if not admitted:
            raise OverBudget(RETRY_AFTER_S)
        (prompt,) = await worker.prompts.next(1)
        return FormingGroup(worker, worker.prompts.admit(prompt), prompt, next(self._numbers))

    async def generate(self, episode_id: str | None, prompt_ids: list[int], params: SamplingParams) -> Completion:
        group = self._episodes.get(episode_id) if episode_id is not None else None
        worker = group.worker if group is not None else max(self.workers, key=lambda w: w.room.free)
        stops = tuple(dict.fromkeys((*params.stop_token_ids, *self.stop_token_ids)))
        try:
            (completion,) = await worker.engine.generate([prompt_ids], replace(params, stop_token_ids=stops))
        except EngineError as exc:  # the agent hears 503 and may resend; the episode's record is unchanged
            worker.ctx.event("gateway.engine_failed", engine=worker.engine.name, error=str(exc))
            raise
        return completion

    async def finish(self, episode_id: str, segments: list[EpisodeTokens], reward: float | None,
                     reason: str | None) -> None:
        group = self._episodes.pop(episode_id)
        group.worker.room.give_back(1)
        if reason is None and reward is not None and segments:
            group.results += [Episode(tokens, reward=reward, turns=tokens.turns) for tokens in segments]
        else:
            group.results.append(EpisodeFailed(reason or "no tokens generated"))
        group.finished += 1
        if group.finished == self.group_size:
            await group.worker.finish_outside_group(group.admission, group.prompt, group.results)
            if group.worker.maker.failing:
                self.failing = group.worker
                self.failed.set()


@dataclass(frozen=True)
class GatewaySettings:
    """`[gateway]`: serve the OpenAI API in front of the run's engines (stages.gateway.server). `port` 0
    takes a free one; `bind` stays 127.0.0.1 unless set; the bearer token is made per run and written
    to RUN_DIR/gateway.token (owner-only), the URLs to RUN_DIR/gateway.json. `agent`: a function
    ("pkg.module:function" or a callable) baton calls per episode with (sample, base_url, api_key),
    returning the reward (or posting it); `agents` of them run at once (default: `batch_groups *
    group_size`). Without `agent`, outside processes open episodes themselves. The rest bound requests
    and episodes (stages.gateway.episodes.Limits)."""

    port: int = 0
    bind: str = "127.0.0.1"
    agent: Any = None
    agents: int | None = None
    max_tokens: int = 1024
    max_episode_tokens: int = 16384
    max_episode_s: float = 3600.0
    reward_timeout_s: float = 600.0


def as_agent(agent: Any):
    """An agent function from config: "pkg.module:function" or a callable; a sync one runs in a thread."""
    fn = plugins.resolve(agent, {}, what="gateway agent") if isinstance(agent, str) else agent
    if not callable(fn):
        raise ValueError(f"gateway.agent {agent!r} is not a function")
    if inspect.iscoroutinefunction(fn):
        return fn

    async def in_thread(sample, base_url, api_key):
        return await anyio.to_thread.run_sync(partial(fn, sample, base_url, api_key))

    return in_thread


class GatewayWorker(ProducerWorker):
    """A producer worker in gateway mode (see the module docstring), serving as `gateway` says. `host` is set
    on the first worker of its process by the rollout stage; the others only record and send their groups."""

    host: RolloutHost | None = None

    def __init__(self, *parts: Any, gateway: GatewaySettings, **named: Any) -> None:
        super().__init__(*parts, **named)
        self.gateway = gateway

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.groups.run)
            if self.host is None:
                return
            gateway = await self._start_gateway(self.host)
            try:
                settings, shape = self.gateway, self.settings
                if settings.agent is not None:
                    agent = as_agent(settings.agent)
                    for _ in range(settings.agents or shape.batch_groups * shape.group_size):
                        tg.start_soon(self._run_agents, gateway, agent)
                await self.host.failed.wait()
                assert self.host.failing is not None
                self.host.failing.maker.raise_if_failing()
            finally:
                with anyio.CancelScope(shield=True):
                    await gateway.stop()

    async def _start_gateway(self, host: RolloutHost) -> Gateway:
        """Serve the gateway; its URL and the file holding its token go to RUN_DIR/gateway-{engine}.json."""
        settings, folder = self.gateway, self.ctx.folder.path
        token_file = folder / f"gateway-{self.engine.name}.token"
        limits = Limits(max_tokens=settings.max_tokens, max_episode_tokens=settings.max_episode_tokens,
                        max_episode_s=settings.max_episode_s, reward_timeout_s=settings.reward_timeout_s)
        gateway = Gateway(host, make_token_file(token_file), settings.port, settings.bind, limits,
                          tokenizer=self.scoring.tokenizer, renderer=renderer_for(self.scoring.tokenizer, True),
                          model=self.ctx.run)
        await gateway.start()
        (folder / f"gateway-{self.engine.name}.json").write_text(msgspec.json.encode(
            {"base_url": gateway.base_url, "token_file": str(token_file)}).decode())
        self.log.info("gateway serving", base_url=gateway.base_url, token_file=str(token_file))
        return gateway

    async def _run_agents(self, gateway: Gateway, agent: Any) -> None:
        while True:
            await gateway.run_agent(agent)

    async def finish_outside_group(self, admission: int, prompt: Prompt, results: list) -> None:
        """Store, record and send a group whose episodes ran outside (the gateway's agents): rewards
        are theirs. A group that cannot be stored cannot be generated again here: it is dropped."""
        try:
            finished = await self.maker.finish(prompt, results, rewarded=True)
        except StoreError as exc:
            self.stats.count("episodes_failed", "store failed")
            finished = self.maker.dropped(self.maker.new_group_id(), (self.engine.version,) * 2,
                                          encode_prompt(prompt), len(results), f"store failed: {exc}")
        finished.admission = admission
        self.groups.put(finished)

