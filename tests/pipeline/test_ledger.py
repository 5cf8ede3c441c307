"""Ledger: fates, counts and balance, illegal transitions, and the JSON file."""

from __future__ import annotations

import json

import pytest

from pipeline.ledger import Ledger, LedgerError


def ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}/{i}" for i in range(n)]


def test_counts_and_balance_after_mixed_fates() -> None:
    ledger = Ledger()
    ledger.produced(ids("g0", 4), group="g0", versions=(0, 0))
    ledger.produced(ids("g1", 3), group="g1", versions=(0, 1))
    ledger.produced(ids("g2", 2), group="g2", versions=(1, 1))
    ledger.produced(ids("g3", 2), group="g3", versions=(2, 2))
    ledger.trained(ids("g0", 4), at_version=1)
    ledger.dropped(ids("g1", 3)[:2], reason="stale")
    ledger.lost(["g1/2"], reason="store lost it")
    ledger.regenerated(ids("g2", 2), reason="requeue")
    assert len(ledger) == 11
    assert ledger.counts() == {
        "produced": 11, "trained": 4, "dropped": 2, "lost": 1, "regenerated": 2, "in_flight": 2,
        "filtered": 0, "reused": 0,
    }
    assert ledger.violations() == []
    assert ledger.balanced()
    assert ledger["g0/0"].trained_at == [1]
    assert ledger["g1/0"].fate == "dropped" and ledger["g1/0"].reason == "stale"
    assert ledger["g1/2"].fate == "lost"
    assert ledger["g2/1"].fate == "regenerated"
    assert ledger["g3/0"].fate == "in_flight"
    assert ledger["g1/1"].versions == (0, 1)


def test_empty_ledger_is_balanced() -> None:
    ledger = Ledger()
    assert ledger.counts()["produced"] == 0
    assert ledger.violations() == []


def test_trained_twice_raises_with_max_uses_one() -> None:
    ledger = Ledger(max_uses=1)
    ledger.produced(["a"], group="g", versions=(0, 0))
    ledger.trained(["a"], at_version=1)
    with pytest.raises(LedgerError, match="max_uses=1"):
        ledger.trained(["a"], at_version=2)
    assert ledger["a"].trained_at == [1]
    assert ledger.counts()["trained"] == 1
    assert ledger.balanced()


def test_reuse_allowed_up_to_max_uses() -> None:
    ledger = Ledger(max_uses=3)
    ledger.produced(["a", "b"], group="g", versions=(0, 0))
    for v in (1, 2, 3):
        ledger.trained(["a"], at_version=v)
    assert ledger["a"].trained_at == [1, 2, 3]
    with pytest.raises(LedgerError):
        ledger.trained(["a"], at_version=4)
    counts = ledger.counts()
    # a reused item is still one item with one fate
    assert counts["trained"] == 1 and counts["in_flight"] == 1 and counts["produced"] == 2
    assert ledger.balanced()


def test_max_uses_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Ledger(max_uses=0)


def test_dropping_a_trained_item_raises() -> None:
    ledger = Ledger()
    ledger.produced(["a"], group="g", versions=(0, 0))
    ledger.trained(["a"], at_version=0)
    with pytest.raises(LedgerError, match="already trained"):
        ledger.dropped(["a"], reason="stale")
    with pytest.raises(LedgerError):
        ledger.lost(["a"], reason="x")
    with pytest.raises(LedgerError):
        ledger.regenerated(["a"], reason="x")
    assert ledger["a"].fate == "trained"


@pytest.mark.parametrize("first", ["dropped", "lost", "regenerated"])
def test_terminal_items_cannot_be_trained_or_finished_again(first: str) -> None:
    ledger = Ledger(max_uses=5)
    ledger.produced(["a"], group="g", versions=(0, 0))
    getattr(ledger, first)(["a"], reason="r")
    with pytest.raises(LedgerError, match="cannot be consumed"):
        ledger.trained(["a"], at_version=1)
    with pytest.raises(LedgerError, match="already"):
        ledger.dropped(["a"], reason="again")
    assert ledger["a"].fate == first
    assert ledger.balanced()


def test_unknown_id_raises() -> None:
    ledger = Ledger()
    for call in (
        lambda: ledger.trained(["nope"], at_version=0),
        lambda: ledger.dropped(["nope"], reason="x"),
        lambda: ledger.lost(["nope"], reason="x"),
        lambda: ledger.regenerated(["nope"], reason="x"),
    ):
        with pytest.raises(LedgerError, match="never produced"):
            call()


def test_produced_twice_raises() -> None:
    ledger = Ledger()
    ledger.produced(["a"], group="g", versions=(0, 0))
    with pytest.raises(LedgerError, match="produced twice"):
        ledger.produced(["a"], group="g2", versions=(1, 1))
    assert ledger["a"].group == "g"
    assert ledger.counts()["produced"] == 1


def test_versions_must_be_ordered() -> None:
    ledger = Ledger()
    with pytest.raises(LedgerError):
        ledger.produced(["a"], group="g", versions=(2, 1))
    assert len(ledger) == 0


def test_json_records(tmp_path) -> None:
    ledger = Ledger(max_uses=2)
    ledger.produced(["g0/0", "g0/1"], group="g0", versions=(0, 1))
    ledger.produced(["g1/0"], group="g1", versions=(2, 2))
    ledger.trained(["g0/0"], at_version=2)
    ledger.trained(["g0/0"], at_version=3)
    ledger.dropped(["g0/1"], reason="stale")
    rows = json.loads(ledger.to_json())
    assert isinstance(rows, list) and len(rows) == 3
    by_id = {r["id"]: r for r in rows}
    for r in rows:
        assert set(r) == {"id", "group", "versions", "trained_at", "fate", "reason"}
    assert by_id["g0/0"] == {
        "id": "g0/0", "group": "g0", "versions": [0, 1], "trained_at": [2, 3], "fate": "trained", "reason": "",
    }
    assert by_id["g0/1"]["fate"] == "dropped" and by_id["g0/1"]["reason"] == "stale"
    assert by_id["g1/0"] == {
        "id": "g1/0", "group": "g1", "versions": [2, 2], "trained_at": [], "fate": "in_flight", "reason": "",
    }


def test_sources_are_kept_for_redo_and_forgotten_when_done() -> None:
    ledger = Ledger()
    ledger.produced(["a/0", "a/1"], "a", (0, 0), source=b"prompt-a")
    ledger.produced(["b/0"], "b", (0, 0), source=b"prompt-b")
    ledger.lost(["a/0", "a/1"], "gone")
    assert ledger.take_source("a") == b"prompt-a"
    with pytest.raises(LedgerError, match="no source"):
        ledger.take_source("a")  # taken once: the redo owns it now
    ledger.trained(["b/0"], at_version=0)
    with pytest.raises(LedgerError, match="no source"):
        ledger.take_source("b")  # trained: never redone, so not kept


def test_reuse_and_filtered_are_counted_without_changing_fates() -> None:
    ledger = Ledger(max_uses=3)
    ledger.produced(ids("a", 2), group="a", versions=(0, 0))
    ledger.produced(ids("b", 2), group="b", versions=(0, 0))
    ledger.produced(ids("c", 2), group="c", versions=(1, 1))
    for v in (0, 1, 2):
        ledger.trained(ids("a", 2), at_version=v)
    ledger.trained(ids("b", 2), at_version=1)
    ledger.dropped(ids("c", 2), reason="filtered: rewards all equal (0.5)")
    counts = ledger.counts()
    assert counts["trained"] == 4 and counts["reused"] == 4  # a/0 and a/1 twice each beyond the first use
    assert counts["dropped"] == 2 and counts["filtered"] == 2
    assert sum(counts[f] for f in ("trained", "dropped", "lost", "regenerated", "in_flight")) == counts["produced"]
    assert ledger.balanced()
    assert ledger["a/0"].trained_at == [0, 1, 2]


def test_a_stale_drop_is_not_counted_as_filtered() -> None:
    ledger = Ledger()
    ledger.produced(["a"], group="a", versions=(0, 0))
    ledger.dropped(["a"], reason="stale: 3 > 2")
    assert ledger.counts()["filtered"] == 0 and ledger.counts()["dropped"] == 1
