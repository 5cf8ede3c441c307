"""The learner's routing replay (stages.learner.replay, stages.learner.step): a step's recorded experts padded
like its token ids, masked by the loss mask, the router metrics of a replayed forward, the setting's check,
and steps of the tiny MoE on groups its torch engine generated (carried through the codec): with replay the
learner routes as the engine did and reproduces its logprobs; without, the disagreement shows once the
weights move; a dense model's step has no router metric."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import numpy as np
import pytest
import torch

from buffers.codec import RolloutBatch, decode, encode
from stages.data.model import make_tiny_model, make_tiny_moe_model
from stages.data.routing import ROUTED_EXPERTS_FIELD, RoutingAgreement
from stages.engines.base import SamplingParams
from stages.engines.torch import TorchEngine
from stages.environments.tokens import EpisodeTokens
from stages.learner import GRPOLearner
from stages.learner.replay import check_routing_replay, fold_layer_shares, routed_tensors, routing_metrics
from stages.learner.step import PolicyTrainer

torch.set_num_threads(1)


@dataclass
class Group:
    offsets: np.ndarray
    token_fields: dict[str, np.ndarray]
    meta: dict = field(default_factory=lambda: {"group": "g"})

    @property
    def rows(self) -> int:
        return len(self.offsets) - 1


def _group(lengths: list[int], prompt: int, start: int) -> Group:
    tokens = sum(lengths)
    experts = (np.arange(tokens * 4).reshape(tokens, 2, 2) + start).astype(np.uint8)
    mask = np.concatenate([np.r_[np.zeros(prompt), np.ones(n - prompt)] for n in lengths]).astype(np.uint8)
    experts[mask == 0] = 0
    return Group(np.r_[0, np.cumsum(lengths)], {ROUTED_EXPERTS_FIELD: experts, "loss_mask": mask})


def test_routed_tensors_pad_rows_like_the_token_ids_and_mask_by_the_loss_mask() -> None:
    groups = [_group([5, 3], prompt=2, start=0), _group([4], prompt=1, start=100)]
    experts, mask = routed_tensors(groups, width=6)
    assert experts.shape == (3, 6, 2, 2) and experts.dtype == torch.uint8 and mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [3, 1, 3]
    assert torch.equal(experts[1, :3], torch.from_numpy(groups[0].token_fields[ROUTED_EXPERTS_FIELD][5:8]))
    assert torch.equal(experts[2, :4], torch.from_numpy(groups[1].token_fields[ROUTED_EXPERTS_FIELD]))
    assert not experts[:, 5:].any() and not experts[1, 3:].any()


def test_a_group_without_experts_or_of_another_shape_is_refused() -> None:
    bare = Group(np.array([0, 3]), {"loss_mask": np.ones(3, np.uint8)}, {"group": "bare"})
    with pytest.raises(ValueError, match="group bare carries no routed_experts"):
        routed_tensors([_group([3], 1, 0), bare], width=3)
    other = _group([3], 1, 0)
    other.token_fields[ROUTED_EXPERTS_FIELD] = np.zeros((3, 4, 2), np.uint8)
    with pytest.raises(ValueError, match="one model"):
        routed_tensors([_group([3], 1, 0), other], width=3)


def test_routing_metrics() -> None:
    seen = RoutingAgreement(2)
    seen.used, seen.own, seen.positions = torch.tensor([0.0, 0.0]), torch.tensor([2.0, 6.0]), 8
    assert routing_metrics(seen) == {"router_disagreement": 0.0, "router_disagreement_max": 0.0,
                                     "router_drift": 0.5}



def test_layer_shares_fold_into_the_metrics_and_nothing_else_changes() -> None:
    info = {"loss": 1.0, "router_share/used/0": 0.0, "router_share/used/1": 0.5,
            "router_share/own/0": 0.25, "router_share/own/1": 0.75}
    assert fold_layer_shares(info) == {"loss": 1.0, "router_disagreement": 0.25, "router_disagreement_max": 0.5,
                                       "router_drift": 0.5}
    assert fold_layer_shares({"loss": 1.0}) == {"loss": 1.0}


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return make_tiny_moe_model(tmp_path_factory.mktemp("tiny_moe"))


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_the_setting_is_checked_before_a_run(moe_folder, dense_folder) -> None:
    check_routing_replay(moe_folder, "rollout", engine_returns_experts=True)
    check_routing_replay(dense_folder, "off", engine_returns_experts=False)
    with pytest.raises(ValueError, match=r"learner.routing_replay = 'rollout'.*is dense.*routing_replay = 'off'"):
        check_routing_replay(dense_folder, "rollout", engine_returns_experts=True)
    with pytest.raises(ValueError, match=r"learner.routing_replay = 'rollout'.*cannot return them"):
        check_routing_replay(moe_folder, "rollout", engine_returns_experts=False)
    with pytest.raises(ValueError, match="learner.routing_replay must be one of off, rollout, got 'on'"):
        check_routing_replay(moe_folder, "on", engine_returns_experts=True)
    with pytest.raises(ValueError, match="learner.routing_replay must be one of"):
        GRPOLearner(moe_folder, routing_replay="on")
    with pytest.raises(ValueError, match=r"learner.routing_replay = 'rollout'.*is dense"):
        PolicyTrainer(GRPOLearner(dense_folder, device="cpu", routing_replay="rollout"), 10)


def _generated_groups(folder, groups: int = 3, group_size: int = 4) -> list[RolloutBatch]:
    """Groups the torch engine generated at version 0, each row an episode (its experts on model tokens),
    through the codec as the learner receives them."""
    async def generate() -> list:
        engine = TorchEngine(folder, seed=5)
        await engine.start()
        try:
            prompts = [[1, 4 + g, 5, 9 - g, 16] for g in range(groups) for _ in range(group_size)]
            return await engine.generate(prompts, SamplingParams(max_new_tokens=6)), prompts
        finally:
            await engine.stop()

    completions, prompts = anyio.run(generate)
    out = []
    for g in range(groups):
        rows = []
        for prompt, completion in list(zip(prompts, completions, strict=True))[g * group_size:(g + 1) * group_size]:
            episode = EpisodeTokens(prompt)
            episode.add_model(completion)
            rows.append(episode.row())
        rewards = np.arange(group_size, dtype=np.float32) / group_size
        batch = RolloutBatch.from_rows(rows, row_fields={"rewards": rewards}, meta={"group": f"g{g}"})
        out.append(decode(encode(batch)))
    return out


@pytest.fixture(scope="module")
def generated(moe_folder) -> list[RolloutBatch]:
    return _generated_groups(moe_folder)


@pytest.mark.parametrize("micro_batch_tokens", [None, 24])
def test_replay_routes_as_the_engine_did_and_reproduces_its_logprobs(moe_folder, generated, micro_batch_tokens):
    assert all(b.token_fields[ROUTED_EXPERTS_FIELD].shape[1:] == (2, 2) for b in generated)
    spec = GRPOLearner(moe_folder, device="cpu", lr=1e-2, routing_replay="rollout",
                       micro_batch_tokens=micro_batch_tokens)
    trainer = PolicyTrainer(spec, 10)
    trainer.schedule(0)
    first = trainer.train(generated)
    assert first["router_disagreement"] == 0.0 and first["router_disagreement_max"] == 0.0
    assert first["logprob_gap"] < 1e-5  # the engine's weights, replayed: its logprobs
    later = [trainer.train(generated) for _ in range(3)]
    assert all(m["router_disagreement"] == 0.0 for m in later)
    assert later[-1]["router_drift"] > 0  # the router moved: without replay these tokens would route elsewhere


def test_without_replay_the_disagreement_shows_once_the_weights_move(moe_folder, generated):
    trainer = PolicyTrainer(GRPOLearner(moe_folder, device="cpu", lr=1e-2), 10)
    trainer.schedule(0)
    first = trainer.train(generated)
    assert first["router_disagreement"] == first["router_drift"] < 0.05  # the engine's weights: its routing
    later = [trainer.train(generated) for _ in range(3)]
    assert later[-1]["router_disagreement"] == later[-1]["router_drift"] > 0
    assert later[-1]["logprob_gap"] > first["logprob_gap"]


def test_a_dense_step_reports_no_router_metric(dense_folder):
    rows = [{"tokens": np.array([1, 4, 5, 6], np.int32), "logprobs": np.array([0, -1, -1, -1], np.float32),
             "loss_mask": np.array([0, 1, 1, 1], np.uint8)}] * 2
    batch = RolloutBatch.from_rows(rows, row_fields={"rewards": np.array([0.0, 1.0], np.float32)})
    trainer = PolicyTrainer(GRPOLearner(dense_folder, device="cpu"), 10)
    trainer.schedule(0)
    metrics = trainer.train([batch])
    assert not any(k.startswith(("router", "logprob_gap")) for k in metrics)


@pytest.mark.slow
def test_two_ranks_replay_and_report_as_one(moe_folder, generated):
    """FSDP2 over two real ranks: the same steps, the same router metrics (summed over ranks in the totals'
    one collective), the same weights; a rank may train no group of a step."""
    from tests.helpers.learner_ranks import ranked_trainer

    spec = GRPOLearner(moe_folder, device="cpu", lr=1e-2, routing_replay="rollout", micro_batch_tokens=24)
    one = PolicyTrainer(spec, 100)
    one.schedule(0)
    with ranked_trainer(spec) as two:
        for step in range(3):
            batches = generated if step != 1 else generated[:1]  # one group: rank 1 runs empty passes
            a, b = one.train(batches, 0.0), two.train(batches, 0.0)
            for key in ("loss", "router_disagreement", "router_drift", "logprob_gap"):
                assert a[key] == pytest.approx(b[key], abs=1e-5), key
        assert b["router_disagreement"] == 0.0 and b["router_drift"] > 0
        single, sharded = one.weights(), two.weights()
        assert max(float((single[k] - sharded[k]).abs().max()) for k in single) <= 1e-5
