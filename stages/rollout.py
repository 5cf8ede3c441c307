"""Rollout: the producer stage. Prompts -> engine -> reward -> group -> encode -> store.put -> Ref.

One worker actor per engine. Each worker, in a loop:
1. waits at the admission gate for a group slot, then takes as many more as the gate allows
   right now (up to `batch_groups`), so one engine call generates many groups;
2. takes prompts of groups to redo from the feedback channel first (their payload was lost, or
   the policy requeued them; the ledger kept each group's prompt for this), else new prompts;
3. generates `group_size` completions per prompt, scores them, and writes each group as one
   encoded batch under a versioned key; only then sends its Ref downstream.
A group is recorded in the ledger as produced only once its payload is stored.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from buffers.codec import RolloutBatch, encode, peek
from buffers.retry import with_retries
from buffers.store import ObjectStore, StoreError
from pipeline.actor import BaseActor
from pipeline.channel import Channel
from pipeline.checkpoint import RandomState, python_random_state, random_state
from pipeline.context import RunContext
from pipeline.faults import FaultPlanError, plan_of
from pipeline.refs import HeldRef, Produced, Ref, make_key
from stages.engines.base import Completion, Engine, EngineError, SamplingParams
from stages.engines.faulty import EngineTimeout, with_engine_faults
from stages.evaluation import EVAL_FILE, Evaluation
from stages.model import ModelFolderError, load_tokenizer, prompt_token_ids, stop_token_ids
from stages.rewards import RewardFunction, Sample, Scores, task_reward
from stages.tasks import DataTask, Prompt, Task
from stages.weights import engine_mailboxes
from stages.weights.snapshot import load_snapshot, snapshot_key


@dataclass
class Rollout:
    """The DSL/config object: `Rollout(task, [TorchEngine(model)], tokenizer=model, group_size=8)`.

    `tokenizer` is a tokenizer object or the model folder to load it from; generation stops at its
    EOS and at generation_config.json's `eos_token_id`s. `reward` scores completions: a
    `stages.rewards.RewardFunction`, a callable or a "pkg.module:function" path; None: the task's
    `reward_function` if it has one, else its own `reward(prompt, completion)`. A sample whose reward
    fails is counted in `stats["reward_failed"]` by reason and gets what the reward's `on_error` says
    (scored 0, or its group dropped). Payloads go to the store the run's buffer stage owns.
    """

    task: Task
    engines: list[Engine]
    tokenizer: Any
    group_size: int = 8
    batch_groups: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    request_timeout_s: float | None = None  # an engine call not answered by then is an EngineTimeout; None: wait
    max_regenerations: int = 5  # attempts at work that failed (engine call, put) before the run fails
    reward: Any = None
    evaluation: Evaluation | None = None  # generate an eval split every few versions (stages.evaluation)
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
        if plan is not None and plan.planned("engine.hang") and self.request_timeout_s is None:
            raise FaultPlanError("fault engine.hang needs rollout.request_timeout_s (e.g. 30) to turn a hang into "
                                 "an error; set it, or remove the fault")
        # engine faults wrap only what the worker calls; weight receivers keep the engine itself
        return [
            RolloutWorker(self, with_engine_faults(engine, plan), store, ctx, outbox, task=self._task_of(i), index=i)
            for i, engine in enumerate(self.engines)
        ]

    def _task_of(self, worker: int) -> Task:
        """Worker `worker`'s task: its own shard of a dataset (workers may live in other processes),
        else the task itself."""
        return self.task.shard(worker, len(self.engines)) if isinstance(self.task, DataTask) else self.task


GENERATION_FILE = "generation.jsonl"  # per engine call: what `baton simulate --calibrate` reads of generation


class GroupsNotStored(StoreError):
    """Some groups of an engine batch could not be stored (after the store's retries); the rollout
    worker generates them again."""


_PROMPT = msgspec.json.Decoder(Prompt)
_ENCODE = msgspec.json.encode


_MT_WORDS = len(random.Random().getstate()[1])  # a Mersenne Twister state's length


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
        self._sending: list[Ref] = []  # recorded as produced, being sent downstream
        self._generating: list[Prompt] = []  # admitted, not yet recorded as produced
        self._recording: list[tuple[str, bytes]] = []  # (group, source) of the `produced` call under way

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
        return [HeldRef(ref=ref, holder=self.name) for ref in self._sending]

    def held_sources(self) -> list[bytes]:
        """The encoded prompts admitted and not yet recorded as produced (a resumed run produces them)."""
        return [_ENCODE(p) for p in self._generating]

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
        return list(self._recording)

    async def run(self) -> None:
        while True:
            await self._evaluate_if_due()
            self.ctx.note(self.name, "waiting at the admission gate")
            t_gate = anyio.current_time()
            n = await self.ctx.gate.acquire_many(self.spec.batch_groups)
            t_prompts = anyio.current_time()
            prompts = self._generating = []  # filled as chosen: a checkpoint meanwhile owes what was chosen
            for _ in range(n):
                prompts.append(await self._next_prompt())
            self._call_timing = {"gate_s": t_prompts - t_gate, "prompts_s": anyio.current_time() - t_prompts}
            self.ctx.note(
                self.name, f"generating {n} groups ({n * self.spec.group_size} requests) on engine "
                f"{self.engine.name} at version {self.engine.version}",
            )
            await self._produce(prompts)

    async def _next_prompt(self) -> Prompt:
        redo = await self.ctx.poll_feedback()
        if redo is None:
            return self.task.sample(self.rng)
        self.spec.stats["redone"] = self.spec.stats.get("redone", 0) + 1
        return _PROMPT.decode(await self.ctx.ledger.take_source(redo.group))

    async def _produce(self, prompts: list[Prompt]) -> None:
        """Generate, store, record and send the groups of `prompts`. Work that fails on the way is
        generated again and counted (`stats["regenerated"]`, by cause), never silently dropped: an engine
        call that does not answer (`EngineError`: it crashed, or outlived `request_timeout_s`) redoes all
        its groups; a group whose put still fails after the store retries redoes that group. Each group
        keeps its admission slot meanwhile (it was never recorded as produced, so the ledger has nothing
        to correct); after `max_regenerations` further attempts the error ends the run, naming it."""
        pending = self._generating = list(prompts)  # shrinks as groups are recorded
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(self.spec.max_regenerations + 1),
            wait=wait_exponential(multiplier=0.1, max=2.0),
            retry=retry_if_exception_type((EngineError, StoreError)),
            before_sleep=lambda state: self._regenerating(len(pending), state.outcome.exception()),
            reraise=True,
        ):
            with attempt:
                await self._produce_once(pending)
        self._generating = []

    def _regenerating(self, groups: int, error: BaseException | None) -> None:
        cause = type(error).__name__
        counts = self.spec.stats.setdefault("regenerated", {})
        counts[cause] = counts.get(cause, 0) + groups
        self.ctx.event("groups.regenerated", count=groups, engine=self.engine.name, cause=cause, error=str(error))
        plan = plan_of(self.ctx)
        if plan is not None:  # the fault runner counts these (they never reached the ledger)
            plan.record("regenerated", cause, self.name, groups=groups)

    async def _produce_once(self, pending: list[Prompt]) -> None:
        """One attempt at `pending`: what gets stored (or dropped for a failed reward) is recorded, sent
        and removed from `pending`; raises when anything is left (EngineError: nothing came back;
        GroupsNotStored: some puts failed)."""
        spec, tok = self.spec, self.spec.tokenizer
        prompt_ids = [prompt_token_ids(tok, p.text, p.messages) for p in pending]
        t0 = anyio.current_time()
        try:
            with anyio.fail_after(spec.request_timeout_s):  # None: no limit
                completions = await self.engine.generate(
                    [ids for ids in prompt_ids for _ in range(spec.group_size)], spec.sampling()
                )
        except TimeoutError:
            raise EngineTimeout(
                f"engine {self.engine.name} did not answer {len(pending)} groups within "
                f"rollout.request_timeout_s = {spec.request_timeout_s} s"
            ) from None
        gen_s = anyio.current_time() - t0
        spec.stats["gen_s"] += gen_s
        t_put = anyio.current_time()
        refs, records, dropped, unstored, failure = [], [], [], [], None
        for g, prompt in enumerate(pending):
            group = completions[g * spec.group_size : (g + 1) * spec.group_size]
            scores = await self._score(prompt, group)
            if spec.reward.on_error == "drop" and any(scores.failures):
                records.append(self._dropped_group(prompt, group, scores))
                dropped.append(records[-1])
                continue
            try:
                ref, values = await self._store_group(prompt, prompt_ids[g], group, scores)
            except StoreError as exc:  # retried already (with_retries): this group is generated again
                unstored.append(prompt)
                failure = exc
                continue
            refs.append(ref)
            records.append(Produced(ref.item_ids, ref.group, (ref.version, ref.version_max), _ENCODE(prompt), values))
        put_s = anyio.current_time() - t_put
        if not records:
            raise GroupsNotStored(f"no group of this batch could be stored: {failure}") from failure
        # one ledger call and one channel call per engine batch: each may cross a process boundary
        self._recording = [(r.group, r.source) for r in records]
        pending[:] = unstored
        await self.ctx.ledger.produced(records)
        self._recording, self._sending = [], refs
        await self._drop(dropped)
        self.ctx.note(self.name, f"sending {len(refs)} refs downstream")
        await self.outbox.send_many(refs)
        self._log_generation(len(refs), gen_s, put_s, anyio.current_time() - t_put - put_s, completions, refs)
        self._sending = []
        if unstored:
            raise GroupsNotStored(f"{len(unstored)} groups could not be stored: {failure}") from failure

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
        tok = self.spec.tokenizer
        scores = await self.spec.reward.score([
            Sample(prompt=prompt.text, completion=tok.decode(c.tokens, skip_special_tokens=True),
                   tokens=c.tokens.tolist(), answer=prompt.answer, metadata=prompt.metadata or {},
                   messages=prompt.messages, source=prompt)
            for c in group
        ])
        counts = self.spec.stats.setdefault(failures, {}) if any(scores.failures) else {}
        for reason in filter(None, scores.failures):
            counts[reason] = counts.get(reason, 0) + 1
        if any(scores.failures):  # a warning now, counts in the metrics and the summary (pipeline.events)
            failed = [f for f in scores.failures if f]
            self.ctx.event(failures.replace("_", "."), count=len(failed), engine=self.engine.name, reason=failed[0])
        return scores

    def _dropped_group(self, prompt: Prompt, group: list[Completion], scores: Scores) -> Produced:
        """The ledger record of a group dropped because its reward failed (nothing is stored)."""
        group_id = self._new_group_id()
        lo, hi = self._version_span(group)
        ids = [f"{group_id}/{i}" for i in range(len(group))]
        reason = next(f for f in scores.failures if f)
        self.log.warning("reward failed; group dropped", group=group_id, reason=reason)
        return Produced(ids, group_id, (lo, hi), _ENCODE(prompt), {"reward_failed": [float(f is not None) for f in
                                                                                  scores.failures]})

    async def _drop(self, dropped: list[Produced]) -> None:
        """Settle groups dropped for a failed reward: their ledger fate (with the reason) and slots."""
        for record in dropped:
            await self.ctx.ledger.finished("dropped", record.ids, "reward failed")
        if dropped:
            await self.ctx.gate.discard(len(dropped))

    def _new_group_id(self) -> str:
        # unique across workers, processes and restarts: engine name, this incarnation, a counter
        group_id = f"{self.engine.name}.{self.incarnation}.{self.groups_made:08d}"
        self.groups_made += 1
        return group_id

    def _version_span(self, group: list[Completion]) -> tuple[int, int]:
        """(oldest, newest) weight version of the group's tokens (the engine's version if it has none)."""
        if not any(len(c.tokens) for c in group):
            return self.engine.version, self.engine.version
        versions = np.concatenate([c.versions for c in group])
        return int(versions.min()), int(versions.max())

    def _log_generation(self, groups: int, gen_s: float, put_s: float, send_s: float, completions: list[Completion],
                        refs: list[Ref]) -> None:
        """One line per engine call in the run folder's generation.jsonl (`baton simulate --calibrate` reads
        it): seconds waiting at the gate, taking prompts, generating, storing, recording and sending; groups,
        response tokens and their lengths, bytes stored."""
        folder = getattr(self.ctx, "folder", None)
        if folder is None or not hasattr(folder, "append_record"):
            return
        timing = {k: round(v, 5) for k, v in getattr(self, "_call_timing", {}).items()}
        folder.append_record(GENERATION_FILE, {
            "engine": self.engine.name, "t": round(time.time() - self.ctx.started_at, 4), "groups": groups,
            "group_size": self.spec.group_size, **timing, "gen_s": round(gen_s, 5), "put_s": round(put_s, 5),
            "send_s": round(send_s, 5),
            "tokens": int(sum(len(c.tokens) for c in completions)),
            "lengths": [len(c.tokens) for c in completions],
            "nbytes": int(sum(r.nbytes for r in refs)),
        })

    async def _store_group(
        self, prompt: Prompt, prompt_ids: list[int], group: list[Completion], scores: Scores
    ) -> tuple[Ref, dict[str, list[float]]]:
        """Encode and store one scored group; returns its Ref (not yet recorded or sent) and, per sample,
        the values the ledger keeps for bias accounting: `reward`, `length` (response tokens) and, when a
        reward failed (scored 0), `reward_failed` (1 for those samples)."""
        spec, ctx = self.spec, self.ctx
        rewards = np.array(scores.rewards, dtype=np.float32)
        plen = len(prompt_ids)
        rows = []
        for c in group:
            n = len(c.tokens)
            rows.append(
                {
                    "tokens": np.concatenate([np.asarray(prompt_ids, dtype=np.int32), c.tokens]),
                    "logprobs": np.concatenate([np.zeros(plen, np.float32), c.logprobs]),
                    "loss_mask": np.concatenate([np.zeros(plen, np.uint8), np.ones(n, np.uint8)]),
                    "token_versions": np.concatenate([np.full(plen, -1, np.int32), c.versions]),
                }
            )
        lo, hi = self._version_span(group)
        group_id = self._new_group_id()
        spec.stats["groups"] += 1
        spec.stats["tokens"] += sum(len(c.tokens) for c in group)
        batch = RolloutBatch.from_rows(
            rows,
            row_fields={
                "rewards": rewards,
                "prompt_lens": np.full(len(group), plen, np.int32),
                "versions": np.array([[lo, hi]] * len(group), dtype=np.int32),
            },
            meta={"run": ctx.run, "group": group_id, "prompt": prompt.text, "answer": prompt.answer},
        )
        payload = encode(batch, pool=getattr(self.store, "pool", None))  # straight into the store's memory
        key = make_key(ctx.run, lo, group_id, f"0-{len(group) - 1}")
        await with_retries(lambda: self.store.put(key, payload))

        ref = Ref(
            store=self.store.name, key=key, version=lo, version_max=hi, rows=len(group),
            nbytes=payload.nbytes, checksum=peek(payload).checksum, group=group_id,
        )
        values = {"reward": rewards.tolist(), "length": [float(len(c.tokens)) for c in group]}
        if any(scores.failures):
            values["reward_failed"] = [float(f is not None) for f in scores.failures]
        return ref, values
