"""TorchEngine on a real tiny Qwen2 beyond the engine contract (tests/contracts/test_engine_contract.py):
seeded sampling, zero-copy weights, versions swapped between decode steps; make_tiny_model / load_model;
and the inproc transport's private copies."""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path

import torch

torch.set_num_threads(1)

import anyio  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from stages.data.model import ModelFolderError, load_model, make_tiny_model  # noqa: E402
from stages.engines.base import SamplingParams  # noqa: E402
from stages.engines.torch import TorchEngine  # noqa: E402
from stages.weights.inproc import InprocTransport  # noqa: E402
from tests.helpers.engines import eval_model, teacher_forced_logprobs, uniform_weights  # noqa: E402

pytestmark = pytest.mark.anyio

BOS = 1
# prompts of different lengths, so the batch is left-padded
PROMPTS = [[BOS, 4, 5, 16], [BOS, 9, 3, 7, 11, 16], [BOS, 6, 16], [BOS, 12, 13, 14, 15, 3, 4, 16]]



@pytest.fixture(scope="module")
def model_a(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_a"))


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_b"), seed=1)


@pytest.fixture
async def engine(model_a):
    eng = TorchEngine(model_a, seed=123)
    await eng.start()
    yield eng
    await eng.stop()


# ---------------------------------------------------------------- generate


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_behaviour_logprobs_match_teacher_forced(engine: TorchEngine, model_a, temperature: float) -> None:
    out = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=temperature))
    model = eval_model(model_a)
    for prompt, c in zip(PROMPTS, out, strict=True):
        ref = teacher_forced_logprobs(model, prompt, c.tokens, temperature)
        assert torch.allclose(torch.from_numpy(c.logprobs), ref, atol=1e-4), (c.logprobs, ref)


async def test_sampling_is_seeded(model_a) -> None:
    outs = []
    for _ in range(2):
        eng = TorchEngine(model_a, seed=7)
        await eng.start()
        outs.append(await eng.generate(PROMPTS, SamplingParams(max_new_tokens=6)))
    for x, y in zip(*outs, strict=True):
        assert np.array_equal(x.tokens, y.tokens)


# ---------------------------------------------------------------- weights


async def test_an_idle_engine_adopts_the_received_tensors_without_a_copy(engine: TorchEngine, model_b) -> None:
    """(That a version is applied whole, before receive_weights returns: tests/contracts/test_engine_contract.py.)"""
    given = load_model(model_b).state_dict()
    await engine.receive_weights(1, given)
    embed = given["model.embed_tokens.weight"]
    assert engine._model.model.embed_tokens.weight.data_ptr() == embed.data_ptr()  # no copy


async def test_new_weights_reproduce_a_fresh_engine(model_a, model_b) -> None:
    params = SamplingParams(max_new_tokens=6)
    swapped = TorchEngine(model_a, seed=5)
    await swapped.start()
    await swapped.receive_weights(1, load_model(model_b).state_dict())
    fresh = TorchEngine(model_b, seed=5)
    await fresh.start()
    out, expected = await swapped.generate(PROMPTS, params), await fresh.generate(PROMPTS, params)
    for x, y in zip(out, expected, strict=True):
        assert np.array_equal(x.tokens, y.tokens)
        assert np.allclose(x.logprobs, y.logprobs, atol=1e-5)


def _swap_during_decode(engine: TorchEngine, monkeypatch, at_call: int, version: int, tensors) -> list[int]:
    """Push weights from the worker thread while `_sample` runs for decode step `at_call`."""
    calls: list[int] = []
    real = engine._sample

    def hooked(logits, params):
        calls.append(engine.version)
        if len(calls) == at_call + 1:
            engine._stage(version, tensors)  # a version arrives while this step computes
        return real(logits, params)

    monkeypatch.setattr(engine, "_sample", hooked)
    return calls


async def test_weights_land_between_decode_steps(engine: TorchEngine, model_b, monkeypatch) -> None:
    steps = 8
    calls = _swap_during_decode(engine, monkeypatch, at_call=2, version=1, tensors=load_model(model_b).state_dict())
    out = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=steps))
    assert engine.version == 1
    assert calls[:3] == [0, 0, 0] and set(calls[3:]) == {1}  # applied after the step it arrived in
    for c in out:
        assert len(c.versions) == steps
        assert (np.diff(c.versions) >= 0).all()
        assert set(c.versions.tolist()) == {0, 1}
        assert (c.versions[:3] == 0).all()  # tokens before the push keep the old version


async def test_each_token_carries_the_version_that_produced_it(engine: TorchEngine, model_a, monkeypatch) -> None:
    model = eval_model(model_a)
    _swap_during_decode(engine, monkeypatch, at_call=2, version=1, tensors=uniform_weights(model))
    out = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=8))
    uniform = -math.log(model.config.vocab_size)
    for prompt, c in zip(PROMPTS, out, strict=True):
        old = c.versions == 0
        assert old.any() and (~old).any()
        # tokens labelled 0 were produced by model A: they match its teacher-forced logprobs
        ref = teacher_forced_logprobs(model, prompt, c.tokens)
        assert torch.allclose(torch.from_numpy(c.logprobs[old]), ref[torch.from_numpy(old)], atol=1e-4)
        # tokens labelled 1 were produced by the zero-norm weights: uniform over the vocabulary
        assert np.allclose(c.logprobs[~old], uniform, atol=1e-4), (c.versions, c.logprobs)


async def test_receive_returns_only_after_the_running_batch_took_the_version(engine: TorchEngine, model_b, monkeypatch):
    """A double-buffered transport rewrites the other slot once receive_weights returns: by then
    the decode loop must have moved to the new tensors (at its next step boundary)."""
    tensors = load_model(model_b).state_dict()
    seen: list[int] = []
    real_sample, real_stage = engine._sample, engine._stage
    mid_batch, staged = threading.Event(), threading.Event()
    calls = 0

    def step_that_waits_for_the_push(logits, params):
        nonlocal calls
        calls += 1
        if calls == 3:  # the batch is running: hold this step until the push has staged its version
            mid_batch.set()
            assert staged.wait(timeout=120), "the push never staged its version"
        return real_sample(logits, params)

    def stage(version, tensors):
        real_stage(version, tensors)
        staged.set()

    monkeypatch.setattr(engine, "_sample", step_that_waits_for_the_push)
    monkeypatch.setattr(engine, "_stage", stage)

    async def push() -> None:
        await anyio.to_thread.run_sync(mid_batch.wait)
        await engine.receive_weights(1, tensors)
        seen.append(engine.version)

    async with anyio.create_task_group() as tg:
        tg.start_soon(push)
        out = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=10))
    assert seen == [1]  # receive returned with the version applied, not just staged
    assert all(set(c.versions.tolist()) == {0, 1} for c in out)  # applied mid-batch, between two steps


async def test_policy_restart_decodes_the_batch_again_on_the_new_weights(engine: TorchEngine, model_a, monkeypatch):
    from policies import MaxStaleness

    engine.policy = MaxStaleness(k=2, max_span=1)  # a sample may not mix versions
    model = eval_model(model_a)
    _swap_during_decode(engine, monkeypatch, at_call=2, version=1, tensors=uniform_weights(model))
    out = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=8))
    uniform = -math.log(model.config.vocab_size)
    assert engine.stats["interrupted"] == len(PROMPTS)
    for c in out:  # decoded again from the prompt: full length, every token by version 1
        assert len(c.tokens) == 8 and set(c.versions.tolist()) == {1}
        assert np.allclose(c.logprobs, uniform, atol=1e-4)


# ---------------------------------------------------------------- model folder


def test_make_tiny_model_reuse_and_mismatch(model_a) -> None:
    files = sorted(model_a.iterdir())
    for f in files:
        os.utime(f, ns=(1_000_000_000, 1_000_000_000))
    assert make_tiny_model(model_a) == model_a
    assert sorted(model_a.iterdir()) == files
    assert all(f.stat().st_mtime_ns == 1_000_000_000 for f in files), "reused: no file written again"
    with pytest.raises(ModelFolderError, match=r"delete the folder .* \(\[model\] hidden_size = 64\)"):
        make_tiny_model(model_a, hidden_size=32)
    with pytest.raises(ModelFolderError):
        make_tiny_model(model_a, seed=5)
    assert (model_a / "model.safetensors").exists()


def test_processes_making_one_model_folder_at_once_all_get_the_whole_model(tmp_path) -> None:
    """Two processes (two runs, two test workers) make the same folder at once: each returns a folder that
    loads, the weights are the one seed's, and no staging folder is left beside it."""
    import subprocess
    import sys

    folder = tmp_path / "runs" / "models" / "tiny"
    make = f"from stages.data.model import make_tiny_model; make_tiny_model({str(folder)!r})"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    makers = [subprocess.Popen([sys.executable, "-c", make], env=env) for _ in range(2)]
    assert [m.wait(timeout=120) for m in makers] == [0, 0]
    assert [p.name for p in folder.parent.iterdir()] == ["tiny"]
    reference = make_tiny_model(tmp_path / "reference")
    made, expected = load_model(folder), load_model(reference)
    for (name, value), (_, want) in zip(made.state_dict().items(), expected.state_dict().items(), strict=True):
        assert torch.equal(value, want), name


def test_load_model_on_missing_folder_names_files(tmp_path) -> None:
    with pytest.raises(ModelFolderError) as info:
        load_model(tmp_path / "nothing-here")
    msg = str(info.value)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert f in msg
    assert isinstance(info.value, FileNotFoundError)
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text("{}")
    with pytest.raises(ModelFolderError) as info:
        load_model(tmp_path / "partial")
    assert "model.safetensors" in str(info.value) and "config.json" not in str(info.value).split("lacks")[1]


def test_tiny_models_with_different_seeds_differ(model_a, model_b) -> None:
    a, b = load_model(model_a).state_dict(), load_model(model_b).state_dict()
    assert a.keys() == b.keys()
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    again = load_model(model_a).state_dict()
    assert all(torch.equal(a[k], again[k]) for k in a)


# ---------------------------------------------------------------- inproc transport


class Sink:
    def __init__(self, name: str) -> None:
        self.name = name
        self.got: list[tuple[int, dict[str, torch.Tensor]]] = []

    async def receive_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.got.append((version, tensors))


async def test_inproc_publish_delivers_private_copies() -> None:
    transport = InprocTransport()
    r1, r2 = Sink("r1"), Sink("r2")
    transport.subscribe(r1)
    transport.subscribe(r2)
    w = torch.nn.Parameter(torch.arange(6, dtype=torch.float32))
    await transport.publish(1, {"w": w})
    with torch.no_grad():
        w.add_(100.0)  # the learner keeps training in place
    for r in (r1, r2):
        assert [v for v, _ in r.got] == [1]
        got = r.got[0][1]["w"]
        assert torch.equal(got, torch.arange(6, dtype=torch.float32))
        assert not got.requires_grad
    assert r1.got[0][1]["w"].data_ptr() != r2.got[0][1]["w"].data_ptr()
    assert transport.stats["versions"] == 1
    assert transport.stats["bytes"] == 2 * 6 * 4


async def test_a_preempted_engine_gives_back_what_it_generated_and_takes_nothing_more(engine: TorchEngine,
                                                                                        model_a) -> None:
    """`preempt` mid-generation: every request ends with the tokens it has, each with its own logprob and
    version (the sampled ones, teacher-forced equal), `finish_reason` "preempted"; a later call is refused."""
    from stages.engines.base import EnginePreempted

    steps = engine.stats["decode_steps"]
    out: list = []

    async def generate() -> None:
        out.extend(await engine.generate(PROMPTS, SamplingParams(max_new_tokens=200)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(generate)
        with anyio.fail_after(60):
            while engine.stats["decode_steps"] < steps + 3:
                await anyio.sleep(0.001)
        engine.preempt()
    model = eval_model(model_a)
    for prompt, c in zip(PROMPTS, out, strict=True):
        assert c.finish_reason == "preempted" and 3 <= len(c.tokens) < 200
        assert len(c.logprobs) == len(c.versions) == len(c.tokens)
        assert torch.allclose(torch.from_numpy(c.logprobs), teacher_forced_logprobs(model, prompt, c.tokens), atol=1e-4)
    with pytest.raises(EnginePreempted):
        await engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
