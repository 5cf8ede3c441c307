"""The engine contract: what every inference engine (`stages.engines.base.Engine`) does, checked on
real engines over a real tiny model (no mocks).

A new engine passes by adding an `EngineKind` to `ENGINES`: a name and how to make it, unstarted, over
a model folder (and, while it has them, the checks it is known to fail and why: strict xfails). One
engine of each kind is started per module and shared by the checks (an SGLang server takes 30-60 s to
start on a small CPU box); each check pushes the weights it needs first, as a newer version, so none
depends on another's leftovers.

The contract, in the checks' order:
- a started engine serves its checkpoint as version 0, is idle (`load` 0) and has numeric `stats`;
  `generate` before `start` raises;
- `generate` returns one `Completion` per prompt: int32 tokens, float32 logprobs (finite, <= 0),
  int32 versions (the engine's version), at most `max_new_tokens` tokens (exactly, without stop
  tokens), cut at the first stop token, with `finish_reason` "stop" exactly when the last token is one;
- sampled tokens carry the logprobs of the weights that produced them (the learner's, to 1e-4);
- `receive_weights(v, tensors)` applies a version whole: afterwards `version == v`, greedy completions
  are the new weights' own (their argmax decoding: what a fresh engine started on them generates) and
  sampled logprobs are theirs; a version not newer than the engine's is
  ignored; a version that does not fit (a wrong shape, a missing or unknown tensor) raises
  `EngineError` and leaves the engine, and the requests it is running, on its version;
- an adapter version (a LoRA run's: the adapter alone and its descriptor, `stages.weights.adapter`) is
  applied to the engine's base: greedy completions and sampled logprobs are then the peft model's; an
  adapter whose probe the engine does not reproduce, or made for another base, raises `EngineError` and
  leaves the engine on its version;
- with the run's staleness policy attached, a request in flight when a version arrives is generated
  again on it when the policy says "restart" (every token of the new version, counted in the kind's
  `restart_counters`), and goes on under it when it says "continue" (its versions: the old, then the
  new, each token labelled with the version whose logits it was sampled from); `load` counts the
  requests in flight;
- `stop` fails the calls still in flight with `EngineError`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

torch.set_num_threads(1)

import anyio  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from policies import MaxStaleness  # noqa: E402
from stages.data.model import load_tokenizer, make_tiny_model  # noqa: E402
from stages.engines.base import Completion, Engine, EngineError, EngineRun, SamplingParams  # noqa: E402
from stages.engines.sglang import SGLangEngine  # noqa: E402
from stages.engines.sglang_lora import LoraServing  # noqa: E402
from stages.engines.sglang_server import SGLangUnavailable, sglang_python  # noqa: E402
from stages.engines.torch import TorchEngine  # noqa: E402
from stages.engines.vllm import VLLMEngine  # noqa: E402
from stages.weights.adapter import as_received  # noqa: E402
from tests.helpers.engines import (  # noqa: E402
    VLLM_MISSING,
    assert_produced_by,
    eval_model,
    greedy_tokens,
    teacher_forced_logprobs,
    uniform_weights,
)
from tests.helpers.lora import (  # noqa: E402
    LINEAR_TARGETS,
    TARGETS,
    adapter_version,
    for_base,
    peft_policy,
    with_probe_shifted,
)

pytestmark = pytest.mark.anyio

try:
    sglang_python()
    _NO_SGLANG = ""
except SGLangUnavailable as exc:
    _NO_SGLANG = str(exc)


@dataclass(frozen=True)
class EngineKind:
    name: str
    make: Callable[[Path, Path], Any]  # (model folder, log folder) -> an unstarted engine
    restart_counters: tuple[str, ...] = ("interrupted",)  # `stats` that count each request restarted
    marks: tuple = ()
    known_gaps: dict[str, str] = field(default_factory=dict)  # check -> why this kind fails it (strict xfail)
    model: dict = field(default_factory=dict)  # make_tiny_model's arguments for the models this kind serves
    lora_targets: tuple[str, ...] = TARGETS  # the modules the adapters it is sent adapt


def known_gap(request, kind: EngineKind, check: str) -> None:
    """Expect `check` to fail on `kind` when the kind lists it as a known gap (strict: a fix shows)."""
    if check in kind.known_gaps:
        request.applymarker(pytest.mark.xfail(reason=kind.known_gaps[check], strict=True))


ENGINES = [
    EngineKind("torch", lambda model, logs: TorchEngine(model, name="contract-torch", seed=3)),
    EngineKind(
        "sglang",
        lambda model, logs: SGLangEngine(model, name="contract-sglang", log_dir=logs,
                                         lora=LoraServing(max_rank=8, target_modules=TARGETS, max_loaded=4)),
        restart_counters=("interrupted", "regenerated"),
        marks=(pytest.mark.sglang, pytest.mark.skipif(bool(_NO_SGLANG), reason=_NO_SGLANG)),
        known_gaps={"continued tokens": (
            "pause_mode 'in_place': the first token SGLang reports under the new version (its weight_versions "
            "span) was sampled from the old weights' logits (its logprob is theirs); 'retract' labels it right"
        )},
    ),
    EngineKind(
        "vllm",
        lambda model, logs: VLLMEngine(model, name="contract-vllm", log_dir=logs,
                                       lora=LoraServing(max_rank=8, target_modules=LINEAR_TARGETS, max_loaded=4)),
        restart_counters=("interrupted", "regenerated"),
        marks=(pytest.mark.vllm, pytest.mark.long, pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING)),
        model={"heads": 2, "kv_heads": 1},  # head size 32: vLLM's CPU attention takes no smaller
        lora_targets=LINEAR_TARGETS,  # vLLM serves no adapter on the tied head (stages.engines.vllm_lora)
    ),
]
KINDS = [pytest.param(kind, id=kind.name, marks=kind.marks) for kind in ENGINES]

BOS = 1
# prompts of different lengths (a batch of them is padded)
PROMPTS = [[BOS, 4, 5, 16], [BOS, 9, 3, 7, 11, 16], [BOS, 6, 16], [BOS, 12, 13, 14, 15, 3, 4, 16]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
LONG = SamplingParams(max_new_tokens=200)  # no stop token: runs its full length, long enough to push into


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # one event loop for the module: the shared engine lives on it


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine-contract")


def models_for(root: Path, kind: EngineKind) -> tuple[Path, Path]:
    """Two tiny models of the architecture `kind` serves: the engine's checkpoint (a) and other weights (b)."""
    tag = "-".join(f"{key}{value}" for key, value in sorted(kind.model.items())) or "default"
    return make_tiny_model(root / f"{tag}-a", **kind.model), make_tiny_model(root / f"{tag}-b", seed=1, **kind.model)


class Shared:
    """One engine of a kind for the module, over its kind's models; `get()` starts it again if a check stopped it."""

    def __init__(self, kind: EngineKind, engine: Any, models: tuple[Path, Path]) -> None:
        self.kind, self.engine, self.running, self.first_version = kind, engine, False, -1
        self.models = models
        self.refs = eval_model(models[0]), eval_model(models[1])

    async def get(self) -> Any:
        if not self.running:
            await self.engine.start()
            self.running = True
            if self.first_version < 0:
                self.first_version = self.engine.version
        return self.engine


@pytest.fixture(scope="module", params=KINDS)
async def shared(request, model_root, tmp_path_factory):
    kind = request.param
    models = models_for(model_root, kind)
    shared = Shared(kind, kind.make(models[0], tmp_path_factory.mktemp(f"{kind.name}-logs")), models)
    await shared.get()
    yield shared
    await shared.engine.stop()


@pytest.fixture
def models(shared: Shared) -> tuple[Path, Path]:
    return shared.models


@pytest.fixture
def refs(shared: Shared) -> tuple[torch.nn.Module, torch.nn.Module]:
    return shared.refs


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A version of `model`'s weights, as a learner hands it over (its own copy)."""
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


async def push(engine, model: torch.nn.Module) -> int:
    """Give the engine `model`'s weights as its next version; returns that version."""
    version = engine.version + 1
    await engine.receive_weights(version, weights(model))
    return version


async def when_in_flight(engine, n: int, action: Callable[[], Awaitable[None]], loads: list[int],
                         settle: float = 0.15) -> None:
    """Once `n` requests are in flight (their `load` is recorded) and have run `settle` s, await `action()`."""
    with anyio.fail_after(120):
        while engine.load < n:
            await anyio.sleep(0.002)
    loads.append(engine.load)
    await anyio.sleep(settle)  # some tokens on the weights they started with
    await action()


async def generate_while(engine, prompts: list[list[int]], params: SamplingParams,
                         action: Callable[[], Awaitable[None]], settle: float = 0.15) -> tuple[list[Completion], int]:
    """Generate `prompts`, awaiting `action()` while they are in flight; returns the completions and
    the engine's `load` while they were in flight (0: they ended before it was seen, and the action
    never ran: the event loop can be held longer than a request takes)."""
    loads: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(when_in_flight, engine, len(prompts), action, loads, settle)
        out = await engine.generate(prompts, params)
        if not loads:
            tg.cancel_scope.cancel()
    return out, loads[0] if loads else 0


T = TypeVar("T")
SETTLES = (0.15, 0.04, 0.01)  # how long requests run before a push, tried in turn while the push comes too late


async def until_mid_flight(attempt: Callable[[float], Awaitable[T]], late: Callable[[T], bool]) -> T:
    """`attempt(settle)` for each of SETTLES until `late` says its push did not come after its requests
    ended: how fast 200 tokens go varies 2-3x from day to day, and a push that came after proves nothing."""
    for settle in SETTLES:
        result = await attempt(settle)
        if not late(result):
            return result
    raise AssertionError(f"every push came after its requests had ended (settled {SETTLES} s)")


def sampled(max_new_tokens: int = 6, stop: tuple[int, ...] = ()) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, stop_token_ids=stop)


# ---------------------------------------------------------------- lifecycle


@pytest.mark.parametrize("kind", KINDS)
async def test_generate_needs_a_started_engine(kind: EngineKind, model_root, tmp_path) -> None:
    engine = kind.make(models_for(model_root, kind)[0], tmp_path)
    assert isinstance(engine, Engine)
    with pytest.raises(RuntimeError, match="not started"):
        await engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))


async def test_a_started_engine_serves_its_checkpoint_idle(shared: Shared) -> None:
    engine = await shared.get()
    assert shared.first_version == 0 and engine.load == 0
    assert isinstance(engine.stats, dict) and engine.stats
    assert all(isinstance(v, int | float) and not isinstance(v, bool) for v in engine.stats.values()), engine.stats
    assert await engine.generate([], SamplingParams(max_new_tokens=4)) == []


# ---------------------------------------------------------------- generate


async def test_generate_returns_one_typed_completion_per_prompt(shared: Shared, refs) -> None:
    engine = await shared.get()
    await push(engine, refs[0])
    out = await engine.generate(PROMPTS, sampled(6))
    assert len(out) == len(PROMPTS)
    for c in out:
        assert isinstance(c, Completion) and isinstance(c.meta, dict)
        assert len(c.tokens) == len(c.logprobs) == len(c.versions) == 6  # no stop tokens: full length
        assert c.tokens.dtype == np.int32 and c.logprobs.dtype == np.float32 and c.versions.dtype == np.int32
        assert ((c.tokens >= 0) & (c.tokens < 64)).all()
        assert (c.logprobs <= 0).all() and np.isfinite(c.logprobs).all()
        assert (c.versions == engine.version).all()
        assert c.finish_reason == "length"
    assert engine.load == 0


async def test_max_new_tokens_is_kept_and_a_stop_token_ends_a_row(shared: Shared, refs) -> None:
    engine = await shared.get()
    await push(engine, refs[0])
    greedy = [c.tokens.tolist() for c in await engine.generate(PROMPTS, GREEDY)]
    assert all(len(g) == GREEDY.max_new_tokens for g in greedy)
    assert [len(c.tokens) for c in await engine.generate(PROMPTS, sampled(1))] == [1] * len(PROMPTS)
    # a stop token that first appears after the start of row 0 (or its first token if all repeat)
    row = greedy[0]
    j = next((i for i in range(1, len(row)) if row[i] not in row[:i]), 0)
    stop = row[j]
    params = SamplingParams(max_new_tokens=GREEDY.max_new_tokens, temperature=0.0, stop_token_ids=(stop,))
    out = await engine.generate(PROMPTS, params)
    assert out[0].tokens.tolist() == row[: j + 1] and out[0].finish_reason == "stop"
    for g, c in zip(greedy, out, strict=True):
        cut = g.index(stop) + 1 if stop in g else len(g)
        assert c.tokens.tolist() == g[:cut]
        assert len(c.logprobs) == len(c.versions) == cut
        assert c.finish_reason == ("stop" if stop in g else "length")
    # every token is a stop token: each row is exactly one token long
    for c in await engine.generate(PROMPTS, sampled(8, stop=tuple(range(64)))):
        assert len(c.tokens) == 1 and c.finish_reason == "stop"


async def test_sampled_tokens_carry_their_weights_logprobs(shared: Shared, models, refs) -> None:
    engine = await shared.get()
    version = await push(engine, refs[0])
    tokenizer = load_tokenizer(models[0])
    eos = tokenizer.eos_token_id
    prompt = [tokenizer.bos_token_id, *tokenizer.encode("12>", add_special_tokens=False)]
    completions = await engine.generate([prompt] * 8, sampled(12, stop=(eos,)))
    for c in completions:
        assert 1 <= len(c.tokens) <= 12 and set(c.versions.tolist()) == {version}
        assert_produced_by(refs[0], prompt, c)
        assert (c.finish_reason == "stop") == (int(c.tokens[-1]) == eos)
        assert eos not in c.tokens[:-1].tolist()  # nothing generated past a stop token
    assert len({tuple(c.tokens.tolist()) for c in completions}) > 1  # sampled, not greedy


# ---------------------------------------------------------------- weights


async def test_a_received_version_is_applied_whole(shared: Shared, refs) -> None:
    engine = await shared.get()
    a, b = refs
    for model, other in ((b, a), (a, b)):
        version = await push(engine, model)
        assert engine.version == version  # an idle engine applied it before receive_weights returned
        greedy = await engine.generate(PROMPTS, GREEDY)
        assert [c.tokens.tolist() for c in greedy] == [greedy_tokens(model, p, GREEDY.max_new_tokens) for p in PROMPTS]
        for prompt, c in zip(PROMPTS, await engine.generate(PROMPTS, sampled(6)), strict=True):
            assert (c.versions == version).all()
            assert_produced_by(model, prompt, c, not_by=other)


async def test_a_version_not_newer_than_the_engines_is_ignored(shared: Shared, refs) -> None:
    engine = await shared.get()
    a, b = refs
    version = await push(engine, b)
    await engine.receive_weights(version, weights(a))  # the version it has
    await engine.receive_weights(version - 1, weights(a))  # an older one
    assert engine.version == version
    for prompt, c in zip(PROMPTS, await engine.generate(PROMPTS, sampled(5)), strict=True):
        assert (c.versions == version).all()
        assert_produced_by(b, prompt, c, not_by=a)


def misfit(model: torch.nn.Module, how: str) -> tuple[dict[str, torch.Tensor], str]:
    """`model`'s weights with one thing wrong; returns them and the tensor name the error must name."""
    state, name = weights(model), "model.layers.0.mlp.up_proj.weight"
    if how == "wrong shape":
        state[name] = torch.zeros(3, 3)
    elif how == "missing":
        del state[name]
    else:
        name = "model.layers.9.mlp.up_proj.weight"
        state[name] = torch.zeros(3, 3)
    return state, name


@pytest.mark.parametrize("how", ["wrong shape", "missing", "unknown"])
async def test_a_version_that_does_not_fit_is_refused_whole(shared: Shared, refs, how: str) -> None:
    engine = await shared.get()
    a, b = refs
    version = await push(engine, a)
    state, name = misfit(b, how)
    with pytest.raises(EngineError, match=name.replace(".", r"\.")):
        await engine.receive_weights(version + 1, state)
    assert engine.version == version
    for prompt, c in zip(PROMPTS, await engine.generate(PROMPTS, sampled(5)), strict=True):
        assert (c.versions == version).all()
        assert_produced_by(a, prompt, c, not_by=b)
    assert await push(engine, b) == version + 1  # the engine goes on


async def test_a_version_that_does_not_fit_leaves_running_requests_on_theirs(shared: Shared, refs) -> None:
    engine = await shared.get()
    a, b = refs
    version = await push(engine, a)
    refused = []

    async def push_misfit() -> None:
        with pytest.raises(EngineError):
            await engine.receive_weights(version + 1, misfit(b, "wrong shape")[0])
        refused.append(engine.version)

    out, _ = await until_mid_flight(lambda settle: generate_while(engine, PROMPTS[:2], LONG, push_misfit, settle),
                                    late=lambda r: r[1] == 0)  # not seen in flight: the push never ran
    assert refused == [version]
    for prompt, c in zip(PROMPTS[:2], out, strict=True):
        assert len(c.tokens) == LONG.max_new_tokens and set(c.versions.tolist()) == {version}
        assert_produced_by(a, prompt, c)


# ---------------------------------------------------------------- adapters


async def test_an_adapter_version_is_applied_to_the_base(shared: Shared, models, refs, request) -> None:
    known_gap(request, shared.kind, "adapter")
    engine = await shared.get()
    await push(engine, refs[0])  # full weights of the model folder: the base an adapter applies to
    for seed in (1, 2):  # a second adapter replaces the first (applied to the base, not on top of it)
        policy = peft_policy(models[0], seed, targets=shared.kind.lora_targets)
        version = engine.version + 1
        await engine.receive_weights(version, as_received(adapter_version(policy, models[0])))
        assert engine.version == version
        greedy = await engine.generate(PROMPTS, GREEDY)
        assert [c.tokens.tolist() for c in greedy] == [greedy_tokens(policy, p, GREEDY.max_new_tokens) for p in PROMPTS]
        for prompt, c in zip(PROMPTS, await engine.generate(PROMPTS, sampled(6)), strict=True):
            assert (c.versions == version).all()
            assert_produced_by(policy, prompt, c, not_by=refs[0])


@pytest.mark.parametrize("how", ["probe", "base"])
async def test_an_adapter_the_engine_does_not_reproduce_is_refused(shared: Shared, models, refs, how: str,
                                                                  request) -> None:
    """A probe off by 0.01 is what an engine holding another adapter than the learner's sees; an adapter
    made for another model folder does not apply to this one."""
    known_gap(request, shared.kind, "bad adapter")
    engine = await shared.get()
    await push(engine, refs[0])
    targets = shared.kind.lora_targets
    kept = peft_policy(models[0], 3, targets=targets)
    version = engine.version + 1
    await engine.receive_weights(version, as_received(adapter_version(kept, models[0])))
    candidate = adapter_version(peft_policy(models[0], 4, targets=targets), models[0])
    bad = with_probe_shifted(candidate, 0.01) if how == "probe" else for_base(candidate, "other:0123")
    with pytest.raises(EngineError, match=how):
        await engine.receive_weights(version + 1, as_received(bad))
    assert engine.version == version
    for prompt, c in zip(PROMPTS, await engine.generate(PROMPTS, sampled(5)), strict=True):
        assert (c.versions == version).all()
        assert_produced_by(kept, prompt, c)


# ---------------------------------------------------------------- requests in flight


async def test_a_request_the_policy_restarts_is_generated_again_on_the_new_version(shared: Shared, refs) -> None:
    engine = await shared.get()
    a, b = refs

    async def attempt(settle: float) -> tuple[int, dict[str, int], list[Completion], int]:
        old = await push(engine, a)
        counted = {name: engine.stats[name] for name in shared.kind.restart_counters}
        engine.attach(EngineRun(policy=MaxStaleness(k=2, max_span=1)))  # a sample may not mix versions
        try:
            out, load = await generate_while(engine, PROMPTS[:2], LONG,
                                             lambda: engine.receive_weights(old + 1, weights(b)), settle)
        finally:
            engine.attach(EngineRun())
        return old, counted, out, load

    old, counted, out, load = await until_mid_flight(
        attempt, late=lambda r: all(set(c.versions.tolist()) == {r[0]} for c in r[2]))
    assert load == 2 and engine.load == 0
    for name, before in counted.items():
        assert engine.stats[name] == before + 2, name
    for prompt, c in zip(PROMPTS[:2], out, strict=True):  # from the prompt again: whole, on the new weights only
        assert len(c.tokens) == LONG.max_new_tokens and set(c.versions.tolist()) == {old + 1}
        assert_produced_by(b, prompt, c)


async def continued(engine, a: torch.nn.Module) -> tuple[int, list[Completion], int]:
    """Two long requests under a policy that lets them continue, a new version (uniform weights: every
    token equally likely) pushed while they run; returns the old version, the completions and the load."""

    async def attempt(settle: float) -> tuple[int, list[Completion], int]:
        old = await push(engine, a)
        engine.attach(EngineRun(policy=MaxStaleness(k=2)))
        try:
            out, load = await generate_while(engine, PROMPTS[:2], LONG,
                                             lambda: engine.receive_weights(old + 1, uniform_weights(a)), settle)
        finally:
            engine.attach(EngineRun())
        return old, out, load

    # late: a request that ended before the version arrived proves nothing for it: try sooner
    return await until_mid_flight(attempt, late=lambda r: any(set(c.versions.tolist()) == {r[0]} for c in r[1]))


async def test_a_request_the_policy_continues_spans_both_versions(shared: Shared, refs) -> None:
    engine = await shared.get()
    counted = {name: engine.stats[name] for name in shared.kind.restart_counters}
    old, out, load = await continued(engine, refs[0])
    assert load == 2 and engine.load == 0 and engine.version == old + 1
    assert {name: engine.stats[name] for name in counted} == counted  # nothing restarted
    for c in out:
        assert len(c.tokens) == LONG.max_new_tokens
        v = c.versions.tolist()
        switch = v.index(old + 1)  # one segment per version: the old first, then the new to the end
        assert 0 < switch and v == [old] * switch + [old + 1] * (len(v) - switch)


async def test_each_continued_token_carries_the_version_that_computed_it(shared: Shared, refs, request) -> None:
    known_gap(request, shared.kind, "continued tokens")
    engine, a = await shared.get(), refs[0]
    old, out, _ = await continued(engine, a)
    for prompt, c in zip(PROMPTS[:2], out, strict=True):
        switch = c.versions.tolist().index(old + 1)
        # the old weights' own logprobs up to the switch, the new (uniform) weights' from it on
        before = teacher_forced_logprobs(a, prompt, c.tokens[:switch])
        assert torch.allclose(torch.from_numpy(c.logprobs[:switch]), before, atol=1e-4)
        assert np.allclose(c.logprobs[switch:], -math.log(a.config.vocab_size), atol=1e-4), c.logprobs[switch:][:3]


# ---------------------------------------------------------------- stop (last: it stops the shared engine)


async def test_stop_fails_the_calls_in_flight(shared: Shared) -> None:
    engine = await shared.get()

    async def stop() -> None:
        shared.running = False
        await engine.stop()

    async with anyio.create_task_group() as tg:
        tg.start_soon(when_in_flight, engine, 2, stop, [])
        with pytest.raises(EngineError, match="stopped"):
            await engine.generate(PROMPTS[:2], LONG)
