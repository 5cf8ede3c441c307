"""The fleet's logic (`pipeline.fleet`), its control endpoint (`pipeline.control`, `baton scale`), the roster
(`pipeline.roster`) and a cancelled admission (`pipeline.admission`), with stand-in workers: a worker
here is a few awaits, not an engine (the real pipeline's joins and leaves: tests/faults/test_elastic.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest

from baton.cli import main
from pipeline.admission import AdmissionGate
from pipeline.control import CONTROL_FILE, TOKEN_FILE, ControlError, ControlServer, control_request, scale_run
from pipeline.fleet import Fleet, FleetError
from pipeline.roster import Roster
from pipeline.runtime.local import LocalLauncher
from pipeline.versions import VersionClock

pytestmark = pytest.mark.anyio


class Worker:
    """Starts (or fails to), takes work until retired, then says it drained; records what happened."""

    def __init__(self, name: str, log: list[str], fail: bool = False) -> None:
        self.name, self.log, self.fail = name, log, fail
        self._retired = anyio.Event()
        self._drained = anyio.Event()

    async def start(self) -> None:
        await anyio.sleep(0.01)
        if self.fail:
            raise RuntimeError("no engine today")
        self.log.append(f"start {self.name}")

    async def run(self) -> None:
        await self._retired.wait()
        self.log.append(f"drained {self.name}")
        self._drained.set()

    async def retire(self, preempt: bool = False) -> None:
        self.log.append(f"retire {self.name}{' preempted' if preempt else ''}")
        self._retired.set()
        await self._drained.wait()

    async def stop(self) -> None:
        self.log.append(f"stop {self.name}")


class Stage:
    def __init__(self, log: list[str], failing: tuple[int, ...] = ()) -> None:
        self.log, self.failing = log, failing
        self.workers = 1

    def actors(self, ctx, inbox, outbox):
        return [Worker("w0", self.log)]

    def join(self, ctx, outbox, index: int) -> Worker:
        return Worker(f"w{index}", self.log, fail=index in self.failing)


def context(events: list[tuple[str, dict]]) -> SimpleNamespace:
    return SimpleNamespace(event=lambda kind, **fields: events.append((kind, fields)))


async def test_a_fleet_grows_shrinks_newest_first_and_says_what_each_cost() -> None:
    log, events = [], []
    stage = Stage(log)
    first = Worker("w0", log)
    fleet = Fleet(LocalLauncher(stage, None, None), context(events), [first], max_workers=3)
    async with anyio.create_task_group() as tg:
        tg.start_soon(first.run)
        tg.start_soon(fleet.run)
        status = await fleet.scale(3, wait=True)
        assert status == {"live": 3, "joining": 0, "leaving": 0, "target": 3, "max": 3, "workers": ["w0", "w1", "w2"]}
        status = await fleet.scale(1, wait=True)
        assert status["workers"] == ["w0"] and status["live"] == 1
        with pytest.raises(FleetError, match="allows 1 to 3"):
            await fleet.scale(0)
        with pytest.raises(FleetError, match="max_engines"):
            await fleet.scale(4)
        tg.cancel_scope.cancel()
    assert log.index("drained w2") < log.index("stop w2") and log.index("drained w1") < log.index("stop w1")
    assert log.index("stop w2") < log.index("stop w1"), "the newest leaves first"
    assert [k for k, _ in events] == ["fleet.joined", "fleet.joined", "fleet.left", "fleet.left"]
    assert all(f["join_s"] >= 0.01 for k, f in events if k == "fleet.joined")
    assert [f["live"] for k, f in events if k == "fleet.left"] == [1, 1], "both left together: one live throughout"


async def test_a_join_that_fails_to_start_is_an_event_and_the_fleet_stays_as_it_was() -> None:
    log, events = [], []
    first = Worker("w0", log)
    fleet = Fleet(LocalLauncher(Stage(log, failing=(1,)), None, None), context(events), [first], max_workers=2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(fleet.run)
        status = await fleet.scale(2, wait=True)
        tg.cancel_scope.cancel()
    assert status["live"] == 1 and status["target"] == 1
    assert events[0][0] == "fleet.join_failed" and "no engine today" in events[0][1]["error"]
    assert "stop w1" in log, "what it started is stopped"


async def test_a_join_whose_target_dropped_while_it_started_leaves_before_taking_work() -> None:
    log, events = [], []
    first = Worker("w0", log)
    fleet = Fleet(LocalLauncher(Stage(log), None, None), context(events), [first], max_workers=2)
    async with anyio.create_task_group() as tg:
        tg.start_soon(first.run)
        tg.start_soon(fleet.run)
        await fleet.scale(2)  # the join is under way
        status = await fleet.scale(1, wait=True)
        tg.cancel_scope.cancel()
    assert status["workers"] == ["w0"]
    assert [k for k, _ in events] == ["fleet.left"], "it never counted as joined"


async def test_the_control_endpoint_needs_its_token_and_scales_the_fleet(tmp_path: Path) -> None:
    log, events = [], []
    first = Worker("w0", log)
    fleet = Fleet(LocalLauncher(Stage(log), None, None), context(events), [first], max_workers=2)
    server = ControlServer(fleet, tmp_path)
    async with anyio.create_task_group() as tg:
        tg.start_soon(first.run)
        tg.start_soon(fleet.run)
        await server.start()
        assert (tmp_path / TOKEN_FILE).stat().st_mode & 0o777 == 0o600
        url = json.loads((tmp_path / CONTROL_FILE).read_text())["url"]
        assert url.startswith("http://127.0.0.1:")

        def without_token() -> int:
            try:
                urllib.request.urlopen(f"{url}/v1/fleet", timeout=5)
            except urllib.error.HTTPError as exc:
                return exc.code
            return 200

        assert await anyio.to_thread.run_sync(without_token) == 401
        status = await anyio.to_thread.run_sync(lambda: scale_run(tmp_path, 2, wait_s=10))
        assert status["live"] == 2 and status["workers"] == ["w0", "w1"]
        with pytest.raises(ControlError, match="allows 1 to 2"):
            await anyio.to_thread.run_sync(lambda: control_request(tmp_path, {"workers": 3}))
        with pytest.raises(ControlError, match="malformed body"):
            await anyio.to_thread.run_sync(lambda: control_request(tmp_path, {"engines": 1}))
        code = await anyio.to_thread.run_sync(lambda: main(["scale", str(tmp_path), "--engines", "1", "--wait", "10",
                                                             "--preempt"]))
        assert code == 0 and fleet.status()["workers"] == ["w0"]
        assert "retire w1 preempted" in log, "--preempt reaches the leaving worker"
        await server.stop()
        tg.cancel_scope.cancel()
    assert not (tmp_path / CONTROL_FILE).exists() and not (tmp_path / TOKEN_FILE).exists()
    assert main(["scale", str(tmp_path), "--engines", "2"]) == 2, "a run that is not running has no endpoint"


def test_a_roster_tells_each_watcher_of_every_member_and_of_each_leave() -> None:
    roster, seen, gone = Roster(["a"]), [], []

    def watcher(member: str):
        seen.append(member)
        return lambda: gone.append(member)

    roster.watch(watcher)
    roster.extend(["b", "c"])
    roster.remove("b")
    roster.remove("b")  # idempotent
    assert seen == ["a", "b", "c"] and gone == ["b"] and list(roster) == ["a", "c"]


async def test_an_admission_wait_that_is_cancelled_takes_no_unit() -> None:
    class Closed:
        def admit(self, version, started, discarded, per_version):
            return started - discarded < 1

    gate = AdmissionGate(VersionClock(), Closed(), units_per_version=1)
    assert gate.try_acquire()
    with anyio.move_on_after(0.05):
        await gate.acquire()  # waits: the policy admits one unit only
    assert gate.started == 1, "the cancelled wait took nothing"
    gate.discard()
    await gate.acquire()
    assert gate.started == 2
