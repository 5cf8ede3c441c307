"""TorchEngine continuous batching: concurrent calls share one running batch, requests join and
leave it at decode-step boundaries, per-request sampling params and restarts, weights mid-stream."""

from __future__ import annotations

import math
import threading

import torch

torch.set_num_threads(1)

import anyio  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from policies import MaxStaleness  # noqa: E402
from stages.data.model import load_model, make_tiny_model  # noqa: E402
from stages.engines.base import EngineError, SamplingParams  # noqa: E402
from stages.engines.torch import TorchEngine  # noqa: E402
from tests.helpers.engines import GREEDY, eval_model, teacher_forced_logprobs, uniform_weights  # noqa: E402

pytestmark = pytest.mark.anyio

BOS = 1
SHORT = [BOS, 7]
MEDIUM = [BOS, 6, 16]
LONG = [BOS, 12, 13, 14, 15, 3, 4, 16, 9, 3, 7, 11]
DEADLOCK_GUARD_S = 60  # a hook that waits longer than this has found the engine stuck


@pytest.fixture(scope="module")
def model_a(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_a"))


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_b"), seed=1)


async def started(folder, **options) -> TorchEngine:
    engine = TorchEngine(folder, seed=11, **options)
    await engine.start()
    return engine


def record_forwards(engine: TorchEngine, monkeypatch, hold_until_load: int = 0) -> list[tuple[int, int]]:
    """The (rows, columns) of every forward pass's input ids; with `hold_until_load`, the first
    forward pass waits until that many requests are queued or running (so they batch together)."""
    shapes: list[tuple[int, int]] = []
    real = engine._forward

    def forward(**inputs):
        if not shapes and hold_until_load:
            assert wait_for(lambda: engine.load >= hold_until_load), "the concurrent calls never arrived"
        shapes.append(tuple(inputs["input_ids"].shape))
        return real(**inputs)

    monkeypatch.setattr(engine, "_forward", forward)
    return shapes


def wait_for(condition) -> bool:
    """(decode thread) poll `condition` until it holds; False if it never does."""
    event = threading.Event()
    for _ in range(DEADLOCK_GUARD_S * 500):
        if condition():
            return True
        event.wait(0.002)
    return False


def on_step(engine: TorchEngine, monkeypatch, actions: dict) -> list[int]:
    """Run `actions[k]()` in the decode thread while the batch samples its k-th token (1-based);
    returns the batch size at every step."""
    sizes: list[int] = []
    real = engine._sample

    def sample(logits, sampling):
        sizes.append(logits.shape[0])
        if len(sizes) in actions:
            actions[len(sizes)]()
        return real(logits, sampling)

    monkeypatch.setattr(engine, "_sample", sample)
    return sizes


async def solo(folder, prompt: list[int], params: SamplingParams):
    engine = await started(folder)
    try:
        return (await engine.generate([prompt], params))[0]
    finally:
        await engine.stop()


# ---------------------------------------------------------------- batching


async def test_concurrent_calls_share_forward_passes_with_their_own_params(model_a, monkeypatch) -> None:
    engine = await started(model_a)
    calls = [
        (SHORT, SamplingParams(max_new_tokens=3, temperature=1.0)),
        (MEDIUM, SamplingParams(max_new_tokens=5, temperature=0.5)),
        (LONG, SamplingParams(max_new_tokens=9, temperature=1.0, top_p=1e-6)),  # top-p keeps the argmax only
        (SHORT, SamplingParams(max_new_tokens=7, temperature=2.0, stop_token_ids=(999,))),
    ]
    shapes = record_forwards(engine, monkeypatch, hold_until_load=len(calls))
    out: list = [None] * len(calls)

    async def call(i: int) -> None:
        out[i] = (await engine.generate([calls[i][0]], calls[i][1]))[0]

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(call, i)
    # alone, a call of n tokens takes n forward passes (a prefill and n - 1 decode steps)
    assert len(shapes) < sum(p.max_new_tokens for _, p in calls)
    assert max(rows for rows, _ in shapes) == len(calls)
    model = eval_model(model_a)
    for (prompt, params), c in zip(calls, out, strict=True):
        assert len(c.tokens) == params.max_new_tokens and c.finish_reason == "length"
        assert (c.versions == 0).all()
        ref = teacher_forced_logprobs(model, prompt, c.tokens, params.temperature)
        assert torch.allclose(torch.from_numpy(c.logprobs), ref, atol=1e-4)
    greedy = await solo(model_a, LONG, SamplingParams(max_new_tokens=9, temperature=GREEDY))
    assert out[2].tokens.tolist() == greedy.tokens.tolist()
    assert engine.load == 0
    await engine.stop()


async def test_requests_joining_and_leaving_mid_batch_decode_as_they_would_alone(model_a, monkeypatch) -> None:
    """Greedy decoding: each request's tokens equal a solo run's, whatever padding the merged cache
    gave it (the long prompt pads the running row; the short one is padded) and after rows leave."""
    engine = await started(model_a)
    first = (MEDIUM, SamplingParams(max_new_tokens=24, temperature=GREEDY))
    joiners = [(LONG, SamplingParams(max_new_tokens=6, temperature=GREEDY)),
               (SHORT, SamplingParams(max_new_tokens=12, temperature=GREEDY))]
    running = threading.Event()
    sizes = on_step(engine, monkeypatch, {
        4: lambda: (running.set(), wait_for(lambda: engine.load == 1 + len(joiners))),
    })
    out: dict[int, object] = {}

    async def call(i: int, prompt, params) -> None:
        out[i] = (await engine.generate([prompt], params))[0]

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, 0, *first)
        await anyio.to_thread.run_sync(running.wait)
        for i, (prompt, params) in enumerate(joiners, start=1):
            tg.start_soon(call, i, prompt, params)
    assert sizes[:4] == [1] * 4 and 3 in sizes and sizes[-1] == 1  # joined mid-batch, left before the end
    for i, (prompt, params) in enumerate([first, *joiners]):
        alone = await solo(model_a, prompt, params)
        assert out[i].tokens.tolist() == alone.tokens.tolist()
        assert np.allclose(out[i].logprobs, alone.logprobs, atol=1e-4)
    await engine.stop()


async def test_a_finished_request_frees_its_slot_at_once(model_a, monkeypatch) -> None:
    engine = await started(model_a)
    short_returned = threading.Event()
    shapes = record_forwards(engine, monkeypatch, hold_until_load=2)
    on_step(engine, monkeypatch, {8: lambda: short_returned.wait(DEADLOCK_GUARD_S)})
    long_done = anyio.Event()
    load_when_short_returned = []

    async def long() -> None:
        await engine.generate([LONG], SamplingParams(max_new_tokens=20))
        long_done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(long)
        await engine.generate([SHORT], SamplingParams(max_new_tokens=4))
        assert not long_done.is_set()  # the batch is held at its 8th step until now
        load_when_short_returned.append(engine.load)
        short_returned.set()
    assert load_when_short_returned == [1]
    decode_rows = [rows for rows, columns in shapes if columns == 1]
    assert 2 in decode_rows and decode_rows[-1] == 1  # the short row left the batch


async def test_max_running_queues_requests_in_order(model_a, monkeypatch) -> None:
    engine = await started(model_a, max_running=2)
    shapes = record_forwards(engine, monkeypatch, hold_until_load=5)
    order: list[int] = []
    lengths = [3, 9, 4, 2, 5]

    async def call(i: int) -> None:
        await engine.generate([MEDIUM], SamplingParams(max_new_tokens=lengths[i]))
        order.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(len(lengths)):
            tg.start_soon(call, i)
            await anyio.sleep(0)
    assert max(rows for rows, _ in shapes) == 2
    # two slots: 0 and 1 start; 0 ends at step 3, 2 takes its slot (ends at 7), then 3 (ends at 9, as
    # does 1 when it started with 0), then 4
    assert order in ([0, 2, 3, 1, 4], [0, 2, 1, 3, 4])  # call 1 admitted one step after call 0, or with it
    assert engine.load == 0


async def test_a_multi_prompt_call_returns_when_all_its_prompts_are_done(model_a) -> None:
    engine = await started(model_a)
    prompts = [SHORT, LONG, MEDIUM]
    out = await engine.generate(prompts, SamplingParams(max_new_tokens=6, stop_token_ids=tuple(range(0, 64, 2))))
    model = eval_model(model_a)
    for prompt, c in zip(prompts, out, strict=True):
        assert 1 <= len(c.tokens) <= 6 and (c.tokens[:-1] % 2 == 1).all()
        assert c.finish_reason == ("stop" if c.tokens[-1] % 2 == 0 else "length")
        assert torch.allclose(torch.from_numpy(c.logprobs), teacher_forced_logprobs(model, prompt, c.tokens), atol=1e-4)


def plain_batched_loop(model, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[list[int]]:
    """The reference: one left-padded batch decoded to the end, every row sampled at every step by
    torch.multinomial (finished rows too), rows cut at their first stop token."""
    generator = torch.Generator().manual_seed(seed)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions, cache, rows = (mask.cumsum(1) - 1).clamp(min=0), None, []
    with torch.no_grad():
        for _ in range(params.max_new_tokens):
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
            probs = torch.softmax(out.logits[:, -1].float() / params.temperature, -1)
            sorted_p, order = probs.sort(-1, descending=True)
            kept = sorted_p * (sorted_p.cumsum(-1) - sorted_p < params.top_p)
            probs = torch.zeros_like(probs).scatter(-1, order, kept)
            ids = torch.multinomial(probs, 1, generator=generator)
            rows.append(ids[:, 0].tolist())
            cache, mask = out.cache, torch.cat([mask, torch.ones_like(ids)], 1)
            positions = positions[:, -1:] + 1
    tokens = [list(t) for t in zip(*rows, strict=True)]
    return [next((t[: i + 1] for i, x in enumerate(t) if x in params.stop_token_ids), t) for t in tokens]


async def test_a_lone_call_samples_what_a_plain_batched_loop_samples(model_a) -> None:
    """Same seed, same tokens: rows that finish early leave the batch, yet the others draw the same
    random numbers as in a batch that keeps sampling every row to the end."""
    prompts = [SHORT, LONG, MEDIUM, [BOS, 9, 3, 7, 11, 16]]
    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, stop_token_ids=(5, 9, 17, 30))
    engine = await started(model_a)
    out = await engine.generate(prompts, params)
    expected = plain_batched_loop(eval_model(model_a), prompts, params, seed=11)
    assert [c.tokens.tolist() for c in out] == expected
    assert len({len(t) for t in expected}) > 1  # rows did finish at different steps


# ---------------------------------------------------------------- weights and restarts


async def test_restart_is_decided_per_request(model_a, model_b, monkeypatch) -> None:
    """k = 1: a request begun on version 0 restarts when version 2 arrives; one begun on 1 continues."""
    engine = await started(model_a)
    engine.policy = MaxStaleness(k=1)
    b, uniform = load_model(model_b).state_dict(), uniform_weights(eval_model(model_a))
    running = threading.Event()
    on_step(engine, monkeypatch, {
        3: lambda: engine._stage(1, b),
        5: lambda: (running.set(), wait_for(lambda: engine.load == 2)),
        9: lambda: engine._stage(2, uniform),
    })
    params = SamplingParams(max_new_tokens=16)
    out: dict[str, object] = {}

    async def call(name: str, prompt) -> None:
        out[name] = (await engine.generate([prompt], params))[0]

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, "early", MEDIUM)
        await anyio.to_thread.run_sync(running.wait)
        tg.start_soon(call, "late", LONG)
    assert engine.stats["interrupted"] == 1
    early, late = out["early"], out["late"]
    assert len(early.tokens) == 16 and set(early.versions.tolist()) == {2}  # decoded again from its prompt
    uniform_logprob = -math.log(eval_model(model_a).config.vocab_size)
    assert np.allclose(early.logprobs, uniform_logprob, atol=1e-4)
    assert len(late.tokens) == 16 and late.versions[0] == 1 and set(late.versions.tolist()) == {1, 2}
    old = late.versions == 1
    ref = teacher_forced_logprobs(eval_model(model_b), LONG, late.tokens)
    assert torch.allclose(torch.from_numpy(late.logprobs[old]), ref[torch.from_numpy(old)], atol=1e-4)
    assert np.allclose(late.logprobs[~old], uniform_logprob, atol=1e-4)


async def test_receive_weights_during_a_continuous_stream(model_a, model_b, monkeypatch) -> None:
    """Requests keep arriving while two versions are pushed: each push is applied by the running
    batch between two decode steps (a long request keeps it from idling), receive returns with the
    version applied, and every token keeps the version that produced it."""
    engine = await started(model_a)
    appliers: list[tuple[int, str]] = []
    real_apply = engine._apply_staged

    def apply() -> None:
        before = engine.version
        real_apply()
        if engine.version != before:
            appliers.append((engine.version, threading.current_thread().name))

    monkeypatch.setattr(engine, "_apply_staged", apply)
    completions: list[tuple[int, object]] = []  # (the engine's version when the call began, completion)
    pushed = anyio.Event()

    async def stream(worker: int) -> None:
        i = 0
        while not pushed.is_set():
            began = engine.version
            params = SamplingParams(max_new_tokens=3 + (worker * 5 + i) % 9)
            completions.append((began, (await engine.generate([[BOS, 3 + worker, 5 + i % 7]], params))[0]))
            i += 1

    def produced_by(version: int) -> bool:
        return any(version in c.versions for _, c in completions)

    async def push() -> None:
        for version, folder in ((1, model_b), (2, model_a)):
            while not produced_by(version - 1):
                await anyio.sleep(0.005)
            await engine.receive_weights(version, load_model(folder).state_dict())
            assert engine.version == version
        while not produced_by(2):
            await anyio.sleep(0.005)
        pushed.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.generate, [LONG], SamplingParams(max_new_tokens=1_000_000))  # until cancelled
        for worker in range(6):
            tg.start_soon(stream, worker)
        await push()
        await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert appliers == [(1, f"{engine.name}-decode"), (2, f"{engine.name}-decode")]  # applied mid-stream
    for began, c in completions:
        assert (np.diff(c.versions) >= 0).all() and c.versions[0] >= began


# ---------------------------------------------------------------- leaving early


async def test_cancelled_calls_leave_the_queue_at_once_and_the_batch_at_the_next_step(model_a, monkeypatch) -> None:
    engine = await started(model_a, max_running=1)
    running = threading.Event()
    on_step(engine, monkeypatch, {3: lambda: (running.set(), wait_for(lambda: engine.load == 2))})
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.generate, [LONG], SamplingParams(max_new_tokens=10_000))
            await anyio.to_thread.run_sync(running.wait)
            tg.start_soon(engine.generate, [SHORT], SamplingParams(max_new_tokens=3))  # queued behind it
            await anyio.sleep(0.01)
            scope.cancel()
    assert engine.load <= 1  # the queued request is gone; the running one goes at its next step boundary
    with anyio.fail_after(DEADLOCK_GUARD_S):
        while engine.load or engine._serving:
            await anyio.sleep(0.01)
    out = await engine.generate([SHORT], SamplingParams(max_new_tokens=3))
    assert len(out[0].tokens) == 3


async def test_a_staged_version_that_does_not_fit_fails_the_batch_and_the_engine_goes_on(model_a) -> None:
    """A version received before `start` (receive_weights checks a version against the model only once
    it has one) fails the batch that would apply it; the engine stays on its version. (`stop` failing
    the calls in flight: tests/contracts/test_engine_contract.py.)"""
    engine = TorchEngine(model_a, seed=11)
    await engine.receive_weights(1, {"nonsense": torch.zeros(1)})
    await engine.start()
    with pytest.raises(EngineError, match="do not fit"):
        await engine.generate([SHORT, MEDIUM], SamplingParams(max_new_tokens=4))
    out = await engine.generate([SHORT], SamplingParams(max_new_tokens=4))  # the engine goes on
    assert len(out[0].tokens) == 4 and engine.version == 0
