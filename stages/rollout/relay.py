"""`Relay`: where the requests of a preempted engine continue (an elastic run's leave with `preempt`).

A rollout stage keeps one relay for the engines of its process. A worker's engine is on it while the worker
takes work (`add` once it passed its fence, `remove` when it leaves). When an engine is preempted
(`stages.engines.base.Preemptible`), every request it had in flight comes back with the tokens it generated
(`finish_reason` "preempted"), and `carry` continues each one on the least loaded other engine of the relay:
the prompt and those tokens go back as input, the token budget is what is left, and the completion is
stitched, so each token keeps the logprob and the weight version that produced it (the staleness policy
judges the sample by its oldest token, as for any other). Invariants:
- a token is either carried over (kept in the sample) or lost (counted): when the staleness policy says
  the carried tokens may not continue under the successor's weights (`interrupt` -> "restart"), they are
  dropped and the request starts again on the successor from its prompt, counted as lost;
- no engine left to continue on, or a successor that fails the request, is an EngineError (the episode is
  generated again from its sample, counted) and the preempted engine's tokens are lost;
- where a runtime places each engine in a process of its own (Ray), `elsewhere` gives the other processes'
  engines (stages.rollout.relay_remote), asked only when none of this process's engines takes work;
- the counts, per preempted engine: `requests` carried, `tokens_carried`, `tokens_lost`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from stages.engines.base import Completion, Engine, EngineError, SamplingParams, preempted_before_start

__all__ = ["Relay", "preempted_before_start", "stitched"]


class Relay:
    """The engines taking work in this process, and the carry-over of a preempted engine's requests."""

    def __init__(self) -> None:
        self.engines: dict[str, Engine] = {}
        self.counts: dict[str, Counter[str]] = {}  # preempted engine -> requests, tokens_carried, tokens_lost
        # other processes' engines, where none of this one's takes work (the Ray runtime: stages.rollout.relay_remote)
        self.elsewhere: Callable[[Engine], Any] | None = None

    def add(self, engine: Engine) -> None:
        self.engines[engine.name] = engine

    def remove(self, engine: Engine) -> None:
        """`engine` takes no more work (it leaves, or is preempted): nothing is carried onto it."""
        self.engines.pop(engine.name, None)

    def successor(self, preempted: Engine) -> Engine | None:
        """The least loaded engine taking work, other than `preempted`; else the other processes' engines
        (`elsewhere`, where the runtime has them); None: there is none."""
        others = [e for name, e in self.engines.items() if name != preempted.name]
        if not others and self.elsewhere is not None:
            return self.elsewhere(preempted)
        return min(others, key=lambda e: e.load, default=None)

    async def carry(self, engine: Engine, prompt: list[int], partial: Completion, params: SamplingParams,
                    policy: Any = None) -> Completion:
        """`partial` (a request `engine` gave back preempted) finished on other engines (see the module
        docstring); a completion that was not preempted comes back as it is."""
        done, earlier = partial, 0  # `earlier`: tokens of `done` that engines before `engine` generated
        while done.finish_reason == "preempted":
            counts = self.counts.setdefault(engine.name, Counter())
            fresh = len(done.tokens) - earlier  # what `engine` generated
            successor = self.successor(engine)
            if successor is None:
                counts["tokens_lost"] += fresh
                raise EngineError(f"engine {engine.name} was preempted and no other engine takes work: its "
                                  "request is generated again from its sample")
            kept, dropped = done, 0
            if len(kept.tokens) and policy is not None and \
                    policy.interrupt(int(kept.versions.min()), successor.version) == "restart":
                kept, dropped = preempted_before_start(), len(kept.tokens)  # it starts again from its prompt
            rest = replace(params, max_new_tokens=params.max_new_tokens - len(kept.tokens))
            try:
                (more,) = await successor.generate([[*prompt, *kept.tokens.tolist()]], rest)
            except EngineError:  # the successor failed it: regenerated from its sample, its tokens lost
                counts["tokens_lost"] += fresh
                raise
            counts["requests"] += 1
            counts["tokens_lost" if dropped else "tokens_carried"] += dropped or fresh
            done, engine, earlier = stitched(kept, more), successor, len(kept.tokens)
        return done


def stitched(first: Completion, then: Completion) -> Completion:
    """`first`'s tokens followed by `then`'s, each with its own logprob, version and experts; `then`'s finish.
    `meta["carried_tokens"]`: the tokens that came from earlier engines."""
    if not len(first.tokens):
        return replace(then, meta={**then.meta, "carried_tokens": 0})
    experts = None
    if first.routed_experts is not None and then.routed_experts is not None:
        experts = np.concatenate([first.routed_experts, then.routed_experts])
    return Completion(np.concatenate([first.tokens, then.tokens]), np.concatenate([first.logprobs, then.logprobs]),
                      np.concatenate([first.versions, then.versions]), then.finish_reason,
                      {**then.meta, "carried_tokens": len(first.tokens)}, experts)

