"""Why items settled as they did: the items of each fate counted by reason, in bounded memory.

A reason is an opaque string to the pipeline (the stage that settles an item writes it). Its *kind*
is the reason up to its first ':' ("stale: 3 > 2" -> "stale"), as in the ledger's outcomes. Counts
are kept per whole reason, so a reader sees "episode failed: environment step raised ValueError:
boom" apart from "episode failed: environment step timed out after 10 s", within two bounds, since
reasons may hold anything (an exception's message, a number):

* an empty reason is counted as `NO_REASON`;
* per fate, at most `KINDS_PER_FATE` kinds; items of further kinds are counted as `OTHER_KINDS`;
* per kind, at most `REASONS_PER_KIND` whole reasons; items of further reasons of that kind are
  counted as "{kind}: ..." (`more_of`).

So every item is counted exactly once whatever the reasons, and the counts of a fate sum to its items.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping

KINDS_PER_FATE = 16
REASONS_PER_KIND = 4
OTHER_KINDS = "other reasons"
NO_REASON = "(no reason)"


def reason_kind(reason: str) -> str:
    """`reason` up to its first ':', stripped ("" for an empty reason)."""
    return reason.split(":", 1)[0].strip()


def more_of(kind: str) -> str:
    """The key that counts a kind's items beyond its first `REASONS_PER_KIND` whole reasons."""
    return f"{kind}: ..."


class ReasonCounts:
    """Items per fate and reason, bounded as the module docstring says."""

    def __init__(self) -> None:
        self._counts: defaultdict[str, Counter[str]] = defaultdict(Counter)  # fate -> key -> items
        self._kept: defaultdict[str, dict[str, set[str]]] = defaultdict(dict)  # fate -> kind -> whole reasons

    def add(self, fate: str, reason: str, n: int = 1) -> None:
        self._counts[fate][self._key(fate, reason or NO_REASON)] += n

    def add_all(self, rows: Iterable[tuple[str, str, int]]) -> None:
        """`(fate, reason, items)` rows, in the order the reasons first appeared."""
        for fate, reason, n in rows:
            self.add(fate, reason, n)

    def as_dict(self) -> dict[str, dict[str, int]]:
        """{fate: {reason: items}}, most items first; fates with none left out."""
        return {fate: dict(counts.most_common()) for fate, counts in self._counts.items() if counts}

    def _key(self, fate: str, reason: str) -> str:
        kinds = self._kept[fate]
        kind = reason_kind(reason)
        kept = kinds.get(kind)
        if kept is None:
            if len(kinds) >= KINDS_PER_FATE:
                return OTHER_KINDS
            kept = kinds[kind] = set()
        if reason in kept or len(kept) < REASONS_PER_KIND:
            kept.add(reason)
            return reason
        return more_of(kind)


def by_kind(reasons: Mapping[str, int]) -> dict[str, int]:
    """One fate's {reason: items} summed per kind, most items first (`OTHER_KINDS` stays itself)."""
    kinds: Counter[str] = Counter()
    for reason, n in reasons.items():
        kinds[reason if reason == OTHER_KINDS else reason_kind(reason)] += n
    return dict(kinds.most_common())


__all__ = [
    "KINDS_PER_FATE", "NO_REASON", "OTHER_KINDS", "REASONS_PER_KIND", "ReasonCounts", "by_kind", "more_of",
    "reason_kind",
]
