"""Start, find and stop a `mooncake_master` on 127.0.0.1, or on `$BATON_HOST` (a Ray run's driver sets it to
its node's address, so the other nodes reach the master).

`MooncakeMaster().start()` picks free ports, launches the master bundled with the
`mooncake-transfer-engine` wheel with quiet logs, waits until its RPC port accepts connections,
and `stop()` ends exactly that process, by pid. `require_mooncake()` turns the import errors of a
missing wheel or a missing `libibverbs.so.1` into one message that says what to install.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from pipeline.lifetime import die_with_parent
from pipeline.net import free_port

# The read lease of the masters baton starts (`default_kv_lease_ttl`; mooncake_master's own default is 10 s):
# a read whose transfer outlasts it fails (-707), and a key read less than it ago cannot be removed. 2 s
# covers a 64 MiB part (`MooncakeSettings.chunk_bytes`) on a loaded machine, where 500 ms did not (a 128 MiB
# cross-process read with two busy loops on two cores), and delays only frees, which run in the background.
READ_LEASE_MS = 2000


class MooncakeUnavailable(ImportError):
    """The mooncake wheel or a system library it needs is missing."""


def require_mooncake():
    """Import `mooncake.store`, or raise MooncakeUnavailable naming what to install."""
    try:
        import mooncake.store as store
    except ImportError as exc:
        if "libibverbs" in str(exc):
            raise MooncakeUnavailable(
                f"Mooncake needs the system library libibverbs.so.1 (even for TCP): "
                f"apt-get install -y libibverbs1  ({exc})"
            ) from exc
        raise MooncakeUnavailable(
            "the Mooncake store needs the mooncake wheel: pip install 'baton-rl[mooncake]' "
            f"(mooncake-transfer-engine-non-cuda on CPU machines)  ({exc})"
        ) from exc
    return store


def master_binary() -> Path:
    import mooncake

    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.exists():
        raise MooncakeUnavailable(f"the mooncake wheel has no mooncake_master binary at {path}")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


class MooncakeMaster:
    """One master process. Use as a context manager, or start()/stop()."""

    def __init__(
        self,
        port: int | None = None,
        *,
        lease_ttl_ms: int = READ_LEASE_MS,
        client_ttl_s: int = 10,
        log_path: str | Path | None = None,
        extra_flags: tuple[str, ...] = (),
    ) -> None:
        self.host = os.environ.get("BATON_HOST", "127.0.0.1")  # a Ray run's driver: its node's address
        self.port = port
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.log_path = Path(log_path) if log_path else None
        self.extra_flags = extra_flags
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout_s: float = 20.0) -> MooncakeMaster:
        require_mooncake()
        self.port = self.port or free_port(self.host)
        cmd = [
            str(master_binary()),
            f"--rpc_address={self.host}",
            f"--rpc_port={self.port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={free_port(self.host)}",
            "--enable_metric_reporting=false",
            "--enable_http_metadata_server=false",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            f"--client_ttl={self.client_ttl_s}",
            "--logtostderr=1",
            "--minloglevel=1",
            *self.extra_flags,
        ]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        # ends with this process, also when it is SIGKILLed (pipeline.lifetime)
        self.process = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                        preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"mooncake_master exited with {self.process.returncode} at start "
                    f"(port {self.port}); command: {' '.join(cmd)}"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"mooncake_master did not listen on {self.address} within {timeout_s} s")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (graceful), then SIGKILL; only the process this object started."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """SIGKILL, as a crash would (fault tests)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restart(self, timeout_s: float = 20.0) -> None:
        """SIGKILL this master and start a new one on the same port (store.master_restart: every key
        is lost, clients reconnect to the new one); `stop()` then stops the new process."""
        self.kill()
        self.process = None
        self.start(timeout_s)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
