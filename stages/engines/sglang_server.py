"""An SGLang HTTP server as a subprocess: found, launched on 127.0.0.1, health-checked, stopped by pid.

The server usually lives in its own virtual environment (SGLang pins its own torch, transformers
and kernels), so this module never imports sglang: it runs `PYTHON -m sglang.launch_server` and
talks HTTP. `sglang_python()` finds that interpreter: an explicit path, `$BATON_SGLANG_PYTHON`, the
repository's `.venv-sglang` (made by `tools/sglang-cpu/install.sh`), or this interpreter if it has
sglang; `SGLangUnavailable` says how to install it when none does.

Guarantees (`stages.engines.server_process.ServerProcess`, shared with vLLM's server): the server binds
127.0.0.1 unless told otherwise; it runs in its own session, so `stop()` ends exactly the process group this
object started (server, scheduler, detokenizer) and nothing else; on Linux it also gets SIGTERM if the process
that launched it dies; a server that dies or never becomes healthy raises `ServerFailed` carrying the tail of
its log; healthy means `/health` answered by a process of this server's own group, on a port it bound (a port
baton picked and found taken, as a restart's may be, is replaced by a fresh one; a port the caller named raises
`PortTaken`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from stages.engines.server_process import (  # noqa: F401 (ServerFailed, PortTaken: this module's names too)
    BIND_FAILED,
    PORT_TRIES,
    PortTaken,
    ServerFailed,
    ServerProcess,
    find_python,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO / ".venv-sglang"
INSTALL_HINT = "run tools/sglang-cpu/install.sh (CPU: about 4 minutes, 3.5 GB) or set engine.python"
# SGLang's torch-native CPU path (see ../shared/notes/sglang.md): no CUDA graph, no flashinfer,
# and sleep when idle so the scheduler does not spin on a core.
CPU_FLAGS = (
    "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--disable-cuda-graph", "--sleep-on-idle",
)


class SGLangUnavailable(RuntimeError):
    """No Python interpreter with sglang installed was found."""


def sglang_python(explicit: str | os.PathLike | None = None) -> Path:
    """The interpreter that runs the server (see the module docstring for the search order)."""
    return find_python(explicit, "BATON_SGLANG_PYTHON", DEFAULT_VENV, "sglang", SGLangUnavailable, INSTALL_HINT,
                       "SGLang")


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass
class SGLangServer(ServerProcess):
    """One `sglang.launch_server` process. `extra_args` are appended verbatim to the command; the process
    itself (launch, health, ports, stop) is `ServerProcess`'s."""

    label = "SGLang"

    model_path: str | Path
    python: str | os.PathLike | None = None
    dtype: str = "float32"
    device: str = "auto"  # "auto": cuda when a GPU is visible, else cpu
    threads: int = 1  # torch threads in the server's processes on CPU
    max_total_tokens: int = 16384
    extra_args: tuple[str, ...] = ()

    def command(self) -> list[str]:
        cpu = self.device == "cpu" or (self.device == "auto" and not gpu_available())
        return [
            str(sglang_python(self.python)), "-m", "sglang.launch_server",
            "--model-path", str(self.model_path), "--host", self.host, "--port", str(self.port),
            "--dtype", self.dtype, "--max-total-tokens", str(self.max_total_tokens),
            *(CPU_FLAGS if cpu else ()), *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        cpu = self.device == "cpu" or (self.device == "auto" and not gpu_available())
        if cpu:
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env["OMP_NUM_THREADS"] = str(self.threads)
        # the server's own venv must not see this project's site-packages through PYTHONPATH
        env.pop("PYTHONPATH", None)
        return env
