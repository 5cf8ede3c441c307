"""The ObjectStore protocol: where payloads live while refs travel.

Every backend (process memory, Ray's object store, Mooncake Store) implements these five async
methods in its own module. The contract every implementation keeps:

* `put` stores the bytes under `key`, replacing any value already there (upsert), and returns
  only once the value is readable by `get` from any client of the store. The bytes come as one
  buffer or as a `Gathered` payload (parts whose concatenation is the value): a store that can send
  from several buffers (Mooncake) sends the parts where they lie, the others join them first.
* `get` returns exactly the bytes that were put, or raises: `KeyNotFound` for a missing key,
  `StoreError` (or a subclass) for any other failure. It never returns an empty result for a
  failure.
* `remove` and `remove_matching` return how many keys they removed; removing a missing key is
  not an error (it returns 0), so eviction is idempotent.
* A store's `name` is carried in every Ref it produced; a consumer refuses refs of another store.
* `pool` is where a producer encodes payloads for this store (memory the store can send from without
  a copy, e.g. Mooncake's registered buffers), or None: the codec's own pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
from typing_extensions import Buffer

if TYPE_CHECKING:
    from buffers.pool import BufferPool


class StoreError(RuntimeError):
    """A store operation failed. Subclasses name the cause; the message names the key."""


class KeyNotFound(StoreError, KeyError):
    """`get` of a key the store does not hold (never stored, evicted, or lost)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else "key not found"


class StoreFull(StoreError):
    """The store cannot take more bytes right now."""


@dataclass(frozen=True)
class Gathered:
    """A value given as its parts, in order: its bytes are their concatenation (`nbytes` in all).

    Each part is a 1-D C-contiguous uint8 array that stays unchanged and alive until the `put` that
    takes it returns. A put of a gathered value stores exactly what a put of `join()` would."""

    parts: tuple[np.ndarray, ...]
    nbytes: int

    def __post_init__(self) -> None:
        if sum(p.nbytes for p in self.parts) != self.nbytes:
            raise ValueError(f"parts of {sum(p.nbytes for p in self.parts)} bytes, not the {self.nbytes} stated")

    def join(self, pool: BufferPool | None = None) -> np.ndarray:
        """The value in one buffer (from `pool` when given): one copy of every part."""
        out = pool.take(self.nbytes) if pool is not None else np.empty(self.nbytes, dtype=np.uint8)
        pos = 0
        for part in self.parts:
            out[pos : pos + part.nbytes] = part
            pos += part.nbytes
        return out


def joined(data: Buffer | Gathered, pool: BufferPool | None = None) -> Buffer:
    """`data` as one buffer: a `Gathered` value joined (into `pool`'s memory when given), any other as it is."""
    return data.join(pool) if isinstance(data, Gathered) else data


@runtime_checkable
class ObjectStore(Protocol):
    name: str
    pool: BufferPool | None

    async def put(self, key: str, data: Buffer | Gathered) -> None: ...

    async def get(self, key: str, size_hint: int | None = None) -> memoryview:
        """`size_hint`: the value's size if the caller knows it (a Ref's nbytes); stores may ignore it."""
        ...

    async def remove(self, key: str) -> int: ...

    async def remove_matching(self, pattern: str) -> int:
        """Remove every key matching the regex `pattern` (re.match semantics)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class StoreSpec(Protocol):
    """How to open a store in a given process: the buffer stage's process holds the data
    (`holder=True`, e.g. mounts the Mooncake segment), every other process is a client. Runtimes
    that place stages in several processes need a spec (or a store that pickles into a client, such
    as RayStore); the local runtime opens the spec once, as holder."""

    name: str

    def open(self, holder: bool) -> ObjectStore: ...

