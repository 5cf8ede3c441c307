"""`RayStore`: the ObjectStore protocol on Ray's object store (Miles's `--object-store-backend ray`).

Layout. Every payload is one Ray object, a 1-D numpy uint8 array, so Ray moves it as a single
out-of-band buffer and never pickles its contents. A small named async actor, `RayStoreIndex`
(`num_cpus=0`, named `baton-ray-store/<name>` in the Ray namespace, `get_if_exists=True`), maps
key -> (ObjectRef, nbytes); every process of a run that opens `RayStore(name=...)` (driver, producer
actors, learner) sees the same keys. Refs cross the actor boundary wrapped in a list so Ray passes
them as refs instead of resolving them.

Ownership and what survives which death (Ray 2.60, measured by tests/buffers/test_ray_store.py):

* `ray.put(..., _owner=actor)` was removed in Ray 2.56 (it raises ValueError in 2.60), so a process
  cannot hand ownership of its own put to the index. With `owner="index"` (the default) the payload
  therefore travels to the index as a call argument (Ray writes it to plasma once) and the index
  `ray.put`s it again (one plasma-to-plasma memcpy), so the index owns the stored copy; the
  caller's argument object is released when the call returns. `put` returns after that.
  **A producer that dies after `put` returned loses nothing**: its batches stay readable.
* `owner="producer"` skips the second copy: the caller `ray.put`s and owns the object, the index
  only borrows the ref. Then a producer's death loses its objects: once Ray notices (1-2 s here;
  until then a get may still read the intact bytes) `get` raises `RayObjectLost` (OwnerDiedError)
  naming the key, never empty data.
* The index owns every `owner="index"` object, so **the index's death loses the whole store**:
  `get` then raises `RayIndexUnavailable` (RayActorError). The index is not detached by default,
  so Ray kills it when the process that created it (the first to open the name) exits: open the
  store first in the long-lived process of the run (the driver), or pass `lifetime="detached"`.
* `close()` drops this process's handle; only the creating handle's `close()` (or `destroy()`
  from anywhere) kills the index. Ray would also collect a non-detached named actor once its
  creator drops every handle; this module pins the handles it opened until then, so dropping a
  RayStore object without `close()` loses nothing while its process lives.

Zero copy. `get` returns a read-only memoryview over the numpy array that `await ref` yields, a
view into plasma (the array does not own its data); bytes are not copied on the read side.

Contract. `put` is an upsert (the old ref is dropped, so Ray frees the old object once no reader
holds it); `get` of a missing key raises `KeyNotFound`; a `size_hint` that differs from the
stored size raises `RaySizeMismatch` before any data moves; `capacity_bytes` bounds the store's
total bytes (all processes) for this handle's puts (`RayStoreFull`, nothing changes); `remove` and
`remove_matching` (re.match on keys) return counts, 0 for a missing key.

Costs measured on the 2-core dev box (one local node, other work running: load 1-2.7; medians):
`ray.init` 5-7 s once per process tree; a new index actor about 1 s (a new worker process); an
awaited index call 2.6 ms (a lookup that returns a ref 4 ms); put (owner="index") 1 KiB 5 ms,
1 MiB 9-10 ms, 16 MiB 25-45 ms; put (owner="producer") 5-7 / 6-8 / 13-19 ms; get 4-6 ms at any
size up to 16 MiB (the lookup call plus a 0.5 ms plasma view). Ray noticed a killed owner's
objects as lost about 1-2 s after `ray.kill`. Payloads larger than `INLINE_BYTES` are serialised in
a worker thread so the event loop keeps running; the index copies them in a thread too.

All Ray calls are awaited, so the methods need an asyncio event loop (anyio's asyncio backend).
"""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from collections.abc import Callable
from typing import Any, Literal

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every Ray listener on 127.0.0.1

import anyio
import numpy as np
import ray
from ray import exceptions as rex
from typing_extensions import Buffer

from buffers.pool import shared_pool
from buffers.store import Gathered, KeyNotFound, StoreError, StoreFull, joined

__all__ = [
    "INLINE_BYTES", "RayIndexUnavailable", "RayObjectLost", "RaySizeMismatch", "RayStore", "RayStoreError",
    "RayStoreFull", "RayStoreIndex",
]

INLINE_BYTES = 2 << 20  # larger payloads are serialised / copied in a worker thread
ACTOR_PREFIX = "baton-ray-store/"

# Ray errors meaning "the object's data is gone" (as opposed to "the index is gone").
_LOST = (rex.ObjectLostError, rex.ObjectFetchTimedOutError, rex.ObjectFreedError,
         rex.ReferenceCountingAssertionError, rex.WorkerCrashedError, rex.NodeDiedError, rex.LocalRayletDiedError)


def _describe(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:300]}"


class RayStoreError(StoreError):
    """A Ray object store operation failed; `.key` names the key, `.cause` the Ray error if any."""

    def __init__(self, message: str, key: str = "", cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.cause = cause


class RayObjectLost(RayStoreError):
    """The index still lists the key, but Ray cannot produce its data (owner died, object lost)."""


class RayIndexUnavailable(RayStoreError):
    """The index actor is dead or unreachable: every key of the store is gone with it."""


class RaySizeMismatch(RayStoreError):
    """The stored value's size differs from the size the caller's ref carries."""


class RayStoreFull(RayStoreError, StoreFull):
    """The put would exceed `capacity_bytes`, or Ray's object store cannot take the object."""


class RayStoreIndex:
    """key -> ([ObjectRef], nbytes). Runs as a named async Ray actor; owns the objects it `ray.put`s."""

    def __init__(self, store_name: str, creator: str) -> None:
        self._store_name = store_name
        self._creator = creator
        self._refs: dict[str, list[ray.ObjectRef]] = {}
        self._sizes: dict[str, int] = {}
        self._nbytes = 0
        self._put_lock = asyncio.Lock()

    def _full(self, key: str, nbytes: int, capacity: int | None) -> str | None:
        total = self._nbytes - self._sizes.get(key, 0) + nbytes
        if capacity is not None and total > capacity:
            return (f"store {self._store_name!r} cannot put {key!r} ({nbytes} bytes): it holds {self._nbytes} of "
                    f"{capacity} bytes and would need {total}")
        return None

    def _commit(self, key: str, ref: ray.ObjectRef, nbytes: int) -> None:
        self._nbytes += nbytes - self._sizes.get(key, 0)
        self._refs[key] = [ref]  # replacing drops the old ref: Ray frees it once no reader borrows it
        self._sizes[key] = nbytes

    async def put(self, key: str, data: np.ndarray, capacity: int | None) -> str | None:
        """Copy `data` into an object this actor owns; None, or why the store is full."""
        async with self._put_lock:  # one copy at a time keeps the capacity check exact
            full = self._full(key, data.nbytes, capacity)
            if full:
                return full
            try:
                if data.nbytes > INLINE_BYTES:
                    ref = await asyncio.to_thread(ray.put, data)
                else:
                    ref = ray.put(data)
            except (rex.ObjectStoreFullError, rex.OutOfDiskError) as exc:
                return f"ray cannot store {key!r} ({data.nbytes} bytes): {_describe(exc)}"
            self._commit(key, ref, data.nbytes)
            return None

    async def adopt(self, key: str, refs: list[ray.ObjectRef], nbytes: int, capacity: int | None) -> str | None:
        """Record an object the caller owns (owner="producer"); None, or why the store is full."""
        full = self._full(key, nbytes, capacity)
        if full:
            return full
        self._commit(key, refs[0], nbytes)
        return None

    async def lookup(self, key: str) -> tuple[list[ray.ObjectRef], int] | None:
        refs = self._refs.get(key)
        return None if refs is None else (refs, self._sizes[key])

    async def remove(self, key: str) -> int:
        if self._refs.pop(key, None) is None:
            return 0
        self._nbytes -= self._sizes.pop(key)
        return 1

    async def remove_matching(self, pattern: str) -> int:
        regex = re.compile(pattern)
        doomed = [key for key in self._refs if regex.match(key)]
        for key in doomed:
            del self._refs[key]
            self._nbytes -= self._sizes.pop(key)
        return len(doomed)

    async def keys(self) -> list[str]:
        return list(self._refs)

    async def nbytes(self) -> int:
        return self._nbytes

    async def creator(self) -> str:
        return self._creator


_IndexActor = ray.remote(num_cpus=0)(RayStoreIndex)

# A non-detached named actor is garbage-collected once its creator drops its last handle, which
# would lose the store if a creating RayStore object were simply dropped. This process's handles
# are pinned here until the creating RayStore's close() / destroy(), or until the process exits.
_PINNED: dict[tuple[str | None, str], Any] = {}


def _reopen(kwargs: dict[str, Any]) -> RayStore:
    return RayStore(**kwargs)


class RayStore:
    """`RayStore(name="run-1")` in every process of a run (after `ray.init`); see the module docstring."""

    def __init__(
        self,
        name: str = "ray",
        *,
        namespace: str | None = None,
        capacity_bytes: int | None = None,
        owner: Literal["index", "producer"] = "index",
        lifetime: Literal["detached"] | None = None,
        get_timeout_s: float | None = 60.0,
    ) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 or None, got {capacity_bytes}")
        if owner not in ("index", "producer"):
            raise ValueError(f"owner must be 'index' or 'producer', got {owner!r}")
        if not ray.is_initialized():
            raise StoreError(f"RayStore {name!r} needs a connected Ray: call ray.init() first")
        self.name = name
        self.pool = None  # payloads are encoded into the codec's own pool
        self.namespace = namespace
        self.capacity_bytes = capacity_bytes
        self.owner = owner
        self.lifetime = lifetime
        self.get_timeout_s = get_timeout_s
        self._token = uuid.uuid4().hex
        options: dict[str, Any] = {"name": ACTOR_PREFIX + name, "get_if_exists": True, "lifetime": lifetime}
        if namespace is not None:
            options["namespace"] = namespace
        self._index: Any = _IndexActor.options(**options).remote(name, self._token)
        _PINNED.setdefault((namespace, name), self._index)  # the first handle: a later one may not count

    def __reduce__(self):
        """A store sent to another process re-opens the same index there (it is never its creator)."""
        return _reopen, ({
            "name": self.name, "namespace": self.namespace, "capacity_bytes": self.capacity_bytes,
            "owner": self.owner, "lifetime": self.lifetime, "get_timeout_s": self.get_timeout_s,
        },)

    # -- helpers -----------------------------------------------------------------------------------
    def _handle(self, key: str) -> Any:
        if self._index is None:
            raise RayStoreError(f"store {self.name!r} is closed (operation on {key!r})", key)
        return self._index

    async def _call(self, key: str, op: str, method: str, *args: Any) -> Any:
        index = self._handle(key)
        return await self._typed(key, op, lambda: getattr(index, method).remote(*args))

    async def _typed(self, key: str, op: str, call: Callable[[], Any]) -> Any:
        """Make and await a call on the index actor, with Ray's failures as this store's typed errors."""
        try:
            return await call()
        except rex.RayActorError as exc:
            raise RayIndexUnavailable(
                f"store {self.name!r}: {op} of {key!r} failed: the index actor is gone ({_describe(exc)})", key, exc
            ) from exc
        except rex.RayError as exc:
            raise RayStoreError(f"store {self.name!r}: {op} of {key!r} failed: {_describe(exc)}", key, exc) from exc

    # -- the five protocol methods -------------------------------------------------------------------
    async def put(self, key: str, data: Buffer | Gathered) -> None:
        """Upsert `data` under `key` (a gathered value joined first); returns once any process of the run can
        `get` it."""
        view = memoryview(joined(data, shared_pool()))
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        arr = np.frombuffer(view, dtype=np.uint8)
        index = self._handle(key)
        big = arr.nbytes > INLINE_BYTES
        try:
            if self.owner == "index":
                submit = lambda: index.put.remote(key, arr, self.capacity_bytes)  # noqa: E731
                pending = await anyio.to_thread.run_sync(submit) if big else submit()
            else:
                ref = await anyio.to_thread.run_sync(ray.put, arr) if big else ray.put(arr)
                pending = index.adopt.remote(key, [ref], arr.nbytes, self.capacity_bytes)
        except (rex.ObjectStoreFullError, rex.OutOfDiskError) as exc:
            raise RayStoreFull(f"store {self.name!r}: ray cannot take {key!r} ({arr.nbytes} bytes): "
                               f"{_describe(exc)}", key, exc) from exc
        full = await self._typed(key, "put", lambda: pending)
        if full is not None:
            raise RayStoreFull(full, key)

    async def get(self, key: str, size_hint: int | None = None) -> memoryview:
        """A read-only view (into plasma, no copy) of the bytes under `key`.

        `KeyNotFound` if the index does not list it; `RaySizeMismatch` if `size_hint` differs from the
        stored size; `RayObjectLost` if Ray lost the data; `RayIndexUnavailable` if the index is gone."""
        found = await self._call(key, "get", "lookup", key)
        if found is None:
            raise KeyNotFound(f"key {key!r} not found in store {self.name!r}")
        (ref,), nbytes = found
        if size_hint is not None and size_hint != nbytes:
            raise RaySizeMismatch(
                f"store {self.name!r}: {key!r} holds {nbytes} bytes, the ref says {size_hint}", key)
        try:
            with anyio.fail_after(self.get_timeout_s):
                arr = await ref
        except TimeoutError as exc:
            raise RayObjectLost(f"store {self.name!r}: get of {key!r} timed out after {self.get_timeout_s} s "
                                "(the object is unreachable)", key, exc) from exc
        except _LOST + (rex.RayActorError,) as exc:
            raise RayObjectLost(
                f"store {self.name!r}: the data of {key!r} is gone ({_describe(exc)})", key, exc) from exc
        except rex.RayError as exc:
            raise RayStoreError(f"store {self.name!r}: get of {key!r} failed: {_describe(exc)}", key, exc) from exc
        if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.nbytes != nbytes:
            raise RayStoreError(f"store {self.name!r}: {key!r} holds {type(arr).__name__} "
                                f"{getattr(arr, 'dtype', '')} of {getattr(arr, 'nbytes', '?')} bytes, "
                                f"the index says {nbytes} uint8 bytes", key)
        return memoryview(arr).toreadonly()

    async def remove(self, key: str) -> int:
        """Drop `key`; 1, or 0 if it was not held. Ray frees the object once no reader holds it."""
        return await self._call(key, "remove", "remove", key)

    async def remove_matching(self, pattern: str) -> int:
        """Drop every key that `re.match`es `pattern`; returns how many were dropped."""
        re.compile(pattern)  # a bad pattern raises re.error here, not as a Ray task error
        return await self._call(pattern, "remove_matching", "remove_matching", pattern)

    async def close(self) -> None:
        """Drop this process's handle; the handle that created the index also kills it (and its data)."""
        index, self._index = self._index, None
        if index is None:
            return
        try:
            creator = await index.creator.remote()
        except rex.RayError:
            return  # already gone
        if creator == self._token:
            _PINNED.pop((self.namespace, self.name), None)
            ray.kill(index)

    # -- extras ------------------------------------------------------------------------------------
    async def destroy(self) -> None:
        """Kill the index actor whoever created it: every process loses every key of the store."""
        index, self._index = self._index, None
        _PINNED.pop((self.namespace, self.name), None)
        if index is None:
            index = ray.get_actor(ACTOR_PREFIX + self.name, namespace=self.namespace)
        ray.kill(index)

    async def keys(self) -> list[str]:
        """A snapshot of the keys the store holds, in insertion order (all processes)."""
        return await self._call("<keys>", "keys", "keys")

    async def nbytes(self) -> int:
        """Bytes the store holds (sum of value sizes, all processes)."""
        return await self._call("<nbytes>", "nbytes", "nbytes")

    async def is_creator(self) -> bool:
        """Whether this handle created the index (so its `close()` kills it)."""
        return await self._call("<creator>", "creator", "creator") == self._token


class RayStoreSpec:
    """A StoreSpec for RayStore: opens it in whichever process asks, starting a local Ray on
    127.0.0.1 first if this process has none (the local runtime). The first process to open it
    (the buffer stage's, under the Ray runtime) creates the index and so owns the stored data."""

    def __init__(self, name: str = "ray", capacity_bytes: int | None = None) -> None:
        self.name, self.capacity_bytes = name, capacity_bytes

    def open(self, holder: bool) -> RayStore:
        if not ray.is_initialized():
            from pipeline.runtime.ray import init_own_cluster

            init_own_cluster(log_to_driver=False)
        return RayStore(self.name, capacity_bytes=self.capacity_bytes)
