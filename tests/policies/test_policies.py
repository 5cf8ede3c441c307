"""MaxStaleness: accept / admit decisions, and the FIFO simulation that the admit rule bounds staleness."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.staleness import MaxStaleness, reuse_lead, staleness, sync

ks = st.integers(min_value=0, max_value=6)
versions = st.integers(min_value=0, max_value=1000)
groups = st.integers(min_value=1, max_value=16)
on_stale = st.sampled_from(["drop", "requeue"])


def test_staleness_is_version_difference() -> None:
    assert staleness(7, 3) == 4
    assert staleness(5, 5) == 0


@given(k=ks, v=versions, age=st.integers(min_value=0, max_value=20), mode=on_stale)
def test_accept_trains_iff_within_bound(k: int, v: int, age: int, mode: str) -> None:
    policy = MaxStaleness(k=k, on_stale=mode)
    oldest = v - age
    verdict = policy.accept(v, oldest)
    if age <= k:
        assert verdict == "train"
    else:
        assert verdict == mode  # never "train" beyond the bound, and on_stale picks the action


@pytest.mark.parametrize("mode", ["drop", "requeue"])
def test_on_stale_selects_action(mode: str) -> None:
    policy = MaxStaleness(k=1, on_stale=mode)
    assert policy.accept(10, 9) == "train"
    assert policy.accept(10, 8) == mode


def test_default_is_drop_and_bound_is_k() -> None:
    assert MaxStaleness().on_stale == "drop"
    assert MaxStaleness(k=3).bound == 3


@given(v=versions, age=st.integers(min_value=0, max_value=10))
def test_sync_accepts_only_on_policy(v: int, age: int) -> None:
    policy = sync()
    assert policy.k == 0
    assert (policy.accept(v + age, v) == "train") == (age == 0)


@given(k=ks, v=versions)
def test_item_newer_than_learner_raises(k: int, v: int) -> None:
    with pytest.raises(ValueError, match="newer than the learner"):
        MaxStaleness(k=k).accept(v, v + 1)


@pytest.mark.parametrize("k", [-1, -5])
def test_negative_k_raises(k: int) -> None:
    with pytest.raises(ValueError, match="k must be >= 0"):
        MaxStaleness(k=k)


@pytest.mark.parametrize("mode", ["retry", "", "DROP", None])
def test_invalid_on_stale_raises(mode) -> None:
    with pytest.raises(ValueError, match="on_stale"):
        MaxStaleness(on_stale=mode)


@given(k=ks, v=versions, b=groups, started=st.integers(0, 20000), discarded=st.integers(0, 20000))
def test_admit_is_monotone_in_version(k: int, v: int, b: int, started: int, discarded: int) -> None:
    policy = MaxStaleness(k=k)
    if policy.admit(v, started, discarded, b):
        assert policy.admit(v + 1, started, discarded, b)


@given(k=ks, v=versions, b=groups, discarded=st.integers(0, 100))
def test_admit_limit_is_exact(k: int, v: int, b: int, discarded: int) -> None:
    policy = MaxStaleness(k=k)
    limit = (v + k + 1) * b
    assert policy.admission_limit(v, b) == limit
    # live = started - discarded; admitted while live < limit, never at or beyond it
    assert policy.admit(v, discarded + limit - 1, discarded, b)
    assert not policy.admit(v, discarded + limit, discarded, b)
    assert not policy.admit(v, discarded + limit + 7, discarded, b)


@given(k=ks, v=versions, b=groups, data=st.data())
def test_a_lead_lowers_the_admission_limit_and_never_exceeds_k(k: int, v: int, b: int, data) -> None:
    lead = data.draw(st.integers(0, k))
    policy = MaxStaleness(k=k, lead=lead)
    assert policy.ahead == lead and policy.admission_limit(v, b) == (v + lead + 1) * b
    assert MaxStaleness(k=k).ahead == k
    with pytest.raises(ValueError, match="staleness.lead must be in 0..staleness.k"):
        MaxStaleness(k=k, lead=k + 1)


def test_reuse_lead_leaves_room_for_every_use() -> None:
    assert [reuse_lead(4, r) for r in (1, 2, 3, 5)] == [4, 3, 2, 0]
    assert reuse_lead(0, 1) == 0 and reuse_lead(1, 3) == 0  # never below 0 (max_reuse > k + 1 is refused)


@given(k=ks, v=versions, b=groups, n=st.integers(1, 50))
def test_discards_free_slots(k: int, v: int, b: int, n: int) -> None:
    policy = MaxStaleness(k=k)
    full = policy.admission_limit(v, b)
    assert not policy.admit(v, full, 0, b)
    assert policy.admit(v, full, 1, b)
    assert policy.admit(v, full + n - 1, n, b)
    assert not policy.admit(v, full + n, n, b)


@given(k=ks, v=versions, b=groups)
def test_greedy_producer_never_exceeds_limit(k: int, v: int, b: int) -> None:
    policy = MaxStaleness(k=k)
    started = 0
    while policy.admit(v, started, 0, b):
        started += 1
        assert started <= 10**6
    assert started == (v + k + 1) * b


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(0, 4),
    b=st.integers(1, 8),
    moves=st.lists(st.booleans(), min_size=1, max_size=300),
)
def test_fifo_simulation_never_trains_beyond_k(k: int, b: int, moves: list[bool]) -> None:
    """Producer admits groups tagged with the current version; consumer trains B per version, FIFO."""
    policy = MaxStaleness(k=k)
    version, started = 0, 0
    queue: deque[int] = deque()
    trained: list[int] = []
    for produce in moves:
        if produce:
            if policy.admit(version, started, 0, b):
                started += 1
                queue.append(version)
        elif len(queue) >= b:
            for _ in range(b):
                tag = queue.popleft()
                trained.append(version - tag)
                assert policy.accept(version, tag) == "train"
            version += 1
        # live groups never exceed the admission limit
        assert started <= (version + k + 1) * b
    assert all(0 <= s <= k for s in trained)


@settings(max_examples=50, deadline=None)
@given(k=st.integers(0, 4), b=st.integers(1, 8), steps=st.integers(1, 20))
def test_fifo_simulation_producer_first_reaches_bound(k: int, b: int, steps: int) -> None:
    """Worst case: the producer fills every slot before each consumer step; staleness hits exactly k."""
    policy = MaxStaleness(k=k)
    version, started = 0, 0
    queue: deque[int] = deque()
    worst = 0
    for _ in range(steps):
        while policy.admit(version, started, 0, b):
            started += 1
            queue.append(version)
        for _ in range(b):
            worst = max(worst, version - queue.popleft())
        version += 1
    assert worst == min(k, steps - 1)


@given(k=st.integers(0, 6), oldest=st.integers(0, 50), ahead=st.integers(1, 10), span=st.none() | st.integers(1, 6))
def test_interrupt_restarts_exactly_what_could_not_be_trained_or_spans_too_much(k, oldest, ahead, span) -> None:
    policy = MaxStaleness(k=k, max_span=span)
    new = oldest + ahead
    verdict = policy.interrupt(oldest, new)
    trainable = policy.accept(new, oldest) == "train"  # the earliest version it could be trained at
    within_span = span is None or ahead + 1 <= span
    assert verdict == ("continue" if trainable and within_span else "restart")


def test_max_span_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_span"):
        MaxStaleness(k=2, max_span=0)
