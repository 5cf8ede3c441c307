"""`RolloutStats`: what the workers of one rollout stage counted in this process, in one object the stage owns.

The stage (`Rollout.stats`) hands it to the parts that count: the prompt stream (`redone`), the group maker
(`groups`, `tokens`, failed rewards and teachers), the workers (regenerated groups, failed and restarted
episodes) and the evaluator (`eval`). Counts by reason go through `count(name, reason)`, `name` one of
`BY_REASON`. Read as a mapping, it is the dict these counts always were: `groups`, `tokens` and
`regenerated` always, the others once counted (`redone`, each name of `BY_REASON`, `eval`: the latest
evaluation's record). Run events, not these counts, carry failures to the metrics (pipeline.events).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

BY_REASON = ("regenerated", "episodes_restarted", "episodes_failed", "reward_failed", "eval_reward_failed",
             "teacher_failed")


@dataclass(eq=False)
class RolloutStats(Mapping[str, Any]):
    """The stage's counters (see the module docstring); compares equal to its dict."""

    groups: int = 0  # groups stored
    tokens: int = 0  # model tokens generated, stored groups or not
    redone: int = 0  # groups redone on request (their payload was lost, or the policy requeued them)
    eval: dict[str, Any] | None = None  # the latest evaluation's eval.jsonl record
    by_reason: dict[str, Counter[str]] = field(default_factory=lambda: {name: Counter() for name in BY_REASON})

    def count(self, name: str, reason: str) -> None:
        """One more `reason` under `name` (one of `BY_REASON`)."""
        self.by_reason[name][reason] += 1

    def as_dict(self) -> dict[str, Any]:
        counted = {name: dict(counts) for name, counts in self.by_reason.items() if counts or name == "regenerated"}
        extra = {"redone": self.redone} if self.redone else {}
        return {"groups": self.groups, "tokens": self.tokens, **counted, **extra,
                **({"eval": self.eval} if self.eval is not None else {})}

    def __getitem__(self, name: str) -> Any:
        return self.as_dict()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())
