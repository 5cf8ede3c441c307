"""`RolloutStats`: what one rollout stage's workers counted in this process, in one object the stage owns
(`Rollout.stats`), handed to the parts that count: the prompt stream, the group maker, the workers and the
evaluator. Read as a mapping it is the dict these counts always were: `groups`, `tokens` and `regenerated`
always; `redone`, each other name of `BY_REASON` (counts by reason) and `eval` (the latest evaluation's
record) once there is one. Run events, not these counts, carry failures to the metrics (pipeline.events)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

BY_REASON = ("regenerated", "episodes_restarted", "episodes_failed", "reward_failed", "eval_reward_failed",
             "teacher_failed")


@dataclass(eq=False)
class RolloutStats(Mapping[str, Any]):
    groups: int = 0  # groups stored
    tokens: int = 0  # model tokens generated, stored or not
    redone: int = 0  # groups made again on request (their payload was lost, or the policy requeued them)
    eval: dict[str, Any] | None = None
    by_reason: dict[str, Counter[str]] = field(default_factory=lambda: {name: Counter() for name in BY_REASON})

    def count(self, name: str, reason: str) -> None:
        """One more `reason` under `name` (one of `BY_REASON`)."""
        self.by_reason[name][reason] += 1

    def as_dict(self) -> dict[str, Any]:
        counted = {name: dict(counts) for name, counts in self.by_reason.items() if counts or name == "regenerated"}
        once = {k: v for k, v in (("redone", self.redone), ("eval", self.eval)) if v}
        return {"groups": self.groups, "tokens": self.tokens, **counted, **once}

    def __getitem__(self, name: str) -> Any:
        return self.as_dict()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())
