"""The OpenAI-compatible gateway with the real `openai` client, on loopback, in front of a real
TorchEngine on the byte-level BPE chat model of tools/make_math_example.py (seeds fixed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections import Counter

import aiohttp
import numpy as np
import openai
import pytest
from openai import AsyncOpenAI

from stages.data.model import load_tokenizer
from stages.data.tasks import Prompt
from stages.engines.base import Completion, ContextFull, EngineError, SamplingParams
from stages.engines.torch import TorchEngine
from stages.environments.base import Tool, ToolCall
from stages.environments.render import ChatRenderer
from stages.environments.tool_calls import render_tool_calls
from stages.gateway import EngineHost, Gateway, Limits, make_token_file
from tests.helpers.engines import SGLANG_MISSING, VLLM_MISSING
from tools.make_math_example import make_qwen_like_model

pytestmark = pytest.mark.anyio
KEY = "test-key"
CALCULATOR = Tool("calculator", "evaluate an arithmetic expression",
                  {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    return make_qwen_like_model(tmp_path_factory.mktemp("gateway-model"), seed=0)


@pytest.fixture(scope="session")
def tokenizer(model):
    return load_tokenizer(model)


class Questions:
    """A chat task: `what is a + b?` as one user message."""

    name, max_new_tokens = "questions", 8

    def sample(self, rng: random.Random) -> Prompt:
        a, b = rng.randrange(10), rng.randrange(10)
        text = f"what is {a} + {b}?"
        return Prompt(text=text, answer=str(a + b), messages=[{"role": "user", "content": text}])


class Recording:
    """An engine wrapper that keeps every completion the engine emitted."""

    def __init__(self, engine) -> None:
        self.engine, self.name, self.emitted = engine, engine.name, []

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def load(self) -> int:
        return self.engine.load

    async def generate(self, prompts, params):
        out = await self.engine.generate(prompts, params)
        self.emitted += [(list(p), c) for p, c in zip(prompts, out, strict=True)]
        return out


class Forced(Recording):
    """Emits the tokens of `reply(prompt text)` (then the stop token) instead of sampling: a random model
    never writes a tool call, and parsing and the round trip are what these tests check."""

    def __init__(self, engine, tokenizer, reply) -> None:
        super().__init__(engine)
        self.tokenizer, self.reply = tokenizer, reply

    async def generate(self, prompts, params: SamplingParams):
        out = []
        for prompt in prompts:
            reply = self.reply(self.tokenizer.decode(prompt))
            ids = self.tokenizer.encode(reply, add_special_tokens=False) + [params.stop_token_ids[0]]
            n = len(ids)
            out.append(Completion(np.array(ids, np.int32), np.full(n, -0.5, np.float32), np.zeros(n, np.int32), "stop"))
            self.emitted.append((list(prompt), out[-1]))
        return out


def replies(*texts: str):
    """A forced engine's replies: `texts` in turn, whatever the prompt."""
    left = list(texts)
    return lambda _prompt: left.pop(0)


@contextlib.asynccontextmanager
async def serving(model, tokenizer, *, wrap=None, forced=None, engines: int = 1, limits: Limits | None = None,
                  started: list | None = None, **host_options):
    """A gateway over an EngineHost over started engines (`engines` TorchEngines, or the `started`
    ones the caller stops), each wrapped by `wrap` or forced to answer `forced(prompt text)`, with an
    authorized aiohttp session for episode control."""
    if forced is not None:
        wrap = lambda engine: Forced(engine, tokenizer, forced)  # noqa: E731
    if started is None:
        started = [TorchEngine(model, name=f"torch-{i}", seed=i) for i in range(engines)]
        for engine in started:
            await engine.start()
    used = [wrap(e) if wrap else e for e in started]
    host = EngineHost(used, Questions(), **host_options)
    gateway = Gateway(host, KEY, limits=limits, tokenizer=tokenizer)
    await gateway.start()
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as control:
            yield gateway, host, control
    finally:
        while OPEN_CLIENTS:
            await OPEN_CLIENTS.pop().close()
        await gateway.stop()


async def open_episode(gateway, control, wait: bool = True) -> dict:
    async with control.post(f"{gateway.base_url}/episodes", params={"wait": str(wait).lower()}) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def post(control, url: str, body: dict | None = None) -> tuple[int, dict]:
    async with control.post(url, json=body or {}) as response:
        return response.status, await response.json()


OPEN_CLIENTS: list[AsyncOpenAI] = []


def client(base_url: str, key: str = KEY) -> AsyncOpenAI:
    """An openai client (no retries), closed when the `serving` block ends."""
    OPEN_CLIENTS.append(AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0))
    return OPEN_CLIENTS[-1]


async def test_recorded_ids_are_the_engines_ids(model, tokenizer):
    """Two turns (the second streamed) through the untouched engine: the episode's record is the
    rendered prompt, the engine's ids, the new user message rendered alone, the engine's ids."""
    await two_recorded_turns(model, tokenizer)


@pytest.mark.long
@pytest.mark.parametrize("kind", [
    pytest.param("sglang", marks=[pytest.mark.sglang, pytest.mark.skipif(bool(SGLANG_MISSING), reason=SGLANG_MISSING)]),
    pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.timeout(900),
                                pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING)]),
])
async def test_recorded_ids_are_the_engines_ids_on_a_real_server(kind, model, tokenizer, tmp_path):
    """The same two turns with a real server engine (CPU) behind the gateway: SGLang's on the session's model,
    vLLM's on the same model shaped for its CPU attention (3 heads over hidden size 96: head size 32)."""
    from stages.engines.sglang import SGLangEngine
    from stages.engines.vllm import VLLMEngine

    if kind == "vllm":
        model = make_qwen_like_model(tmp_path / "hd32", seed=0, heads=3, kv_heads=1)
        tokenizer = load_tokenizer(model)
    engine = (SGLangEngine if kind == "sglang" else VLLMEngine)(model, name=f"{kind}-gateway", log_dir=tmp_path)
    await engine.start()
    try:
        await two_recorded_turns(model, tokenizer, started=[engine])
    finally:
        await engine.stop()


async def two_recorded_turns(model, tokenizer, **serving_options) -> None:
    async with serving(model, tokenizer, wrap=Recording, **serving_options) as (gateway, host, control):
        opened = await open_episode(gateway, control)
        agent = client(opened["base_url"])
        messages = opened["sample"]["messages"]
        first = await agent.chat.completions.create(model="baton", messages=messages, max_tokens=12, logprobs=True)
        messages = [*messages, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "are you sure?"}]
        stream = await agent.chat.completions.create(model="baton", messages=messages, max_tokens=12, stream=True)
        chunks = [chunk async for chunk in stream]
        assert await post(control, f"{gateway.base_url}/episodes/{opened['id']}/reward", {"reward": 0.5}) == \
            (200, {"id": opened["id"], "status": "rewarded"})

    (engine,) = host.engines
    (p1, c1), (p2, c2) = engine.emitted
    renderer = ChatRenderer(tokenizer)
    reply = renderer.reply_ids([{"role": "user", "content": "are you sure?"}], c1.finish_reason == "stop")
    assert p1 == renderer.prompt_ids(opened["sample"]["messages"])
    assert p2 == p1 + c1.tokens.tolist() + reply
    finished = host.finished[opened["id"]]
    assert finished.reward == 0.5 and finished.reason is None and len(finished.segments) == 1
    row = finished.segments[0].row()
    assert row["tokens"].tolist() == p2 + c2.tokens.tolist()
    model_at = np.flatnonzero(row["loss_mask"])
    assert row["tokens"][model_at].tolist() == c1.tokens.tolist() + c2.tokens.tolist()
    assert np.array_equal(row["logprobs"][model_at], np.concatenate([c1.logprobs, c2.logprobs]))
    assert [t.logprob for t in first.choices[0].logprobs.content] == pytest.approx(c1.logprobs.tolist())
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == tokenizer.decode(c2.tokens.tolist(), skip_special_tokens=True)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert gateway.stats["segments"] == 0 and host.finish_calls == Counter({opened["id"]: 1})


def calls_text(*calls: ToolCall) -> str:
    return render_tool_calls(calls)


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_round_trip(model, tokenizer, stream):
    """A forced tool call comes back as OpenAI tool_calls; the agent's assistant message and tool
    result extend the record (no new segment): the tool message is rendered alone and appended."""
    texts = [calls_text(ToolCall("calculator", {"expression": "3 + 4"})), "The answer is 7."]
    async with serving(model, tokenizer, forced=replies(*texts)) as (gateway, host, control):
        opened = await open_episode(gateway, control)
        agent = client(opened["base_url"])
        messages = opened["sample"]["messages"]
        tools = [CALCULATOR.schema()]
        if stream:
            chunks = [c async for c in await agent.chat.completions.create(
                model="baton", messages=messages, tools=tools, stream=True)]
            deltas = [c.choices[0].delta for c in chunks if c.choices]
            (call,) = [tc for d in deltas for tc in d.tool_calls or ()]
            finish = chunks[-1].choices[0].finish_reason
            assistant = {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": call.function.arguments}}]}
        else:
            response = await agent.chat.completions.create(model="baton", messages=messages, tools=tools)
            (call,) = response.choices[0].message.tool_calls
            finish = response.choices[0].finish_reason
            assert response.choices[0].message.content is None
            assistant = response.choices[0].message.model_dump(exclude_none=True)
        assert finish == "tool_calls"
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "3 + 4"}
        result = {"role": "tool", "tool_call_id": call.id, "content": "7"}
        second = await agent.chat.completions.create(model="baton", messages=[*messages, assistant, result],
                                                     tools=tools)
        assert second.choices[0].message.content == "The answer is 7." and second.choices[0].finish_reason == "stop"
        assert (await post(control, f"{gateway.base_url}/episodes/{opened['id']}/reward", {"reward": 1.0}))[0] == 200

    (engine,) = host.engines
    (p1, c1), (p2, c2) = engine.emitted
    renderer = ChatRenderer(tokenizer)
    assert p1 == renderer.prompt_ids(messages, [CALCULATOR])
    assert p2 == p1 + c1.tokens.tolist() + renderer.reply_ids([result], after_stop=True)
    (segment,) = host.finished[opened["id"]].segments
    assert segment.row()["tokens"].tolist() == p2 + c2.tokens.tolist()
    assert gateway.stats["segments"] == 0


async def test_edited_history_starts_a_counted_segment(model, tokenizer):
    """An agent that edits a recorded assistant turn does not extend the record: the gateway renders
    the whole given conversation into a new segment and counts it; both segments reach the host."""
    async with serving(model, tokenizer, wrap=Recording) as (gateway, host, control):
        opened = await open_episode(gateway, control)
        agent = client(opened["base_url"])
        messages = opened["sample"]["messages"]
        first = await agent.chat.completions.create(model="baton", messages=messages, max_tokens=6)
        edited = [*messages, {"role": "assistant", "content": first.choices[0].message.content + " (edited)"},
                  {"role": "user", "content": "again"}]
        await agent.chat.completions.create(model="baton", messages=edited, max_tokens=6)
        extended = [*edited, (await agent.chat.completions.create(model="baton", messages=edited, max_tokens=6))
                    .choices[0].message.model_dump(exclude_none=True)]
        assert gateway.stats["segments"] == 2  # the edit, then resending `edited` (not an extension)
        await agent.chat.completions.create(model="baton", messages=[*extended, {"role": "user", "content": "ok"}],
                                            max_tokens=6)
        assert gateway.stats["segments"] == 2
        await post(control, f"{gateway.base_url}/episodes/{opened['id']}/reward", {"reward": 0.0})

    (engine,) = host.engines
    prompts = [p for p, _ in engine.emitted]
    renderer = ChatRenderer(tokenizer)
    assert prompts[1] == renderer.prompt_ids(edited) == prompts[2]
    segments = host.finished[opened["id"]].segments
    assert [s.turns for s in segments] == [1, 1, 2]
    assert segments[1].ids() == prompts[1] + engine.emitted[1][1].tokens.tolist()


async def test_errors_are_openai_shaped(model, tokenizer):
    limits = Limits(max_body_bytes=4096, max_tokens=32)
    async with serving(model, tokenizer, limits=limits) as (gateway, host, control):
        messages = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.AuthenticationError) as caught:
            await client(gateway.base_url, "wrong").chat.completions.create(model="baton", messages=messages)
        assert caught.value.status_code == 401 and caught.value.body["type"] == "authentication_error"
        with pytest.raises(openai.NotFoundError) as caught:
            await client(gateway.episode_url("nope")).chat.completions.create(model="baton", messages=messages)
        assert "nope" in caught.value.body["message"]
        agent = client(gateway.base_url)
        with pytest.raises(openai.BadRequestError) as caught:
            await agent.chat.completions.create(model="baton", messages=messages, max_tokens=33)
        assert "max_tokens" in caught.value.body["message"]
        with pytest.raises(openai.BadRequestError):
            await agent.chat.completions.create(model="baton", messages=[{"content": "no role"}])
        with pytest.raises(openai.BadRequestError):
            await agent.chat.completions.create(model="baton", messages=[{"role": "robot", "content": "x"}])
        with pytest.raises(openai.BadRequestError):
            await agent.chat.completions.create(model="baton", messages=messages, temperature=5)
        with pytest.raises(openai.BadRequestError):
            await agent.chat.completions.create(model="baton", messages=messages, extra_body={"n": "two"})
        async with control.post(f"{gateway.base_url}/chat/completions", data=b"{not json") as response:
            assert response.status == 400 and (await response.json())["error"]["type"] == "invalid_request_error"
        big = {"model": "baton", "messages": [{"role": "user", "content": "x" * 5000}]}
        async with control.post(f"{gateway.base_url}/chat/completions", json=big) as response:
            assert response.status == 413 and "error" in await response.json()
        async with control.post(f"{gateway.base_url}/nowhere") as response:
            assert response.status == 404 and "Traceback" not in await response.text()
        async with aiohttp.ClientSession() as anonymous, anonymous.post(f"{gateway.base_url}/episodes") as response:
            assert response.status == 401
        assert host.open_episodes == 0
        assert (await post(control, f"{gateway.base_url}/episodes/nope/reward", {"reward": 1}))[0] == 404
        opened = await open_episode(gateway, control)
        for bad in ({"reward": "high"}, {}, {"reward": float("inf")}):
            async with control.post(f"{gateway.base_url}/episodes/{opened['id']}/reward", data=json.dumps(bad)) as r:
                assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
        assert await post(control, f"{gateway.base_url}/episodes/{opened['id']}/reward", {"reward": 1}) == \
            (200, {"id": opened["id"], "status": "rewarded"})
        assert host.finished[opened["id"]].segments == [] and host.finished[opened["id"]].reward == 1.0


async def test_over_budget_is_429_with_retry_after_and_waits_otherwise(model, tokenizer):
    limits = Limits(shutdown_s=0.5)
    async with serving(model, tokenizer, max_open=1, retry_after_s=2.0, limits=limits) as (gateway, host, control):
        first = await open_episode(gateway, control)
        async with control.post(f"{gateway.base_url}/episodes", params={"wait": "false"}) as response:
            assert response.status == 429 and response.headers["Retry-After"] == "2"
            assert (await response.json())["error"]["type"] == "rate_limit_error"
        waiting = asyncio.ensure_future(open_episode(gateway, control, wait=True))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        assert await post(control, f"{gateway.base_url}/episodes/{first['id']}/close") == \
            (200, {"id": first["id"], "status": "closed without reward"})
        second = await asyncio.wait_for(waiting, 10)
        assert second["id"] != first["id"]
        status, body = await post(control, f"{gateway.base_url}/episodes/{first['id']}/reward", {"reward": 1.0})
        assert status == 409 and "closed without reward" in body["error"]["message"]
        blocked = asyncio.ensure_future(open_episode(gateway, control, wait=True))  # still waiting at stop
        await asyncio.sleep(0.2)
    assert host.finished[first["id"]].reason == "closed without reward"
    assert host.finished[second["id"]].reason == "gateway stopped"
    with pytest.raises(aiohttp.ClientError):
        await blocked


async def test_reward_timeout_drops_the_episode(model, tokenizer):
    limits = Limits(reward_timeout_s=2.0)  # long enough for the first request to come in on a busy machine
    async with serving(model, tokenizer, limits=limits) as (gateway, host, control):
        opened = await open_episode(gateway, control)
        agent = client(opened["base_url"])
        await agent.chat.completions.create(model="baton", messages=opened["sample"]["messages"], max_tokens=4)
        for _ in range(200):
            if opened["id"] in host.finished:
                break
            await asyncio.sleep(0.05)
        finished = host.finished[opened["id"]]
        assert finished.reason == "reward timeout" and finished.reward is None and len(finished.segments) == 1
        assert gateway.stats["dropped: reward timeout"] == 1
        with pytest.raises(openai.ConflictError):
            await agent.chat.completions.create(model="baton", messages=opened["sample"]["messages"], max_tokens=4)
    assert host.finish_calls[opened["id"]] == 1


async def test_episode_time_limit_drops_the_episode(model, tokenizer):
    async with serving(model, tokenizer, limits=Limits(max_episode_s=2.0)) as (gateway, host, control):
        opened = await open_episode(gateway, control)
        agent = client(opened["base_url"])
        await agent.chat.completions.create(model="baton", messages=opened["sample"]["messages"], max_tokens=2)
        await asyncio.sleep(2.1)
        with pytest.raises(openai.ConflictError) as caught:
            await agent.chat.completions.create(model="baton", messages=opened["sample"]["messages"], max_tokens=2)
        assert "episode time limit" in caught.value.body["message"]
    assert host.finished[opened["id"]].reason == "episode time limit" and host.finish_calls[opened["id"]] == 1
    assert gateway.stats["dropped: episode time limit"] == 1


async def test_episode_token_limit_and_n(model, tokenizer):
    async with serving(model, tokenizer, limits=Limits(max_episode_tokens=40)) as (gateway, host, control):
        opened = await open_episode(gateway, control)
        agent = client(opened["base_url"])
        messages = opened["sample"]["messages"]
        with pytest.raises(openai.BadRequestError):
            await agent.chat.completions.create(model="baton", messages=messages, n=2)
        first = await agent.chat.completions.create(model="baton", messages=messages, max_tokens=100 - 90)
        assert first.usage.prompt_tokens + first.usage.completion_tokens <= 40
        long = [*messages, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "tell me more " * 10}]
        with pytest.raises(openai.BadRequestError) as caught:
            await agent.chat.completions.create(model="baton", messages=long, max_tokens=5)
        assert "token limit" in caught.value.body["message"]
        several = await client(gateway.base_url).chat.completions.create(model="baton", messages=messages, n=3,
                                                                        max_tokens=3)
        assert [c.index for c in several.choices] == [0, 1, 2]


async def test_completions_and_models(model, tokenizer):
    async with serving(model, tokenizer, wrap=Recording) as (gateway, host, control):
        outside = client(gateway.base_url)
        assert [m.id for m in (await outside.models.list()).data] == ["baton"]
        plain = await outside.completions.create(model="baton", prompt=["1 + 1 =", "2 + 2 ="], max_tokens=3,
                                                 logprobs=0)
        assert len(plain.choices) == 2 and len(plain.choices[0].logprobs.token_logprobs) <= 3
        streamed = [c async for c in await outside.completions.create(model="baton", prompt=[5, 6, 7], max_tokens=2,
                                                                      n=2, stream=True)]
        assert sorted(c.choices[0].index for c in streamed) == [0, 1]
        with pytest.raises(openai.BadRequestError):
            await outside.completions.create(model="baton", prompt=[10**6], max_tokens=2)
        opened = await open_episode(gateway, control)
        agent = client(opened["base_url"])
        first = await agent.completions.create(model="baton", prompt="Q: 3 + 4 =", max_tokens=4)
        prompt = "Q: 3 + 4 =" + first.choices[0].text + "\nQ: 1 + 1 ="
        await agent.completions.create(model="baton", prompt=prompt, max_tokens=4)
        await post(control, f"{gateway.base_url}/episodes/{opened['id']}/reward", {"reward": 1.0})
    (engine,) = host.engines
    *_, (p1, c1), (p2, c2) = engine.emitted
    assert p2 == p1 + c1.tokens.tolist() + tokenizer.encode("\nQ: 1 + 1 =", add_special_tokens=False)
    (segment,) = host.finished[opened["id"]].segments
    assert segment.ids() == p2 + c2.tokens.tolist() and gateway.stats["segments"] == 0


async def test_stop_strings_cut_the_record_where_the_text_stops(model, tokenizer):
    texts = ["seven. and more text", "ok"]
    async with serving(model, tokenizer, forced=replies(*texts)) as (gateway, host, control):
        opened = await open_episode(gateway, control)
        agent = client(opened["base_url"])
        messages = opened["sample"]["messages"]
        first = await agent.chat.completions.create(model="baton", messages=messages, stop=[". "])
        assert first.choices[0].message.content == "seven" and first.choices[0].finish_reason == "stop"
        follow = [*messages, first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "?"}]
        await agent.chat.completions.create(model="baton", messages=follow)
        await post(control, f"{gateway.base_url}/episodes/{opened['id']}/reward", {"reward": 1.0})
    (engine,) = host.engines
    (p1, c1), (p2, _) = engine.emitted
    emitted = c1.tokens.tolist()
    k = next(k for k in range(1, len(emitted) + 1) if ". " in tokenizer.decode(emitted[:k]))
    assert k < len(emitted) - 1  # the record ends inside the completion, not at its stop token
    renderer = ChatRenderer(tokenizer)
    assert p2 == p1 + emitted[:k] + renderer.reply_ids([{"role": "user", "content": "?"}], after_stop=False)


async def test_64_concurrent_episodes_each_finished_once(model, tokenizer):
    async def episode(gateway, control, i: int) -> str:
        opened = await open_episode(gateway, control)
        agent = client(opened["base_url"])
        messages = opened["sample"]["messages"]
        for turn in range(2):
            response = await agent.chat.completions.create(model="baton", messages=messages, max_tokens=4,
                                                           stream=turn == 1 and i % 2 == 1)
            if turn == 0:
                messages = [*messages, response.choices[0].message.model_dump(exclude_none=True),
                            {"role": "user", "content": "next"}]
            elif i % 2 == 1:
                assert [c async for c in response][-1].choices[0].finish_reason in ("stop", "length")
        await post(control, f"{gateway.base_url}/episodes/{opened['id']}/reward", {"reward": i / 64})
        return opened["id"], opened["group"], opened["sample"]["prompt"]

    async with serving(model, tokenizer, engines=2, group_size=4, max_open=64) as (gateway, host, control):
        results = await asyncio.gather(*(episode(gateway, control, i) for i in range(64)))
    ids = [r[0] for r in results]
    assert len(set(ids)) == 64 and host.finish_calls == Counter({i: 1 for i in ids})
    assert all(host.finished[i].reason is None and len(host.finished[i].segments) == 1 for i in ids)
    assert all(host.finished[i].segments[0].turns == 2 for i in ids)
    groups: dict[int, set[str]] = {}
    for _, group, prompt in results:
        groups.setdefault(group, set()).add(prompt)
    assert len(groups) == 16 and all(len(prompts) == 1 for prompts in groups.values())
    assert gateway.stats["segments"] == 0 and host.open_episodes == 0


def calculator_model(prompt: str) -> str:
    """A model that learned the calculator task: a call to the calculator for the problem's sum first,
    then, once the prompt ends with the tool's response, that response alone."""
    if "<tool_response>" in prompt.rsplit("<|im_start|>user", 1)[-1]:
        return prompt.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>")[0]
    a, b = prompt.rsplit("what is ", 1)[1].split("?")[0].split(" + ")
    return calls_text(ToolCall("calculator", {"expression": f"{a} + {b}"}))


async def test_example_agent_solves_the_calculator_task_through_the_gateway(model, tokenizer):
    """examples/openai_agent.py (openai only): called per episode, and standalone opening its own."""
    from examples.openai_agent import agent, serve

    async with serving(model, tokenizer, forced=calculator_model, group_size=2) as (gateway, host, control):
        opened = await open_episode(gateway, control)
        assert await agent(opened["sample"], opened["base_url"], KEY) == 1.0
        await post(control, f"{gateway.base_url}/episodes/{opened['id']}/close")
        assert await serve(gateway.base_url, KEY, episodes=4, concurrency=2) == [1.0] * 4
        called = await gateway.run_agent(agent)

        async def broken(sample, base_url, api_key):
            raise RuntimeError("no luck")

        failed = await gateway.run_agent(broken)
    assert host.finished[opened["id"]].reason == "closed without reward"
    assert host.finished[failed].reason == "agent failed: RuntimeError: no luck"
    assert host.finished[called].reward == 1.0
    rewarded = [f for f in host.finished.values() if f.reason is None]
    assert len(rewarded) == 5 and all(f.reward == 1.0 for f in rewarded)
    for finished in rewarded:
        (segment,) = finished.segments
        assert segment.turns == 2
        text = tokenizer.decode(segment.ids())
        assert "<tool_call>" in text and "<tool_response>" in text and gateway.stats["segments"] == 0


def test_token_file_is_owner_only(tmp_path):
    path = tmp_path / "run" / "gateway.token"
    token = make_token_file(path)
    assert path.read_text().strip() == token and len(token) >= 32
    assert path.stat().st_mode & 0o777 == 0o600
    assert make_token_file(path) != token


async def test_stream_is_server_sent_events_ending_in_done(model, tokenizer):
    async with serving(model, tokenizer) as (gateway, host, control):
        body = {"model": "baton", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}
        async with control.post(f"{gateway.base_url}/chat/completions", json=body) as response:
            assert response.status == 200 and response.content_type == "text/event-stream"
            events = (await response.text()).split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-2])
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 1 <= usage["completion_tokens"] <= 3


class FailsOnce(Recording):
    """The engine dies during its `fail_at`-th call (nothing it generated comes back), then serves again."""

    def __init__(self, engine, fail_at: int) -> None:
        super().__init__(engine)
        self.calls, self.fail_at = 0, fail_at

    async def generate(self, prompts, params):
        self.calls += 1
        out = await self.engine.generate(prompts, params)
        if self.calls == self.fail_at:
            raise EngineError("engine died mid-request")
        self.emitted += [(list(p), c) for p, c in zip(prompts, out, strict=True)]
        return out


async def test_engine_failure_is_503_and_a_resent_request_is_recorded_once(model, tokenizer):
    """The record changes only when the host answers: after a 503 the agent resends the same
    conversation, and the episode holds each turn once (the lost one is not in the record)."""
    async with serving(model, tokenizer, wrap=lambda e: FailsOnce(e, fail_at=2)) as (gateway, host, control):
        opened = await open_episode(gateway, control)
        agent = client(opened["base_url"])
        first = await agent.chat.completions.create(model="baton", messages=opened["sample"]["messages"],
                                                    max_tokens=5)
        follow = [*opened["sample"]["messages"], first.choices[0].message.model_dump(exclude_none=True),
                  {"role": "user", "content": "and then?"}]
        with pytest.raises(openai.InternalServerError) as caught:
            await agent.chat.completions.create(model="baton", messages=follow, max_tokens=5)
        assert caught.value.status_code == 503 and "engine" in caught.value.body["message"]
        await agent.chat.completions.create(model="baton", messages=follow, max_tokens=5)
        await post(control, f"{gateway.base_url}/episodes/{opened['id']}/reward", {"reward": 1.0})
    (engine,) = host.engines
    (p1, c1), (p2, c2) = engine.emitted
    (segment,) = host.finished[opened["id"]].segments
    assert segment.turns == 2 and segment.ids() == p2 + c2.tokens.tolist()
    assert p2[: len(p1) + len(c1.tokens)] == p1 + c1.tokens.tolist() and gateway.stats["segments"] == 0


class ContextAlwaysFull(Recording):
    """An engine whose context every prompt fills (vLLM's max_model_len below the agent's prompt)."""

    async def generate(self, prompts, params):
        raise ContextFull("engine e: a prompt of 620 tokens fills the server's context of 512 (engine.max_model_len)")


async def test_a_prompt_that_fills_the_context_is_the_clients_400_not_an_engine_failure(model, tokenizer):
    """The request's fault: OpenAI's 400 `context_length_exceeded` naming the key (the client does not resend
    it, as it would a 503), and the gateway counts no engine failure."""
    async with serving(model, tokenizer, wrap=ContextAlwaysFull) as (gateway, host, control):
        opened = await open_episode(gateway, control)
        with pytest.raises(openai.BadRequestError) as caught:
            await client(opened["base_url"]).chat.completions.create(
                model="baton", messages=opened["sample"]["messages"], max_tokens=5)
        assert caught.value.code == "context_length_exceeded" and "engine.max_model_len" in caught.value.message
        assert gateway.stats["http 400"] == 1 and gateway.stats["http 503"] == 0


async def test_engine_host_routes_sticky_per_episode_and_new_episodes_to_the_least_loaded():
    class Counting:
        def __init__(self, name: str) -> None:
            self.name, self.version, self.load, self.prompts = name, 0, 0, []

        async def generate(self, prompts, params):
            self.prompts += prompts
            return [Completion(np.array([1], np.int32), np.zeros(1, np.float32), np.zeros(1, np.int32))]

    busy, idle = Counting("busy"), Counting("idle")
    busy.load = 5  # requests of other callers
    host = EngineHost([busy, idle], Questions(), group_size=2)
    first, second = await host.open(wait=False), await host.open(wait=False)
    assert first.group == second.group and first.sample == second.sample
    params = SamplingParams(max_new_tokens=1)
    for _ in range(2):
        await host.generate(first.id, [1, 2], params)
    assert len(idle.prompts) == 2 and not busy.prompts
    idle.load = 9
    await host.generate(first.id, [1, 2, 3], params)  # sticky: its conversation is in that engine's cache
    third = await host.open(wait=False)
    await host.generate(third.id, [4], params)
    assert len(idle.prompts) == 3 and busy.prompts == [[4]] and third.group == first.group + 1


def test_a_completion_cut_at_a_stop_string_keeps_its_tokens_routed_experts():
    from stages.gateway.turns import _cut

    experts = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2)
    whole = Completion(np.arange(5, dtype=np.int32), np.full(5, -0.5, np.float32), np.zeros(5, np.int32),
                       "length", {}, experts)
    cut = _cut(whole, 3)
    assert cut.tokens.tolist() == [0, 1, 2] and np.array_equal(cut.routed_experts, experts[:3])
    assert cut.finish_reason == "stop"
    dense = Completion(np.arange(5, dtype=np.int32), np.full(5, -0.5, np.float32), np.zeros(5, np.int32))
    assert _cut(dense, 2).routed_experts is None
