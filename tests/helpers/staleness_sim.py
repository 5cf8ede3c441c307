"""A discrete-event model of the pipeline's staleness, driven step by step, with the real policies.

Stages (as in the running pipeline, without payloads or time):
  engines   each takes up to `batch_groups` admission slots at once (`MaxStaleness.admit`, as the
            AdmissionGate asks it), generates them with the current version, and hands them on in order;
            when the version moves while it generates, `MaxStaleness.interrupt` decides continue/restart;
  queues    the produced channel, the buffer's index and the ready channel, as one FIFO of their summed
            capacity (they are FIFO stages in series);
  learner   a prefetch of up to `groups_per_step` loaded groups, and the `ReplayWindow` of
            policies.selection (admit / evict / select, and reuse), which it asks exactly as
            stages/learner/collector.py does; a replayed group takes a new one's place and counts as a
            started unit (`AdmissionGate.replayed`), or, with `replays_ride_along`, trains on top of
            `groups_per_step` new groups and takes no admission slot.

Each action is one event; any sequence of them is a legal interleaving (an impossible action is a
no-op). `worst_case` plays the interleaving the static bound is derived from: producers fill every
slot before each learner action. Records what the properties need: the staleness of every group when
the learner first judges it (arrival), of every group trained, the optimizer-step lag of each epoch,
and use counts.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from policies.bounds import PipelineShape
from policies.selection import ReplayWindow, Selection, Taken
from policies.staleness import MaxStaleness

ACTIONS = ("start", "deliver", "fetch", "collect", "commit")


@dataclass
class Group:
    id: int
    version: int  # oldest version of its tokens
    signal: bool = True  # rewards differ (False: all equal)


@dataclass
class Engine:
    batch: list[Group] = field(default_factory=list)
    generating: bool = False
    started_at: int = 0  # order of its batch's start, for in-order completion


class Sim:
    def __init__(self, shape: PipelineShape, staleness: MaxStaleness, selection: Selection,
                 in_order: bool = True) -> None:
        self.shape, self.policy, self.selection, self.in_order = shape, staleness, selection, in_order
        self.version = 0
        self.started = self.discarded = 0
        self.engines = [Engine() for _ in range(shape.engines)]
        self.queue: deque[Group] = deque()
        self.fetched: list[Group] = []
        self.window: ReplayWindow[Group] = ReplayWindow(selection, staleness)
        self.training: list[Taken[Group]] | None = None
        self._ids = self._starts = 0
        self.arrival: list[int] = []  # staleness of each group when first judged by the learner
        self.trained: list[int] = []  # staleness of each (group, use) trained on
        self.lags: list[int] = []  # optimizer steps between sampling weights and the clip's reference
        self.uses: Counter[int] = Counter()
        self.refused = self.filtered = 0
        self.signal = iter(())  # per new group: has it signal? (default: yes)

    # -- producers --------------------------------------------------------------------------
    def start(self, i: int) -> bool:
        engine = self.engines[i % len(self.engines)]
        if engine.batch:
            return False
        while len(engine.batch) < self.shape.batch_groups and self.policy.admit(
            self.version, self.started, self.discarded, self.shape.groups_per_step
        ):
            self.started += 1
            self._ids += 1
            engine.batch.append(Group(self._ids, self.version, next(self.signal, True)))
        if not engine.batch:
            return False
        engine.generating, engine.started_at = True, self._starts
        self._starts += 1
        return True

    def deliver(self, i: int) -> bool:
        """Engine i finishes generating (in order: the earliest-started one) and sends what fits."""
        busy = [e for e in self.engines if e.batch]
        if not busy:
            return False
        engine = min(busy, key=lambda e: e.started_at) if self.in_order else busy[i % len(busy)]
        was_generating, engine.generating = engine.generating, False
        moved = False
        while engine.batch and len(self.queue) < self.shape.queues:
            self.queue.append(engine.batch.pop(0))
            moved = True
        return moved or was_generating

    # -- learner ------------------------------------------------------------------------------
    def fetch(self) -> bool:
        room = self.shape.groups_per_step - len(self.fetched) - self._counted()
        moved = False
        while room > 0 and self.queue:
            self.fetched.append(self.queue.popleft())
            room -= 1
            moved = True
        return moved

    def collect(self) -> bool:
        if self.training is not None:
            return False
        for group in self.fetched:  # as LearnerActor._admit_fetched
            self.arrival.append(self.version - group.version)
            if self.selection.admit([1.0, 0.0] if group.signal else [0.5, 0.5]):
                self.window.add(group, group.version)
            else:
                self.filtered += 1
                self.discarded += 1
        self.fetched = []
        for entry in self.window.expire(self.version):
            if not entry.reused:
                self.refused += 1
                self.discarded += 1  # dropped or requeued: either frees its slot
        counted, wanted = self._counted(), self.shape.groups_per_step
        if counted < wanted:
            return False
        self.training = self.window.take(self.version, wanted + len(self.window) - counted)
        if not self.shape.replays_ride_along:
            self.started += sum(t.reused for t in self.training)  # AdmissionGate.replayed
        return True

    def _counted(self) -> int:
        """Groups in the window that count towards groups_per_step (as LearnerActor._counted)."""
        if not self.shape.replays_ride_along:
            return len(self.window)
        return sum(not entry.reused for entry in self.window.entries())

    def commit(self) -> bool:
        if self.training is None:
            return False
        epochs = self.shape.epochs
        for t in self.training:
            s = self.version - t.candidate.version
            self.trained.append(s)
            self.uses[t.item.id] += 1
            for epoch in range(epochs):
                self.lags.append(epoch if self.shape.corrected else s * epochs + epoch)
        self.version += 1
        self.window.returned(self.training, self.version - 1)
        self.training = None
        for engine in self.engines:  # the new weights reach every engine
            if engine.generating and engine.batch:
                oldest = min(g.version for g in engine.batch)
                if self.policy.interrupt(oldest, self.version) == "restart":
                    for g in engine.batch:
                        g.version = self.version
        return True

    # -- driving ------------------------------------------------------------------------------
    def act(self, action: str, index: int = 0) -> bool:
        return getattr(self, action)(index) if action in ("start", "deliver") else getattr(self, action)()

    def fill(self) -> None:
        """Producers and the learner's prefetch take every slot they can (the worst case for staleness)."""
        changed = True
        while changed:
            changed = False
            for i in range(len(self.engines)):
                changed |= self.start(i)
            while self.deliver(0):
                changed = True
            changed |= self.fetch()

    def worst_case(self, steps: int) -> Sim:
        """Fill everything, collect; refill at the same version; commit; repeat `steps` times."""
        for _ in range(steps):
            for _ in range(4 * self.shape.max_reuse + 4):
                self.fill()
                if self.collect():
                    break
            self.fill()
            self.commit()
        return self
