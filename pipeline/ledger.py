"""The ledger: the fate of every item that entered the pipeline.

Each item (one sample) is recorded when it is produced and then moves to exactly one terminal
fate, or is consumed (possibly several times, up to `max_uses`):

    in_flight --consumed--> trained      (trained_at grows by the consumer's version each use)
    in_flight ------------> dropped      (with a reason: stale, evicted, filtered ...)
    in_flight ------------> lost         (its payload is gone; counted, never silent)
    in_flight ------------> regenerated  (its work is being redone under a new item id)

Invariants, checked by `violations()` and asserted by the tests:
* every produced item has exactly one fate, so produced == trained + dropped + lost +
  regenerated + in_flight;
* no item is consumed more than `max_uses` times, and a terminal item is never consumed
  (illegal transitions raise `LedgerError` at once: they are bugs, not outcomes);
* an item's recorded versions are [oldest, newest] with oldest <= newest;
* reuse is counted, not a fate: an item consumed again stays `trained` (counted once there), its
  `trained_at` grows, and `counts()["reused"]` counts every consumption beyond an item's first.
  Items a consumer refused for carrying nothing to learn from are `dropped` with a reason starting
  `"filtered:"`, and `counts()["filtered"]` counts them (a part of `dropped`).

Bias accounting: a producer may attach named values to its items (`values`, e.g. one number per
item for each of a few names; the ledger gives them no meaning). When an item settles (is first
consumed, or reaches a terminal fate) its values move under its *outcome*: `"trained"`, or
`"{fate}:{kind}"` where `kind` is its reason up to the first ':' (`"dropped:stale"`,
`"dropped:filtered"`, `"lost:StoreError"` ...). `take_settled()` hands over what settled since the
last call (and forgets it), so a consumer can histogram trained vs dropped values step by step;
values of items still in flight are the only ones held.

The ledger also keeps, per group, what the group was made from (`source`, opaque bytes such as an
encoded prompt) until the group is trained or dropped, so work that was lost or requeued can be
redone exactly (`take_source`) by whichever producer picks it up. A taken source stays *pending*
until a group made from the same bytes is produced (`pending_redo()`), so a checkpoint taken while
the redo is being generated still knows that work is owed (see pipeline.checkpoint).

`state()` / `Ledger.from_state()` turn the whole ledger (records, counts, sources, pending redos,
values of unsettled items) into a msgspec struct and back, for checkpoints. `changes()` is the same
struct with only the records created or changed since its last call: the next segment of a
checkpoint's ledger journal, so a checkpoint writes what changed, not every record of the run.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import msgspec

Fate = Literal["in_flight", "trained", "dropped", "lost", "regenerated"]
FATES: tuple[Fate, ...] = ("trained", "dropped", "lost", "regenerated", "in_flight")
FILTERED = "filtered"  # the reason kind of items a selection refused for carrying no signal ("filtered: ...")


class LedgerError(RuntimeError):
    """An illegal fate transition: the pipeline tried to use or drop an item twice."""


class ItemRecord(msgspec.Struct):
    id: str
    group: str
    versions: tuple[int, int]
    trained_at: list[int] = msgspec.field(default_factory=list)
    fate: Fate = "in_flight"
    reason: str = ""


class LedgerState(msgspec.Struct, kw_only=True):
    """Everything a ledger holds, for a checkpoint (msgspec: no pickle). `pending_redo` lists the sources
    taken for redoing (by the group they were taken from) whose new group was not produced yet."""

    max_uses: int
    records: list[ItemRecord]
    counts: dict[str, int]
    sources: dict[str, bytes]
    pending_redo: list[tuple[str, bytes]]
    values: dict[str, dict[str, float]]


class Ledger:
    def __init__(self, max_uses: int = 1) -> None:
        if max_uses < 1:
            raise ValueError(f"max_uses must be >= 1, got {max_uses}")
        self.max_uses = max_uses
        self._items: dict[str, ItemRecord] = {}
        self._counts: Counter[str] = Counter()
        self._sources: dict[str, bytes] = {}
        self._values: dict[str, dict[str, float]] = {}  # item id -> named values, until it settles
        self._pending_redo: list[tuple[str, bytes]] = []  # (group, source) taken, its redo not produced yet
        self._changed: dict[str, None] = {}  # ids of records created or changed since `changes()`, in order
        self._settled: defaultdict[str, defaultdict[str, list[float]]] = defaultdict(lambda: defaultdict(list))

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, item_id: str) -> ItemRecord:
        return self._items[item_id]

    def produced(
        self,
        ids: Iterable[str],
        group: str,
        versions: tuple[int, int],
        source: bytes | None = None,
        values: Mapping[str, Sequence[float]] | None = None,
    ) -> None:
        """Record new items; `values` maps a name to one number per item (in the order of `ids`)."""
        lo, hi = versions
        if lo > hi:
            raise LedgerError(f"versions must be [oldest, newest], got {versions}")
        ids = list(ids)
        for name, numbers in (values or {}).items():
            if len(numbers) != len(ids):
                raise LedgerError(f"values[{name!r}] has {len(numbers)} entries for {len(ids)} items of {group!r}")
        fresh: set[str] = set()
        for item_id in ids:  # all or nothing: check the whole batch before recording any of it
            if item_id in self._items or item_id in fresh:
                raise LedgerError(f"item {item_id!r} produced twice")
            fresh.add(item_id)
        for item_id in ids:
            self._items[item_id] = ItemRecord(id=item_id, group=group, versions=(lo, hi))
            self._changed[item_id] = None
            self._counts["in_flight"] += 1
        if values:
            for i, item_id in enumerate(ids):
                self._values[item_id] = {name: float(numbers[i]) for name, numbers in values.items()}
        if source is not None:
            self._sources[group] = source
            for i, (_, pending) in enumerate(self._pending_redo):  # a redo made from these bytes is done
                if pending == source:
                    del self._pending_redo[i]
                    break

    def take_source(self, group: str) -> bytes:
        """What `group` was made from (given at `produced`), for redoing it. Once taken it is no longer
        the group's source, but stays in `pending_redo()` until a group made from it is produced."""
        try:
            source = self._sources.pop(group)
        except KeyError:
            raise LedgerError(f"no source recorded for group {group!r} (never produced, or already done)") from None
        self._pending_redo.append((group, source))
        return source

    def pending_redo(self) -> list[tuple[str, bytes]]:
        """(group, source) of redos taken by a producer whose new group was not produced yet."""
        return list(self._pending_redo)

    def owe(self, group: str, source: bytes) -> None:
        """Record work owed under the name `group` (no items yet): a producer makes it by `take_source(group)`
        (a resumed run owes the prompts the crashed one had admitted but not produced)."""
        if group in self._sources or any(rec.group == group for rec in self._items.values()):
            raise LedgerError(f"group {group!r} is known already; owed work needs a new name")
        self._sources[group] = source

    def requeue_pending_redo(self) -> list[str]:
        """Every pending redo becomes its group's source again, to be taken anew (a resumed run owes the
        work the crashed one was redoing); returns those groups."""
        groups = []
        for group, source in self._pending_redo:
            self._sources[group] = source
            groups.append(group)
        self._pending_redo.clear()
        return groups

    def state(self) -> LedgerState:
        """A deep snapshot of the ledger (records are copied: later changes do not touch it)."""
        return self._state(self._items.values())

    def changes(self) -> LedgerState:
        """`state()` with only the records created or changed since the last call (every record at the
        first call); everything else whole. Folding the records of successive calls, later over earlier
        by id (`fold_records`), gives `state().records`."""
        changed = [self._items[i] for i in self._changed]
        self._changed = {}
        return self._state(changed)

    def _state(self, records: Iterable[ItemRecord]) -> LedgerState:
        return LedgerState(
            max_uses=self.max_uses,
            records=[ItemRecord(r.id, r.group, r.versions, list(r.trained_at), r.fate, r.reason) for r in records],
            counts=dict(self._counts),
            sources=dict(self._sources),
            pending_redo=list(self._pending_redo),
            values={k: dict(v) for k, v in self._values.items()},
        )

    @classmethod
    def from_state(cls, state: LedgerState, max_uses: int | None = None, journaled: bool = True) -> Ledger:
        """The ledger `state` describes (`max_uses`: the resumed run's, default the checkpoint's). With
        `journaled` (its records are in a journal already) `changes()` starts empty, else with every record."""
        ledger = cls(max_uses=max_uses if max_uses is not None else state.max_uses)
        ledger._items = {r.id: r for r in state.records}
        if not journaled:
            ledger._changed = dict.fromkeys(ledger._items)
        ledger._counts = Counter(state.counts)
        ledger._sources = dict(state.sources)
        ledger._pending_redo = list(state.pending_redo)
        ledger._values = {k: dict(v) for k, v in state.values.items()}
        problems = ledger.violations()
        if problems:
            raise LedgerError(f"a checkpointed ledger does not balance: {'; '.join(problems[:5])}")
        return ledger

    def trained(self, ids: Iterable[str], at_version: int) -> None:
        for item_id in ids:
            rec = self._get(item_id)
            if rec.fate not in ("in_flight", "trained"):
                raise LedgerError(f"item {item_id!r} is {rec.fate} ({rec.reason}) and cannot be consumed")
            if len(rec.trained_at) >= self.max_uses:
                raise LedgerError(
                    f"item {item_id!r} already consumed {len(rec.trained_at)} time(s) "
                    f"at versions {rec.trained_at}; max_uses={self.max_uses}"
                )
            if rec.trained_at:
                self._counts["reused"] += 1
            rec.trained_at.append(at_version)
            self._move(rec, "trained", "")

    def dropped(self, ids: Iterable[str], reason: str) -> None:
        self._finish(ids, "dropped", reason)

    def lost(self, ids: Iterable[str], reason: str) -> None:
        self._finish(ids, "lost", reason)

    def regenerated(self, ids: Iterable[str], reason: str) -> None:
        self._finish(ids, "regenerated", reason)

    def take_settled(self) -> dict[str, dict[str, list[float]]]:
        """{outcome: {name: [value per item]}} for the items that settled since the last call."""
        settled = {outcome: dict(named) for outcome, named in self._settled.items()}
        self._settled.clear()
        return settled

    def counts(self) -> dict[str, int]:
        """{"produced": n, "trained": ..., "dropped": ..., "lost": ..., "regenerated": ..., "in_flight": ...,
        "filtered": ..., "reused": ...}: one count per fate (they sum to "produced"), then two that are not
        fates: "filtered", the dropped items whose reason is `FILTERED` (a part of "dropped"), and "reused",
        the consumptions beyond each item's first (a trained item counts once in "trained")."""
        return {
            "produced": len(self._items),
            **{fate: self._counts[fate] for fate in FATES},
            "filtered": self._counts["filtered"],
            "reused": self._counts["reused"],
        }

    def violations(self) -> list[str]:
        """Every broken invariant, as a sentence; empty when the ledger balances."""
        found = []
        counts = self.counts()
        total = sum(counts[f] for f in FATES)
        if total != counts["produced"]:
            found.append(f"fates sum to {total} but {counts['produced']} items were produced")
        for rec in self._items.values():
            if len(rec.trained_at) > self.max_uses:
                found.append(f"{rec.id} consumed {len(rec.trained_at)} times (max_uses={self.max_uses})")
            if rec.fate == "trained" and not rec.trained_at:
                found.append(f"{rec.id} is trained but has no trained_at")
        reused = sum(max(len(rec.trained_at) - 1, 0) for rec in self._items.values())
        if reused != counts["reused"]:
            found.append(f"{counts['reused']} reuses counted but items record {reused}")
        return found

    def balanced(self) -> bool:
        return not self.violations()

    def records(self) -> list[ItemRecord]:
        return list(self._items.values())

    def to_json(self) -> bytes:
        """One record per item as a JSON list (fields: id, group, versions, trained_at, fate, reason):
        the run folder's ledger.json."""
        return msgspec.json.encode(self.records())

    def _get(self, item_id: str) -> ItemRecord:
        try:
            return self._items[item_id]
        except KeyError:
            raise LedgerError(f"item {item_id!r} was never produced") from None

    def _finish(self, ids: Iterable[str], fate: Fate, reason: str) -> None:
        for item_id in ids:
            rec = self._get(item_id)
            if rec.fate != "in_flight":
                raise LedgerError(f"item {item_id!r} is already {rec.fate}; cannot mark it {fate}")
            self._move(rec, fate, reason)

    def _move(self, rec: ItemRecord, fate: Fate, reason: str) -> None:
        if fate in ("trained", "dropped"):
            self._sources.pop(rec.group, None)  # done: it will never be redone
        values = self._values.pop(rec.id, None)  # only the first settling counts (a reused item stays put)
        if values:
            outcome = outcome_of(fate, reason)
            for name, value in values.items():
                self._settled[outcome][name].append(value)
        if fate == "dropped" and outcome_of(fate, reason) == f"dropped:{FILTERED}":
            self._counts["filtered"] += 1
        self._counts[rec.fate] -= 1
        self._counts[fate] += 1
        rec.fate = fate
        rec.reason = reason
        self._changed[rec.id] = None


def fold_records(segments: Iterable[Iterable[ItemRecord]]) -> list[ItemRecord]:
    """The records of successive `Ledger.changes()` calls folded into one ledger's: a later record of
    an id replaces the earlier one, and records keep the order in which they were first produced."""
    folded: dict[str, ItemRecord] = {}
    for records in segments:
        for rec in records:
            folded[rec.id] = rec
    return list(folded.values())


def outcome_of(fate: str, reason: str) -> str:
    """"trained", or "{fate}:{kind}" where kind is `reason` up to its first ':' (the fate alone if empty)."""
    if fate == "trained":
        return fate
    kind = reason.split(":", 1)[0].strip()
    return f"{fate}:{kind}" if kind else fate
