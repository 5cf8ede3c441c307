"""MooncakeStore against a real mooncake_master, across real processes (loopback, TCP)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import numpy as np
import pytest

from buffers import mooncake
from buffers.mooncake import (
    MooncakeLeased,
    MooncakeMasterUnreachable,
    MooncakeSettings,
    MooncakeStore,
    MooncakeTransferFailed,
)
from buffers.mooncake_master import MooncakeMaster, MooncakeUnavailable, require_mooncake
from buffers.store import KeyNotFound, ObjectStore, StoreError, StoreFull
from pipeline.channel import Channel
from pipeline.refs import make_key, older_than_pattern

ROOT = Path(__file__).resolve().parents[2]
PEER = ROOT / "tests" / "helpers" / "mooncake_peer.py"
pytestmark = pytest.mark.anyio


def payload(size: int) -> bytes:
    return np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()


def peer(master: str, segment: int, *args: str, env: dict | None = None, timeout: float = 120) -> list:
    proc = subprocess.run(
        [sys.executable, str(PEER), master, str(segment), *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def start_holder(master: str, segment: int, seconds: float, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(PEER), master, str(segment), "hold", str(seconds)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, **(env or {})},
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture(scope="module")
async def holder(mooncake_master):
    """This test process as the buffer stage: it mounts the segment (512 MiB)."""
    store = MooncakeStore(
        MooncakeSettings(master_server_address=mooncake_master.address, global_segment_size=512 << 20)
    )
    yield store
    await store.close()


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


async def test_is_an_object_store(holder) -> None:
    assert isinstance(holder, ObjectStore)


SIZES = [1 << 10, 1 << 20, 16 << 20, 128 << 20]


async def test_round_trip_across_processes(holder, mooncake_master) -> None:
    """A pure client (segment 0) in another process puts 1 KiB..128 MiB; the holder reads them
    back exactly; the 128 MiB one is chunked (> 64 MiB). Then the client reads what we put."""
    args = [x for size in SIZES for x in ("put", f"rt/v00000000/p{size}/0", str(size))]
    assert peer(mooncake_master.address, 0, *args) == [["put", f"rt/v00000000/p{s}/0", s] for s in SIZES]
    for size in SIZES:
        got = await holder.get(f"rt/v00000000/p{size}/0")
        assert got.readonly and len(got) == size
        assert got == memoryview(payload(size))
    for size in SIZES:
        await holder.put(f"rt/v00000000/h{size}/0", payload(size))
    args = [x for size in SIZES for x in ("get", f"rt/v00000000/h{size}/0", str(size))]
    assert peer(mooncake_master.address, 0, *args) == [["get", f"rt/v00000000/h{s}/0", True] for s in SIZES]
    assert await holder.remove_matching("^rt/") >= 2 * len(SIZES)


async def test_chunked_objects_reassemble_and_remove_whole(mooncake_master) -> None:
    store = MooncakeStore(
        MooncakeSettings(master_server_address=mooncake_master.address, global_segment_size=128 << 20,
                         chunk_bytes=4 << 20)
    )
    try:
        data = payload((10 << 20) + 7)
        await store.put("ch/v00000000/g/0", data)
        assert store._client.is_exist("ch/v00000000/g/0#p0002") == 1  # 3 parts of <= 4 MiB
        assert await store.get("ch/v00000000/g/0") == memoryview(data)
        assert await store.remove("ch/v00000000/g/0") == 4  # manifest + 3 parts
        with pytest.raises(KeyNotFound):
            await store.get("ch/v00000000/g/0")
    finally:
        await store.close()


async def test_upsert_replaces(holder) -> None:
    await holder.put("up/v00000000/g/0", b"old value")
    await holder.put("up/v00000000/g/0", b"the new value")
    assert bytes(await holder.get("up/v00000000/g/0")) == b"the new value"


async def test_encode_into_registered_pool_is_zero_copy(holder) -> None:
    """The codec writes into the store's registered pool; a put sends those very bytes."""
    from buffers.codec import RolloutBatch, decode, encode

    batch = RolloutBatch.from_rows(
        [{"tokens": np.arange(5000, dtype=np.int32)} for _ in range(64)], meta={"group": "g"}
    )
    made = holder.pool.allocated
    for _ in range(5):
        encoded = encode(batch, pool=holder.pool)
        staged = np.frombuffer(encoded, dtype=np.uint8)
        assert holder._staged(staged) is staged, "payload in registered memory is sent in place"
        await holder.put("zc/v00000000/g/0", encoded)
        got = decode(await holder.get("zc/v00000000/g/0"))
        assert np.array_equal(got.token_fields["tokens"], batch.token_fields["tokens"])
        del encoded, staged, got
    assert holder.pool.allocated - made <= 4, "steady state reuses pooled buffers"


@pytest.mark.parametrize("chunk_mib", [64, 1])
async def test_a_gathered_payload_is_sent_from_its_arrays_and_read_back_whole(mooncake_master, chunk_mib,
                                                                             monkeypatch) -> None:
    """encode_parts' arrays go out where they lie (no join; chunk_mib=1: split over parts); a gathered put
    onto a key that exists replaces it the copying way; nothing stays registered after the puts."""
    from buffers.codec import RolloutBatch, decode, encode, encode_parts
    from buffers.store import Gathered

    store = MooncakeStore(MooncakeSettings(master_server_address=mooncake_master.address,
                                           global_segment_size=64 << 20, chunk_bytes=chunk_mib << 20))
    try:
        rng = np.random.default_rng(chunk_mib)
        batches = [RolloutBatch.from_rows([{"tokens": rng.integers(0, 9, 60_000, dtype=np.int32)} for _ in range(24)],
                                          row_fields={"rewards": rng.random(24).astype(np.float32)}, meta={"n": n})
                   for n in range(2)]
        joins, key = [], f"ga/v00000000/g{chunk_mib}/0"  # a key of its own: a closed store's keys may linger
        real_join = Gathered.join
        monkeypatch.setattr(Gathered, "join", lambda self, pool=None: joins.append(1) or real_join(self, pool))
        value, header = encode_parts(batches[0], pool=store.pool)
        assert value.nbytes >= mooncake.GATHER_MIN_BYTES
        await store.put(key, value)
        assert not joins, "a fresh key was sent from the parts"
        assert bytes(await store.get(key, size_hint=value.nbytes)) == bytes(encode(batches[0]))
        value, header = encode_parts(batches[1], pool=store.pool)
        await store.put(key, value)  # the key exists: upsert, by the copy
        assert joins == [1]
        got = decode(await store.get(key))
        assert got.meta == {"n": 1} and np.array_equal(got.token_fields["tokens"], batches[1].token_fields["tokens"])
        assert store._registrations._held == {}, "a part stayed registered"
    finally:
        await store.close()


async def test_eviction_by_version(holder) -> None:
    keys = [make_key("ev", v, f"g{v}", "0-7") for v in range(6)]
    for key in keys:
        await holder.put(key, b"x" * 100)
    assert await holder.remove_matching(older_than_pattern("ev", 3)) == 3
    for key in keys[:3]:
        with pytest.raises(KeyNotFound):
            await holder.get(key)
    for key in keys[3:]:
        assert bytes(await holder.get(key)) == b"x" * 100


async def test_missing_key_is_typed(holder) -> None:
    with pytest.raises(KeyNotFound, match="-704 OBJECT_NOT_FOUND") as err:
        await holder.get("nope/v00000000/g/0")
    assert isinstance(err.value, StoreError)
    assert await holder.remove("nope/v00000000/g/0") == 0


async def test_full_store_refuses_instead_of_evicting() -> None:
    """Objects are hard-pinned: a full store never evicts rollout data; a put waits for space
    (full_wait_s) and then raises the typed -200 error."""
    with MooncakeMaster() as master:
        store = MooncakeStore(
            MooncakeSettings(master_server_address=master.address, global_segment_size=32 << 20, full_wait_s=1)
        )
        try:
            for i in range(28):
                await store.put(f"full/v00000000/g{i}/0", payload(1 << 20))
            with pytest.raises(StoreFull, match="-200 NO_AVAILABLE_HANDLE"):
                await store.put("full/v00000000/big/0", payload(16 << 20))
            for i in range(28):  # nothing was evicted to make room
                assert await store.get(f"full/v00000000/g{i}/0") == memoryview(payload(1 << 20))
        finally:
            await store.close()


def record_removes(store: MooncakeStore) -> list[str]:
    """What each of `store`'s remove tries met: "leased" or "removed N"."""
    attempts: list[str] = []
    remove_once = store._remove

    def recorded(key: str) -> int:
        try:
            removed = remove_once(key)
        except MooncakeLeased:
            attempts.append("leased")
            raise
        attempts.append(f"removed {removed}")
        return removed

    store._remove = recorded
    return attempts


async def test_leased_object_is_removed_after_the_lease(holder) -> None:
    """A lease taken by another reader (here the raw client, past the store's bookkeeping) is retried
    until it ends."""
    await holder.put("ls/v00000000/g/0", b"leased")
    holder._client.get("ls/v00000000/g/0")  # takes a 500 ms read lease
    assert holder._client.remove("ls/v00000000/g/0") == -706
    attempts = record_removes(holder)
    assert await holder.remove("ls/v00000000/g/0") == 1  # retried with tenacity until the lease ends
    assert attempts[0] == "leased" and attempts[-1] == "removed 1"
    assert set(attempts[:-1]) == {"leased"}, "every retry before the last met the lease"
    with pytest.raises(KeyNotFound):
        await holder.get("ls/v00000000/g/0")


async def test_a_key_this_store_read_is_removed_once_its_lease_is_over(holder) -> None:
    """The store's own read: its remove waits out the lease and then succeeds at the first try."""
    await holder.put("own/v00000000/g/0", b"mine")
    await holder.get("own/v00000000/g/0")
    attempts = record_removes(holder)
    t0 = time.monotonic()
    assert await holder.remove("own/v00000000/g/0") == 1
    assert attempts == ["removed 1"], "no refused try"
    assert time.monotonic() - t0 >= holder.settings.read_lease_s - 0.05
    with pytest.raises(KeyNotFound):
        await holder.get("own/v00000000/g/0")


def failing_puts(store: MooncakeStore, failures: int, monkeypatch) -> list[str]:
    """Make `store`'s next `failures` transfers fail to submit (-800), as under load; the keys it was asked for."""
    real, asked = store._put, []

    def put(key: str, data) -> None:
        asked.append(key)
        if len(asked) <= failures:
            raise MooncakeTransferFailed(f"mooncake put of {key!r} failed: -800 TRANSFER_FAIL")
        return real(key, data)

    monkeypatch.setattr(store, "_put", put)
    return asked


async def test_a_put_whose_transfer_failed_to_submit_is_tried_again(holder, monkeypatch) -> None:
    asked = failing_puts(holder, 2, monkeypatch)
    await holder.put("tf/v00000000/g/0", b"sent on the third try")
    assert asked == ["tf/v00000000/g/0"] * 3
    assert bytes(await holder.get("tf/v00000000/g/0")) == b"sent on the third try"


async def test_a_put_that_never_reaches_a_holder_still_fails_typed(holder, monkeypatch) -> None:
    monkeypatch.setattr(mooncake, "TRANSFER_RETRY_S", 0.3)
    asked = failing_puts(holder, 1 << 30, monkeypatch)
    with pytest.raises(MooncakeTransferFailed):
        await holder.put("tf/v00000000/g/1", b"never sent")
    assert len(asked) >= 2  # tried again, then raised: one replica waits TRANSFER_RETRY_S, not full_wait_s
    with pytest.raises(KeyNotFound):
        await holder.get("tf/v00000000/g/1")


async def test_holder_death_is_a_transfer_failure(mooncake_master) -> None:
    """The only segment holder dies: reading what it held fails loudly, never as empty data."""
    with MooncakeMaster(lease_ttl_ms=500, client_ttl_s=30) as master:
        holder = start_holder(master.address, 64 << 20, 60)
        client = MooncakeStore(MooncakeSettings(master_server_address=master.address, global_segment_size=0))
        try:
            await client.put("hd/v00000000/g/0", payload(1 << 20))
            assert await client.get("hd/v00000000/g/0") == memoryview(payload(1 << 20))
            holder.send_signal(signal.SIGKILL)
            holder.wait()
            with pytest.raises(StoreError) as err:
                await client.get("hd/v00000000/g/0")
            assert isinstance(err.value, MooncakeTransferFailed | KeyNotFound)
        finally:
            holder.kill()
            await client.close()


async def test_replicas_survive_a_holder_death() -> None:
    """Two holders, replicas = 2: one dies, the get fails over to the other copy once the master
    has dropped the dead holder's segment (client_ttl)."""
    with MooncakeMaster(lease_ttl_ms=500, client_ttl_s=2) as master:
        holders = [start_holder(master.address, 64 << 20, 60) for _ in range(2)]
        client = MooncakeStore(
            MooncakeSettings(master_server_address=master.address, global_segment_size=0, replicas=2, failover_s=10)
        )
        try:
            data = payload(2 << 20)
            await client.put("rp/v00000000/g/0", data)
            assert client.replica_count("rp/v00000000/g/0") == 2
            holders[0].send_signal(signal.SIGKILL)
            holders[0].wait()
            assert await client.get("rp/v00000000/g/0") == memoryview(data)
        finally:
            for h in holders:
                h.kill()
            await client.close()


async def test_master_loss_is_typed() -> None:
    master = MooncakeMaster(lease_ttl_ms=500).start()
    store = MooncakeStore(MooncakeSettings(master_server_address=master.address, global_segment_size=32 << 20))
    try:
        await store.put("ml/v00000000/g/0", b"gone soon")
        master.kill()
        with pytest.raises(StoreError) as err:
            await store.get("ml/v00000000/g/0")
        assert isinstance(err.value, MooncakeMasterUnreachable | MooncakeTransferFailed | KeyNotFound)
    finally:
        await store.close()
        master.stop()


async def test_byte_backpressure_keeps_a_small_store_from_filling() -> None:
    """160 MiB flow through a 32 MiB segment: a byte-bounded channel below the store's capacity
    slows the producers; nothing is lost, nothing evicted, and no put fails."""
    master = MooncakeMaster().start()
    store = MooncakeStore(MooncakeSettings(master_server_address=master.address, global_segment_size=32 << 20))
    channel: Channel = Channel("into-buffer", max_items=64, max_bytes=8 << 20, size_of=lambda item: item[1])
    n, size = 160, 1 << 20
    received: list[str] = []

    async def produce(worker: int) -> None:
        for i in range(worker, n, 2):
            key = f"bp/v00000000/g{i}/0"
            await store.put(key, payload(size))
            await channel.send((key, size))

    async def consume() -> None:
        async with anyio.create_task_group() as frees:  # a removal waits out the read lease
            async for key, _ in channel:
                assert await store.get(key) == memoryview(payload(size))
                frees.start_soon(store.remove, key)
                received.append(key)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            async with anyio.create_task_group() as producers:
                producers.start_soon(produce, 0)
                producers.start_soon(produce, 1)
            channel.close()
        assert sorted(received) == sorted(f"bp/v00000000/g{i}/0" for i in range(n))
        assert channel.stats().send_wait_s > 0, "producers were slowed by the byte bound"
    finally:
        await store.close()
        master.stop()


def test_missing_libibverbs_names_the_package(monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("mooncake"):
            raise ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "mooncake.store", raising=False)
    monkeypatch.delitem(sys.modules, "mooncake", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(MooncakeUnavailable, match="apt-get install -y libibverbs1"):
        require_mooncake()


async def test_size_hint_skips_the_lookup_and_is_checked(holder) -> None:
    data = payload(300_000)
    await holder.put("sh/v00000000/g/0", data)
    assert await holder.get("sh/v00000000/g/0", size_hint=len(data)) == memoryview(data)
    for wrong in (1000, 400_000):  # a ref that disagrees with the store is an error, not data
        with pytest.raises(MooncakeTransferFailed, match=f"the value has 300000 bytes, the ref says {wrong}"):
            await holder.get("sh/v00000000/g/0", size_hint=wrong)


def busy_loops(n: int) -> list[subprocess.Popen]:
    """`n` processes spinning a core each (this test's own CPU hog; kill them by pid)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


@pytest.mark.slow
async def test_a_large_read_across_processes_passes_with_every_core_busy() -> None:
    """Every core saturated by busy loops: the 128 MiB cross-process round trip (a pure client puts, this
    process holds and reads; then the reverse) passes on a master started as baton starts one (its read lease
    `READ_LEASE_MS`), where a 500 ms lease once failed it with LEASE_EXPIRED."""
    size = 128 << 20
    hogs = busy_loops(max(2, os.cpu_count() or 2))
    try:
        with MooncakeMaster() as master:
            store = MooncakeStore(MooncakeSettings(master_server_address=master.address, global_segment_size=512 << 20))
            try:
                assert peer(master.address, 0, "put", "hog/v00000000/p/0", str(size), timeout=300) == [
                    ["put", "hog/v00000000/p/0", size]]
                assert await store.get("hog/v00000000/p/0") == memoryview(payload(size))
                await store.put("hog/v00000000/h/0", payload(size))
                assert peer(master.address, 0, "get", "hog/v00000000/h/0", str(size), timeout=300) == [
                    ["get", "hog/v00000000/h/0", True]]
            finally:
                await store.close()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


async def test_a_part_whose_lease_expired_is_read_again_alone(holder, monkeypatch) -> None:
    """A chunked value whose second part's read outlasts its lease (-707): that part alone is read again,
    under a fresh lease; the first part is not read twice, and the value comes back whole."""
    data = payload((130 << 20) + 5)
    await holder.put("le/v00000000/g/0", data)
    asked = []

    class Expiring:
        """The real client, but the parts' batch (after the manifest's read) says the second part's lease expired."""

        def __init__(self, client) -> None:
            self.client = client

        def __getattr__(self, name: str):
            return getattr(self.client, name)

        def batch_get_into(self, keys, ptrs, sizes):
            asked.append(list(keys))
            got = list(self.client.batch_get_into(keys, ptrs, sizes))
            return [got[0], mooncake.MooncakeLeaseExpired.code, *got[2:]] if len(asked) == 2 else got

    monkeypatch.setattr(holder, "_client", Expiring(holder._client))
    assert await holder.get("le/v00000000/g/0") == memoryview(data)
    assert asked[1:] == [[f"le/v00000000/g/0#p{i:04d}" for i in range(3)], ["le/v00000000/g/0#p0001"]]
    await holder.remove("le/v00000000/g/0")
