"""Local runtime (run_actors), VersionClock and AdmissionGate."""

from __future__ import annotations

import anyio
import pytest

from pipeline.actor import ActorFailed, BaseActor
from pipeline.admission import AdmissionGate
from pipeline.runtime.local import run_actors
from pipeline.versions import VersionClock
from policies.staleness import MaxStaleness

pytestmark = pytest.mark.anyio

SHORT = 0.05
HUNG_AFTER = 60.0  # a guard against a hang, far above any correct run's time



class Recorder(BaseActor):
    """An actor that logs its lifecycle into a shared list."""

    def __init__(self, name: str, log: list[str], *, steps: int | None = None, fail_run: Exception | None = None,
                 fail_start: Exception | None = None, fail_stop: Exception | None = None) -> None:
        self.name = name
        self.log = log
        self.steps = steps  # None: run forever
        self.fail_run, self.fail_start, self.fail_stop = fail_run, fail_start, fail_stop
        self.done = 0
        self.cancelled = False

    async def start(self) -> None:
        self.log.append(f"start:{self.name}")
        if self.fail_start is not None:
            raise self.fail_start

    async def run(self) -> None:
        self.log.append(f"run:{self.name}")
        try:
            i = 0
            while self.steps is None or i < self.steps:
                await anyio.sleep(0.001)
                i += 1
                self.done = i
            if self.fail_run is not None:
                raise self.fail_run
        except anyio.get_cancelled_exc_class():
            self.cancelled = True
            raise
        self.log.append(f"return:{self.name}")

    async def stop(self) -> None:
        self.log.append(f"stop:{self.name}")
        if self.fail_stop is not None:
            raise self.fail_stop


async def without_waiting(call):
    """The result of `await call()`, which must return on its own: once every other task is
    blocked, nothing can wake it any more, so by then it has returned."""
    results = []

    async def run() -> None:
        results.append(await call())

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert results, "it waited for something"
    return results[0]


async def assert_acquire_waits_for(gate: AdmissionGate, *releases) -> None:
    """A producer's `gate.acquire()` keeps waiting after each release but the last, and returns after it."""
    acquired = anyio.Event()

    async def producer() -> None:
        await gate.acquire()
        acquired.set()

    with anyio.fail_after(HUNG_AFTER):
        async with anyio.create_task_group() as tg:
            tg.start_soon(producer)
            for release in releases:
                await anyio.wait_all_tasks_blocked()
                assert not acquired.is_set()
                release()
            await acquired.wait()


def stops(log: list[str]) -> list[str]:
    return [e.split(":", 1)[1] for e in log if e.startswith("stop:")]


async def test_runs_all_and_stops_when_until_finishes() -> None:
    log: list[str] = []
    a = Recorder("a", log, steps=5)
    b = Recorder("b", log, steps=None)  # would run forever
    c = Recorder("c", log, steps=2)  # returns early; not awaited, but must not end the run
    with anyio.fail_after(HUNG_AFTER):
        await run_actors([a, b, c], until=["a"])
    assert a.done == 5 and not a.cancelled
    assert b.cancelled and b.done >= 1
    assert c.done == 2 and not c.cancelled
    # every start before any run
    first_run = min(i for i, e in enumerate(log) if e.startswith("run:"))
    assert [e for e in log[:first_run]] == ["start:a", "start:b", "start:c"]
    assert {e for e in log if e.startswith("run:")} == {"run:a", "run:b", "run:c"}
    assert stops(log) == ["c", "b", "a"]


async def test_run_waits_for_every_until_actor() -> None:
    log: list[str] = []
    fast = Recorder("fast", log, steps=1)
    slow = Recorder("slow", log, steps=20)
    forever = Recorder("forever", log)
    with anyio.fail_after(HUNG_AFTER):
        await run_actors([fast, slow, forever], until=["fast", "slow"])
    assert slow.done == 20 and not slow.cancelled
    assert forever.cancelled


async def test_failing_run_raises_actor_failed_with_cause_and_stops_all() -> None:
    log: list[str] = []
    boom = KeyError("boom")
    a = Recorder("a", log)
    bad = Recorder("bad", log, steps=3, fail_run=boom)
    c = Recorder("c", log)
    with anyio.fail_after(HUNG_AFTER):
        with pytest.raises(ActorFailed) as info:
            await run_actors([a, bad, c], until=["a"])
    err = info.value
    assert err.actor == "bad" and err.phase == "run"
    assert "bad" in str(err)
    assert err.__cause__ is boom
    assert a.cancelled and c.cancelled
    assert stops(log) == ["c", "bad", "a"]


async def test_failing_start_stops_earlier_actors_only() -> None:
    log: list[str] = []
    err0 = RuntimeError("no gpu")
    a = Recorder("a", log)
    b = Recorder("b", log)
    bad = Recorder("bad", log, fail_start=err0)
    d = Recorder("d", log)
    with anyio.fail_after(HUNG_AFTER):
        with pytest.raises(ActorFailed) as info:
            await run_actors([a, b, bad, d], until=["a"])
    assert info.value.actor == "bad" and info.value.phase == "start"
    assert info.value.__cause__ is err0
    assert not any(e.startswith("run:") for e in log)
    assert "start:d" not in log
    assert stops(log) == ["b", "a"]  # reverse order, and not the one whose start failed


async def test_stop_failure_does_not_skip_other_stops() -> None:
    log: list[str] = []
    a = Recorder("a", log)
    b = Recorder("b", log, fail_stop=ValueError("stuck"))
    c = Recorder("c", log, steps=1)
    with anyio.fail_after(HUNG_AFTER):
        with pytest.raises(ActorFailed) as info:
            await run_actors([a, b, c], until=["c"])
    assert info.value.actor == "b" and info.value.phase == "stop"
    assert stops(log) == ["c", "b", "a"]


async def test_run_failure_wins_over_stop_failure() -> None:
    log: list[str] = []
    a = Recorder("a", log, fail_stop=ValueError("stuck"))
    bad = Recorder("bad", log, steps=1, fail_run=OSError("disk"))
    with anyio.fail_after(HUNG_AFTER):
        with pytest.raises(ActorFailed) as info:
            await run_actors([a, bad], until=["a"])
    assert info.value.actor == "bad" and isinstance(info.value.__cause__, OSError)
    assert stops(log) == ["bad", "a"]


async def test_start_failure_not_masked_by_stop_failure() -> None:
    log: list[str] = []
    a = Recorder("a", log, fail_stop=ValueError("stuck"))
    bad = Recorder("bad", log, fail_start=RuntimeError("no gpu"))
    with anyio.fail_after(HUNG_AFTER):
        with pytest.raises(ActorFailed) as info:
            await run_actors([a, bad], until=["a"])
    assert stops(log) == ["a"]
    assert (info.value.actor, info.value.phase) == ("bad", "start")


async def test_external_cancel_still_stops_everyone() -> None:
    log: list[str] = []
    a, b = Recorder("a", log), Recorder("b", log)
    with anyio.move_on_after(SHORT) as scope:
        await run_actors([a, b], until=["a"])
    assert scope.cancelled_caught
    assert stops(log) == ["b", "a"]


async def test_duplicate_names_rejected() -> None:
    log: list[str] = []
    with pytest.raises(ValueError, match="unique"):
        await run_actors([Recorder("x", log), Recorder("x", log)], until=["x"])
    assert log == []  # nothing started


async def test_unknown_until_rejected() -> None:
    log: list[str] = []
    with pytest.raises(ValueError, match="unknown"):
        await run_actors([Recorder("x", log)], until=["y"])
    assert log == []


# ---------------------------------------------------------------- VersionClock


async def test_clock_wait_until_wakes_on_advance() -> None:
    clock = VersionClock()
    got: list[int] = []

    async def waiter() -> None:
        got.append(await clock.wait_until(2))

    with anyio.fail_after(HUNG_AFTER):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert got == []
            assert clock.advance() == 1
            await anyio.wait_all_tasks_blocked()
            assert got == []  # 1 < 2: still waiting
            clock.advance()
    assert got == [2]


async def test_clock_wait_change_wakes_all_waiters() -> None:
    clock = VersionClock(3)
    got: list[int] = []

    async def waiter() -> None:
        got.append(await clock.wait_change(3))

    with anyio.fail_after(HUNG_AFTER):
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert got == []
            clock.advance(5)
    assert got == [5, 5, 5]


async def test_clock_returns_at_once_when_already_there() -> None:
    clock = VersionClock(4)
    assert await without_waiting(lambda: clock.wait_until(4)) == 4
    assert await without_waiting(lambda: clock.wait_until(1)) == 4
    assert await without_waiting(lambda: clock.wait_change(2)) == 4


async def test_clock_same_version_advance_does_not_wake() -> None:
    clock = VersionClock(1)
    with anyio.move_on_after(SHORT) as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(clock.wait_change, 1)
            await anyio.sleep(0.01)
            assert clock.advance(1) == 1
            await anyio.sleep(SHORT * 2)
    assert scope.cancelled_caught


async def test_clock_backwards_raises() -> None:
    clock = VersionClock(3)
    with pytest.raises(ValueError, match="may not go back"):
        clock.advance(2)
    assert clock.version == 3
    with pytest.raises(ValueError):
        VersionClock(-1)


# ---------------------------------------------------------------- AdmissionGate


async def test_gate_try_acquire_follows_policy() -> None:
    clock = VersionClock()
    gate = AdmissionGate(clock, MaxStaleness(k=1), units_per_version=2)
    assert [gate.try_acquire() for _ in range(5)] == [True] * 4 + [False]
    assert gate.started == 4
    gate.discard(1)
    assert gate.try_acquire() and not gate.try_acquire()
    clock.advance()
    assert gate.try_acquire() and gate.try_acquire() and not gate.try_acquire()
    with pytest.raises(ValueError):
        AdmissionGate(clock, MaxStaleness(), units_per_version=0)


async def test_gate_acquire_blocks_until_clock_advances() -> None:
    clock = VersionClock()
    gate = AdmissionGate(clock, MaxStaleness(k=0), units_per_version=1)
    await without_waiting(gate.acquire)
    with anyio.move_on_after(SHORT) as scope:
        await gate.acquire()
    assert scope.cancelled_caught and gate.started == 1

    await assert_acquire_waits_for(gate, clock.advance)
    assert gate.started == 2
    assert gate.wait_s > 0


async def test_gate_acquire_released_by_discard() -> None:
    clock = VersionClock()
    gate = AdmissionGate(clock, MaxStaleness(k=0), units_per_version=2)
    assert gate.try_acquire() and gate.try_acquire()
    await assert_acquire_waits_for(gate, gate.discard)
    assert clock.version == 0
    assert gate.started == 3 and gate.discarded == 1


async def test_gate_stays_blocked_when_advance_is_not_enough() -> None:
    """A wake-up that does not open the gate must not admit: the producer keeps waiting."""
    clock = VersionClock()
    policy_calls: list[tuple[int, int, int]] = []

    class EveryOther:
        def admit(self, version: int, started: int, discarded: int, groups_per_step: int) -> bool:
            policy_calls.append((version, started, discarded))
            return started - discarded < version // 2 + 1

    gate = AdmissionGate(clock, EveryOther(), units_per_version=1)
    assert gate.try_acquire()

    def advance_after_the_policy_was_asked_again() -> None:
        assert any(c[0] == 1 for c in policy_calls)  # it did re-evaluate on the advance
        clock.advance()  # version 2: limit 2

    await assert_acquire_waits_for(gate, clock.advance, advance_after_the_policy_was_asked_again)
    assert gate.started == 2


async def test_many_producers_never_exceed_limit() -> None:
    clock = VersionClock()
    k, b = 1, 3
    gate = AdmissionGate(clock, MaxStaleness(k=k), units_per_version=b)
    live_max: list[int] = []

    async def producer() -> None:
        while True:
            await gate.acquire()
            live_max.append(gate.started - gate.discarded)

    with anyio.fail_after(HUNG_AFTER):
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(producer)
            for _ in range(3):
                await anyio.wait_all_tasks_blocked()
                assert gate.started - gate.discarded == (clock.version + k + 1) * b
                clock.advance()
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
    assert max(live_max) <= (clock.version + k + 1) * b
    assert gate.started == (clock.version + k + 1) * b


async def test_gate_admits_nothing_once_the_clock_reaches_the_last_version() -> None:
    """Work started at the run's last version could never be consumed: the gate closes there, whatever the
    policy says (a sync run that ends leaves no group produced and untrained)."""
    clock = VersionClock()
    gate = AdmissionGate(clock, MaxStaleness(k=0), units_per_version=2, last_version=1)
    assert gate.try_acquire() and gate.try_acquire() and not gate.try_acquire()
    clock.advance()
    assert clock.version == 1 and not gate.try_acquire() and not gate.status()["admits_now"]
    open_ended = AdmissionGate(clock, MaxStaleness(k=0), units_per_version=2)
    assert open_ended.try_acquire()
