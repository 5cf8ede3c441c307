"""The store boundary's fault hooks: `FaultyStore` wraps an ObjectStore when a run plans `store.*` faults.

Installed by `open_store(..., faults=plan)` (here: how every process opens its store) only when the
plan has a `store.` kind; otherwise the store is returned unchanged and costs nothing. What each kind
does at its occurrence (counted per operation: puts for put_fail / master_restart / holder_crash, gets
for get_fail / corrupt):

* `store.put_fail`: the put raises `InjectedStoreError` (a `StoreError`), and so do the caller's
  retries of the same key (`buffers.retry.ATTEMPTS` tries in all), so the producer regenerates the
  group whichever other puts run meanwhile;
* `store.get_fail`: the call raises `InjectedStoreError` (the callers' tenacity retries apply; a group
  whose retries all fail is lost and redone);
* `store.corrupt`: the get returns the value with one byte flipped, which the codec's checksum
  refuses (the learner counts the group lost and has it redone);
* `store.master_restart`: the target "master" is killed and started again on the same port before
  the put (every key is lost; Mooncake clients reconnect; the lost keys surface as typed errors);
* `store.holder_crash`: the target "holder" (a process holding a segment) is SIGKILLed before the
  put; with `replicas = 2` gets fail over to the surviving copy.

A firing is recorded as recovered at the boundary's next successful call of the same operation (a
holder crash: the next put or get that succeeds; in a Ray producer process there are only puts).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import anyio
from typing_extensions import Buffer

from buffers.retry import ATTEMPTS
from buffers.store import Gathered, ObjectStore, StoreError, StoreSpec
from pipeline.faults import FaultPlan, FaultPlanError, InjectedFault, Schedule
from pipeline.telemetry import get_logger


class InjectedStoreError(StoreError, InjectedFault):
    """A store call failed by injection (store.put_fail / store.get_fail)."""


class Restartable(Protocol):
    def restart(self) -> None: ...


class Killable(Protocol):
    def kill(self) -> None: ...


@runtime_checkable
class OwnsMaster(Protocol):
    """A store that started its own Mooncake master (`buffers.mooncake.MooncakeStore.open("auto")`)."""

    master: Restartable | None


@dataclass(frozen=True)
class HolderByPid:
    """A segment-holder process that whoever started it lets a fault SIGKILL (by its pid)."""

    pid: int

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass(frozen=True)
class MasterByPid:
    """A mooncake_master a fault may restart from any process of the run: `restart()` SIGKILLs the
    pid written in `pid_file` and starts a new master on the same port, writing its pid there, so the
    owner stops whichever master runs at the end, by that pid (`stop()`)."""

    port: int
    pid_file: str
    lease_ttl_ms: int = 500
    client_ttl_s: int = 3

    def restart(self) -> None:
        from buffers.mooncake_master import MooncakeMaster

        old = int(Path(self.pid_file).read_text())
        _kill_master(old)
        master = MooncakeMaster(self.port, lease_ttl_ms=self.lease_ttl_ms, client_ttl_s=self.client_ttl_s)
        master.start()
        _atomic_write(self.pid_file, str(master.pid))

    def stop(self) -> None:
        path = Path(self.pid_file)
        if path.exists():
            _kill_master(int(path.read_text()), signal.SIGTERM)


def _kill_master(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal `pid` only if it still is a mooncake_master (a recycled pid is left alone), and reap it
    when it is our child."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if b"mooncake_master" not in cmdline:
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return
    for _ in range(200):
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)
            if done:
                return
        except ChildProcessError:  # not our child: wait until it is gone (or a zombie its parent reaps)
            if _gone(pid):
                return
        time.sleep(0.025)


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, path)


class FaultyStore:
    """An ObjectStore with the plan's `store.*` faults at its boundary (see the module docstring);
    every other attribute (`pool`, `master`, ...) is the wrapped store's."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self.inner, self.name, self.pool = inner, inner.name, inner.pool
        self._put_fail = plan.schedule("store.put_fail")
        self._failing_puts: dict[str, int] = {}  # key -> puts of it that still fail
        self._get_fail = plan.schedule("store.get_fail")
        self._corrupt = plan.schedule("store.corrupt")
        self._master_restart = plan.schedule("store.master_restart")
        self._holder_crash = plan.schedule("store.holder_crash")
        own = inner.master if isinstance(inner, OwnsMaster) else None
        self._master: Restartable | None = plan.targets.get("master") or own
        self._holder: Killable | None = plan.targets.get("holder")
        if self._master_restart is not None and self._master is None:
            raise FaultPlanError(
                "store.master_restart needs a master this run may restart: store.kind = 'mooncake' with "
                "store.master = 'auto' (local runtime), or run it with `baton faults`, which owns the master"
            )
        if self._holder_crash is not None and self._holder is None:
            raise FaultPlanError(
                "store.holder_crash needs a second process holding a segment to kill: run it with "
                "`baton faults` (it starts one and sets store.replicas = 2)"
            )
        self.log = get_logger("faults").bind(boundary="store")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def put(self, key: str, data: Buffer | Gathered) -> None:
        if self._master_restart is not None and self._master_restart.hit():
            self.log.warning("injected fault: restarting the store's master", key=key)
            await anyio.to_thread.run_sync(self._master.restart)  # type: ignore[union-attr]
        if self._holder_crash is not None and self._holder_crash.hit():
            self.log.warning("injected fault: killing a segment holder", key=key)
            self._holder.kill()  # type: ignore[union-attr]
        if self._put_fail is not None and self._put_fail.hit():
            self._failing_puts[key] = ATTEMPTS  # this try and the retries of the same key: the group is redone
        if self._failing_puts.get(key, 0) > 0:
            self._failing_puts[key] -= 1
            raise InjectedStoreError(f"injected fault store.put_fail: put of {key!r} failed")
        await self.inner.put(key, data)
        _recovered(self._put_fail, self._master_restart, self._holder_crash, detail=f"put {key}")

    async def get(self, key: str, size_hint: int | None = None) -> memoryview:
        if self._get_fail is not None and self._get_fail.hit():
            raise InjectedStoreError(f"injected fault store.get_fail: get of {key!r} failed")
        value = await self.inner.get(key, size_hint=size_hint)
        if self._corrupt is not None and self._corrupt.hit() and value.nbytes:
            damaged = bytearray(value)
            damaged[-1] ^= 0xFF  # the last byte: in the body, covered by the payload's checksum
            self.log.warning("injected fault: corrupted a payload", key=key)
            return memoryview(bytes(damaged))
        _recovered(self._get_fail, self._corrupt, self._holder_crash, detail=f"get {key}")
        return value

    async def remove(self, key: str) -> int:
        return await self.inner.remove(key)

    async def remove_matching(self, pattern: str) -> int:
        return await self.inner.remove_matching(pattern)

    async def close(self) -> None:
        await self.inner.close()


def _recovered(*schedules: Schedule | None, detail: str) -> None:
    for schedule in schedules:
        if schedule is not None:
            schedule.recovered(detail)


def with_store_faults(store: Any, plan: FaultPlan | None) -> Any:
    """`store` wrapped in a FaultyStore when `plan` has a store fault, else `store` itself."""
    if plan is None or not plan.planned("store.") or isinstance(store, FaultyStore):
        return store
    return FaultyStore(store, plan)


def open_store(store: ObjectStore | StoreSpec, holder: bool, faults: FaultPlan | None = None) -> ObjectStore:
    """The store for this process: `store` itself, or `store.open(holder)` for a spec; wrapped in a
    FaultyStore only when `faults` plans a store fault (here, so `buffers.store` imports no backend)."""
    if isinstance(store, StoreSpec) and not isinstance(store, ObjectStore):
        store = store.open(holder)
    return with_store_faults(store, faults)


def start_holder(master: str, segment_bytes: int, log_path: str | Path | None = None) -> subprocess.Popen:
    """Start a process that mounts `segment_bytes` into the store on `master` and holds it until
    killed (a second segment holder, for replicas = 2); returns once it holds the segment."""
    import sys

    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "buffers.mooncake_holder", master, str(segment_bytes)],
        stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "MC_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"},
    )
    line = proc.stdout.readline() if proc.stdout else b""
    if b"ready" not in line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the segment holder did not start (said {line!r}); see {log_path}")
    return proc


__all__ = ["FaultyStore", "HolderByPid", "InjectedStoreError", "MasterByPid", "open_store", "start_holder",
           "with_store_faults"]
