"""VersionClock: the one counter every stage reads.

The consumer owns the clock and is its only writer: version = optimizer steps taken. Everyone else
reads `version` or waits for it to move. Invariant: the version never decreases, and `advance`
wakes every waiter exactly once per change.
"""

from __future__ import annotations

import anyio


class VersionClock:
    def __init__(self, version: int = 0) -> None:
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self._version = version
        self._changed = anyio.Event()

    @property
    def version(self) -> int:
        return self._version

    def advance(self, to: int | None = None) -> int:
        """Move to `to` (default: version + 1) and wake all waiters. Returns the new version."""
        new = self._version + 1 if to is None else to
        if new < self._version:
            raise ValueError(f"version may not go back: {self._version} -> {new}")
        if new != self._version:
            self._version = new
            self._changed.set()
            self._changed = anyio.Event()
        return new

    async def wait_change(self, seen: int) -> int:
        """Return as soon as the version differs from `seen` (at once if it already does)."""
        while self._version == seen:
            await self._changed.wait()
        return self._version

    async def wait_until(self, version: int) -> int:
        """Return once version >= `version`."""
        while self._version < version:
            await self._changed.wait()
        return self._version
