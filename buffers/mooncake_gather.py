"""Sending a gathered value to Mooncake from where its parts lie: the zero-copy half of `MooncakeStore.put`.

A `Gathered` value (a payload's head, then the batch's arrays where they lie) goes out with
`batch_put_from_multi_buffers`: each stored object (the value, or each `chunk_bytes` part of it) is sent
from the list of memory ranges that make it up, so the arrays are never copied into a staging buffer.
Invariants:

* Every range sent from is registered with the client for the length of the put. Memory of the
  store's own pool is registered already; small parts (the head, padding, row fields) are copied into
  one pooled buffer; any other part is registered when the first put that sends from it begins and
  unregistered when the last one ends (counted per address, under a lock: two puts may share an array).
* A gathered put never replaces a value: Mooncake's multi-buffer put keeps an existing object and
  reports success. The store therefore checks that the keys are new (the rollout path's case: every
  group has its own key) and otherwise sends the value the copying way, as an upsert.
* Registration is bookkeeping over TCP (about 0.1 ms for a 64 MiB batch's arrays, measured 2026-12-07);
  over RDMA it pins the pages, which can cost more than the copy it saves, so the store sends parts
  only where its settings say (`MooncakeSettings.gather_puts`, on for TCP by default).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

GATHER_MIN_BYTES = 4 << 20  # smaller values are joined into one pooled buffer: the copy costs less than the bookkeeping
REGISTER_MIN_BYTES = 64 << 10  # smaller parts (head, padding, row fields) are copied into pooled memory, not registered


def split_ranges(ranges: Sequence[tuple[int, int]], chunk: int) -> tuple[list[list[int]], list[list[int]]]:
    """The (pointers, sizes) of each `chunk`-byte object of the value whose bytes are `ranges` (address,
    size) in order: object i holds bytes [i * chunk, (i + 1) * chunk) of the value, the last one the rest."""
    ptrs: list[list[int]] = [[]]
    sizes: list[list[int]] = [[]]
    room = chunk
    for address, size in ranges:
        while size:
            if not room:
                ptrs.append([])
                sizes.append([])
                room = chunk
            take = min(size, room)
            ptrs[-1].append(address)
            sizes[-1].append(take)
            address, size, room = address + take, size - take, room - take
    return ptrs, sizes


class Registrations:
    """Memory registered with one Mooncake client: the store's pool buffers (for as long as the pool keeps
    them) and the parts of gathered puts (while puts send from them; see the module docstring)."""

    def __init__(self, client: Any, error_for: Callable[[str, int, str], Exception]) -> None:
        """`error_for(key, code, op)`: the store's typed error for a refused pool registration."""
        self._client, self._error_for = client, error_for
        self.pool_ranges: dict[int, int] = {}  # address -> bytes of the store's registered pool buffers
        self._held: dict[int, tuple[int, int]] = {}  # address -> (bytes registered, puts sending from it)
        self._lock = threading.Lock()
        self.closed = False  # the client is closed: nothing is unregistered any more

    def pool_new(self, buf: np.ndarray) -> None:
        """A new buffer of the store's pool: registered for as long as the pool keeps it."""
        rc = self._client.register_buffer(buf.ctypes.data, buf.nbytes)
        if rc != 0:
            raise self._error_for("<register_buffer>", rc, "register_buffer")
        self.pool_ranges[buf.ctypes.data] = buf.nbytes

    def pool_drop(self, buf: np.ndarray) -> None:
        if not self.closed and self.pool_ranges.pop(buf.ctypes.data, None) is not None:
            self._client.unregister_buffer(buf.ctypes.data)

    def in_pool(self, part: np.ndarray) -> bool:
        start, size = part.ctypes.data, part.nbytes
        ranges = list(self.pool_ranges.items())  # one step under the GIL: the pool may grow in another thread
        return any(base <= start and start + size <= base + n for base, n in ranges)

    @contextlib.contextmanager
    def held(self, parts: Sequence[np.ndarray]) -> Iterator[None]:
        """Every part registered until the block ends. Raises `GatherRefused` (nothing stays registered)
        if a registration is refused, or if a part starts where another of a different size is held."""
        taken: list[int] = []
        try:
            for part in parts:
                self._take(part.ctypes.data, part.nbytes)
                taken.append(part.ctypes.data)
            yield
        finally:
            for address in taken:
                self._release(address)

    def _take(self, address: int, nbytes: int) -> None:
        with self._lock:
            size, users = self._held.get(address, (nbytes, 0))
            if size != nbytes:
                raise GatherRefused(f"{nbytes} bytes at an address registered for {size}")
            if not users and (rc := self._client.register_buffer(address, nbytes)) != 0:
                raise GatherRefused(f"register_buffer of {nbytes} bytes failed with code {rc}")
            self._held[address] = (size, users + 1)

    def _release(self, address: int) -> None:
        with self._lock:
            size, users = self._held[address]
            if users > 1:
                self._held[address] = (size, users - 1)
            else:
                del self._held[address]
                self._client.unregister_buffer(address)


class GatherRefused(RuntimeError):
    """These parts cannot be sent where they lie; the store sends the value the copying way instead."""


def staged_ranges(parts: Sequence[np.ndarray], registrations: Registrations, take: Any) -> tuple[
        list[tuple[int, int]], list[np.ndarray], list[np.ndarray]]:
    """Where each part is sent from: parts in the store's pool as they lie, large ones (REGISTER_MIN_BYTES)
    registered where they lie, small ones copied into one buffer from `take(nbytes)` (registered pool
    memory). Returns the (address, size) ranges in order, the parts to register, and the staging buffers
    (kept alive by the caller until the put returns)."""
    small = [p for p in parts if p.nbytes and p.nbytes < REGISTER_MIN_BYTES and not registrations.in_pool(p)]
    staging = take(sum(p.nbytes for p in small)) if small else None
    ranges, register, pos = [], [], 0
    for part in parts:
        if not part.nbytes:
            continue
        if staging is not None and any(part is p for p in small):
            staging[pos : pos + part.nbytes] = part
            ranges.append((staging.ctypes.data + pos, part.nbytes))
            pos += part.nbytes
            continue
        if not registrations.in_pool(part):
            register.append(part)
        ranges.append((part.ctypes.data, part.nbytes))
    return ranges, register, [staging] if staging is not None else []


def send_gathered(client: Any, config: Any, registrations: Registrations, take: Any, keys: list[str],
                  chunk: int, data: Any) -> list[int] | None:
    """Put `data` (a `Gathered` value) from where its parts lie under `keys`: the value's key, or its
    `chunk`-byte parts' keys then its key (the manifest's, written by the caller). Returns the codes of the
    data keys, or None (nothing sent) when one of `keys` exists already (only an upsert replaces it) or a
    part cannot be registered: the caller sends it the copying way. `take(n)`: registered pool memory."""
    if any(client.batch_is_exist(keys)):  # 1: exists, -1: unknown
        return None
    data_keys = keys if len(keys) == 1 else keys[:-1]
    ranges, register, staging = staged_ranges(data.parts, registrations, take)
    ptrs, sizes = split_ranges(ranges, chunk)
    try:
        with registrations.held(register):
            codes = list(client.batch_put_from_multi_buffers(data_keys, ptrs, sizes, config))
    except GatherRefused:
        return None
    del staging  # the small parts' copy lives until the put returned
    return codes
