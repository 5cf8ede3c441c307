"""The torch engine's adapter path beyond the engine contract: an adapter that arrives before the engine
starts (a restarted engine process loading the run's snapshot) is what it serves once started; an adapter
on the tied output head unties it (the embedding stays the base's) and a later adapter merges into the
base again, not on top."""

from __future__ import annotations

import pytest
import torch

from stages.data.model import load_model, make_tiny_model
from stages.engines.base import SamplingParams
from stages.engines.torch import TorchEngine
from stages.learner.lora import LoraSpec
from stages.weights.adapter import as_received
from tests.helpers.engines import assert_produced_by
from tests.helpers.lora import TARGETS, adapter_version, peft_policy

torch.set_num_threads(1)
pytestmark = pytest.mark.anyio
PROMPTS = [[1, 4, 5, 16], [1, 9, 3, 7]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("torch-adapter") / "tiny")


async def sampled_from(engine: TorchEngine, policy: torch.nn.Module, version: int) -> None:
    for prompt, c in zip(PROMPTS, await engine.generate(PROMPTS, SamplingParams(max_new_tokens=6)), strict=True):
        assert (c.versions == version).all()
        assert_produced_by(policy, prompt, c)


async def test_an_adapter_received_before_start_is_served_from_start(folder) -> None:
    policy = peft_policy(folder, 1)
    engine = TorchEngine(folder, name="late")
    await engine.receive_weights(3, as_received(adapter_version(policy, folder)))
    await engine.start()
    try:
        await sampled_from(engine, policy, 3)
        assert engine.stats["adapters_merged"] == 1
    finally:
        await engine.stop()


async def test_an_adapted_tied_head_is_untied_and_the_next_adapter_starts_from_the_base(folder) -> None:
    engine = TorchEngine(folder, name="head")
    await engine.start()
    embedding = load_model(folder).get_input_embeddings().weight.detach()
    try:
        for version, seed in ((1, 2), (2, 3)):
            policy = peft_policy(folder, seed, LoraSpec(rank=4, alpha=8.0, target_modules=TARGETS))
            await engine.receive_weights(version, as_received(adapter_version(policy, folder)))
            await sampled_from(engine, policy, version)
            model = engine._model
            assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
            assert torch.equal(model.get_input_embeddings().weight, embedding)  # the head's adapter left it alone
    finally:
        await engine.stop()

