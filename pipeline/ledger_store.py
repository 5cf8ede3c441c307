"""The ledger's store: every settled record of a run, in the order it settled, in the run folder's
`ledger.sqlite`; and the pure functions that read it back (totals, invariant checks, export, one
sample's history).

Why SQLite in WAL mode (Python's standard library) rather than append-only segment files:
* a settled record must still answer by id (a reused sample, `ledger[id]`, `baton ledger --id`, the
  "produced twice" check): an index on `id` answers in O(log n) without reading the run's history;
  segments would need an index of their own;
* a transaction is all or nothing: a process killed mid-write (SIGKILL) leaves the last committed
  state, the WAL's unfinished frames are ignored on reopen; no torn lines to repair;
* a checkpoint's position is a row number, and going back to it on resume is one DELETE;
* the invariant checks are SQL aggregates, run in place, in bounded memory.

Tables:
* `settled`: one row per settling (`use` 0: the item's fate, its reason, the version it was trained
  at if trained) and one per later training of a reused item (`use` n: its n-th reuse). Rows are only
  appended (`seq` = 1, 2, ...), except that a resume deletes those past its checkpoint's position.
* `live`: the items in flight at the last commit (the ledger holds them in memory; this copy lets a
  reader of the file see the whole ledger).
* `meta`: `max_uses` and the ledger's counts at the last commit.

Writes are committed at most every `COMMIT_S` seconds or `COMMIT_ROWS` rows, and whenever the ledger
is read whole or checkpointed (`sync`: committed and fsynced). So a crash loses at most the last
second of settlings, and never any a checkpoint counts on.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec

STORE_FILE = "ledger.sqlite"
COMMIT_S = 1.0
COMMIT_ROWS = 4096
SETTLED_FATES = ("trained", "dropped", "lost", "regenerated")
FATES = (*SETTLED_FATES, "in_flight")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS settled (
    seq INTEGER PRIMARY KEY, id TEXT NOT NULL, grp TEXT NOT NULL, lo INTEGER NOT NULL, hi INTEGER NOT NULL,
    fate TEXT NOT NULL, reason TEXT NOT NULL, at INTEGER, use INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS settled_by_id ON settled(id);
CREATE TABLE IF NOT EXISTS live (id TEXT PRIMARY KEY, grp TEXT NOT NULL, lo INTEGER NOT NULL, hi INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class StoreError(RuntimeError):
    """The store does not hold what a checkpoint says it held (damaged, or another run's)."""


class Position(msgspec.Struct, frozen=True):
    """Where a checkpoint stood in the store: `rows` settled rows, the last of them about item `last`."""

    rows: int
    last: str = ""


Fate = Literal["in_flight", "trained", "dropped", "lost", "regenerated"]


class ItemRecord(msgspec.Struct):
    """One sample's record, as ledger.json has it."""

    id: str
    group: str
    versions: tuple[int, int]
    trained_at: list[int] = msgspec.field(default_factory=list)
    fate: Fate = "in_flight"
    reason: str = ""


def connect(path: Path | str | None) -> sqlite3.Connection:
    """A connection to the store at `path` (None: a private one in memory), its tables made."""
    if path is None:
        conn = sqlite3.connect(":memory:", check_same_thread=False)
    else:
        conn = sqlite3.connect(str(path), check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")  # commits survive a killed process; `sync` fsyncs for checkpoints
    conn.executescript(_SCHEMA)
    conn.commit()
    return conn


class LedgerStore:
    """The writing side, owned by one `pipeline.ledger.Ledger` (one thread at a time). Every commit writes
    the ledger's counts (`counts`, set by the ledger) with the rows, so the file is always consistent."""

    def __init__(self, path: Path | str | None = None, max_uses: int = 1) -> None:
        self.path = Path(path) if path is not None else None
        self.conn = connect(self.path)
        self.rows = self.conn.execute("SELECT coalesce(max(seq), 0) FROM settled").fetchone()[0]
        self._set_meta("max_uses", max_uses)
        self.counts: Callable[[], dict[str, int]] | None = None
        self._pending, self._since = 0, time.monotonic()

    @classmethod
    def in_folder(cls, run_dir: Path | str, max_uses: int = 1) -> LedgerStore:
        return cls(Path(run_dir) / STORE_FILE, max_uses)

    def _set_meta(self, key: str, value: Any) -> None:
        self.conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))

    # -- writing ---------------------------------------------------------------------------------
    def produced(self, records: Iterable[Any]) -> None:
        rows = [(r.id, r.group, r.versions[0], r.versions[1]) for r in records]
        self.conn.executemany("INSERT INTO live (id, grp, lo, hi) VALUES (?, ?, ?, ?)", rows)
        self._wrote(len(rows))

    def settled(self, records: Iterable[tuple[Any, int]]) -> None:
        """Append one row per (record, use): use 0 settles it (it leaves `live`), use n > 0 is a reuse."""
        rows = []
        for rec, use in records:
            self.rows += 1
            at = rec.trained_at[use] if rec.fate == "trained" else None
            rows.append((self.rows, rec.id, rec.group, rec.versions[0], rec.versions[1], rec.fate, rec.reason, at, use))
        self.conn.executemany("INSERT INTO settled VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
        self.conn.executemany("DELETE FROM live WHERE id = ?", [(r[1],) for r in rows if r[8] == 0])
        self._wrote(len(rows))

    def _wrote(self, n: int) -> None:
        self._pending += n
        if self._pending >= COMMIT_ROWS or time.monotonic() - self._since >= COMMIT_S:
            self.commit()

    def commit(self) -> None:
        """Commit everything written, with the ledger's counts (what the invariant checks compare to)."""
        if self.counts is not None:
            self._set_meta("counts", self.counts())
        self.conn.commit()
        self._pending, self._since = 0, time.monotonic()

    def sync(self) -> Position:
        """Commit and make it durable (fsync): the position a checkpoint records."""
        self.commit()
        if self.path is not None:
            for path in (self.path, self.path.with_name(self.path.name + "-wal")):
                if path.exists():
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
        return self.position()

    def position(self) -> Position:
        row = self.conn.execute("SELECT id FROM settled WHERE seq = ?", (self.rows,)).fetchone()
        return Position(self.rows, row[0] if row else "")

    def rewind(self, position: Position, live: Iterable[Any]) -> None:
        """Go back to a checkpoint: rows past `position` are deleted (they settled after it), `live` becomes
        the items in flight. Raises `StoreError` when the store does not hold the checkpoint's rows."""
        if self.rows < position.rows or self.position_at(position.rows) != position.last:
            raise StoreError(
                f"the ledger store {self.path} holds {self.rows} settled rows, ending differently from the "
                f"checkpoint's {position.rows} (last {position.last!r}): it is damaged or another run's"
            )
        self.conn.execute("DELETE FROM settled WHERE seq > ?", (position.rows,))
        self.conn.execute("DELETE FROM live")
        self.rows = position.rows
        self.produced(live)
        self.commit()

    def position_at(self, rows: int) -> str:
        row = self.conn.execute("SELECT id FROM settled WHERE seq = ?", (rows,)).fetchone()
        return row[0] if row else ""

    # -- reading (the ledger's own connection: what it wrote, committed or not) --------------------
    def known(self, ids: list[str]) -> list[str]:
        """Those of `ids` that settled already."""
        found: list[str] = []
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            marks = ",".join("?" * len(chunk))
            query = f"SELECT DISTINCT id FROM settled WHERE id IN ({marks})"
            found.extend(r[0] for r in self.conn.execute(query, chunk))
        return found

    def lookup(self, item_id: str) -> ItemRecord | None:
        return history(self.conn, item_id)

    def close(self) -> None:
        self.conn.close()


# ---------------------------------------------------------------------------------------------- reading


def history(conn: sqlite3.Connection, item_id: str) -> ItemRecord | None:
    """The record of settled item `item_id` (its fate, reason and every training), or None."""
    rows = conn.execute(
        "SELECT grp, lo, hi, fate, reason, at, use FROM settled WHERE id = ? ORDER BY seq", (item_id,)
    ).fetchall()
    if not rows:
        row = conn.execute("SELECT grp, lo, hi FROM live WHERE id = ?", (item_id,)).fetchone()
        return ItemRecord(item_id, row[0], (row[1], row[2])) if row else None
    grp, lo, hi, fate, reason, _, _ = rows[0]
    return ItemRecord(item_id, grp, (lo, hi), [r[5] for r in rows if r[5] is not None], fate, reason)


def records(conn: sqlite3.Connection, upto: int | None = None) -> Iterator[ItemRecord]:
    """Every record: the settled ones in the order they settled (each with all its trainings), then those
    in flight. With `upto` (a checkpoint's position), only the settled rows up to it, and nothing in flight
    (the checkpoint holds those)."""
    last = upto if upto is not None else -1
    reuses = conn.execute("SELECT 1 FROM meta WHERE key = 'max_uses' AND CAST(value AS INTEGER) > 1").fetchone()
    query = "SELECT id, grp, lo, hi, fate, reason, at FROM settled WHERE use = 0 AND (? < 0 OR seq <= ?) ORDER BY seq"
    for item_id, grp, lo, hi, fate, reason, at in conn.execute(query, (last, last)):
        trained_at = [] if at is None else [at]
        if reuses and at is not None:
            trained_at.extend(r[0] for r in conn.execute(
                "SELECT at FROM settled WHERE id = ? AND use > 0 AND (? < 0 OR seq <= ?) ORDER BY use",
                (item_id, last, last)))
        yield ItemRecord(item_id, grp, (lo, hi), trained_at, fate, reason)
    if upto is None:
        for item_id, grp, lo, hi in conn.execute("SELECT id, grp, lo, hi FROM live ORDER BY rowid"):
            yield ItemRecord(item_id, grp, (lo, hi))


def export_jsonl(conn: sqlite3.Connection, path: Path | str) -> int:
    """Write one JSON record per sample (the fields of ledger.json) to `path`; returns how many."""
    encoder, n = msgspec.json.Encoder(), 0
    with open(path, "wb") as f:
        for rec in records(conn):
            f.write(encoder.encode(rec) + b"\n")
            n += 1
    return n


def meta(conn: sqlite3.Connection) -> dict[str, Any]:
    return {k: json.loads(v) for k, v in conn.execute("SELECT key, value FROM meta")}


def totals(conn: sqlite3.Connection) -> dict[str, int]:
    """What the rows hold: items per fate, "produced" (their sum), "filtered" and "reused" (see Ledger.counts)."""
    found = dict.fromkeys(FATES, 0)
    found.update(conn.execute("SELECT fate, count(*) FROM settled WHERE use = 0 GROUP BY fate").fetchall())
    found["in_flight"] = conn.execute("SELECT count(*) FROM live").fetchone()[0]
    return {
        "produced": sum(found[f] for f in FATES), **found,
        "filtered": conn.execute(
            "SELECT count(*) FROM settled WHERE use = 0 AND fate = 'dropped' AND reason LIKE 'filtered%'"
        ).fetchone()[0],
        "reused": conn.execute("SELECT count(*) FROM settled WHERE use > 0").fetchone()[0],
    }


def settled_reasons(conn: sqlite3.Connection) -> list[tuple[str, str, int]]:
    """(fate, reason, items) of the items that settled other than trained, in the order each reason first
    appeared (for pipeline.reasons.ReasonCounts)."""
    return conn.execute(
        "SELECT fate, reason, count(*) FROM settled WHERE use = 0 AND fate != 'trained' "
        "GROUP BY fate, reason ORDER BY min(seq)"
    ).fetchall()


class Violation(msgspec.Struct, frozen=True):
    kind: str  # settled twice | trained twice | over max_uses | over the bound | lost uncounted | bad record
    message: str


def check(conn: sqlite3.Connection, bound: int | None = None, limit: int = 20) -> list[Violation]:
    """Every broken invariant the store shows (at most `limit` examples of each kind): an item with more
    than one fate, trained twice at one version, trained more than `max_uses` times, trained more than
    `bound` versions after its oldest token (when `bound` is given), records whose versions or
    trainings are malformed, and counts that disagree with the rows (an item lost uncounted)."""
    max_uses = int(meta(conn).get("max_uses", 1))
    queries = {
        "settled twice": ("SELECT id, group_concat(fate) FROM settled GROUP BY id "
                          "HAVING sum(use = 0) != 1 OR min(fate) != max(fate) LIMIT ?", (limit,),
                          "{0} has fates {1}"),
        "trained twice": ("SELECT id, at, count(*) FROM settled WHERE fate = 'trained' GROUP BY id, at "
                          "HAVING count(*) > 1 LIMIT ?", (limit,), "{0} trained {2} times at version {1}"),
        "over max_uses": ("SELECT id, count(*) FROM settled WHERE fate = 'trained' GROUP BY id HAVING count(*) > ? "
                          "LIMIT ?", (max_uses, limit), "{0} trained {1} times (max_uses = " + str(max_uses) + ")"),
        "bad record": ("SELECT id, lo, hi, fate, at FROM settled WHERE lo > hi OR (fate = 'trained') != "
                       "(at IS NOT NULL) LIMIT ?", (limit,), "{0}: versions [{1}, {2}], fate {3}, trained at {4}"),
    }
    if bound is not None:
        queries["over the bound"] = (
            "SELECT id, at, lo FROM settled WHERE fate = 'trained' AND at - lo > ? LIMIT ?", (bound, limit),
            "{0} trained at version {1}, made from version {2}: staleness above " + str(bound),
        )
    found = [Violation(kind, text.format(*row))
             for kind, (sql, args, text) in queries.items() for row in conn.execute(sql, args)]
    return found + _uncounted(conn)


def _uncounted(conn: sqlite3.Connection) -> list[Violation]:
    """Counts the ledger kept (at its last commit) that the rows do not bear out."""
    counts = meta(conn).get("counts")
    if counts is None:
        return []
    rows, found = totals(conn), []
    for key in ("produced", *FATES, "filtered", "reused"):
        if counts.get(key, 0) != rows[key]:
            found.append(Violation("lost uncounted", f"{key}: the ledger counted {counts.get(key, 0)}, "
                                                     f"its records hold {rows[key]}"))
    return found


def open_run(run_dir: Path | str) -> sqlite3.Connection:
    """The store of run folder `run_dir`, to read (raises FileNotFoundError when it has none). A run still
    going may write meanwhile: a reader sees its last commit."""
    path = Path(run_dir) / STORE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} holds no {STORE_FILE} (not a run folder, or a run older than the store)")
    return sqlite3.connect(path)


__all__ = [
    "COMMIT_ROWS", "COMMIT_S", "STORE_FILE", "Fate", "ItemRecord", "LedgerStore", "Position", "StoreError", "Violation",
    "check",
    "connect", "export_jsonl", "history", "meta", "open_run", "records", "settled_reasons", "totals",
]
