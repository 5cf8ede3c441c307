"""The tiny mixture of experts on a real SGLang server (CPU; one server for the module, stopped by pid):
every push lands whole, experts included, checked by the server's own logprobs against a torch forward of
the same weights; a push whose experts stay stale is refused; the experts the server routes each generated
token to equal the torch model's; a short MoE run with routing replay on SGLang balances its ledger.

The server runs this checkout's CPU shim (its directory first on the server's PYTHONPATH, so the module the
venv's .pth imports is this one's): what is tested is the shim in the tree, not the one the venv was made
with. Skipped, with the reason, only when no SGLang environment exists (tools/sglang-cpu/install.sh).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from stages.data.model import load_model, load_tokenizer, make_tiny_moe_model
from stages.data.routing import own_routing
from stages.engines.base import SamplingParams, returns_routed_experts
from stages.engines.sglang import SGLangEngine
from stages.engines.sglang_probe import PushMismatch
from stages.engines.sglang_server import REPO, gpu_available, sglang_python
from stages.engines.torch import TorchEngine
from tests.helpers.engines import GREEDY, SGLANG_SERVER_MODULE, started
from tests.helpers.preemption import assert_partial, carried_to_torch, preempted_mid_decode
from tests.stages.engines.test_sglang import run_probes

pytestmark = SGLANG_SERVER_MODULE
SHIM = REPO / "tools" / "sglang-cpu" / "sgl_kernel_cpu_shim"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def server_python(tmp_path_factory) -> str:
    """The SGLang interpreter, with this checkout's shim first on its path on a CPU-only machine."""
    python = sglang_python()
    if gpu_available():
        return str(python)
    wrapper = tmp_path_factory.mktemp("sglang-python") / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{SHIM}" exec "{python}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    return make_tiny_moe_model(tmp_path_factory.mktemp("sglang-moe") / "tiny-moe")


@pytest.fixture(scope="module")
async def engine(model_path, server_python, tmp_path_factory):
    engine = SGLangEngine(model_path, name="sglang-moe", python=server_python,
                          log_dir=tmp_path_factory.mktemp("sglang-moe-logs"))
    assert returns_routed_experts(engine)  # an MoE folder: from its config, before start
    await engine.start()
    pid = engine.server.pid
    yield engine
    await engine.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)


def moved(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A new version (fused expert names, as a transformers 5 learner's state_dict), every weight moved."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


async def served_probe(engine: SGLangEngine, model: torch.nn.Module) -> float:
    """The largest |server - torch| logprob on the engine's probe tokens (absolute)."""
    probe = engine._probe
    answer = await engine._call("POST", "/generate", probe.request(engine.version) | {"extra_key": "test"})
    served = np.array([lp for lp, *_ in answer["meta_info"]["input_token_logprobs"][1:]])
    ids = torch.tensor([probe.tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    return float(np.abs(served - logp.numpy()).max())


@pytest.mark.parametrize("path", ["tensor", "disk", "distributed"])
async def test_every_push_lands_with_its_experts_checked_by_the_servers_logprobs(engine, model_path, path):
    model = load_model(model_path)
    version = engine.version + 1
    engine.update = path
    try:
        await engine.receive_weights(version, moved(model, seed=version))  # fused names: renamed on the way
    finally:
        engine.update = "tensor"
    gap = await served_probe(engine, model)
    print(f"push v{version} by {path}: the engine's probe gap {engine.stats['probe_gap']:.3g}, "
          f"server vs torch {gap:.3g}")
    assert engine.version == version and engine.stats["probe_gap"] <= 1e-5
    assert gap <= 1e-5
    assert await served_probe(engine, load_model(model_path)) > 1e-2  # the weights did move


async def test_a_push_whose_experts_stay_stale_is_refused_and_the_server_keeps_what_it_held(engine, model_path):
    model = load_model(model_path)
    await engine.receive_weights(engine.version + 1, moved(model, seed=11))
    held = engine.version
    stale = moved(load_model(model_path), seed=12)  # fused names straight to the server: its loader skips them
    stale.pop("lm_head.weight")  # tied: the checkpoint has none
    refused = engine.stats.get("pushes_refused", 0)
    with pytest.raises(PushMismatch, match="probe"):
        await engine._update(held + 1, stale)
    assert engine.stats["pushes_refused"] == refused + 1 and engine.version == held
    assert await served_probe(engine, model) <= 1e-5  # back on the version it held


async def test_routed_experts_equal_the_torch_models_for_the_same_weights(engine, model_path):
    model = load_model(model_path)
    await engine.receive_weights(engine.version + 1, moved(model, seed=21))
    tok = load_tokenizer(model_path)
    prompts = [[tok.bos_token_id, *tok.encode(text, add_special_tokens=False)] for text in ("12>", "3456>", "9>")]
    completions = await engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0))
    same = ordered = total = 0
    for ids, c in zip(prompts, completions, strict=True):
        assert c.routed_experts is not None and c.routed_experts.dtype == np.uint8
        assert c.routed_experts.shape == (len(c.tokens), 2, 2)
        full = torch.tensor([ids + c.tokens.tolist()])
        own = own_routing(model, input_ids=full)[0, len(ids) - 1 : full.shape[1] - 1].numpy()  # the sampling rows
        same += int((np.sort(own, -1) == np.sort(c.routed_experts, -1)).all(-1).sum())
        ordered += int((own == c.routed_experts).all(-1).sum())
        total += own.shape[0] * own.shape[1]
    print(f"routed experts: {same}/{total} (token, layer) top-k sets equal torch's, {ordered} in the same order")
    assert same == total
    # the torch engine on the same weights, greedy: the same tokens, and the same experts for each
    torch_engine = TorchEngine(model_path, seed=0)
    await torch_engine.start()
    try:
        await torch_engine.receive_weights(engine.version, moved(load_model(model_path), seed=21))
        greedy = SamplingParams(max_new_tokens=12, temperature=GREEDY)
        pairs = zip(await engine.generate(prompts, greedy), await torch_engine.generate(prompts, greedy), strict=True)
    finally:
        await torch_engine.stop()
    compared = 0
    for served, own in pairs:
        m = min(len(served.tokens), len(own.tokens))
        differ = np.flatnonzero(served.tokens[:m] != own.tokens[:m])
        n = int(differ[0]) + 1 if differ.size else m  # rows up to the first differing token share their context
        assert np.array_equal(np.sort(served.routed_experts[:n], -1), np.sort(own.routed_experts[:n], -1))
        compared += n
    print(f"routed experts: {compared} greedy tokens' experts equal the torch engine's on the same weights")
    assert compared >= 24  # the engines agree on most greedy tokens (their logits differ by ~1e-7)


async def test_a_short_moe_run_with_routing_replay_on_sglang(engine, model_path, tmp_path):
    """configs/quickstart-moe.toml with the SGLang engine (the module's server, attached by url), 10 steps."""
    from baton.builder import build_pipeline
    from baton.config import load_toml
    from baton.schema import RunConfig
    from pipeline.telemetry import RunFolder

    data = load_toml("configs/quickstart-moe.toml")
    data.update(steps=10, run_root=str(tmp_path))
    data["engine"] = {"kind": "sglang", "urls": [engine.base_url], "batch_groups": 16, "dtype": "float32"}
    data["model"].update(path=str(model_path), heads=4, kv_heads=2)  # make_tiny_moe_model's defaults
    data["telemetry"] = {"progress": False}
    summary = await build_pipeline(RunConfig.model_validate(data)).arun()
    probes = run_probes(summary["run_dir"])
    print(json.dumps(summary), probes)
    assert summary["ledger_balanced"] and summary["version"] == 10
    # every push checked by the server's logprobs (the last one's probe may come after the last record)
    assert probes["probes"] >= probes["updates"] - 1 >= 5 and probes["probe_gap_max"] <= 1e-5
    records = [r for r in RunFolder(summary["run_dir"]).read_metrics() if "router_disagreement" in r]
    assert len(records) == 10 and all(r["router_disagreement"] == 0.0 for r in records)
    info = await engine._call("GET", "/get_model_info")
    assert int(info["weight_version"]) >= 8  # the run's versions reached the module's server (each probed)


async def test_a_preempted_engine_gives_back_its_tokens_routed_experts(engine, model_path):
    """An engine on the module's server (attached by url: it pushes the folder's weights as version 0) preempted
    mid-decode: each request's tokens come back with their logprobs and routed experts, the torch model's for the
    same weights; carried on by a torch engine, the stitched sample's experts are those of one forward pass."""
    model = load_model(model_path)
    tok = load_tokenizer(model_path)
    prompts = [[tok.bos_token_id, *tok.encode(text, add_special_tokens=False)] for text in ("12>", "3456>")]
    attached = SGLangEngine(model_path, name="sglang-moe-preempted", url=engine.base_url)
    params = SamplingParams(max_new_tokens=100)
    async with started(attached):
        partials = await preempted_mid_decode(attached, attached, prompts, params)
    assert_partial(model, prompts, partials, params, 0)
    weights = {n: t.detach().clone() for n, t in model.state_dict().items()}
    carried, done = await carried_to_torch(attached, model_path, weights, 0, prompts, partials, params, model)
    for ids, partial, c in zip(prompts, partials, done, strict=True):
        full = torch.tensor([ids + c.tokens.tolist()])
        own = own_routing(model, input_ids=full)[0, len(ids) - 1 : full.shape[1] - 1].numpy()  # the sampling rows
        assert partial.routed_experts is not None and partial.routed_experts.shape == (len(partial.tokens), 2, 2)
        assert c.routed_experts is not None and np.array_equal(np.sort(c.routed_experts, -1), np.sort(own, -1))
    print(f"SGLang MoE preempted: {[len(c.tokens) for c in partials]} tokens of {params.max_new_tokens} each given "
          f"back with their experts, carried / generated {carried:.3f}")
    assert carried >= 0.9
