"""BufferPool: reusable byte buffers, handed out as views and recycled when the view dies.

Invariant: a buffer is idle (reusable) only after the single view handed out for it has been
garbage-collected, and everything derived from a payload (memoryviews, decoded arrays) keeps that
view alive, so a recycled buffer is never still visible to anyone. Finalizers only append to a
deque, so they never take the lock; returned buffers are filed (and the idle limit applied) on the
next `take` or `trim`.

`on_new` / `on_drop` are called when the pool allocates a fresh buffer or lets one go, so a store
can register the pool's memory with its transport once (e.g. Mooncake `register_buffer`) and
reuse it for every payload: no allocation and no registration per batch in steady state.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections import deque
from collections.abc import Callable

import numpy as np


class BufferPool:
    def __init__(
        self,
        max_idle_bytes: int,
        *,
        min_nbytes: int = 1 << 20,
        on_new: Callable[[np.ndarray], None] | None = None,
        on_drop: Callable[[np.ndarray], None] | None = None,
    ) -> None:
        """Buffers below `min_nbytes` are plain allocations (not pooled, `on_new` not called)."""
        self.max_idle_bytes = max_idle_bytes
        self.min_nbytes = min_nbytes
        self._on_new = on_new
        self._on_drop = on_drop
        self._lock = threading.Lock()
        self._idle: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0
        self._returned: deque[np.ndarray] = deque()
        self.allocated = 0  # fresh pooled buffers made, for tests and metrics

    @staticmethod
    def _size_class(nbytes: int) -> int:
        """Round up to one of 16 classes per power of two (64 KiB at least): waste <= 1/16."""
        step = max(64 << 10, 1 << max(nbytes.bit_length() - 4, 0))
        return -(-nbytes // step) * step

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of exactly `nbytes`; its contents are arbitrary."""
        if nbytes < self.min_nbytes:
            return np.empty(nbytes, dtype=np.uint8)
        size = self._size_class(nbytes)
        with self._lock:
            self._file_returned()
            idle = self._idle.get(size)
            buf = idle.pop() if idle else None
            if buf is not None:
                self._idle_bytes -= size
        if buf is None:
            buf = np.empty(size, dtype=np.uint8)
            self.allocated += 1
            if self._on_new is not None:
                self._on_new(buf)
        # The lease is the one object every view of this buffer keeps alive. It must not be an
        # ndarray: numpy collapses `base` chains of arrays, so a slice of a plain `buf[:n]` view
        # would point past it at `buf`, and the buffer would be recycled while the slice is in use.
        lease = (ctypes.c_uint8 * nbytes).from_buffer(buf)
        finalizer = weakref.finalize(lease, self._returned.append, buf)
        finalizer.atexit = False
        return np.frombuffer(lease, dtype=np.uint8)

    def pooled(self, nbytes: int) -> bool:
        return nbytes >= self.min_nbytes

    def trim(self) -> None:
        with self._lock:
            self._file_returned()

    def clear(self) -> None:
        """Let every idle buffer go (buffers still in use are dropped when they come back)."""
        with self._lock:
            self.max_idle_bytes = 0
            self._file_returned()

    def _file_returned(self) -> None:
        while self._returned:
            buf = self._returned.popleft()
            if self._idle_bytes + buf.nbytes <= self.max_idle_bytes:
                self._idle.setdefault(buf.nbytes, []).append(buf)
                self._idle_bytes += buf.nbytes
            elif self._on_drop is not None:
                self._on_drop(buf)
        while self._idle_bytes > self.max_idle_bytes:
            size = max(s for s, bufs in self._idle.items() if bufs)
            buf = self._idle[size].pop()
            self._idle_bytes -= size
            if self._on_drop is not None:
                self._on_drop(buf)


_SHARED = BufferPool(max_idle_bytes=256 << 20)


def shared_pool() -> BufferPool:
    """The process-wide pool for payload buffers no store provides memory for (the codec's encodes, the
    joins of gathered values by stores that keep one buffer per value); `buffers.codec.configure_pool`
    caps its idle bytes."""
    return _SHARED
