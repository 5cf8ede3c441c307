"""`GroupMaker`: a group whose episodes are over -> scored, encoded, stored -> a `Finished` for the outbox.

Invariants:
- a group is stored under a versioned key (`run/v{oldest}/{group}/{rows}`) before anything records
  it; the Ref it yields carries the stored payload's size and checksum;
- failed episodes (the environment raised or timed out) are recorded as dropped with their reason;
  a group with nothing left to train (every episode failed, or a failed reward with `on_error =
  "drop"`) is recorded and dropped whole, and nothing is stored for it;
- a reward function that raises never raises here: the sample is counted (`stats["reward_failed"]`
  by reason, and a run event) and scored as the reward's `on_error` says; a teacher that fails likewise
  (`stats["teacher_failed"]`, the distillation's `on_error`);
- the reward and the teacher score a group at once, after its episodes gave their engine room back:
  scoring never holds an engine slot; with model scorers each row carries `scoring_s`, the group's
  scoring seconds;
- group ids are unique across workers, processes and restarts (engine name, incarnation, counter);
- `give_up_after` episodes failed one after another with none kept in between (a prompt beyond the engine's
  context, an agent or environment that always raises) end the run with `EpisodesFailing` naming their last
  reason, instead of a run that drops every group and never trains (0: never).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from buffers.codec import encode_parts
from buffers.retry import with_retries
from buffers.store import ObjectStore
from pipeline.context import RunContext
from pipeline.refs import Produced, Ref, make_key
from stages.data.model import decode_many
from stages.data.rewards import RewardFunction, Sample, Scores
from stages.data.tasks import Prompt
from stages.engines.base import Completion, Engine
from stages.rollout.episode import Episode, EpisodeFailed
from stages.rollout.outbox import Finished, encode_group, version_span
from stages.rollout.prompts import encode_prompt
from stages.rollout.stats import RolloutStats
from stages.scorers import ComposedReward, Distillation, Lifecycle
from stages.scorers.teacher import TEACHER_FIELD


class EpisodesFailing(RuntimeError):
    """Every episode of a worker failed, `give_up_after` in a row: the run cannot train."""


@dataclass(frozen=True)
class Scoring:
    """How a worker's groups are scored: the reward (and the tokenizer decoding completions for it), the
    teacher with distillation; `by_reward` False when an environment's episodes bring their own rewards."""

    reward: RewardFunction | ComposedReward
    tokenizer: Any  # a Hugging Face tokenizer
    teacher: Distillation | None = None
    by_reward: bool = True

    @property
    def scorers(self) -> list[Lifecycle]:
        """The model scorers the workers start and stop with their engines (none for rule rewards)."""
        return [part for part in (self.reward, self.teacher) if isinstance(part, Lifecycle)]


class GroupMaker:
    """Scores and stores one worker's finished groups (see the module docstring), counting into `stats`."""

    def __init__(self, scoring: Scoring, stats: RolloutStats, engine: Engine, store: ObjectStore,
                 ctx: RunContext, give_up_after: int = 512) -> None:
        self.scoring, self.stats, self.engine, self.store, self.ctx = scoring, stats, engine, store, ctx
        self.incarnation = uuid.uuid4().hex[:8]
        self.made = 0
        self.give_up_after = give_up_after
        self.failed_in_a_row = 0  # episodes failed since the last one kept
        self.last_failure = ""
        self.log = ctx.log(f"rollout:{engine.name}")

    async def finish(self, prompt: Prompt, results: list[Episode | EpisodeFailed], rewarded: bool = False) -> Finished:
        """Score and store a group whose episodes are over (`rewarded`: the episodes carry their rewards)."""
        episodes = [r for r in results if isinstance(r, Episode)]
        failed = [r for r in results if isinstance(r, EpisodeFailed)]
        group_id, source = self.new_group_id(), encode_prompt(prompt)
        span = version_span(episodes, self.engine.version)
        self.stats.tokens += sum(e.tokens.model_tokens for e in episodes)
        self._count_failures(failed, kept=len(episodes))
        if not episodes:
            return self.dropped(group_id, span, source, len(results), f"episode failed: {failed[0].reason}")
        t_score = anyio.current_time()
        scored = await self._scored(prompt, episodes, rewarded)
        scored.seconds = anyio.current_time() - t_score
        reason = scored.drop_reason(self.scoring.reward.on_error, self.scoring.teacher)
        if reason is not None:
            self.log.warning("group dropped", group=group_id, reason=reason)
            return self.dropped(group_id, span, source, len(results), reason,
                                {"reward_failed": [float(f is not None) for f in scored.scores.failures]})
        t_put = anyio.current_time()
        ref, values = await self._store(group_id, prompt, episodes, scored, span)
        finished = Finished([Produced(ref.item_ids, group_id, span, source, values)], ref, source=source,
                            lengths=[e.tokens.model_tokens for e in episodes], put_s=anyio.current_time() - t_put,
                            scoring_s=scored.seconds)
        if failed:
            ids = [f"{group_id}/failed-{i}" for i in range(len(failed))]
            finished.records.append(Produced(ids, f"{group_id}.failed", span, source, {}))
            finished.dropped.append((ids, f"episode failed: {failed[0].reason}"))
        return finished

    def _count_failures(self, failed: list[EpisodeFailed], kept: int) -> None:
        self.failed_in_a_row = len(failed) if kept else self.failed_in_a_row + len(failed)
        if failed:
            self.last_failure = failed[-1].reason

    @property
    def failing(self) -> bool:
        """`give_up_after` episodes failed with none kept in between: the run cannot train."""
        return 0 < self.give_up_after <= self.failed_in_a_row

    def raise_if_failing(self) -> None:
        """EpisodesFailing when `failing` (called once the group that made it so is in the outbox)."""
        if self.failing:
            raise EpisodesFailing(
                f"engine {self.engine.name}: {self.failed_in_a_row} episodes in a row failed and none was kept, so "
                f"the run cannot train; the last one: {self.last_failure}. Fix that cause (the run's events and "
                "summary count every reason), or raise rollout.max_failed_in_a_row (0: never stop for this)")

    async def _scored(self, prompt: Prompt, episodes: list[Episode], rewarded: bool) -> Scored:
        """The group's rewards and, with distillation, its teacher logprobs: scored at once, on no engine."""
        scored = Scored(Scores([e.reward for e in episodes], [None] * len(episodes)))

        async def rewards() -> None:
            scored.scores = await self.score(prompt, [e.last for e in episodes if e.last is not None])

        async def teacher() -> None:
            scored.teacher, scored.teacher_failure = await self.teach(prompt, episodes)

        async with anyio.create_task_group() as tg:
            if self.scoring.by_reward and not rewarded:
                tg.start_soon(rewards)
            if self.scoring.teacher is not None:
                tg.start_soon(teacher)
        return scored

    async def teach(self, prompt: Prompt, episodes: list[Episode]) -> tuple[list[np.ndarray], str | None]:
        """Every episode's `teacher_logprobs` (stages.scorers.teacher); a failure is counted in
        `stats["teacher_failed"]` by reason, and a run event."""
        assert self.scoring.teacher is not None
        values, failure = await self.scoring.teacher.score(prompt.metadata, [e.tokens.row() for e in episodes])
        if failure is not None:
            self.stats.count("teacher_failed", failure)
            self.ctx.event("teacher.failed", count=len(episodes), engine=self.engine.name, reason=failure)
        return values, failure

    def dropped(self, group_id: str, span: tuple[int, int], source: bytes, n: int, reason: str,
                values: dict | None = None) -> Finished:
        """A whole group recorded and dropped with `reason` (nothing stored; its slot is freed)."""
        ids = [f"{group_id}/{i}" for i in range(n)]
        return Finished([Produced(ids, group_id, span, source, values or {})], None, [(ids, reason)], source)

    async def score(self, prompt: Prompt, group: list[Completion], failures: str = "reward_failed") -> Scores:
        """The group's rewards (never raises); failed samples are counted in `stats[failures]` by reason."""
        tokens = [c.tokens.tolist() for c in group]
        scores = await self.scoring.reward.score([
            Sample(prompt=prompt.text, completion=text, tokens=ids, answer=prompt.answer,
                   metadata=prompt.metadata or {}, messages=prompt.messages, source=prompt)
            for text, ids in zip(decode_many(self.scoring.tokenizer, tokens), tokens, strict=True)
        ])
        failed = [f for f in scores.failures if f]
        for reason in failed:
            self.stats.count(failures, reason)
        if failed:  # a warning now, counts in the metrics and the summary (pipeline.events)
            self.ctx.event(failures.replace("_", "."), count=len(failed), engine=self.engine.name, reason=failed[0])
        return scores

    def new_group_id(self) -> str:
        group_id = f"{self.engine.name}.{self.incarnation}.{self.made:08d}"
        self.made += 1
        return group_id

    async def _store(self, group_id: str, prompt: Prompt, episodes: list[Episode], scored: Scored,
                     span: tuple[int, int]) -> tuple[Ref, dict[str, list[float]]]:
        """Encode and store one scored group; returns its Ref (not yet recorded or sent) and, per sample,
        the values the ledger keeps for bias accounting: `reward`, `length` (model tokens), when a
        reward failed (scored 0) `reward_failed` (1 for those samples), and when some of its tokens came from
        a preempted engine `carried` (how many: stages.rollout.relay)."""
        ctx, (lo, hi), scores = self.ctx, span, scored.scores
        token_fields = {TEACHER_FIELD: scored.teacher} if scored.teacher is not None else {}
        row_fields = {"scoring_s": np.full(len(episodes), scored.seconds, np.float32)} if self.scoring.scorers else {}
        batch = encode_group(episodes, scores.rewards, span,
                             {"run": ctx.run, "group": group_id, "prompt": prompt.text, "answer": prompt.answer},
                             token_fields, row_fields)
        payload, header = encode_parts(batch, pool=self.store.pool)  # the arrays where they lie, no copy
        key = make_key(ctx.run, lo, group_id, f"0-{len(episodes) - 1}")
        await with_retries(lambda: self.store.put(key, payload))
        self.stats.groups += 1
        ref = Ref(
            store=self.store.name, key=key, version=lo, version_max=hi, rows=len(episodes),
            nbytes=payload.nbytes, checksum=header.checksum, group=group_id,
        )
        values = {"reward": [float(r) for r in scores.rewards],
                  "length": [float(e.tokens.model_tokens) for e in episodes]}
        if any(scores.failures):
            values["reward_failed"] = [float(f is not None) for f in scores.failures]
        if any(e.carried for e in episodes):  # tokens a preempted engine made that another continued from
            values["carried"] = [float(e.carried) for e in episodes]
        return ref, values


@dataclass
class Scored:
    """What scoring one group gave: its rewards, its teacher logprobs (with distillation) and how long it took."""

    scores: Scores
    teacher: list[np.ndarray] | None = None
    teacher_failure: str | None = None
    seconds: float = 0.0

    def drop_reason(self, reward_on_error: str, distillation: Distillation | None) -> str | None:
        """Why the group is dropped (None: it is stored): a failed reward or teacher whose `on_error` is "drop"."""
        if reward_on_error == "drop" and any(self.scores.failures):
            return "reward failed"
        if self.teacher_failure is not None and distillation is not None and distillation.on_error == "drop":
            return "teacher failed"
        return None
