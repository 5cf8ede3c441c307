"""`GroupMaker`: a group whose episodes are over -> scored, encoded, stored -> a `Finished` for the outbox.

Invariants:
- a group is stored under a versioned key (`run/v{oldest}/{group}/{rows}`) before anything records
  it; the Ref it yields carries the stored payload's size and checksum;
- failed episodes (the environment raised or timed out) are recorded as dropped with their reason;
  a group with nothing left to train (every episode failed, or a failed reward with `on_error =
  "drop"`) is recorded and dropped whole, and nothing is stored for it;
- a reward function that raises never raises here: the sample is counted (`stats["reward_failed"]`
  by reason, and a run event) and scored as the reward's `on_error` says;
- group ids are unique across workers, processes and restarts (engine name, incarnation, counter).
"""

from __future__ import annotations

import uuid
from typing import Any

import anyio

from buffers.codec import encode, peek
from buffers.retry import with_retries
from buffers.store import ObjectStore
from pipeline.context import RunContext
from pipeline.refs import Produced, Ref, make_key
from stages.data.model import decode_many
from stages.data.rewards import Sample, Scores
from stages.data.tasks import Prompt
from stages.engines.base import Completion, Engine
from stages.rollout.episode import Episode, EpisodeFailed
from stages.rollout.outbox import Finished, encode_group, version_span
from stages.rollout.prompts import encode_prompt


def count(stats: dict, stat: str, key: str) -> None:
    """One more `key` in the rollout's `stats[stat]` (a dict of counts by reason)."""
    counts = stats.setdefault(stat, {})
    counts[key] = counts.get(key, 0) + 1


class GroupMaker:
    """Scores and stores one worker's finished groups (see the module docstring)."""

    def __init__(self, spec: Any, engine: Engine, store: ObjectStore, ctx: RunContext, environment: bool) -> None:
        self.spec, self.engine, self.store, self.ctx = spec, engine, store, ctx
        self.scored_by_reward = not environment  # single-turn groups are scored here; episodes bring their own
        self.incarnation = uuid.uuid4().hex[:8]
        self.made = 0
        self.log = ctx.log(f"rollout:{engine.name}")

    async def finish(self, prompt: Prompt, results: list[Episode | EpisodeFailed], rewarded: bool = False) -> Finished:
        """Score and store a group whose episodes are over (`rewarded`: the episodes carry their rewards)."""
        episodes = [r for r in results if isinstance(r, Episode)]
        failed = [r for r in results if isinstance(r, EpisodeFailed)]
        group_id, source = self.new_group_id(), encode_prompt(prompt)
        span = version_span(episodes, self.engine.version)
        self.spec.stats["tokens"] += sum(e.tokens.model_tokens for e in episodes)
        if self.scored_by_reward and episodes and not rewarded:
            scores = await self.score(prompt, [e.last for e in episodes if e.last is not None])
            if self.spec.reward.on_error == "drop" and any(scores.failures):
                reason = next(f for f in scores.failures if f)
                self.log.warning("reward failed; group dropped", group=group_id, reason=reason)
                return self.dropped(group_id, span, source, len(results), "reward failed",
                                    {"reward_failed": [float(f is not None) for f in scores.failures]})
        else:
            scores = Scores([e.reward for e in episodes], [None] * len(episodes))
        if not episodes:
            return self.dropped(group_id, span, source, len(results), f"episode failed: {failed[0].reason}")
        t_put = anyio.current_time()
        ref, values = await self._store(group_id, prompt, episodes, scores, span)
        finished = Finished([Produced(ref.item_ids, group_id, span, source, values)], ref, source=source,
                            lengths=[e.tokens.model_tokens for e in episodes], put_s=anyio.current_time() - t_put)
        if failed:
            ids = [f"{group_id}/failed-{i}" for i in range(len(failed))]
            finished.records.append(Produced(ids, f"{group_id}.failed", span, source, {}))
            finished.dropped.append((ids, f"episode failed: {failed[0].reason}"))
        return finished

    def dropped(self, group_id: str, span: tuple[int, int], source: bytes, n: int, reason: str,
                values: dict | None = None) -> Finished:
        """A whole group recorded and dropped with `reason` (nothing stored; its slot is freed)."""
        ids = [f"{group_id}/{i}" for i in range(n)]
        return Finished([Produced(ids, group_id, span, source, values or {})], None, [(ids, reason)], source)

    async def score(self, prompt: Prompt, group: list[Completion], failures: str = "reward_failed") -> Scores:
        """The group's rewards (never raises); failed samples are counted in `stats[failures]` by reason."""
        tokens = [c.tokens.tolist() for c in group]
        scores = await self.spec.reward.score([
            Sample(prompt=prompt.text, completion=text, tokens=ids, answer=prompt.answer,
                   metadata=prompt.metadata or {}, messages=prompt.messages, source=prompt)
            for text, ids in zip(decode_many(self.spec.tokenizer, tokens), tokens, strict=True)
        ])
        failed = [f for f in scores.failures if f]
        for reason in failed:
            count(self.spec.stats, failures, reason)
        if failed:  # a warning now, counts in the metrics and the summary (pipeline.events)
            self.ctx.event(failures.replace("_", "."), count=len(failed), engine=self.engine.name, reason=failed[0])
        return scores

    def new_group_id(self) -> str:
        group_id = f"{self.engine.name}.{self.incarnation}.{self.made:08d}"
        self.made += 1
        return group_id

    async def _store(self, group_id: str, prompt: Prompt, episodes: list[Episode], scores: Scores,
                     span: tuple[int, int]) -> tuple[Ref, dict[str, list[float]]]:
        """Encode and store one scored group; returns its Ref (not yet recorded or sent) and, per sample,
        the values the ledger keeps for bias accounting: `reward`, `length` (model tokens) and, when a
        reward failed (scored 0), `reward_failed` (1 for those samples)."""
        ctx, (lo, hi) = self.ctx, span
        batch = encode_group(episodes, scores.rewards, span,
                             {"run": ctx.run, "group": group_id, "prompt": prompt.text, "answer": prompt.answer})
        payload = encode(batch, pool=self.store.pool)  # straight into the store's memory where it has a pool
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
