"""TorchEngine on the tiny MoE model: every generated token carries the experts its sampling position was
routed to (the learner's own teacher-forced routing at the same weights, through left padding, rows joining
and leaving the running batch, and a weight swap), so replaying them in the learner reproduces the
engine's logprobs; a dense model's completions carry none and its engine installs no hook."""

from __future__ import annotations

import torch

torch.set_num_threads(1)

import anyio  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from stages.data.model import load_model, make_tiny_model, make_tiny_moe_model  # noqa: E402
from stages.data.routing import inputs_of_tokens, moe_layout, own_routing, replay_routing, routers  # noqa: E402
from stages.engines.base import SamplingParams, returns_routed_experts  # noqa: E402
from stages.engines.torch import TorchEngine  # noqa: E402

pytestmark = pytest.mark.anyio

BOS = 1
PROMPTS = [[BOS, 4, 5, 16], [BOS, 9, 3, 7, 11, 16], [BOS, 6, 16]]  # of different lengths: left-padded


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return make_tiny_moe_model(tmp_path_factory.mktemp("tiny_moe"))


def _learner_routing(model, prompt: list[int], tokens: np.ndarray) -> np.ndarray:
    """The experts `model` routes each completion token's sampling position to: [tokens, layers, top_k]."""
    ids = torch.tensor([prompt + tokens.tolist()])
    own = own_routing(model, input_ids=ids)[0]
    return own[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].numpy()


def _assert_learner_routes_as_engine(model, prompts, completions) -> None:
    for prompt, c in zip(prompts, completions, strict=True):
        assert c.routed_experts.shape == (len(c.tokens), 2, 2) and c.routed_experts.dtype == np.uint8
        assert np.array_equal(np.sort(c.routed_experts, -1), np.sort(_learner_routing(model, prompt, c.tokens), -1))


async def test_routed_experts_are_the_learners_routing_and_replay_reproduces_logprobs(moe_folder) -> None:
    engine = TorchEngine(moe_folder, seed=3)
    assert returns_routed_experts(engine)  # from the folder's config, before start
    await engine.start()
    served = engine._model
    try:
        assert returns_routed_experts(engine)
        assert all(len(gate._forward_hooks) == 1 for gate in routers(served, moe_layout(served)))
        async with anyio.create_task_group() as tg:  # two calls: rows join and leave the running batch
            results = {}

            async def call(name, prompts, n):
                results[name] = await engine.generate(prompts, SamplingParams(max_new_tokens=n))

            tg.start_soon(call, "long", PROMPTS, 7)
            tg.start_soon(call, "short", PROMPTS[:2], 3)
        model = load_model(moe_folder).eval()
        _assert_learner_routes_as_engine(model, PROMPTS, results["long"])
        _assert_learner_routes_as_engine(model, PROMPTS[:2], results["short"])

        prompt, c = PROMPTS[1], results["long"][1]  # replayed in the learner: the engine's logprobs
        ids = torch.tensor([prompt + c.tokens.tolist()])
        per_token = torch.zeros((1, ids.shape[1], 2, 2), dtype=torch.long)
        per_token[0, len(prompt):] = torch.from_numpy(c.routed_experts.astype(np.int64))
        generated = torch.zeros(ids.shape, dtype=torch.bool)
        generated[0, len(prompt):] = True
        experts, mask = inputs_of_tokens(per_token, generated)
        with torch.no_grad(), replay_routing(model, experts, mask) as seen:
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        assert seen.disagreement() == [0.0, 0.0] and seen.positions == len(c.tokens)
        torch.testing.assert_close(logp[len(prompt) - 1:], torch.from_numpy(c.logprobs), rtol=0, atol=1e-5)

        moved = {k: v.clone() for k, v in model.state_dict().items()}  # a new version: other routers
        for i in (0, 1):
            moved[f"model.layers.{i}.mlp.gate.weight"] = torch.randn_like(moved[f"model.layers.{i}.mlp.gate.weight"])
        await engine.receive_weights(1, moved)
        after = await engine.generate(PROMPTS, SamplingParams(max_new_tokens=5))
        model.load_state_dict(moved)
        _assert_learner_routes_as_engine(model, PROMPTS, after)
        empty = await engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=0))
        assert empty[0].routed_experts.shape == (0, 2, 2)
    finally:
        await engine.stop()
    assert all(not gate._forward_hooks for gate in routers(served, moe_layout(served)))  # removed on stop


async def test_a_dense_model_returns_no_experts_and_installs_no_hook(tmp_path) -> None:
    engine = TorchEngine(make_tiny_model(tmp_path / "dense"), seed=3)
    assert not returns_routed_experts(engine)
    await engine.start()
    try:
        assert not returns_routed_experts(engine)
        assert all(not m._forward_hooks for m in engine._model.modules())
        out = await engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=3))
        assert all(c.routed_experts is None for c in out)
    finally:
        await engine.stop()


def test_the_fault_wrapper_says_what_its_engine_returns(moe_folder, tmp_path) -> None:
    from pipeline.faults import FaultPlan, FaultSpec
    from stages.engines.faulty import FaultyEngine

    plan = FaultPlan([FaultSpec("engine.crash", at=(3,))])
    assert returns_routed_experts(FaultyEngine(TorchEngine(moe_folder, seed=3), plan))
    assert not returns_routed_experts(FaultyEngine(TorchEngine(make_tiny_model(tmp_path / "dense"), seed=3), plan))
