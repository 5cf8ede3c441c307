"""Weight pushes into a real vLLM server on the tiny MoE model (Qwen3-MoE, head dim 32): the experts'
CPU prepack is redone after every update (without it even unchanged weights shift the logprobs by
~0.015), so A -> B -> A land within 1e-5 of the float32 transformers forward. Its own server, started
and stopped like tests/stages/engines/test_vllm_update.py's."""

from __future__ import annotations

import sys

import anyio
import pytest
import torch

from stages.data.model import make_tiny_moe_model
from stages.engines.sglang_probe import WeightProbe, folder_version
from tests.stages.engines.test_vllm_update import TOLERANCE, check_landed_plain, push_and_check, running_server
from tests.stages.engines.test_vllm_update import pytestmark as pytestmark  # noqa: PLC0414 - same markers


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    folder = make_tiny_moe_model(tmp_path_factory.mktemp("vllm-moe") / "tiny-moe", heads=2, kv_heads=1)
    with running_server(folder, folder.parent / "server.log") as url:
        yield folder, url


def test_moe_pushes_a_b_a_land_exactly(moe_server):
    folder, url = moe_server
    probe = WeightProbe(folder)
    a = folder_version(folder)
    g = torch.Generator().manual_seed(2)
    b = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in a.items() if n != "lm_head.weight"}
    b["lm_head.weight"] = b["model.embed_tokens.weight"]
    before = anyio.run(check_landed_plain, url, folder, probe, a)
    figures = [anyio.run(push_and_check, url, folder, probe, v, w) for v, w in ((1, a), (2, b), (3, a))]
    print(f"\nvLLM push (tiny MoE model): before {before:.2e}; " + ", ".join(
        f"v{v}: {s:.3f} s, gap {gap:.2e}" for v, (s, gap) in enumerate(figures, 1)), file=sys.stderr)
    assert all(gap <= TOLERANCE for _, gap in figures)
