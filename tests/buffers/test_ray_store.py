"""RayStore keeps the ObjectStore contract on a real local Ray cluster, across processes and deaths."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import os
import uuid

import anyio
import numpy as np
import pytest

from buffers.ray_store import RayIndexUnavailable, RayObjectLost, RaySizeMismatch, RayStore, RayStoreError

import ray  # isort: skip  (after buffers.ray_store, which pins Ray's listeners to 127.0.0.1)

from buffers.store import KeyNotFound, ObjectStore, StoreError, StoreFull
from tests.contracts.store_contract import (
    SURVIVORS,
    check_capacity_refuses_and_changes_nothing,
    check_encoded_batch_round_trip,
    check_remove_matching_by_version,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("ray_cluster")]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def payload(nbytes: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def digest(data) -> str:
    return hashlib.sha256(memoryview(data)).hexdigest()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@ray.remote(num_cpus=0)
class Peer:
    """Another process of the run: opens the store by name, as a producer or consumer would."""

    def pid(self) -> int:
        return os.getpid()

    async def put(self, store: str | RayStore, key: str, nbytes: int, seed: int, owner: str = "index") -> None:
        s = store if isinstance(store, RayStore) else RayStore(store, owner=owner)
        await s.put(key, payload(nbytes, seed))
        await s.close()  # not the creator: the index and its data stay

    async def get(self, name: str, key: str) -> tuple[str, bool]:
        s = RayStore(name)
        view = await s.get(key)
        return digest(view), view.readonly


@pytest.fixture(scope="module")
def peer(ray_cluster):
    handle = Peer.remote()
    yield handle
    ray.kill(handle)


@pytest.fixture(scope="module")
def shared_store(ray_cluster):
    """One index actor for most tests (each actor is a new process: about 1 s to start here)."""
    s = RayStore(unique("t"))
    yield s
    asyncio.run(s.close())


@pytest.fixture
async def store(shared_store: RayStore):
    assert await shared_store.remove_matching("") >= 0  # empty it: every test starts from an empty store
    assert await shared_store.is_creator()
    return shared_store


async def test_is_an_object_store(store: RayStore) -> None:
    assert isinstance(store, ObjectStore)
    assert store.name.startswith("t-")
    with pytest.raises(ValueError):
        RayStore(unique("bad"), capacity_bytes=-1)
    with pytest.raises(ValueError):
        RayStore(unique("bad"), owner="nobody")  # type: ignore[arg-type]


@pytest.mark.parametrize("nbytes", [1 << 10, 64 << 10, 1 << 20, 16 << 20])
async def test_round_trip_from_this_process(store: RayStore, nbytes: int) -> None:
    data = payload(nbytes, nbytes)
    await store.put("k", data)
    got = await store.get("k", size_hint=nbytes)
    assert got.readonly and got.nbytes == nbytes and bytes(got) == data
    assert (await store.keys(), await store.nbytes()) == (["k"], nbytes)


async def test_get_is_a_zero_copy_view_into_plasma(store: RayStore) -> None:
    await store.put("k", np.arange(256 << 10, dtype=np.int32).reshape(512, -1))  # any buffer, stored as bytes
    view = await store.get("k")
    arr = view.obj
    assert view.readonly and view.format == "B" and view.nbytes == 1 << 20
    assert isinstance(arr, np.ndarray) and not arr.flags.owndata and not arr.flags.writeable
    assert np.frombuffer(view, np.int32)[-1] == (256 << 10) - 1


async def test_across_processes(store: RayStore, peer) -> None:
    for i, nbytes in enumerate((1 << 10, 4 << 20)):
        await peer.put.remote(store.name, f"from-peer/{i}", nbytes, seed=i)
        assert digest(await store.get(f"from-peer/{i}", size_hint=nbytes)) == digest(payload(nbytes, i))
        data = payload(nbytes, 100 + i)
        await store.put(f"from-driver/{i}", data)
        assert await peer.get.remote(store.name, f"from-driver/{i}") == (digest(data), True)
    await peer.put.remote(store, "pickled-handle", 10, seed=7)  # a store object sent to a peer re-opens there
    assert bytes(await store.get("pickled-handle")) == payload(10, 7)
    assert len(await store.keys()) == 5


async def test_upsert_replaces(store: RayStore) -> None:
    await store.put("a", b"x" * 60)
    await store.put("a", b"y" * 90)
    assert (bytes(await store.get("a")), await store.keys(), await store.nbytes()) == (b"y" * 90, ["a"], 90)
    await store.put("a", b"z" * 10)
    assert (bytes(await store.get("a", size_hint=10)), await store.nbytes()) == (b"z" * 10, 10)


async def test_missing_key_raises_key_not_found(store: RayStore) -> None:
    with pytest.raises(KeyNotFound) as err:
        await store.get("nope")
    assert isinstance(err.value, StoreError) and isinstance(err.value, KeyError)
    assert str(err.value) == f"key 'nope' not found in store {store.name!r}"


async def test_size_hint_mismatch_raises(store: RayStore) -> None:
    await store.put("k", b"12345")
    with pytest.raises(RaySizeMismatch, match=r"'k' holds 5 bytes, the ref says 6") as err:
        await store.get("k", size_hint=6)
    assert isinstance(err.value, StoreError) and err.value.key == "k"
    assert bytes(await store.get("k", size_hint=5)) == b"12345"


async def test_remove_and_remove_matching(store: RayStore) -> None:
    await store.put("a", b"123")
    assert await store.remove("a") == 1
    assert await store.remove("a") == 0
    with pytest.raises(KeyNotFound):
        await store.get("a")
    await check_remove_matching_by_version(store)
    assert sorted(await store.keys()) == SURVIVORS
    assert await store.nbytes() == 6
    assert await store.remove_matching(r"^other/") == 1


async def until_dead(actor, within_s: float = 30.0) -> None:
    """Return once calls on `actor` fail with RayActorError: `ray.kill` is asynchronous, and a call sent
    right after it may still run on the dying process (seen once in CI)."""
    with anyio.fail_after(within_s):
        while True:
            try:
                await actor.pid.remote()
            except ray.exceptions.RayActorError:
                return
            await anyio.sleep(0.05)


async def test_batches_outlive_their_killed_producer(store: RayStore) -> None:
    producer = Peer.remote()
    await producer.put.remote(store.name, "durable", 3 << 20, seed=1)  # owner="index": the index owns it
    await producer.put.remote(store.name, "small", 100, seed=2)
    await producer.put.remote(store.name, "fragile", 3 << 20, seed=3, owner="producer")  # producer owns it
    ray.kill(producer)
    await until_dead(producer)
    assert bytes(await store.get("durable", size_hint=3 << 20)) == payload(3 << 20, 1)
    assert bytes(await store.get("small")) == payload(100, 2)
    # owner="producer": Ray frees the object once it notices its owner died (under a second here);
    # until then a get may still read the intact bytes, never a torn or empty value
    for _ in range(100):
        try:
            assert bytes(await store.get("fragile")) == payload(3 << 20, 3)
        except RayObjectLost as exc:
            err = exc
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("a producer-owned object was still readable 10 s after its owner died")
    assert "'fragile'" in str(err) and "OwnerDiedError" in str(err), str(err)
    assert isinstance(err, StoreError) and isinstance(err.cause, ray.exceptions.ObjectLostError)


async def test_capacity_raises_store_full_and_changes_nothing(store: RayStore) -> None:
    s = RayStore(store.name, capacity_bytes=100)  # the bound applies to this handle's puts, on the shared total

    async def held():
        return await s.nbytes(), await s.keys()

    await check_capacity_refuses_and_changes_nothing(s, held)
    await s.put("a", b"y" * 70)  # an upsert only needs room for the difference
    assert await s.nbytes() == 100
    with pytest.raises(StoreFull):
        await RayStore(store.name, capacity_bytes=100, owner="producer").put("c", b"x")
    await store.put("c", b"x")  # the unbounded handle is not held to it
    await s.close()
    assert await store.nbytes() == 101


async def test_codec_round_trip(store: RayStore) -> None:
    await check_encoded_batch_round_trip(store)


async def test_close_only_kills_the_index_from_its_creator() -> None:
    creator = RayStore(unique("life"))
    other = RayStore(creator.name)
    assert await creator.is_creator() and not await other.is_creator()
    await creator.put("k", b"v")
    third = RayStore(creator.name)
    await third.close()  # not the creator: the data stays
    assert bytes(await other.get("k")) == b"v"
    with pytest.raises(RayStoreError, match="closed"):
        await third.get("k")
    await creator.close()  # the creator: the index and everything it owns go
    with pytest.raises(RayIndexUnavailable, match=r"'k'.*index actor is gone") as err:
        await other.get("k")
    assert isinstance(err.value, StoreError)


async def test_a_dropped_creator_keeps_the_index_until_destroy() -> None:
    name = unique("drop")
    creator = RayStore(name)
    await creator.put("k", b"v")
    del creator  # dropped without close(): Ray would collect the index, the module's pin keeps it
    gc.collect()
    await asyncio.sleep(0.5)
    other, late = RayStore(name), RayStore(name)
    assert bytes(await other.get("k")) == b"v" and not await other.is_creator()
    await other.destroy()  # explicit: kills the index whoever created it
    with pytest.raises(RayIndexUnavailable, match="'k'"):
        await late.get("k")
