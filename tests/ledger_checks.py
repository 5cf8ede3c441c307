"""The invariants of a finished run's `ledger.json`, asserted (shared by the end-to-end tests)."""

from __future__ import annotations

import json
from pathlib import Path

FIELDS = {"id", "group", "versions", "trained_at", "fate", "reason"}


def check_ledger(run_dir: Path, bound: int, max_uses: int = 1) -> list[dict]:
    """Every sample recorded once, with a known fate; trained at most `max_uses` times, each time
    within `bound` versions of the oldest weights that produced it; untrained ones never trained."""
    records = json.loads((run_dir / "ledger.json").read_text())
    assert records, "empty ledger"
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "an item recorded twice"
    for r in records:
        assert set(r) == FIELDS, r
        lo, hi = r["versions"]
        assert lo <= hi
        assert len(r["trained_at"]) <= max_uses, f"{r['id']} trained too often: {r['trained_at']}"
        if r["fate"] == "trained":
            assert all(v - lo <= bound for v in r["trained_at"]), f"{r['id']} trained with staleness above {bound}"
        else:
            assert r["trained_at"] == [], r
            assert r["fate"] in ("dropped", "lost", "regenerated", "in_flight"), r
    return records
