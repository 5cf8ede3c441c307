"""`MemoryStore`: the ObjectStore protocol in process memory, without copying payloads.

Ownership: `put` keeps a read-only memoryview of the caller's buffer, not a copy. From that call
on the buffer belongs to the store: the caller must not mutate it (a payload from `codec.encode`
is read-only already). `get` returns a new read-only memoryview of the same bytes.

Invariants:
* `nbytes` is the sum of the sizes of the values currently held, and never exceeds
  `capacity_bytes` (when set); a `put` that would exceed it raises `StoreFull` and changes nothing;
* `put` is an upsert: replacing a key releases the old value's bytes from the accounting first.

Every method yields to the event loop once (`anyio.lowlevel.checkpoint`), as a real store would;
the state change itself happens after that checkpoint, atomically.
"""

from __future__ import annotations

import re

import anyio.lowlevel
from typing_extensions import Buffer

from buffers.pool import shared_pool
from buffers.store import Gathered, KeyNotFound, StoreFull, joined

__all__ = ["MemoryStore"]


class MemoryStore:
    """An in-process, optionally capacity-bounded ObjectStore."""

    def __init__(self, name: str = "memory", capacity_bytes: int | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        self.name = name
        self.pool = None  # payloads are encoded into the codec's own pool
        self.capacity_bytes = capacity_bytes
        self._values: dict[str, memoryview] = {}
        self._nbytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes held (sum of value sizes)."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._values)

    def keys(self) -> list[str]:
        """A snapshot of the keys held, in insertion order."""
        return list(self._values)

    async def put(self, key: str, data: Buffer | Gathered) -> None:
        """Store `data` under `key` (upsert), taking ownership of the buffer without copying it (a gathered
        value is joined into one pooled buffer: one copy)."""
        await anyio.lowlevel.checkpoint()
        view = memoryview(joined(data, shared_pool()))
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        view = view.toreadonly()
        old = self._values.get(key)
        total = self._nbytes - (old.nbytes if old is not None else 0) + view.nbytes
        if self.capacity_bytes is not None and total > self.capacity_bytes:
            raise StoreFull(
                f"store {self.name!r} cannot put {key!r} ({view.nbytes} bytes): it holds {self._nbytes} "
                f"of {self.capacity_bytes} bytes and would need {total}"
            )
        self._values[key] = view
        self._nbytes = total

    async def get(self, key: str, size_hint: int | None = None) -> memoryview:
        """A read-only view of the bytes stored under `key`; `KeyNotFound` if there are none."""
        await anyio.lowlevel.checkpoint()
        try:
            return self._values[key][:]
        except KeyError:
            raise KeyNotFound(f"key {key!r} not found in store {self.name!r}") from None

    async def remove(self, key: str) -> int:
        """Drop `key`; returns 1, or 0 if it was not held."""
        await anyio.lowlevel.checkpoint()
        view = self._values.pop(key, None)
        if view is None:
            return 0
        self._nbytes -= view.nbytes
        return 1

    async def remove_matching(self, pattern: str) -> int:
        """Drop every key that `re.match`es `pattern`; returns how many were dropped."""
        await anyio.lowlevel.checkpoint()
        regex = re.compile(pattern)
        doomed = [key for key in self._values if regex.match(key)]
        for key in doomed:
            self._nbytes -= self._values.pop(key).nbytes
        return len(doomed)

    async def close(self) -> None:
        """Drop every value."""
        await anyio.lowlevel.checkpoint()
        self._values.clear()
        self._nbytes = 0
