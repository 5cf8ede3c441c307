"""MemoryStore keeps the ObjectStore contract: zero-copy upserts, exact accounting, typed errors."""

from __future__ import annotations

import numpy as np
import pytest

from buffers.memory import MemoryStore
from buffers.store import KeyNotFound, ObjectStore, StoreError
from tests.contracts.store_contract import (
    SURVIVORS,
    check_capacity_refuses_and_changes_nothing,
    check_encoded_batch_round_trip,
    check_remove_matching_by_version,
)

pytestmark = pytest.mark.anyio



def test_is_an_object_store() -> None:
    store = MemoryStore()
    assert isinstance(store, ObjectStore)
    assert store.name == "memory"
    assert MemoryStore("other").name == "other"


async def test_put_get_round_trip_without_copy() -> None:
    store = MemoryStore()
    data = bytearray(b"hello payload")
    await store.put("k", data)
    got = await store.get("k")
    assert isinstance(got, memoryview) and got.readonly
    assert bytes(got) == b"hello payload"
    assert np.shares_memory(np.frombuffer(got, np.uint8), np.frombuffer(data, np.uint8))
    assert (store.nbytes, len(store), store.keys()) == (len(data), 1, ["k"])


async def test_get_views_are_independent() -> None:
    store = MemoryStore()
    await store.put("k", b"abc")
    (await store.get("k")).release()
    assert bytes(await store.get("k")) == b"abc"


async def test_multidimensional_buffers_are_stored_as_bytes() -> None:
    store = MemoryStore()
    arr = np.arange(6, dtype=np.int32).reshape(2, 3)
    await store.put("k", arr)
    assert store.nbytes == arr.nbytes
    assert bytes(await store.get("k")) == arr.tobytes()


async def test_encoded_batch_round_trip() -> None:
    store = MemoryStore()
    payload_bytes = await check_encoded_batch_round_trip(store)
    assert store.nbytes == 2 * payload_bytes  # the batch, and the same batch put as parts


async def test_upsert_replaces_and_accounting_follows() -> None:
    store = MemoryStore(capacity_bytes=100)
    await store.put("a", b"x" * 60)
    await store.put("a", b"y" * 90)
    assert (store.nbytes, len(store), bytes(await store.get("a"))) == (90, 1, b"y" * 90)
    await store.put("a", b"z" * 10)
    await store.put("b", b"w" * 90)
    assert store.nbytes == 100


async def test_missing_key_raises_key_not_found() -> None:
    store = MemoryStore("mem-1")
    with pytest.raises(KeyNotFound, match="'nope'.*'mem-1'") as err:
        await store.get("nope")
    assert isinstance(err.value, StoreError)
    assert isinstance(err.value, KeyError)
    assert str(err.value) == "key 'nope' not found in store 'mem-1'"


async def test_capacity_raises_store_full_and_changes_nothing() -> None:
    store = MemoryStore(capacity_bytes=100)

    async def held():
        return store.nbytes, store.keys()

    await check_capacity_refuses_and_changes_nothing(store, held)
    with pytest.raises(ValueError):
        MemoryStore(capacity_bytes=-1)


async def test_remove_counts_and_is_idempotent() -> None:
    store = MemoryStore()
    await store.put("a", b"123")
    assert await store.remove("a") == 1
    assert await store.remove("a") == 0
    assert (store.nbytes, len(store)) == (0, 0)
    with pytest.raises(KeyNotFound):
        await store.get("a")


async def test_remove_matching_by_version_range() -> None:
    store = MemoryStore()
    await check_remove_matching_by_version(store)
    assert sorted(store.keys()) == SURVIVORS
    assert store.nbytes == 3 * 2
    assert await store.remove_matching(r"^other/") == 1


async def test_close_clears() -> None:
    store = MemoryStore()
    await store.put("a", b"1")
    await store.put("b", b"2")
    await store.close()
    assert (store.nbytes, len(store), store.keys()) == (0, 0, [])
