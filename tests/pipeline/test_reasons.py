"""Why samples were not trained, counted by reason (pipeline.reasons, `Ledger.reasons`): whole reasons
apart, bounded per kind and per fate with every item still counted once, and the same counts after a
checkpoint's ledger is reopened from its store (a resumed run)."""

from __future__ import annotations

from pathlib import Path

from pipeline.ledger import Ledger
from pipeline.reasons import KINDS_PER_FATE, OTHER_KINDS, REASONS_PER_KIND, ReasonCounts, by_kind, more_of


def ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}/{i}" for i in range(n)]


def test_whole_reasons_are_told_apart_and_grouped_by_kind() -> None:
    ledger = Ledger()
    for g, n in (("a", 5), ("b", 2), ("c", 3), ("d", 1)):
        ledger.produced(ids(g, n), group=g, versions=(0, 0))
    ledger.dropped(ids("a", 5), "episode failed: environment step raised ValueError: boom")
    ledger.dropped(ids("b", 2), "episode failed: environment step timed out after 10 s")
    ledger.dropped(ids("c", 3), "stale: 3 > 2")
    ledger.lost(ids("d", 1), "")
    assert ledger.reasons() == {
        "dropped": {"episode failed: environment step raised ValueError: boom": 5, "stale: 3 > 2": 3,
                    "episode failed: environment step timed out after 10 s": 2},
        "lost": {"(no reason)": 1},
    }
    assert by_kind(ledger.reasons()["dropped"]) == {"episode failed": 7, "stale": 3}


def test_counts_stay_bounded_and_exact_whatever_the_reasons_hold() -> None:
    counts = ReasonCounts()
    for i in range(100):  # one kind, a different message each time
        counts.add("dropped", f"episode failed: environment step raised KeyError: 'id-{i}'")
    for k in range(KINDS_PER_FATE + 5):  # more kinds than are kept
        counts.add("dropped", f"kind{k}: x", n=2)
    dropped = counts.as_dict()["dropped"]
    assert sum(dropped.values()) == 100 + 2 * (KINDS_PER_FATE + 5)
    assert len(dropped) == REASONS_PER_KIND + 1 + (KINDS_PER_FATE - 1) + 1
    assert dropped[more_of("episode failed")] == 100 - REASONS_PER_KIND
    assert dropped[OTHER_KINDS] == 2 * 6  # the kinds beyond KINDS_PER_FATE (one kind was "episode failed")
    assert by_kind(dropped)["episode failed"] == 100


def test_a_reopened_checkpoint_counts_the_reasons_its_store_holds(tmp_path: Path) -> None:
    ledger = Ledger.create(tmp_path)
    for g in "abcd":
        ledger.produced(ids(g, 2), group=g, versions=(0, 0))
    ledger.dropped(ids("a", 2), "stale: 2 > 1")
    ledger.regenerated(ids("b", 2), "stale: 2 > 1")
    state, at_checkpoint = ledger.state(), ledger.reasons()
    ledger.dropped(ids("c", 2), "filtered: rewards all equal (0)")  # after the checkpoint: not the resumed run's
    ledger.store.commit()
    ledger.store.close()
    again = Ledger.from_state(state, store=Ledger.create(tmp_path).store)
    assert again.reasons() == at_checkpoint == {"dropped": {"stale: 2 > 1": 2}, "regenerated": {"stale: 2 > 1": 2}}
    again.dropped(ids("d", 2), "stale: 2 > 1")
    assert again.reasons()["dropped"] == {"stale: 2 > 1": 4}
