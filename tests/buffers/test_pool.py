"""BufferPool recycles a buffer only when nothing derived from it is alive."""

from __future__ import annotations

import gc

import numpy as np

from buffers.pool import BufferPool


def test_a_slice_keeps_its_buffer_out_of_the_pool() -> None:
    pool = BufferPool(64 << 20, min_nbytes=0)
    first = pool.take(1 << 20)
    first[:] = 7
    kept = memoryview(first[: 1000]).toreadonly()  # e.g. what a store's get returns
    del first
    gc.collect()
    second = pool.take(1 << 20)
    second[:] = 9
    assert bytes(kept[:4]) == b"\x07" * 4, "the buffer behind a live slice was handed out again"
    assert pool.allocated == 2


def test_buffers_come_back_once_every_view_is_gone() -> None:
    made: list[int] = []
    pool = BufferPool(64 << 20, min_nbytes=0, on_new=lambda buf: made.append(buf.ctypes.data))
    view = pool.take(3 << 20)
    derived = np.frombuffer(memoryview(view[10:20]), dtype=np.uint8)
    del view
    gc.collect()
    assert pool.take(3 << 20).ctypes.data != made[0]  # still in use through `derived`
    del derived
    gc.collect()
    again = pool.take(3 << 20)
    assert again.ctypes.data in made, "a free buffer of the same size class is reused"
