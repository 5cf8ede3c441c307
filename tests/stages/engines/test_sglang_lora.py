"""SGLangEngine serving a LoRA run (stages.engines.sglang_lora) on a real SGLang server on CPU: one server
for the module (a start costs 60-140 s here), launched with LoRA through the CPU pin_memory shim.

The learner's adapters land (the engine's logprobs are the learner's); the adapters resident are the
staleness window, and an adapter a paused request holds is never unloaded (no deadlock, the server
lives); an adapter loaded from a folder leaves nothing to be reloaded from; a server killed mid-run comes
back serving the current adapter. The engine contract (tests/contracts/test_engine_contract.py) checks
the adapter path of every engine besides.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch

from policies import MaxStaleness
from stages.data.model import make_tiny_model
from stages.engines.base import EngineError, EngineRun, SamplingParams
from stages.engines.sglang import SGLangEngine
from stages.engines.sglang_lora import LoraServing
from stages.engines.sglang_server import SGLangUnavailable, sglang_python
from stages.learner import GRPOLearner
from stages.learner.lora import LoraSpec
from stages.learner.step import PolicyTrainer
from stages.weights.adapter import as_received
from tests.helpers.engines import teacher_forced_logprobs
from tests.helpers.lora import TARGETS, adapter_version, peft_policy
from tests.stages.learner.test_ranks import groups

try:
    sglang_python()
    _MISSING = ""
except SGLangUnavailable as exc:
    _MISSING = str(exc)

pytestmark = [pytest.mark.anyio, pytest.mark.sglang, pytest.mark.long,  # CI time: the long suite
               pytest.mark.skipif(bool(_MISSING), reason=_MISSING)]

PROMPT = [1, 5, 9, 12]
LONG = SamplingParams(max_new_tokens=240)  # the tiny model's positions end at 256
BATCH = 16
MAX_LOADED = 4  # k + 2 for k = 2


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_model(tmp_path_factory.mktemp("sglang-lora") / "tiny")


@pytest.fixture(scope="module")
async def engine(model_path, tmp_path_factory):
    engine = SGLangEngine(model_path, name="sglang-lora", log_dir=tmp_path_factory.mktemp("sglang-lora-logs"),
                          lora=LoraServing(max_rank=8, target_modules=TARGETS, max_loaded=MAX_LOADED))
    await engine.start()
    yield engine
    await engine.stop()


async def served(engine: SGLangEngine) -> set[str]:
    """The adapters the server itself lists (OpenAI's /v1/models: the base and each loaded adapter)."""
    cards = (await engine._call("GET", "/v1/models"))["data"]
    return {card["id"] for card in cards if card.get("parent")}


async def push(engine: SGLangEngine, policy: torch.nn.Module, model_path, probe: bool = True) -> int:
    version = engine.version + 1
    await engine.receive_weights(version, as_received(adapter_version(policy, model_path, probe)))
    return version


def produced_by(policy: torch.nn.Module, completion, atol: float = 1e-4) -> bool:
    got = torch.from_numpy(completion.logprobs)
    return bool(torch.allclose(got, teacher_forced_logprobs(policy, PROMPT, completion.tokens), atol=atol))


async def test_each_version_serves_the_learners_adapter(engine: SGLangEngine, model_path) -> None:
    """The real learner's versions: after each push the engine's sampled logprobs are the learner's own."""
    trainer = PolicyTrainer(GRPOLearner(model_path, lr=1e-2, device="cpu", lora=LoraSpec(rank=4, alpha=8.0,
                                                                                          target_modules=TARGETS)), 10)
    trainer.schedule(0)
    worst = 0.0
    for step in range(3):
        trainer.train(groups(step), 1.0)
        version = engine.version + 1
        await engine.receive_weights(version, as_received(trainer.weights(version)))
        trainer.model.eval()
        for c in await engine.generate([PROMPT] * 4, SamplingParams(max_new_tokens=12)):
            assert set(c.versions.tolist()) == {version}
            want = teacher_forced_logprobs(trainer.model, PROMPT, c.tokens)
            worst = max(worst, float((torch.from_numpy(c.logprobs) - want).abs().max()))
        trainer.model.train()
        assert await served(engine) == {f"policy-v{version}"}
    assert worst <= 1e-5, worst
    assert engine.stats["adapters_refused"] == 0


async def test_the_resident_adapters_are_the_staleness_window(engine: SGLangEngine, model_path) -> None:
    """k = 2: requests under two versions in flight, then generation paused on the server while two more
    versions arrive (without probes: a probe is a request, and a paused server runs none). An adapter a
    paused request holds is never unloaded (nothing blocks), the others go; the requests the policy
    restarts come back under the new version, those it continues keep their adapter to the end."""
    policies = {}

    async def next_version(seed: int, paused: bool = False) -> int:
        policy = peft_policy(model_path, seed)
        version = await push(engine, policy, model_path, probe=not paused)
        policies[version] = policy
        return version

    async def in_flight(n: int) -> None:
        with anyio.fail_after(60):
            while engine.load < n:
                await anyio.sleep(0.005)

    outcomes: dict[str, list] = {}

    async def generate(key: str) -> None:  # a batch: long enough to be in flight through the pushes
        outcomes[key] = await engine.generate([PROMPT] * BATCH, LONG)

    first = await next_version(11)
    engine.attach(EngineRun(policy=MaxStaleness(k=2)))
    try:
        with anyio.fail_after(300):  # no deadlock
            async with anyio.create_task_group() as tg:
                tg.start_soon(generate, "a")  # under `first`
                await in_flight(BATCH)
                second = await next_version(12)
                tg.start_soon(generate, "b")  # under `second`
                await in_flight(2 * BATCH)
                await engine._call("POST", "/pause_generation", {"mode": "in_place"})
                third = await next_version(13, paused=True)
                assert await served(engine) == {f"policy-v{v}" for v in (first, second, third)}  # k + 1
                fourth = await next_version(14, paused=True)  # "a" is 3 versions old: restarted; "b" continues
                assert f"policy-v{third}" not in await served(engine)  # nobody holds it
                assert len(await served(engine)) <= MAX_LOADED
                await engine._call("POST", "/continue_generation", {})
        fifth = await next_version(15)
    finally:
        engine.attach(EngineRun())
    for c in outcomes["a"]:
        assert set(c.versions.tolist()) == {fourth} and produced_by(policies[fourth], c)
    for c in outcomes["b"]:
        assert set(c.versions.tolist()) == {second} and len(c.tokens) == LONG.max_new_tokens
        assert produced_by(policies[second], c)
    assert engine.stats["interrupted"] >= BATCH
    assert await served(engine) == {f"policy-v{fifth}"}  # nothing holds the others any more
    assert (await engine._call("GET", "/health")) is not None


async def test_an_adapter_from_a_folder_leaves_nothing_to_reload(engine: SGLangEngine, model_path) -> None:
    """update = "disk": each adapter a PEFT folder the server loads; once unloaded, its folder is gone and a
    request naming it fails instead of being served an old version."""
    engine.update = "disk"
    try:
        old = await push(engine, peft_policy(model_path, 21), model_path)
        folder = engine._adapters.folders / f"policy-v{old}"
        assert (folder / "adapter_model.safetensors").is_file()
        policy = peft_policy(model_path, 22)
        new = await push(engine, policy, model_path)
        assert not folder.exists() and await served(engine) == {f"policy-v{new}"}
        (c,) = await engine.generate([PROMPT], SamplingParams(max_new_tokens=8))
        assert set(c.versions.tolist()) == {new} and produced_by(policy, c)
        with pytest.raises(EngineError, match="policy-v"):
            await engine._call("POST", "/generate", {"input_ids": PROMPT, "lora_path": f"policy-v{old}",
                                                     "sampling_params": {"max_new_tokens": 2}})
    finally:
        engine.update = "tensor"


async def test_a_killed_server_comes_back_serving_the_current_adapter(engine: SGLangEngine, model_path) -> None:
    """Last: it restarts the module's server (60-140 s)."""
    policy = peft_policy(model_path, 31)
    version = await push(engine, policy, model_path)
    restarts = engine.stats["restarts"]
    engine.server.kill()
    out = await engine.generate([PROMPT] * 2, SamplingParams(max_new_tokens=10))
    assert engine.stats["restarts"] == restarts + 1
    assert await served(engine) == {f"policy-v{version}"}
    for c in out:
        assert set(c.versions.tolist()) == {version} and produced_by(policy, c)
    assert np.isfinite(engine.stats["restart_s"])
