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
values of items still in flight are the only ones held. `reasons()` counts the items of each fate
but trained by reason (pipeline.reasons: bounded whatever the reasons hold), for the run's summary.

The ledger also keeps, per group, what the group was made from (`source`, opaque bytes such as an
encoded prompt) until the group is trained or dropped, so work that was lost or requeued can be
redone exactly (`take_source`) by whichever producer picks it up. A taken source stays *pending*
until a group made from the same bytes is produced (`pending_redo()`), so a checkpoint taken while
the redo is being generated still knows that work is owed (see pipeline.checkpoint).

Memory holds only what is in flight. Every record that settles (its first training, or a terminal
fate) is appended to the ledger's store (pipeline.ledger_store: `ledger.sqlite` in the run folder for
`Ledger.create(run_dir)`, a private in-memory one otherwise) and leaves memory; a reused item's later
trainings are appended too. A settled record still answers `ledger[id]` (read back from the store, a
copy). So every operation costs what its own items cost, whatever the run's length.

`state()` / `Ledger.from_state()` turn the ledger into a msgspec struct and back, for checkpoints: the
records in flight, counts, sources, pending redos, values of unsettled items, and the store's
`position` (its settled rows so far, committed and fsynced): a checkpoint records where the store
stood, not the records. `from_state` with the run's store rewinds it to that position (rows that
settled after the checkpoint are deleted: the resumed run is the checkpoint's run).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import msgspec

from pipeline.ledger_store import Fate, ItemRecord, LedgerStore, Position, StoreError, check, records, settled_reasons
from pipeline.reasons import ReasonCounts, reason_kind

FATES: tuple[Fate, ...] = ("trained", "dropped", "lost", "regenerated", "in_flight")
SETTLED: tuple[Fate, ...] = FATES[:-1]
FILTERED = "filtered"  # the reason kind of items a selection refused for carrying no signal ("filtered: ...")
LEDGER_JSON_LIMIT = 1_000_000  # produced items up to which `to_json` writes them all (ledger.json); beyond: None
FULL_CHECK_ROWS = 1_000_000  # store rows up to which `violations()` checks every settled record too


class LedgerError(RuntimeError):
    """An illegal fate transition: the pipeline tried to use or drop an item twice."""


class LedgerState(msgspec.Struct, kw_only=True):
    """What a checkpoint holds of a ledger (msgspec: no pickle): the records in flight (`records`; a
    checkpoint of format 1 held every record here, and `position` None), the counts, the store's
    `position`, and what is owed. `pending_redo` lists the sources taken for redoing (by the group they
    were taken from) whose new group was not produced yet."""

    max_uses: int
    records: list[ItemRecord]
    counts: dict[str, int]
    sources: dict[str, bytes]
    pending_redo: list[tuple[str, bytes]]
    values: dict[str, dict[str, float]]
    position: Position | None = None


class LedgerView:
    """The read side of a `Ledger`: its counts, reasons, records and the invariant check, over the state
    the ledger keeps (`_counts`, `_live`: the records in flight, `_reasons`, `store`: the settled ones)."""

    _counts: Counter[str]
    _live: dict[str, ItemRecord]
    _reasons: ReasonCounts
    store: LedgerStore

    def __len__(self) -> int:
        """Items produced (settled or not)."""
        return self._counts["produced"]

    def __getitem__(self, item_id: str) -> ItemRecord:
        """The item's record; a settled one is read back from the store (a copy)."""
        return self._get(item_id)

    def in_memory(self) -> int:
        """Records held in memory: exactly the items in flight."""
        return len(self._live)

    def counts(self) -> dict[str, int]:
        """{"produced": n, "trained": ..., "dropped": ..., "lost": ..., "regenerated": ..., "in_flight": ...,
        "filtered": ..., "reused": ...}: one count per fate (they sum to "produced"), then two that are not
        fates: "filtered", the dropped items whose reason is `FILTERED` (a part of "dropped"), and "reused",
        the consumptions beyond each item's first (a trained item counts once in "trained")."""
        return {
            "produced": self._counts["produced"],
            **{fate: self._counts[fate] for fate in FATES},
            "filtered": self._counts["filtered"],
            "reused": self._counts["reused"],
        }

    def reasons(self) -> dict[str, dict[str, int]]:
        """{fate: {reason: items}} for the items that settled other than trained, most items first; bounded
        (pipeline.reasons: beyond a few reasons per kind, a kind's items are counted under "{kind}: ...")."""
        return self._reasons.as_dict()

    def violations(self, full: bool = True) -> list[str]:
        """Every broken invariant, as a sentence; empty when the ledger balances. Checks the counts (the
        fates sum to what was produced; the store holds one row per settling and per reuse) and the
        records in flight; with `full`, and a store of at most `FULL_CHECK_ROWS` rows, also every settled
        record (`pipeline.ledger_store.check`; `baton ledger RUN_DIR` checks any store)."""
        found = []
        counts = self.counts()
        total = sum(counts[f] for f in FATES)
        if total != counts["produced"]:
            found.append(f"fates sum to {total} but {counts['produced']} items were produced")
        if len(self._live) != counts["in_flight"]:
            found.append(f"{counts['in_flight']} items counted in flight, {len(self._live)} held")
        rows = sum(counts[f] for f in SETTLED) + counts["reused"]
        if rows != self.store.rows:
            found.append(f"{rows} settlings and reuses counted, the store holds {self.store.rows} rows")
        if full and self.store.rows <= FULL_CHECK_ROWS:
            self.store.commit()
            found.extend(f"{v.kind}: {v.message}" for v in check(self.store.conn))
        return found

    def balanced(self) -> bool:
        return not self.violations()

    def records(self) -> list[ItemRecord]:
        """Every record (read back from the store: for small ledgers; `pipeline.ledger_store.records`
        streams): the settled ones in the order they settled, then those in flight."""
        self.store.commit()
        return list(records(self.store.conn))

    def to_json(self) -> bytes | None:
        """One record per item as a JSON list (fields: id, group, versions, trained_at, fate, reason):
        the run folder's ledger.json; None beyond `LEDGER_JSON_LIMIT` items (read the store instead:
        `baton ledger RUN_DIR --export`). Commits the store either way."""
        if self._counts["produced"] > LEDGER_JSON_LIMIT:
            self.store.commit()
            return None
        return msgspec.json.encode(self.records())

    def _get(self, item_id: str) -> ItemRecord:
        rec = self._live.get(item_id)
        if rec is None:
            rec = self.store.lookup(item_id)
        if rec is None:
            raise LedgerError(f"item {item_id!r} was never produced")
        return rec


class Ledger(LedgerView):
    """Records the fate of every item (see the module docstring); the reads are `LedgerView`'s."""

    def __init__(self, max_uses: int = 1, store: LedgerStore | None = None) -> None:
        if max_uses < 1:
            raise ValueError(f"max_uses must be >= 1, got {max_uses}")
        self.max_uses = max_uses
        self.store = store if store is not None else LedgerStore(None, max_uses)
        self.store.counts = self.counts
        self._live: dict[str, ItemRecord] = {}  # the items in flight, in production order
        self._counts: Counter[str] = Counter()
        self._sources: dict[str, bytes] = {}
        self._values: dict[str, dict[str, float]] = {}  # item id -> named values, until it settles
        self._pending_redo: list[tuple[str, bytes]] = []  # (group, source) taken, its redo not produced yet
        self._settled: defaultdict[str, defaultdict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self._reasons = ReasonCounts()  # the items settled other than trained, by reason

    @classmethod
    def create(cls, run_dir: str | Path, max_uses: int = 1) -> Ledger:
        """A new ledger whose settled records go to `run_dir`'s ledger.sqlite."""
        return cls(max_uses, LedgerStore.in_folder(run_dir, max_uses))

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
            if item_id in self._live or item_id in fresh:
                raise LedgerError(f"item {item_id!r} produced twice")
            fresh.add(item_id)
        settled = self.store.known(ids)
        if settled:
            raise LedgerError(f"item {settled[0]!r} produced twice")
        made = [ItemRecord(id=item_id, group=group, versions=(lo, hi)) for item_id in ids]
        self._live.update((rec.id, rec) for rec in made)
        self.store.produced(made)
        self._counts["produced"] += len(ids)
        self._counts["in_flight"] += len(ids)
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
        (a resumed run owes the prompts the crashed one had admitted but not produced). The name must be
        new to the sources and the items in flight (settled groups are not searched: name it uniquely)."""
        if group in self._sources or any(rec.group == group for rec in self._live.values()):
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
        """A snapshot for a checkpoint (records in flight copied: later changes do not touch it); the store
        is committed and fsynced first, and its position recorded."""
        position = self.store.sync()
        return LedgerState(
            max_uses=self.max_uses,
            records=[ItemRecord(r.id, r.group, r.versions, list(r.trained_at), r.fate, r.reason)
                     for r in self._live.values()],
            counts=dict(self._counts),
            sources=dict(self._sources),
            pending_redo=list(self._pending_redo),
            values={k: dict(v) for k, v in self._values.items()},
            position=position,
        )

    @classmethod
    def from_state(cls, state: LedgerState, max_uses: int | None = None, store: LedgerStore | None = None) -> Ledger:
        """The ledger `state` describes (`max_uses`: the resumed run's, default the checkpoint's), over
        `store` (default: a new one in memory), rewound to the state's position. A format-1 state (every
        record in it, no position) has its settled records written into the store."""
        max_uses = max_uses if max_uses is not None else state.max_uses
        ledger = cls(max_uses, store)
        live = [r for r in state.records if r.fate == "in_flight"]
        ledger._counts = Counter(state.counts)
        ledger._counts.setdefault("produced", sum(state.counts.get(f, 0) for f in FATES))
        try:
            if state.position is not None:
                ledger.store.rewind(state.position, live)
            else:  # format 1: the state's records replace whatever the store held
                ledger.store.rewind(Position(0), live)
                ledger.store.settled((r, use) for r in state.records if r.fate != "in_flight"
                                     for use in range(max(len(r.trained_at), 1)))
        except StoreError as exc:
            raise LedgerError(str(exc)) from None
        ledger._live = {r.id: r for r in live}
        ledger._sources = dict(state.sources)
        ledger._pending_redo = list(state.pending_redo)
        ledger._values = {k: dict(v) for k, v in state.values.items()}
        ledger._reasons.add_all(settled_reasons(ledger.store.conn))  # the store holds the checkpoint's rows
        problems = ledger.violations(full=False)
        if problems:
            raise LedgerError(f"a checkpointed ledger does not balance: {'; '.join(problems[:5])}")
        return ledger

    def trained(self, ids: Iterable[str], at_version: int) -> None:
        rows: list[tuple[ItemRecord, int]] = []
        try:
            for item_id in ids:
                rec = self._live.pop(item_id, None)
                if rec is not None:  # its first training: it settles
                    rec.trained_at.append(at_version)
                    self._move(rec, "trained", "")
                    rows.append((rec, 0))
                    continue
                rec = self._get(item_id)
                if rec.fate != "trained":
                    raise LedgerError(f"item {item_id!r} is {rec.fate} ({rec.reason}) and cannot be consumed")
                if len(rec.trained_at) >= self.max_uses:
                    raise LedgerError(
                        f"item {item_id!r} already consumed {len(rec.trained_at)} time(s) "
                        f"at versions {rec.trained_at}; max_uses={self.max_uses}"
                    )
                self._counts["reused"] += 1
                rec.trained_at.append(at_version)
                rows.append((rec, len(rec.trained_at) - 1))
        finally:
            self.store.settled(rows)

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

    def _finish(self, ids: Iterable[str], fate: Fate, reason: str) -> None:
        rows: list[tuple[ItemRecord, int]] = []
        try:
            for item_id in ids:
                rec = self._live.pop(item_id, None)
                if rec is None:
                    rec = self._get(item_id)
                    raise LedgerError(f"item {item_id!r} is already {rec.fate}; cannot mark it {fate}")
                self._move(rec, fate, reason)
                rows.append((rec, 0))
        finally:
            self.store.settled(rows)

    def _move(self, rec: ItemRecord, fate: Fate, reason: str) -> None:
        """`rec` (in flight, already out of `_live`) settles as `fate`."""
        if fate in ("trained", "dropped"):
            self._sources.pop(rec.group, None)  # done: it will never be redone
        values = self._values.pop(rec.id, None)
        if values:
            outcome = outcome_of(fate, reason)
            for name, value in values.items():
                self._settled[outcome][name].append(value)
        if fate == "dropped" and outcome_of(fate, reason) == f"dropped:{FILTERED}":
            self._counts["filtered"] += 1
        if fate != "trained":
            self._reasons.add(fate, reason)
        self._counts["in_flight"] -= 1
        self._counts[fate] += 1
        rec.fate = fate
        rec.reason = reason


def outcome_of(fate: str, reason: str) -> str:
    """"trained", or "{fate}:{kind}" where kind is `reason` up to its first ':' (the fate alone if empty)."""
    if fate == "trained":
        return fate
    kind = reason_kind(reason)
    return f"{fate}:{kind}" if kind else fate


__all__ = [
    "FATES", "FILTERED", "LEDGER_JSON_LIMIT", "Fate", "ItemRecord", "Ledger", "LedgerError", "LedgerState",
    "LedgerView", "outcome_of",
]
