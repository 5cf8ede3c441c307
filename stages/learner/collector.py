"""`BatchCollector`: refs in -> the groups one version trains on.

It receives and loads refs into the replay window (`policies.selection.ReplayWindow`) until it holds
`groups_per_step` groups that may be trained at the current version, then lets the selection policy
(fifo, freshest, uniform) pick them. With `max_reuse` > 1 the window also holds groups trained before
with uses left: by default a replay takes a new group's place (and counts as a started unit at the
admission gate); with `replays_ride_along` a step trains `groups_per_step` new groups plus every such
replay, so each version consumes exactly `groups_per_step` new groups and the gate's pace argument
(policies.bounds) holds with reuse as without it.

Invariants:
- every ref received is either in the window, loaded and not yet judged (`fetched`), or settled in
  the ledger: filtered (rewards all equal, with `drop_zero_signal`), refused by the staleness policy
  (dropped or requeued), lost (payload gone or corrupt: its prompt goes back to the producer); nothing
  received is ever dropped silently, also when a prefetch is cancelled;
- a group is judged by the staleness policy only once the version it would be trained at is known;
- a payload is freed only after its group's last use.
"""

from __future__ import annotations

import time
from typing import Any

import anyio

from buffers.codec import CodecError, RolloutBatch, decode
from buffers.retry import with_retries
from buffers.store import ObjectStore, StoreError
from pipeline.channel import Channel, ChannelClosed
from pipeline.context import RunContext, free, redo, refuse
from pipeline.refs import HeldRef, Ref
from policies.selection import NoSignalError, ReplayWindow, Taken

Group = tuple[Ref, RolloutBatch]


class BatchCollector:
    """The learner's intake (see the module docstring). `spec` is the learner's config."""

    def __init__(self, spec: Any, ctx: RunContext, inbox: Channel, name: str = "learner") -> None:
        self.spec, self.ctx, self.inbox, self.name = spec, ctx, inbox, name
        self.log = ctx.log(name)
        self.frees: anyio.abc.TaskGroup | None = None  # set while the learner runs: payloads freed in the background
        self.fetched: list[Group] = []  # received and loaded, not yet judged
        # groups this learner may train on: admitted (with signal), within the bound, uses left
        self.window: ReplayWindow[Group] = ReplayWindow(spec.selection, ctx.policy)
        self.examined = self.filtered = 0  # groups judged by the signal filter during the current step
        self.load_s, self.loads = 0.0, 0  # store gets since the last metrics record (time, count)

    @property
    def store(self) -> ObjectStore:
        return self.ctx.services.store

    def held_refs(self) -> list[HeldRef]:
        """Loaded and not yet judged, then the window (with use counts): what a checkpoint records."""
        held = [HeldRef(ref=ref, holder=self.name) for ref, _ in self.fetched]
        held.extend(HeldRef(ref=e.item[0], holder=self.name, uses=e.candidate.uses) for e in self.window.entries())
        return held

    def take_load_counts(self) -> tuple[float, int]:
        """Seconds spent in store gets and how many, since the last call."""
        counts, (self.load_s, self.loads) = (self.load_s, self.loads), (0.0, 0)
        return counts

    async def prefetch(self, version: int) -> None:
        """Receive and load up to one step of groups (whatever is there, waiting for the first). One
        receive only: the groups being trained come back into the window after the step, and a prefetch
        that filled a whole step ahead of them would let them age out unused (max_reuse).
        Cancelled while waiting, it takes nothing (channel receives are cancellation-safe); once it
        holds refs, it finishes loading them (shielded), so no received ref is ever dropped."""
        refs = await self._receive(version + 1, self.spec.groups_per_step - len(self.fetched) - self.counted())
        with anyio.CancelScope(shield=True):
            for ref in refs:
                batch = await self.load(ref)
                if batch is not None:
                    self.fetched.append((ref, batch))

    async def collect(self, version: int) -> list[Taken[Group]]:
        """The groups to train on at `version`, picked by the selection policy from the replay window:
        `groups_per_step` of the loaded groups (prefetched ones first) that have signal and the groups
        trained before with uses left; with `replays_ride_along`, `groups_per_step` new ones plus every
        reusable one. Before they cost a step, groups without signal are filtered, groups the staleness
        policy refuses are dropped or requeued, and used-up or too old reused ones are freed."""
        wanted, ctx = self.spec.groups_per_step, self.ctx
        self.examined = self.filtered = 0
        while True:
            await self._admit_fetched(version)
            for entry in self.window.expire(version):
                ref = entry.item[0]
                if entry.reused:  # trained already (its fate stays trained): only its payload goes
                    await free(ctx, ref, self.store, self.frees)
                else:
                    await refuse(ctx, ref, version, self.store, self.frees)
            counted = self.counted()
            if counted >= wanted:
                break
            for ref in await self._receive(version, wanted - counted):
                batch = await self.load(ref)
                if batch is not None:
                    self.fetched.append((ref, batch))
        taken = self.window.take(version, wanted + len(self.window) - counted)  # + replays riding along
        replays = sum(t.reused for t in taken)
        if replays and not self.spec.replays_ride_along:  # it fills a new group's slot: producers must not run ahead
            await ctx.gate.replayed(replays)
        return taken

    async def release(self, taken: list[Taken[Group]], version: int) -> None:
        """After the step at `version`: free the payloads of the groups whose last use it was."""
        for ref, _ in self.window.returned(taken, version):
            await free(self.ctx, ref, self.store, self.frees)

    def untake(self, taken: list[Taken[Group]]) -> None:
        """Put back groups taken for a step that was never trained (its rank group died): each re-enters the
        window with the use count and version it had, to be judged and taken again at the next version."""
        for t in taken:
            self.window.add(t.item, t.candidate.version, uses=t.candidate.uses)

    def counted(self) -> int:
        """Groups in the window that count towards `groups_per_step`: all, or with replays riding along, the
        ones never trained."""
        if not self.spec.replays_ride_along:
            return len(self.window)
        return sum(not entry.reused for entry in self.window.entries())

    async def load(self, ref: Ref) -> RolloutBatch | None:
        """The decoded payload, or None when it is gone or corrupt: then its samples are counted as
        lost, the slot is freed and the group's prompt goes back to the producer to be redone."""
        t0 = time.perf_counter()
        try:
            payload = await with_retries(lambda: self.store.get(ref.key, size_hint=ref.nbytes))
            self.load_s += time.perf_counter() - t0
            self.loads += 1
            return decode(payload)
        except (StoreError, CodecError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            self.log.warning("payload lost", key=ref.key, error=reason)
            await redo(self.ctx, ref, "lost", reason, self.store, self.frees)
            return None

    async def restore(self, held: list[HeldRef], version: int) -> int:
        """Put a checkpoint's trained groups with uses left back into the window: those the staleness policy
        still accepts at `version` and whose payload the store still holds (the others' payloads are freed;
        their fate stays trained either way); returns how many came back."""
        kept = 0
        for h in held:
            if self.ctx.policy.accept(version, h.ref.version) != "train":
                await free(self.ctx, h.ref, self.store)
                continue
            try:
                batch = decode(await self.store.get(h.ref.key, size_hint=h.ref.nbytes))
            except (StoreError, CodecError):
                continue
            self.window.add((h.ref, batch), h.ref.version, uses=h.uses)
            kept += 1
        return kept

    async def _receive(self, version: int, wanted: int) -> list[Ref]:
        try:  # as many as are there, up to `wanted`: one round trip
            refs = await self.inbox.receive_many(max(wanted, 1))
        except anyio.EndOfStream:
            raise ChannelClosed(
                f"channel {self.inbox.name!r} closed and drained before the groups for version {version + 1} "
                "were complete: the stage feeding it stopped"
            ) from None
        for ref in refs:
            if ref.store != self.store.name:
                raise ValueError(f"ref {ref.key} comes from store {ref.store!r}, not {self.store.name!r}")
        return refs

    async def _admit_fetched(self, version: int) -> None:
        """Move loaded groups into the window; those the selection refuses (rewards all equal) are
        recorded as filtered, their slots freed (a producer makes another) and their payloads removed.
        Raises `NoSignalError` once this step has filtered more than the selection's budget."""
        selection, ctx = self.spec.selection, self.ctx
        fetched, self.fetched = self.fetched, []
        for ref, batch in fetched:
            self.examined += 1
            rewards = batch.row_fields["rewards"]
            if selection.admit(rewards):
                self.window.add((ref, batch), ref.version)
                continue
            self.filtered += 1
            await ctx.ledger.finished("dropped", ref.item_ids, f"filtered: rewards all equal ({float(rewards[0]):g})")
            await ctx.gate.discard(1)
            await free(ctx, ref, self.store, self.frees)
            if selection.gave_up(self.filtered, self.spec.groups_per_step):
                raise NoSignalError(
                    f"the step for version {version + 1} filtered {self.filtered} groups whose rewards were all "
                    f"equal and still lacks {self.spec.groups_per_step - self.counted()} of "
                    f"learner.groups_per_step = {self.spec.groups_per_step} groups with signal: the policy may have "
                    "collapsed (see the entropy metric) or the task is solved or hopeless for it; raise "
                    f"replay.max_filtered_batches (now {selection.max_filtered_batches}) to wait longer, or set "
                    "replay.drop_zero_signal = false"
                )
