"""The group baseline reweighted to the weights being trained (`learner.advantage_baseline = "current"`):
by hand on small tensors (the weighted mean, its limits, its numerical safety, the sequence weights), and
in a real step on a tiny model (the weights passed are the model's own sequence log-ratios; rows sampled
by the weights being trained leave the advantages as they were)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from baton.config import validate
from baton.schema import RunConfig
from buffers.codec import RolloutBatch
from stages.data.model import make_tiny_model
from stages.learner import GRPOLearner, step
from stages.learner.losses import group_advantages, sequence_log_weights, weighted_group_mean
from stages.learner.step import PolicyTrainer
from tests.stages.learner.test_ranks import groups

torch.set_num_threads(1)


def test_a_heavy_row_pulls_its_groups_baseline_towards_its_reward() -> None:
    rewards, index = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 0])
    weights = torch.tensor([14.0, 0.3, 0.3, 0.3])  # the one right answer is 14 times likelier now than sampled
    adv = group_advantages(rewards, index, scale_by_std=False, log_weights=weights.log())
    baseline = 14.0 / 14.9
    assert adv.tolist() == pytest.approx([1 - baseline, -baseline, -baseline, -baseline])
    assert group_advantages(rewards, index, scale_by_std=False).tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_equal_weights_give_the_plain_mean_and_equal_rewards_give_zero() -> None:
    rewards, index = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.6]), torch.tensor([0, 0, 1, 1, 2, 2])
    same = torch.full((6,), 3.7)
    assert group_advantages(rewards, index, log_weights=same).tolist() == pytest.approx(
        group_advantages(rewards, index).tolist())
    skewed = torch.tensor([2.0, -1.0, 4.0, -3.0, 0.0, 1.0])
    assert group_advantages(rewards, index, scale_by_std=False, log_weights=skewed)[2:4].tolist() == [0.0, 0.0]


def test_the_weighted_mean_survives_log_weights_far_outside_exps_range() -> None:
    values, index = torch.tensor([1.0, 3.0, 100.0, 5.0, 7.0]), torch.tensor([0, 0, 0, 1, 1])
    mean = weighted_group_mean(values, index, torch.tensor([1000.0, 1000.0, 0.0, -1000.0, -1000.0]), 2)
    assert mean.tolist() == pytest.approx([2.0, 6.0])  # the light row counts exp(-1000): nothing


def test_sequence_log_weights_sum_the_trained_tokens_and_are_bounded() -> None:
    current = torch.tensor([[-1.0, -0.5, -0.2], [-0.1, -0.1, -0.1]])
    behaviour = torch.tensor([[-2.0, -0.5, -9.0], [-9.0, -9.0, -9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    assert sequence_log_weights(current, behaviour, mask).tolist() == pytest.approx([5.0, 5.0])  # 8.8 and 26.7
    assert sequence_log_weights(current, behaviour, mask, bound=100).tolist() == pytest.approx([8.8, 26.7])
    assert sequence_log_weights(behaviour, current, mask).tolist() == pytest.approx([-5.0, -5.0])


def test_the_key_is_checked_before_anything_starts(tmp_path: Path) -> None:
    assert validate(RunConfig, {"learner": {"advantage_baseline": "current"}}).learner.advantage_baseline == "current"
    with pytest.raises(Exception, match="advantage_baseline"):
        validate(RunConfig, {"learner": {"advantage_baseline": "proximal"}})
    with pytest.raises(ValueError, match="advantage_baseline"):
        GRPOLearner(tmp_path / "m", advantage_baseline="proximal")


def _own_logprobs(model: torch.nn.Module, batch: RolloutBatch) -> list[torch.Tensor]:
    """Per row, the model's logprob of each token after the first (index 0 gets 0, as a prompt token)."""
    out = []
    with torch.no_grad():
        for j in range(batch.rows):
            ids = torch.from_numpy(batch.row(j)["tokens"].astype("int64"))[None]
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])
            out.append(torch.cat([torch.zeros(1), logp[:, 0]]))
    return out


def _passed_log_weights(trainer: PolicyTrainer, batches: list[RolloutBatch],
                        monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """One step; the `log_weights` its advantages were computed with (None where a call had none)."""
    seen: list[torch.Tensor] = []
    real = step.group_advantages

    def spy(*args, log_weights=None, **kwargs):
        seen.append(log_weights)
        return real(*args, log_weights=log_weights, **kwargs)

    monkeypatch.setattr(step, "group_advantages", spy)
    trainer.train(batches, 0.0)
    return seen


def test_a_step_weights_each_row_by_the_models_own_sequence_ratio(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    spec = GRPOLearner(make_tiny_model(tmp_path / "tiny"), lr=1e-2, device="cpu", micro_batch_tokens=24,
                       advantage_baseline="current")
    trainer = PolicyTrainer(spec, 10)
    trainer.schedule(0)
    stale = groups(3, n=3)
    expected = []
    for batch in stale:
        for j, own in enumerate(_own_logprobs(trainer.model, batch)):
            row = batch.row(j)
            mask = torch.from_numpy(row["loss_mask"].astype("float32"))
            expected.append(float(((own - torch.from_numpy(row["logprobs"])) * mask)[1:].sum().clamp(-5, 5)))
    seen = _passed_log_weights(trainer, stale, monkeypatch)
    assert seen[0] is None  # the first pass (no weights yet), then the step's own
    assert seen[-1].tolist() == pytest.approx(expected, abs=1e-4)
    assert any(abs(w) > 0.5 for w in expected)  # the rows are off-policy: the weights are not all 1


def test_rows_the_trained_weights_sampled_keep_the_sampled_baseline(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    spec = GRPOLearner(make_tiny_model(tmp_path / "tiny"), lr=1e-2, device="cpu", advantage_baseline="current")
    trainer = PolicyTrainer(spec, 10)
    trainer.schedule(0)
    fresh = groups(4, n=3)
    for batch in fresh:
        for j, own in enumerate(_own_logprobs(trainer.model, batch)):
            batch.row(j)["logprobs"][:] = own.numpy()
    seen = _passed_log_weights(trainer, fresh, monkeypatch)
    assert seen[-1].abs().max() < 1e-4
    rewards = torch.tensor([float(r) for b in fresh for r in b.row_fields["rewards"]])
    index = torch.arange(3).repeat_interleave(4)
    assert group_advantages(rewards, index, log_weights=seen[-1]).tolist() == pytest.approx(
        group_advantages(rewards, index).tolist(), abs=1e-4)
