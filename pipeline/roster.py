"""`Roster`: members of one process that come and go during a run, and who hears of it.

A stage adds what it holds (a producer its engines) and removes it when it leaves; another stage
watches (a consumer subscribes each member to what it sends them, and drops the subscription when the
member leaves). The invariants:
* a watcher hears of every member once: those already present when it starts watching, then each one
  added later, in order;
* a member removed is forgotten by every watcher (its `on_leave` ran) before `remove` returns, so nothing
  is sent to it afterwards by a watcher that honours its `on_leave`;
* removing a member that is not present is a no-op (a leave is idempotent).
The roster knows nothing of what its members are; it iterates like the list it replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

Leave = Callable[[], None]
"""What a watcher returns for one member: called once when that member leaves."""


class Roster:
    """The members of this process (see the module docstring)."""

    def __init__(self, members: Iterable[Any] = ()) -> None:
        self._members: list[Any] = list(members)
        self._watchers: list[Callable[[Any], Leave | None]] = []
        self._leaves: dict[int, list[Leave]] = {}

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._members))

    def __len__(self) -> int:
        return len(self._members)

    def __eq__(self, other: object) -> bool:
        """Rosters with the same members, in order, are equal (whoever watches them)."""
        return isinstance(other, Roster) and self._members == other._members

    __hash__ = None  # type: ignore[assignment]  # mutable

    def add(self, member: Any) -> None:
        """A member joins: every watcher hears of it now."""
        self._members.append(member)
        for watcher in self._watchers:
            self._hear(watcher, member)

    def extend(self, members: Iterable[Any]) -> None:
        for member in members:
            self.add(member)

    def remove(self, member: Any) -> None:
        """A member leaves: each watcher's `on_leave` for it runs before this returns."""
        if not any(m is member for m in self._members):
            return
        self._members = [m for m in self._members if m is not member]
        for leave in self._leaves.pop(id(member), []):
            leave()

    def watch(self, on_join: Callable[[Any], Leave | None]) -> None:
        """Call `on_join(member)` for every member present and every one added later; what it returns
        (if anything) is called when that member leaves."""
        self._watchers.append(on_join)
        for member in list(self._members):
            self._hear(on_join, member)

    def _hear(self, watcher: Callable[[Any], Leave | None], member: Any) -> None:
        leave = watcher(member)
        if leave is not None:
            self._leaves.setdefault(id(member), []).append(leave)


__all__ = ["Leave", "Roster"]
