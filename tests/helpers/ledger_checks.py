"""The invariants of a finished run's ledger, asserted from its store (shared by the end-to-end tests)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from pipeline.ledger_store import check, meta, open_run, records

FIELDS = {"id", "group", "versions", "trained_at", "fate", "reason"}


def check_ledger(run_dir: Path, bound: int, max_uses: int = 1) -> list[dict]:
    """Every sample recorded once, with a known fate; trained at most `max_uses` times, each time
    within `bound` versions of the oldest weights that produced it; untrained ones never trained;
    the counts the run kept match its records (`pipeline.ledger_store.check`). Read from the run's
    ledger store; its ledger.json, when written, holds exactly the same records."""
    conn = open_run(run_dir)
    try:
        assert int(meta(conn)["max_uses"]) <= max_uses
        problems = check(conn, bound=bound)
        assert not problems, problems
        found = json.loads(msgspec.json.encode(list(records(conn))))  # as JSON has them (lists, not tuples)
    finally:
        conn.close()
    assert found, "empty ledger"
    ids = [r["id"] for r in found]
    assert len(ids) == len(set(ids)), "an item recorded twice"
    for r in found:
        assert set(r) == FIELDS, r
        lo, hi = r["versions"]
        assert lo <= hi
        assert len(r["trained_at"]) <= max_uses, f"{r['id']} trained too often: {r['trained_at']}"
        if r["fate"] == "trained":
            assert all(v - lo <= bound for v in r["trained_at"]), f"{r['id']} trained with staleness above {bound}"
        else:
            assert r["trained_at"] == [], r
            assert r["fate"] in ("dropped", "lost", "regenerated", "in_flight"), r
    if (run_dir / "ledger.json").exists():
        assert json.loads((run_dir / "ledger.json").read_text()) == found, "ledger.json is the store's export"
    return found
