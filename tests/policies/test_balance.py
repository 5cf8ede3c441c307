"""policies.balance: groups over ranks by tokens (greedy LPT) and rows into micro-batches by a budget."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.balance import balance_groups, loads, micro_batches

FAST = settings(max_examples=150, deadline=None)


def best_max_load(tokens: list[int], world_size: int) -> int:
    """The optimum, by trying every assignment (small inputs only)."""
    best = sum(tokens)
    for ranks in itertools.product(range(world_size), repeat=len(tokens)):
        load = [0] * world_size
        for t, r in zip(tokens, ranks, strict=True):
            load[r] += t
        best = min(best, max(load))
    return best


@FAST
@given(st.lists(st.integers(0, 50), max_size=7), st.integers(1, 4))
def test_every_group_once_and_the_max_load_within_grahams_bound_of_the_optimum(tokens, world_size):
    shares = balance_groups(tokens, world_size)

    assert len(shares) == world_size
    assert sorted(i for share in shares for i in share) == list(range(len(tokens)))
    assert all(share == sorted(share) for share in shares)
    if len(tokens) >= world_size:
        assert all(shares)
    best = best_max_load(tokens, world_size)
    assert 3 * world_size * max(loads(tokens, shares)) <= (4 * world_size - 1) * best


@FAST
@given(st.lists(st.integers(0, 10_000), max_size=60), st.integers(1, 8))
def test_large_inputs_every_group_once_and_the_same_answer_every_time(tokens, world_size):
    shares = balance_groups(tokens, world_size)
    assert sorted(i for share in shares for i in share) == list(range(len(tokens)))
    assert balance_groups(list(tokens), world_size) == shares
    if len(tokens) >= world_size:
        assert all(shares)
    assert max(loads(tokens, shares)) <= -(-sum(tokens) // world_size) + max(tokens, default=0)  # list scheduling


def test_a_known_split_and_fewer_groups_than_ranks():
    assert balance_groups([5, 1, 4, 3, 3], 2) == [[0, 4], [1, 2, 3]]  # 5 | 4, 3 -> 4, 3 -> 5, 1 -> 7: 8 and 8
    assert balance_groups([7, 2], 4) == [[0], [1], [], []]
    assert balance_groups([0, 0, 0], 3) == [[0], [1], [2]]  # ties go to the rank with fewer groups


@FAST
@given(st.lists(st.integers(1, 300), max_size=40), st.integers(1, 256))
def test_micro_batches_hold_every_row_once_within_the_budget(tokens, max_tokens):
    batches = micro_batches(tokens, max_tokens)

    assert sorted(i for b in batches for i in b) == list(range(len(tokens)))
    for b in batches:
        assert len(b) * max(tokens[i] for i in b) <= max_tokens or len(b) == 1, "padded size within the budget"
    assert [b[0] for b in batches] == sorted(b[0] for b in batches)
    assert micro_batches(tokens, None) == ([list(range(len(tokens)))] if tokens else [])


def test_micro_batches_known_packing_and_an_oversized_row_alone():
    assert micro_batches([3, 9, 4, 2, 5], 10) == [[0, 3], [1], [2, 4]]  # 9 | 5 + 4 padded to 2 x 5 | 3 + 2
    assert micro_batches([3, 4, 4, 2], 12) == [[0, 1, 2], [3]]  # 4 + 4 + 3 padded to 3 x 4 = 12 | 2
    assert micro_batches([12, 1, 1], 10) == [[0], [1, 2]]
    assert micro_batches([], 10) == []


@pytest.mark.parametrize("call", [lambda: balance_groups([1], 0), lambda: balance_groups([-1], 2),
                                  lambda: micro_batches([1], 0)])
def test_bad_input_is_a_clear_error(call):
    with pytest.raises(ValueError, match="must"):
        call()
