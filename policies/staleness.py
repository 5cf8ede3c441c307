"""Staleness: which versions may be generated, trained on, or must be interrupted.

The contract, for one run with learner version v (optimizer steps taken), B groups per learner
step and bound k:

* **Staleness** of an item trained at version v is `v - oldest`, where `oldest` is the oldest
  weight version that produced any of its tokens. It counts from generation, so time an item
  spends queued in channels or in the buffer counts too.
* **Admit** (producer side), per `admission`:
  - `pace` (default, AReaL's rule): a producer may start another group only while
    `started - discarded < (v + lead + 1) * B`, `lead` = k unless set lower. Groups that were dropped
    or requeued free their slot. With FIFO consumption and one producer this alone keeps every group
    within `lead` versions when it reaches the learner, so producers wait instead of making work that
    would be dropped ("pace, don't discard"). A `lead` below k leaves each group k - lead versions in
    which it may be trained again (replay): producers that outpace the learner otherwise deliver every
    group exactly k old, and nothing is ever reused.
    Groups that finish out of admission order (several producers, episodes of uneven length) overtake
    one another: with `lead` >= 1 the learner can take a whole version's groups past a long one, which
    then arrives older than k and is dropped or requeued (counted). Only `lead` = 0 (no producer works
    ahead of the learner, so its step waits for every group admitted at its version) rules that out for
    any arrival order, at the cost of the overlap.
  - `eager` (Miles's and verl's behaviour): a producer starts work whenever the bounded channels
    take it; staleness is enforced only by the accept check, so work that aged past k while queued
    is generated, then dropped or requeued (and counted, with its lengths and rewards, as such).
* **Accept** (consumer side): the hard guarantee. An item with staleness > k never reaches a
  gradient step: it is dropped, or requeued for regeneration, per `on_stale`.
* **Interrupt** (engine side, when version `w` reaches an engine with a request in flight whose
  oldest token came from version `o`): `continue` it on the new weights (its tokens record each
  version) while it can still be trained, i.e. `w - o <= k`, and while it would span at most
  `max_span` versions; otherwise `restart` it from its prompt on the new weights, because finishing
  it would only produce a sample the accept check must refuse (or one mixing too many versions).
* **Sync** is k = 0 through exactly this code: groups for step v are generated only after the
  weights of version v were published, and trained at version v.
* **Correct** (learner side, `policies.correction`): an accepted item is still up to k versions
  off-policy; its tokens' behaviour logprobs (recorded per token, with their versions) enter the
  loss as `none` (PPO-clip against them), `tis` or `decoupled` (clip against the learner's own
  logprobs at the step's start, weight each token by pi_prox / pi_behav).

Every function here is pure: it reads versions and counts and returns a decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OnStale = Literal["drop", "requeue"]
Admission = Literal["pace", "eager"]
Verdict = Literal["train", "drop", "requeue"]
Interrupt = Literal["continue", "restart"]


def staleness(learner_version: int, oldest_version: int) -> int:
    """Versions between the weights that generated an item and the weights it is trained at."""
    return learner_version - oldest_version


@dataclass(frozen=True)
class MaxStaleness:
    """No item older than `k` versions is ever trained on. With replays (a selection whose max_reuse is
    r > 1), pass `lead=reuse_lead(k, r)`, as the config does for you: a group then arrives with room for its
    later uses."""

    k: int = 2
    on_stale: OnStale = "drop"
    max_span: int | None = None  # most weight versions one sample's tokens may come from; None: no limit
    admission: Admission = "pace"  # pace: producers wait for a slot; eager: only channel backpressure limits them
    lead: int | None = None  # pace: most versions producers start work ahead of the learner; None: k

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"staleness.k must be >= 0, got {self.k}")
        if self.max_span is not None and self.max_span < 1:
            raise ValueError(f"staleness.max_span must be >= 1 (or unset), got {self.max_span}")
        if self.on_stale not in ("drop", "requeue"):
            raise ValueError(f"staleness.on_stale must be 'drop' or 'requeue', got {self.on_stale!r}")
        if self.admission not in ("pace", "eager"):
            raise ValueError(f"staleness.admission must be 'pace' or 'eager', got {self.admission!r}")
        if self.lead is not None and not 0 <= self.lead <= self.k:
            raise ValueError(f"staleness.lead must be in 0..staleness.k = {self.k} (or unset: k), got {self.lead}")

    @property
    def bound(self) -> int:
        return self.k

    def admission_limit(self, version: int, groups_per_step: int) -> int:
        """How many live (started, not discarded) groups may exist at learner version `version`."""
        return (version + self.ahead + 1) * groups_per_step

    @property
    def ahead(self) -> int:
        """Versions producers may run ahead of the learner under `pace`: `lead`, or k when unset."""
        return self.k if self.lead is None else self.lead

    def admit(self, version: int, started: int, discarded: int, groups_per_step: int) -> bool:
        """May a producer start one more group now? (`eager`: always; backpressure is the channels' job.)"""
        if self.admission == "eager":
            return True
        return started - discarded < self.admission_limit(version, groups_per_step)

    def accept(self, learner_version: int, oldest_version: int) -> Verdict:
        """May the consumer train on an item whose oldest token version is `oldest_version`?"""
        if oldest_version > learner_version:
            raise ValueError(
                f"an item claims version {oldest_version}, newer than the learner's {learner_version}"
            )
        if staleness(learner_version, oldest_version) <= self.k:
            return "train"
        return self.on_stale

    def interrupt(self, oldest_version: int, new_version: int) -> Interrupt:
        """What an engine does with an in-flight request when `new_version` arrives."""
        if staleness(new_version, oldest_version) > self.k:
            return "restart"
        if self.max_span is not None and new_version - oldest_version + 1 > self.max_span:
            return "restart"
        return "continue"


def sync() -> MaxStaleness:
    """On-policy: k = 0 through the same code path."""
    return MaxStaleness(k=0)


def reuse_lead(k: int, max_reuse: int) -> int:
    """The lead that leaves a group room for all its uses within k: it arrives at most k - (max_reuse - 1)
    versions old, so its last use is at most k old (never below 0: max_reuse > k + 1 is refused anyway)."""
    return max(0, k - (max_reuse - 1))


def staleness_lr_factor(staleness: float, tuned_at: float, power: float = 2.0, floor: float = 0.0) -> float:
    """Multiplier of the learning rate for a step whose groups are, on average, `staleness` versions old:
    ((tuned_at + 1) / (staleness + 1)) ** power, at most 1 and at least `floor`. A step no staler than the
    rate was tuned at trains at it; a staler one takes a smaller step, since a gradient that arrives
    versions late keeps pushing where the engines' newer samples would already have said stop
    (asynchronous SGD scales its step by 1 / delay). The floor keeps a large bound learning at all: power 2
    alone gives k = 32 a 30th of the lr. `power` 0: always 1."""
    if staleness < 0 or tuned_at < 0 or power < 0 or not 0 <= floor <= 1:
        raise ValueError(f"staleness, tuned_at and power must be >= 0 and floor in [0, 1], got {staleness}, "
                         f"{tuned_at}, {power}, {floor}")
    return max(floor, min(1.0, ((tuned_at + 1) / (staleness + 1)) ** power))
