"""MooncakeStore: the ObjectStore protocol on Mooncake's distributed store (TCP here, RDMA on clusters).

* **Zero copy.** Payloads go out with `batch_upsert_from` and come back with `batch_get_into`, from
  and into buffers of a `BufferPool` whose memory is registered with Mooncake once; the codec
  encodes straight into that pool (`store.pool`), so a put sends the encoded bytes where they lie
  and a get returns a read-only view of the registered buffer it landed in. A gathered payload
  (`buffers.codec.encode_parts`: the batch's arrays where they lie) is sent from its parts, not copied
  at all (`buffers.mooncake_gather`). In steady state no batch allocates pool memory.
* **Chunking.** An object larger than `chunk_bytes` is stored as parts `key#p0000`, `key#p0001`, ...
  plus a small manifest under `key`; `get` reassembles it into one buffer. (One Mooncake object
  must fit in one segment; chunks let a large batch spread over segments.)
* **Upsert.** Every put replaces the value (a plain Mooncake put keeps the old one).
* **Replicas.** `replicas` copies on distinct segments (a ReplicateConfig), so one holder's death
  does not lose the data. With fewer segments than replicas, Mooncake stores fewer copies.
* **Errors.** Every negative return code becomes a typed exception naming the code and the key;
  `get` never returns an empty or short result as data.
* **Read leases.** The master leases each key a read takes for its `default_kv_lease_ttl` and fails a
  transfer that outlasts it (-707). The masters baton starts lease for `READ_LEASE_MS` (2 s: a 64 MiB part
  on a loaded machine), and a key whose lease expired anyway is read again alone under a fresh lease, the
  other parts of the object kept (`LEASE_RETRIES` tries): a slow machine makes a read slower, not failed.
* **Segment ownership.** `segment_bytes > 0` mounts that much memory into the pool from this
  process (the buffer stage); `segment_bytes = 0` makes a pure client (producers, learner).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import anyio
import numpy as np
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential
from typing_extensions import Buffer

from buffers.mooncake_gather import GATHER_MIN_BYTES, Registrations, send_gathered
from buffers.mooncake_master import READ_LEASE_MS, MooncakeMaster, require_mooncake
from buffers.pool import BufferPool
from buffers.retry import retry_while
from buffers.store import Gathered, KeyNotFound, StoreError, StoreFull

_MANIFEST = struct.Struct("<16sQQI")  # magic, total bytes, chunk bytes, parts
_MANIFEST_MAGIC = b"\x00baton-chunked\x00\x01"
_PART = "#p{:04d}"
INLINE_BYTES = 2 << 20
# a put whose transfer could not be submitted (-800) with one replica is tried again for this long: on a
# loaded machine a first connection to a holder can fail to submit; a holder that is gone still fails
TRANSFER_RETRY_S = 2.0
LEASE_RETRIES = 5  # tries of one key whose read outlasted its lease, each under a fresh lease


def object_keys(key: str, size: int, chunk: int) -> list[str]:
    """The keys a value of `size` bytes is stored under: itself, or its parts when it is over `chunk` bytes."""
    parts = -(-size // chunk)
    return [key] if parts <= 1 else [key + _PART.format(i) for i in range(parts)]


class MooncakeError(StoreError):
    """A Mooncake call returned a negative code; `.code` holds it."""

    code = 0
    reason = "ERROR"

    def __init__(self, key: str, code: int | None = None, op: str = "") -> None:
        self.key = key
        self.code = code if code is not None else type(self).code
        super().__init__(f"mooncake {op or 'call'} of {key!r} failed: {self.code} {self.reason}")


class MooncakeNoSpace(MooncakeError, StoreFull):
    code, reason = -200, "NO_AVAILABLE_HANDLE (no segment has room; the store is full)"


class MooncakeNotFound(MooncakeError, KeyNotFound):
    code, reason = -704, "OBJECT_NOT_FOUND"

    def __str__(self) -> str:
        return MooncakeError.__str__(self)


class MooncakeLeased(MooncakeError):
    code, reason = -706, "OBJECT_HAS_LEASE (read recently; removable once the lease expires)"


class MooncakeTransferFailed(MooncakeError):
    code, reason = -800, "TRANSFER_FAIL (the segment holding it is unreachable or gone)"


class MooncakeMasterUnreachable(MooncakeError):
    code, reason = -900, "RPC_FAIL (the master is unreachable)"


class MooncakeLeaseExpired(MooncakeError):
    code, reason = -707, "LEASE_EXPIRED (the read outlasted its lease; retried)"


class MooncakeInvalid(MooncakeError):
    code, reason = -600, "INVALID_PARAMS"


_ERRORS = {cls.code: cls for cls in (MooncakeNoSpace, MooncakeNotFound, MooncakeLeased, MooncakeLeaseExpired,
                                    MooncakeTransferFailed, MooncakeMasterUnreachable, MooncakeInvalid)}


def error_for(key: str, code: int, op: str) -> MooncakeError:
    cls = _ERRORS.get(code)
    if cls is not None:
        return cls(key, op=op)
    err = MooncakeError(key, code, op)
    return err


@dataclass(frozen=True)
class MooncakeSettings:
    """Mirrors Miles's `--mooncake-store-init-kwargs`; env vars MOONCAKE_* give the defaults."""

    master_server_address: str = ""
    protocol: str = ""
    device: str = ""
    local_hostname: str = ""  # the address peers reach this process's segment at; "": $BATON_HOST, else 127.0.0.1
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = 0
    local_buffer_size: int = 16 << 20
    chunk_bytes: int = 64 << 20
    replicas: int = 1
    failover_s: float = 15.0  # with replicas > 1: how long a get retries a dead holder (> master client_ttl)
    full_wait_s: float = 60.0  # how long a put waits for space in a full store before raising
    # the master's read lease (default_kv_lease_ttl; the masters baton starts: READ_LEASE_MS), see `remove`
    read_lease_s: float = READ_LEASE_MS / 1000
    # send a gathered value's parts where they lie (registering them for the put) rather than copying them into
    # registered memory: registration is bookkeeping over TCP; over RDMA it pins pages (buffers.mooncake_gather)
    gather_puts: bool | None = None  # None: on for protocol tcp

    def resolved(self) -> MooncakeSettings:
        return dataclasses.replace(
            self,
            master_server_address=self.master_server_address or os.environ.get("MOONCAKE_MASTER_ADDR", ""),
            protocol=self.protocol or os.environ.get("MOONCAKE_PROTOCOL", "tcp"),
            device=self.device or os.environ.get("MOONCAKE_DEVICE", ""),
            # on a Ray node, the node's address (pipeline.runtime.ray sets BATON_HOST in every host)
            local_hostname=self.local_hostname or os.environ.get("BATON_HOST", "127.0.0.1"),
            gather_puts=(self.protocol or os.environ.get("MOONCAKE_PROTOCOL", "tcp")) == "tcp"
            if self.gather_puts is None else self.gather_puts,
        )


class MooncakeStore:
    """`MooncakeStore(MooncakeSettings(master_server_address="127.0.0.1:50051", global_segment_size=1 << 30))`."""

    def __init__(self, settings: MooncakeSettings, name: str = "mooncake", pool_idle_bytes: int = 512 << 20) -> None:
        self.settings = settings.resolved()
        self.name = name
        s = self.settings
        if not s.master_server_address:
            raise ValueError("MooncakeStore needs master_server_address (or MOONCAKE_MASTER_ADDR)")
        if s.chunk_bytes < 1 << 20:
            raise ValueError(f"chunk_bytes must be >= 1 MiB, got {s.chunk_bytes}")
        if s.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {s.replicas}")
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        mc = require_mooncake()
        self._client = mc.MooncakeDistributedStore()
        rc = self._client.setup(
            s.local_hostname, s.metadata_server, s.global_segment_size, s.local_buffer_size,
            s.protocol, s.device, s.master_server_address,
        )
        if rc != 0:
            raise error_for("<setup>", rc, f"setup with master {s.master_server_address}")
        self._config = mc.ReplicateConfig()
        self._config.replica_num = s.replicas
        # Hard pin: the master never evicts our objects at its high watermark (that would lose rollout
        # data silently); a full store refuses puts instead (-200), which `put` waits out.
        self._config.with_hard_pin = True
        self._registrations = Registrations(self._client, error_for)  # the pool's buffers, gathered puts' parts
        self.pool = BufferPool(pool_idle_bytes, min_nbytes=0, on_new=self._registrations.pool_new,
                               on_drop=self._registrations.pool_drop)
        self._read_at: dict[str, float] = {}  # key -> when this client last read it (for `remove`)
        self._closed = False
        self.master: MooncakeMaster | None = None  # set by open("auto"): stopped by close()

    @classmethod
    def open(cls, settings: MooncakeSettings, master: str = "auto", name: str = "mooncake") -> MooncakeStore:
        """A store on `master` ("host:port"), or on a master started now for this store ("auto"),
        which `close()` then stops, by pid."""
        owned = MooncakeMaster().start() if master == "auto" else None
        address = owned.address if owned else master
        try:
            store = cls(dataclasses.replace(settings, master_server_address=address), name=name)
        except BaseException:
            if owned:
                owned.stop()
            raise
        store.master = owned
        return store

    # -- the five protocol methods -------------------------------------------------------------
    async def put(self, key: str, data: Buffer | Gathered) -> None:
        """Upsert. While the store is full (-200) or the master is away (-900, e.g. restarting) it
        waits, up to `full_wait_s`, then raises the typed error. With replicas > 1, a put the master
        routed to a dead holder (-800) is retried too: the master drops that holder within its
        client_ttl, and the copies then go to live segments. With one replica a -800 is retried for
        `TRANSFER_RETRY_S` only (a transfer that failed to submit), then raised. A `Gathered` value of
        at least `GATHER_MIN_BYTES` is sent from where its parts lie (`buffers.mooncake_gather`)."""
        if isinstance(data, Gathered):
            gathered = self.settings.gather_puts and data.nbytes >= GATHER_MIN_BYTES
            value: np.ndarray | Gathered = data if gathered else data.join(self.pool)
        else:
            value = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        put = partial(self._call, self._put, key, value, nbytes=value.nbytes)
        transfer_s = self.settings.full_wait_s if self.settings.replicas > 1 else TRANSFER_RETRY_S
        submitted = partial(retry_while, put, (MooncakeTransferFailed,), first_wait_s=0.05, max_wait_s=0.5,
                            within_s=transfer_s)
        waits = (MooncakeNoSpace, MooncakeMasterUnreachable)
        await retry_while(submitted, waits, first_wait_s=0.02, max_wait_s=0.5, within_s=self.settings.full_wait_s)

    async def get(self, key: str, size_hint: int | None = None) -> memoryview:
        """The value of `key`. `size_hint` (a Ref's nbytes) saves the size lookup and is checked: a
        value of another size raises MooncakeTransferFailed.

        A key whose lease expired mid-transfer (-707) is read again alone (`_read`); should that keep
        failing, the whole read is retried for up to `failover_s`. With replicas > 1, a get that hits
        a dead holder is retried until the master drops that replica (its client_ttl), then served
        from a surviving copy; with one replica that failure is raised at once."""
        get = partial(self._call, self._get, key, size_hint, nbytes=size_hint or 0)
        retry_on: tuple[type[MooncakeError], ...] = (MooncakeLeaseExpired,)
        if self.settings.replicas > 1:
            retry_on = (MooncakeLeaseExpired, MooncakeTransferFailed)
        value = await retry_while(get, retry_on, first_wait_s=0.1, max_wait_s=1.0, within_s=self.settings.failover_s)
        self._note_read(key)
        return value

    def _note_read(self, key: str) -> None:
        now = time.monotonic()
        if len(self._read_at) >= 4096:  # keys read and never removed here: forget those past their lease
            self._read_at = {k: t for k, t in self._read_at.items() if now - t < self.settings.read_lease_s}
        self._read_at[key] = now

    async def _call(self, fn, *args, nbytes: int):
        """Small transfers run inline (about a millisecond; a thread hop would double it); large
        ones in a worker thread so the event loop keeps serving the other actors."""
        if nbytes and nbytes <= INLINE_BYTES:
            await anyio.lowlevel.checkpoint()
            return fn(*args)
        return await anyio.to_thread.run_sync(fn, *args)

    async def remove(self, key: str) -> int:
        """Remove `key` (and its parts). The master refuses to remove a key read less than its read lease
        ago: a key this client read is removed once that lease is over (the learner frees what it read
        a step ago: a refused try, then retries, for nearly every payload otherwise); another client's
        lease is waited out by retrying."""
        read_at = self._read_at.pop(key, None)
        if read_at is not None:
            await anyio.sleep(max(0.0, read_at + self.settings.read_lease_s - time.monotonic()))
        remove = partial(anyio.to_thread.run_sync, self._remove, key)
        return await retry_while(remove, (MooncakeLeased,), first_wait_s=0.05, max_wait_s=0.5, within_s=30)

    async def remove_matching(self, pattern: str) -> int:
        """Remove keys matching `pattern` (ECMAScript regex, anchored like re.match); leased ones wait."""
        anchored = pattern if pattern.startswith("^") else f"^(?:{pattern})"
        rc = await anyio.to_thread.run_sync(self._client.remove_by_regex, anchored)
        if rc < 0:
            raise error_for(pattern, rc, "remove_by_regex")
        return rc

    async def close(self) -> None:
        if not self._closed:
            self._closed = self._registrations.closed = True  # the pool's buffers die with the client
            self.pool.clear()
            await anyio.to_thread.run_sync(self._client.close)
            if self.master is not None:
                self.master.stop()

    # -- blocking internals (run in a worker thread) ---------------------------------------------
    def _staged(self, data: np.ndarray) -> np.ndarray:
        """`data` itself when it lies in registered pool memory, else a registered copy of it."""
        if self._registrations.in_pool(data):
            return data
        staged = self.pool.take(data.nbytes)
        staged[:] = data
        return staged

    def _put(self, key: str, data: np.ndarray | Gathered) -> None:
        """Send `data` under its object keys (`object_keys`), a gathered value from where its parts lie when its
        keys are new (`buffers.mooncake_gather`), any other value from registered memory as an upsert; then the
        manifest of a chunked value."""
        size, chunk = data.nbytes, self.settings.chunk_bytes
        keys = object_keys(key, size, chunk)
        codes = None
        if isinstance(data, Gathered):
            lookup = keys if len(keys) == 1 else [*keys, key]
            codes = send_gathered(self._client, self._config, self._registrations, self.pool.take, lookup, chunk, data)
            if codes is None:
                data = data.join(self.pool)
        if codes is None:
            staged = self._staged(data)
            ptrs = [staged.ctypes.data + i * chunk for i in range(len(keys))]
            sizes = [min(chunk, size - i * chunk) for i in range(len(keys))]
            codes = self._client.batch_upsert_from(keys, ptrs, sizes, self._config)
        for k, rc in zip(keys, codes, strict=True):
            if rc < 0:
                raise error_for(k, rc, "put")
        if len(keys) > 1:
            manifest = self.pool.take(_MANIFEST.size)
            _MANIFEST.pack_into(manifest, 0, _MANIFEST_MAGIC, size, chunk, len(keys))
            rc = self._client.upsert_from(key, manifest.ctypes.data, _MANIFEST.size, self._config)
            if rc < 0:
                raise error_for(key, rc, "put manifest")

    def _size(self, key: str) -> int:
        size = self._client.get_size(key)
        if size < 0:
            raise error_for(key, size, "get_size")
        return size

    def _read(self, keys: list[str], buf: np.ndarray, sizes: list[int], exact: bool = True) -> list[int]:
        """Read each key into its slice of `buf`; with exact=False a slice may be larger than the value. A key
        whose read outlasted its lease (-707) is read again alone, the others kept (`_read_again`)."""
        offsets = np.cumsum([0, *sizes[:-1]])
        ptrs = [buf.ctypes.data + int(o) for o in offsets]
        got = list(self._client.batch_get_into(keys, ptrs, sizes))
        for i, n in enumerate(got):
            if n == MooncakeLeaseExpired.code:
                got[i] = self._read_again(keys[i], ptrs[i], sizes[i])
        for k, n, want in zip(keys, got, sizes, strict=True):
            if n < 0:
                raise error_for(k, n, "get")
            if exact and n != want:
                raise MooncakeTransferFailed(k, op=f"get (read {n} of {want} bytes)")
        return got

    def _read_again(self, key: str, ptr: int, size: int) -> int:
        """Read `key` alone into `ptr`, each try under a fresh lease, up to `LEASE_RETRIES` tries while its
        lease expires mid-transfer; the bytes read (or another error's code, for `_read` to raise)."""
        retrying = Retrying(stop=stop_after_attempt(LEASE_RETRIES), wait=wait_exponential(0.05, max=0.5),
                            retry=retry_if_exception_type(MooncakeLeaseExpired), reraise=True)
        for attempt in retrying:
            with attempt:
                (n,) = self._client.batch_get_into([key], [ptr], [size])
                if n == MooncakeLeaseExpired.code:
                    raise MooncakeLeaseExpired(key, op=f"get (read alone, {attempt.retry_state.attempt_number} tries)")
        return n

    def _get(self, key: str, size_hint: int | None = None) -> memoryview:
        size = size_hint if size_hint else self._size(key)
        buf = self.pool.take(max(size, _MANIFEST.size))
        try:
            (n,) = self._read([key], buf, [buf.nbytes], exact=False)
        except MooncakeInvalid:  # the buffer was too small: the value is larger than the hint said
            n = self._size(key)
        if n == _MANIFEST.size and bytes(buf[:16]) == _MANIFEST_MAGIC:
            _, total, chunk, parts = _MANIFEST.unpack_from(buf)
            buf = self.pool.take(total)
            sizes = [min(chunk, total - i * chunk) for i in range(parts)]
            self._read([key + _PART.format(i) for i in range(parts)], buf, sizes)
            n = total
        if size_hint and n != size_hint:
            raise MooncakeTransferFailed(key, op=f"get (the value has {n} bytes, the ref says {size_hint})")
        return memoryview(buf[:n]).toreadonly()

    def _remove(self, key: str) -> int:
        rc = self._client.remove(key)
        if rc == MooncakeNotFound.code:
            return 0
        if rc < 0:
            raise error_for(key, rc, "remove")
        removed = 1
        parts = self._client.remove_by_regex("^" + re.escape(key) + r"#p\d{4}$")
        return removed + max(parts, 0)

    def where(self) -> dict[str, str | int]:
        """The addresses this client uses (for a run's log): the one it advertises, its master's, and the bytes
        of its segment (0: a pure client)."""
        s = self.settings
        return {"local_hostname": s.local_hostname, "master": s.master_server_address,
                "segment_bytes": s.global_segment_size}

    def replica_count(self, key: str) -> int:
        return len(self._client.get_replica_desc(key))


@dataclass(frozen=True)
class MooncakeStoreSpec:
    """A StoreSpec: the buffer stage's process mounts `global_segment_size`; every other process
    opens a pure client (segment 0) on the same master. `master="auto"` must be resolved to an
    address (`with_master`) by whoever starts the master before processes open the store."""

    settings: MooncakeSettings
    master: str = "auto"
    name: str = "mooncake"

    def with_master(self, address: str) -> MooncakeStoreSpec:
        return dataclasses.replace(self, master=address)

    @contextlib.contextmanager
    def serve(self) -> Iterator[MooncakeStoreSpec]:
        """This spec with a master to use for the run: a fresh one on 127.0.0.1 (stopped, by pid,
        when the block ends) if `master == "auto"`, else the configured one."""
        if self.master != "auto":
            yield self
            return
        with MooncakeMaster() as master:
            yield self.with_master(master.address)

    def open(self, holder: bool) -> MooncakeStore:
        if self.master == "auto":
            raise ValueError("MooncakeStoreSpec.master is 'auto': start a master and use with_master(address)")
        settings = dataclasses.replace(
            self.settings,
            master_server_address=self.master,
            global_segment_size=self.settings.global_segment_size if holder else 0,
        )
        return MooncakeStore(settings, name=self.name)
