"""The ObjectStore protocol: where payloads live while refs travel.

Every backend (process memory, Ray's object store, Mooncake Store) implements these five async
methods in its own module. The contract every implementation keeps:

* `put` stores the bytes under `key`, replacing any value already there (upsert), and returns
  only once the value is readable by `get` from any client of the store.
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

from typing import TYPE_CHECKING, Protocol, runtime_checkable

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


@runtime_checkable
class ObjectStore(Protocol):
    name: str
    pool: BufferPool | None

    async def put(self, key: str, data: Buffer) -> None: ...

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

