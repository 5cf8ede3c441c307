"""An inference server as a subprocess of this process: launched on 127.0.0.1, health-checked, stopped by pid.

What every server-backed engine (SGLang's, vLLM's) needs from the process that serves it, whatever the
server: a subclass says only how to launch it (`command()`, `environment()`) and what to call it (`label`).

Guarantees: the server binds 127.0.0.1 unless told otherwise; it runs in its own session, so `stop()` ends
exactly the process group this object started (the server and every process it forked) and nothing else; on
Linux it also gets SIGTERM if the process that launched it dies (`pipeline.lifetime.die_with_parent`); a server
that dies or never becomes healthy raises `ServerFailed` carrying the tail of its log; healthy means the health
route answered from a process of this server's own group, on a port it bound (a port baton picked and found
taken, as a restart's may be, is replaced by a fresh one; a port the caller named raises `PortTaken`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from pipeline.lifetime import die_with_parent
from pipeline.net import free_port


class ServerFailed(RuntimeError):
    """The server exited or did not become healthy; the message ends with its log's tail."""


class PortTaken(ServerFailed):
    """Another process holds the server's port: the server could not bind it (a server may bind its HTTP port
    only at the end of its start, so a port free at launch may be gone by then), or a foreign server answers
    on it."""


def find_python(explicit: str | os.PathLike | None, env_var: str, venv: Path, module: str,
                unavailable: type[Exception], hint: str, label: str) -> Path:
    """The interpreter that runs a server living in its own venv: `explicit` (the config's engine.python),
    `$env_var`, `venv`/bin/python, or this interpreter when it can import `module`; else raise `unavailable`
    saying how to install it (`hint`; `label`: the server's name in the message)."""
    for candidate in (explicit, os.environ.get(env_var), venv / "bin" / "python"):
        if candidate and Path(candidate).exists():
            return Path(candidate)
        if candidate == explicit and explicit:
            raise unavailable(f"engine.python = {str(explicit)!r} does not exist; {hint}")
    if importlib.util.find_spec(module) is not None:
        return Path(sys.executable)
    raise unavailable(f"no {label} server environment: {venv} is missing, {env_var} is unset and this "
                      f"interpreter has no {module}; {hint}")


BIND_FAILED = "address already in use"  # uvicorn's log line when the port is taken (errno 98)
PORT_TRIES = 3  # launches on fresh ports before a port baton picked is given up on


@dataclass(kw_only=True)
class ServerProcess:
    """One server process (see the module docstring). Subclasses define `command()` and `environment()`."""

    label = "inference"  # the server's name in messages and in its default log file's name
    health_path = "/health"

    host: str = "127.0.0.1"
    port: int | None = None
    log_path: Path | None = None
    launch_timeout_s: float = 240.0
    process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _port_given: bool = field(default=False, init=False, repr=False)  # a port the caller named is never moved
    _log_offset: int = field(default=0, init=False, repr=False)  # where this launch's lines start in the log

    def __post_init__(self) -> None:
        self._port_given = self.port is not None

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    async def start(self) -> None:
        """Launch and wait until the health route answers from this server's own process group; raises
        ServerFailed with the log's tail. A port baton picked that another process took meanwhile (a restart
        keeps its port, which may have been handed out again since the crash) is replaced by a fresh one, up
        to PORT_TRIES launches; a port the caller named raises PortTaken."""
        if self.alive():
            return
        tries = 1 if self._port_given else PORT_TRIES
        for attempt in range(tries):
            if self.port is None:
                self.port = free_port(self.host)
            self._launch()
            try:
                await self._wait_healthy()
                return
            except PortTaken:
                self.stop()
                if attempt == tries - 1:
                    raise
                self.port = None

    def _launch(self) -> None:
        if self.log_path is None:
            name = f"baton-{self.label.lower()}-{os.getpid()}-{self.port}.log"
            self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / name
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.environment(), start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, signal.SIGTERM),  # SIGTERM: it stops its own children
            )

    async def _wait_healthy(self) -> None:
        import aiohttp

        deadline = time.monotonic() + self.launch_timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise ServerFailed(f"{self.label} server exited with code {self.process.returncode}{self._tail()}")
                if BIND_FAILED in self._launch_log().lower():  # the server may not exit then: it waits, unbound
                    raise PortTaken(f"port {self.port} is taken by another process{self._tail()}")
                try:
                    async with http.get(self.url + self.health_path) as response:
                        if response.status == 200:
                            self._check_listener()
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await anyio.sleep(0.5)
        self.stop()
        raise ServerFailed(f"{self.label} server not healthy after {self.launch_timeout_s:.0f} s{self._tail()}")

    def _launch_log(self) -> str:
        """What this launch has written to the log so far."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as log:
            log.seek(self._log_offset)
            return log.read().decode(errors="replace")

    def _check_listener(self) -> None:
        """Raise PortTaken when the process listening on the port is not of this server's group: a foreign
        server answering the health route must not pass for this one (its answers would be another model's)."""
        import psutil

        try:
            owners = {c.pid for c in psutil.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN and c.laddr.port == self.port and c.pid is not None}
            foreign = {pid for pid in owners if os.getpgid(pid) != self.process.pid}
        except (psutil.Error, ProcessLookupError, PermissionError):
            return  # cannot tell (another user's process): trust the answer
        if foreign:
            raise PortTaken(f"port {self.port} answers from process {sorted(foreign)}, not this server")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the process group this object started; SIGKILL what is left after `timeout_s`.
        Returns once no process of the group remains."""
        if self.process is None:
            return
        pgid = self.process.pid  # start_new_session: the server leads its own group
        if not _end_group(self.process, pgid, signal.SIGTERM, timeout_s):
            _end_group(self.process, pgid, signal.SIGKILL, 10.0)
        self.process = None

    def kill(self) -> None:
        """SIGKILL the server's group at once (what a crash looks like); for fault tests."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(10)

    def _tail(self, lines: int = 25) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"; log {self.log_path}, last lines:\n" + "\n".join(text)


def _end_group(leader: subprocess.Popen, pgid: int, sig: int, timeout_s: float) -> bool:
    """Send `sig` to the group and wait until none of it is left (the leader reaped by us, its
    children by init); True when the group is gone within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    try:
        leader.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return False
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False
