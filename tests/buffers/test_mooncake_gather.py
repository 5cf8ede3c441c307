"""The ranges a gathered value is sent from (logic only; the store's gathered puts are in test_mooncake.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from buffers.mooncake_gather import GatherRefused, Registrations, split_ranges, staged_ranges
from buffers.store import Gathered


@given(st.lists(st.integers(0, 40), max_size=8), st.integers(1, 50))
def test_split_ranges_cut_the_value_into_chunks_in_order(sizes: list[int], chunk: int) -> None:
    ranges, start = [], 1000
    for size in sizes:
        ranges.append((start, size))
        start += size + 7  # parts lie apart in memory
    ptrs, lens = split_ranges([r for r in ranges if r[1]], chunk)
    assert [sum(x) for x in lens] == [min(chunk, sum(sizes) - i * chunk) for i in range(len(lens))]
    assert sum(map(sum, lens)) == sum(sizes) and all(0 < n for x in lens for n in x)
    want = [a + i for a, n in ranges for i in range(n)]  # every byte's address, in value order
    got = [p + i for ps, ns in zip(ptrs, lens, strict=True) for p, n in zip(ps, ns, strict=True) for i in range(n)]
    assert got == want


class Client:
    """Stands for a Mooncake client: counts what is registered."""

    def __init__(self, refuse: bool = False) -> None:
        self.registered: dict[int, int] = {}
        self.refuse = refuse

    def register_buffer(self, address: int, nbytes: int) -> int:
        if self.refuse:
            return -1
        assert address not in self.registered, "registered twice"
        self.registered[address] = nbytes
        return 0

    def unregister_buffer(self, address: int) -> int:
        del self.registered[address]
        return 0


def test_a_shared_part_stays_registered_until_its_last_put_ends() -> None:
    client, big = Client(), np.zeros(1 << 17, np.uint8)
    regs = Registrations(client, RuntimeError)
    with regs.held([big]):
        with regs.held([big]):
            assert client.registered == {big.ctypes.data: big.nbytes}
        assert client.registered == {big.ctypes.data: big.nbytes}
    assert client.registered == {}


def test_a_refused_registration_leaves_nothing_registered() -> None:
    first, second = np.zeros(1 << 17, np.uint8), np.zeros(1 << 17, np.uint8)
    client = Client()
    regs = Registrations(client, RuntimeError)
    with regs.held([first]), pytest.raises(GatherRefused, match="registered for"):
        with regs.held([second, first[: 1 << 16]]):  # the same address, another size
            pass
    assert client.registered == {}
    with pytest.raises(GatherRefused, match="code -1"), Registrations(Client(refuse=True), RuntimeError).held([first]):
        pass


def test_small_parts_are_staged_and_large_ones_registered_where_they_lie() -> None:
    head, big, row = np.arange(64, dtype=np.uint8), np.ones(1 << 17, np.uint8), np.full(40, 3, np.uint8)
    pool = np.zeros(1 << 20, np.uint8)  # the store's registered memory
    regs = Registrations(Client(), RuntimeError)
    regs.pool_new(pool)
    value = Gathered((pool[:64], head, big, np.zeros(0, np.uint8), row), 64 + 64 + big.nbytes + 40)
    ranges, register, staging = staged_ranges(value.parts, regs, lambda n: np.empty(n, np.uint8))
    assert [r[1] for r in ranges] == [64, 64, big.nbytes, 40]
    assert ranges[0][0] == pool.ctypes.data and ranges[2][0] == big.ctypes.data
    assert [p is big for p in register] == [True]
    (buf,) = staging
    assert bytes(buf) == bytes(head) + bytes(row) and ranges[1][0] == buf.ctypes.data


def test_a_gathered_value_states_its_size() -> None:
    with pytest.raises(ValueError, match="not the 5 stated"):
        Gathered((np.zeros(3, np.uint8),), 5)
    assert bytes(Gathered((np.ones(2, np.uint8), np.zeros(1, np.uint8)), 3).join()) == b"\x01\x01\x00"
