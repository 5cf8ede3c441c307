"""Selection: which groups a learner step trains on, how often a group may be reused, and which
groups carry no learning signal. The shape is NeMo-RL's `PromptGroupSampler`: admit / select / evict.

The learner keeps a *replay window* of loaded groups (`ReplayWindow`); each step it asks, in order:

* **admit** (a group arrives): may it enter the window at all? With `drop_zero_signal`, a group
  whose rewards are all equal is refused: GRPO's group-normalised advantage is 0 for every row, so it
  would cost a learner step and give no gradient (DAPO's dynamic sampling). The learner records it as
  `filtered` in the ledger and frees its admission slot, so producers make a replacement.
* **evict** (each step, for every group in the window): must it leave? A group leaves once it was
  trained `max_reuse` times, and, by the staleness policy (policies.staleness, the same `accept` the
  rest of the pipeline uses), once it is older than k at the step's version. A group evicted before
  its first use is refused (dropped or requeued, per `on_stale`); one evicted after it was trained
  just has its payload freed (its ledger fate stays `trained`).
* **select** (the step): which `n` of the groups left in the window to train on now:
  `fifo` (in the order they entered the window; a reused group re-enters at the back after each use),
  `freshest` (newest version first, then fewest uses), or `uniform` (uniformly at random, seeded).

What every selection promises:
* `select` returns `min(n, len(candidates))` distinct indices into `candidates`: no group is trained
  twice in one step;
* a group is trained at most `max_reuse` times, and only at versions the staleness policy accepts;
  so `max_reuse` above k + 1 can never be reached (`policies.bounds` rejects such a config);
* `admit` depends only on the group's rewards; every other decision only on versions, use counts and
  arrival order.

Everything here is pure: versions and counts in, decisions out (the uniform policy's only state is its
seeded random stream). The learner applies the decisions (ledger, store, admission gate).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar, get_args

SelectionKind = Literal["fifo", "freshest", "uniform"]
KINDS: tuple[str, ...] = get_args(SelectionKind)

T = TypeVar("T")


class NoSignalError(RuntimeError):
    """One learner step refused more groups without signal than its budget allows: the run would
    otherwise wait forever for groups whose rewards differ (the policy collapsed, or the task is
    solved or hopeless for it)."""


@dataclass(frozen=True)
class Candidate:
    """What a selection policy sees of a group in the window.

    version: oldest weight version that produced any of its tokens (as on its Ref)
    uses:    times it was trained on already
    arrival: order in which it (re-)entered the window; larger is later
    """

    version: int
    uses: int
    arrival: int


class Acceptor(Protocol):
    """The staleness policy's consumer-side check (policies.staleness.MaxStaleness.accept)."""

    def accept(self, learner_version: int, oldest_version: int) -> str: ...


class SelectionPolicy(Protocol):
    """What the learner needs of a selection policy."""

    max_reuse: int

    def admit(self, rewards: Sequence[float]) -> bool:
        """May a newly arrived group with these per-sample rewards enter the window?"""
        ...

    def evict(self, candidate: Candidate, version: int) -> bool:
        """Must `candidate` leave the window at learner version `version` (for this policy's reasons)?"""
        ...

    def select(self, candidates: Sequence[Candidate], version: int, n: int) -> list[int]:
        """Indices of the (up to) `n` candidates to train on at `version`, in training order."""
        ...

    def gave_up(self, filtered: int, groups_per_step: int) -> bool:
        """Has one step refused so many groups without signal that it should fail instead of waiting?"""
        ...


def has_signal(rewards: Sequence[float], tolerance: float = 0.0) -> bool:
    """Do the rewards of one group differ by more than `tolerance` (so GRPO gets a gradient from it)?"""
    values = [float(r) for r in rewards]
    return bool(values) and max(values) - min(values) > tolerance


@dataclass(frozen=True)
class Selection:
    """Shared rules: reuse count, the zero-signal filter and its budget. Subclasses choose the order.

    max_reuse:            most times one group is trained (1: each group once)
    drop_zero_signal:     refuse groups whose rewards are all equal (within `signal_tolerance`)
    max_filtered_batches: a step that has refused more than this many times `groups_per_step` groups
                          without signal fails with `NoSignalError` (like verl's `max_num_gen_batches`)
    """

    max_reuse: int = 1
    drop_zero_signal: bool = False
    signal_tolerance: float = 0.0
    max_filtered_batches: int = 10
    kind: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if self.max_reuse < 1:
            raise ValueError(f"replay.max_reuse must be >= 1, got {self.max_reuse}")
        if self.signal_tolerance < 0:
            raise ValueError(f"replay.signal_tolerance must be >= 0, got {self.signal_tolerance}")
        if self.max_filtered_batches < 1:
            raise ValueError(f"replay.max_filtered_batches must be >= 1, got {self.max_filtered_batches}")

    def admit(self, rewards: Sequence[float]) -> bool:
        return not self.drop_zero_signal or has_signal(rewards, self.signal_tolerance)

    def evict(self, candidate: Candidate, version: int) -> bool:
        return candidate.uses >= self.max_reuse

    def gave_up(self, filtered: int, groups_per_step: int) -> bool:
        return filtered > self.max_filtered_batches * groups_per_step

    def rng_state(self) -> tuple | None:
        """The state of this policy's random stream (`random.Random.getstate()`), None if it has none."""
        return None

    def set_rng_state(self, state: tuple) -> None:
        """Continue the random stream from `state` (a checkpoint's); a policy without one ignores it."""
        return None

    def select(self, candidates: Sequence[Candidate], version: int, n: int) -> list[int]:
        order = sorted(range(len(candidates)), key=lambda i: self._rank(candidates[i]))
        return order[: max(n, 0)]

    def _rank(self, candidate: Candidate) -> tuple:
        raise NotImplementedError


@dataclass(frozen=True)
class Fifo(Selection):
    """Oldest arrival first. A reused group re-enters at the back, so fresh groups that were waiting
    go before it. With max_reuse = 1 this is the pipeline's plain FIFO."""

    kind: str = field(default="fifo", init=False)

    def _rank(self, candidate: Candidate) -> tuple:
        return (candidate.arrival,)


@dataclass(frozen=True)
class Freshest(Selection):
    """Newest weight version first; among equals, fewer uses, then earlier arrival. Old groups may
    wait until the staleness policy evicts them (more are dropped than with FIFO)."""

    kind: str = field(default="freshest", init=False)

    def _rank(self, candidate: Candidate) -> tuple:
        return (-candidate.version, candidate.uses, candidate.arrival)


@dataclass(frozen=True)
class Uniform(Selection):
    """Uniformly at random among the candidates (all within the staleness window), from a stream
    seeded by `seed`: the same seed and the same calls give the same picks."""

    seed: int = 0
    kind: str = field(default="uniform", init=False)
    _rng: random.Random = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "_rng", random.Random(f"selection:{self.seed}"))

    def select(self, candidates: Sequence[Candidate], version: int, n: int) -> list[int]:
        return self._rng.sample(range(len(candidates)), min(max(n, 0), len(candidates)))

    def rng_state(self) -> tuple:
        return self._rng.getstate()

    def set_rng_state(self, state: tuple) -> None:
        self._rng.setstate(state)


def make_selection(kind: str, **options) -> Selection:
    """The selection policy named `kind` ("fifo" | "freshest" | "uniform"), with its options."""
    classes = {"fifo": Fifo, "freshest": Freshest, "uniform": Uniform}
    if kind not in classes:
        raise ValueError(f"replay.selection must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind != "uniform":
        options.pop("seed", None)
    return classes[kind](**options)


@dataclass
class Taken(Generic[T]):
    """A group a step trains on: the caller's item and what the window knew of it."""

    item: T
    candidate: Candidate

    @property
    def reused(self) -> bool:
        return self.candidate.uses > 0


class ReplayWindow(Generic[T]):
    """Groups a learner may train on, each with its use count; applies a selection policy and the
    staleness policy. Items are opaque to it (the learner stores `(ref, batch)`).

    Invariants:
    * every item added leaves exactly once: through `expire` (with its use count), or through
      `returned` once it was trained `max_reuse` times (a taken item is out of the window until
      `returned`);
    * `take(version, n)` offers the selection only groups the staleness policy accepts at `version`
      and that have uses left (call `expire(version)` first; `take` refuses to run otherwise);
    * an item's use count only grows, by one per `returned`, and never passes `max_reuse`.
    """

    def __init__(self, selection: SelectionPolicy, staleness: Acceptor) -> None:
        self.selection = selection
        self.staleness = staleness
        self._entries: list[Taken[T]] = []
        self._arrivals = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, item: T, version: int, uses: int = 0) -> None:
        """A group enters at the back: a fresh one (never trained), or, restoring a checkpoint, one that
        was trained `uses` times already (fewer than `max_reuse`)."""
        if not 0 <= uses < self.selection.max_reuse:
            raise ValueError(
                f"a group trained {uses} times cannot enter the window (max_reuse={self.selection.max_reuse})"
            )
        self._entries.append(Taken(item, Candidate(version=version, uses=uses, arrival=self._next_arrival())))

    def entries(self) -> list[Taken[T]]:
        """The groups in the window now, in arrival order, with what the window knows of them."""
        return list(self._entries)

    def expire(self, version: int) -> list[Taken[T]]:
        """Remove and return every group that may not be trained at `version` (too old, or used up)."""
        keep, gone = [], []
        for entry in self._entries:
            c = entry.candidate
            stale = self.staleness.accept(version, c.version) != "train"
            (gone if stale or self.selection.evict(c, version) else keep).append(entry)
        self._entries = keep
        return gone

    def take(self, version: int, n: int) -> list[Taken[T]]:
        """The selection's pick of up to `n` groups for the step at `version`, removed from the window."""
        for entry in self._entries:
            if self.staleness.accept(version, entry.candidate.version) != "train":
                raise ValueError(f"take() at version {version} before expire(): {entry.candidate} is too old")
        picked = self.selection.select([e.candidate for e in self._entries], version, n)
        if len(set(picked)) != len(picked) or any(not 0 <= i < len(self._entries) for i in picked):
            raise ValueError(f"selection {self.selection!r} returned invalid indices {picked}")
        taken = [self._entries[i] for i in picked]
        chosen = set(picked)
        self._entries = [e for i, e in enumerate(self._entries) if i not in chosen]
        return taken

    def returned(self, taken: Sequence[Taken[T]], version: int) -> list[T]:
        """`taken` were trained (once more) at `version`. Those with uses left re-enter at the back;
        the items used up are returned (their last use is over: free them)."""
        done: list[T] = []
        for entry in taken:
            c = entry.candidate
            used = Candidate(version=c.version, uses=c.uses + 1, arrival=self._next_arrival())
            if used.uses > self.selection.max_reuse:
                raise ValueError(f"a group was trained {used.uses} times; max_reuse={self.selection.max_reuse}")
            if self.selection.evict(used, version):
                done.append(entry.item)
            else:
                self._entries.append(Taken(entry.item, used))
        return done

    def _next_arrival(self) -> int:
        self._arrivals += 1
        return self._arrivals
