"""The learner's side of on-policy distillation: the teacher's per-token term in the advantage (or as the whole
advantage), read from the batch's `teacher_logprobs` field, and its metrics."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from buffers.codec import RolloutBatch
from stages.data.model import make_tiny_model
from stages.learner import GRPOLearner
from stages.learner.losses import distill_advantages, leave_one_out_centred
from stages.learner.step import TEACHER_FIELD, PolicyTrainer, group_figures
from stages.scorers.teacher import TEACHER_FIELD as PRODUCER_FIELD

torch.set_num_threads(1)


def test_the_teacher_term_is_added_per_model_token_or_replaces_the_advantage() -> None:
    advantages = torch.tensor([[1.0], [-1.0]])
    behaviour = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -0.5]])
    teacher = torch.tensor([[0.0, -0.5, -3.0], [0.0, -0.5, -1.5]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    term = torch.tensor([[0.0, 1.0, -2.0], [0.0, 0.0, -2.0]])  # -2 * (behaviour - teacher) where masked
    assert torch.equal(distill_advantages(advantages, behaviour, teacher, mask, 2.0), advantages + term)
    assert torch.equal(distill_advantages(advantages, behaviour, teacher, mask, 2.0, "loss"), term)
    with pytest.raises(ValueError, match="advantage, loss"):
        distill_advantages(advantages, behaviour, teacher, mask, 2.0, "kl")


def test_the_group_baseline_leaves_each_token_its_term_less_the_other_rows_mean() -> None:
    term = torch.tensor([[0.0, 3.0, 1.0], [0.0, 1.0, 5.0], [0.0, 2.0, 0.0], [0.0, 4.0, 7.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    group_index = torch.tensor([0, 0, 0, 1])
    expected = torch.tensor([[0.0, 3 - 1.5, 1 - 5.0], [0.0, 1 - 2.5, 5 - 1.0], [0.0, 2 - 2.0, 0.0],
                             [0.0, 4.0, 7.0]])  # a row alone in its group (or at a position) keeps its term
    assert torch.allclose(leave_one_out_centred(term, mask, group_index), expected)
    behaviour, teacher = torch.zeros_like(term), term  # the term is teacher - behaviour with coef 1
    centred = distill_advantages(torch.ones(4, 1), behaviour, teacher, mask, 1.0, "loss", group_index)
    assert torch.allclose(centred, expected)


def test_with_the_baseline_a_token_the_teacher_likes_more_than_its_group_mates_rises(spec) -> None:
    trainer = PolicyTrainer(replace(spec, distill_coef=1.0, distill_mode="loss"), 10)
    trainer.schedule(0)
    batches = groups(0.0, [0.5] * 4, trainer.model, n=1)
    token_fields = dict(batches[0].token_fields)
    liked = np.zeros(batches[0].token_fields["logprobs"].shape, np.float32)
    liked[batches[0].offsets[0]:batches[0].offsets[1]] = 2.0  # the teacher likes row 0's tokens more
    token_fields[TEACHER_FIELD] = token_fields[TEACHER_FIELD] + liked * token_fields["loss_mask"]
    batches = [RolloutBatch(batches[0].offsets, token_fields, batches[0].row_fields, batches[0].meta)]
    before = row_logprobs(trainer, batches[0])
    for _ in range(3):
        trainer.train(batches)
    after = row_logprobs(trainer, batches[0])
    gap = (after[0] - after[1:].mean()) - (before[0] - before[1:].mean())
    assert gap > 0.05, (before, after)


def row_logprobs(trainer: PolicyTrainer, batch: RolloutBatch) -> np.ndarray:
    """Per row, the mean logprob the trainer's policy gives its model tokens."""
    return np.array([token_logprobs(trainer.model, batch.row(i)["tokens"])[batch.row(i)["loss_mask"][1:]
                                                                             .astype(bool)].mean()
                     for i in range(batch.rows)])


def groups(teacher_shift: float, rewards: list[float], model: torch.nn.Module | None = None,
           n: int = 2) -> list[RolloutBatch]:
    """`n` groups of 4 rows over fixed ids, sampled (as far as the logprobs say) from `model` (None: made-up
    logprobs); each model token's teacher logprob is its behaviour one + `teacher_shift`."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        rows = []
        for _ in range(4):
            ids = rng.integers(3, 40, 7)
            mask = np.r_[np.zeros(3), np.ones(4)].astype(np.uint8)
            behaviour = (np.r_[0.0, token_logprobs(model, ids)] if model is not None else
                         np.r_[np.zeros(3), -0.5 - rng.random(4)]).astype(np.float32) * mask
            rows.append({"tokens": ids.astype(np.int32), "logprobs": behaviour, "loss_mask": mask,
                         "token_versions": np.r_[np.full(3, -1), np.zeros(4)].astype(np.int32),
                         TEACHER_FIELD: ((behaviour + teacher_shift) * mask).astype(np.float32)})
        fields = {"rewards": np.asarray(rewards, np.float32), "prompt_lens": np.full(4, 3, np.int32),
                  "versions": np.zeros((4, 2), np.int32), "turns": np.ones(4, np.int32)}
        out.append(RolloutBatch.from_rows(rows, row_fields=fields, meta={"group": "g"}))
    return out


@torch.no_grad()
def token_logprobs(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    """The logprob `model` gives each of `ids` after the first."""
    tokens = torch.from_numpy(ids.astype(np.int64))[None]
    logp = torch.log_softmax(model(input_ids=tokens).logits[0, :-1].float(), -1)
    return logp.gather(1, tokens[0, 1:, None]).squeeze(1).numpy()


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> GRPOLearner:
    return GRPOLearner(make_tiny_model(tmp_path_factory.mktemp("model") / "m"), lr=1e-2, device="cpu",
                       entropy_coef=0.0)


def sampled_logprob(trainer: PolicyTrainer, batches: list[RolloutBatch]) -> float:
    """Mean logprob the trainer's policy gives the batches' model tokens."""
    values = [token_logprobs(trainer.model, b.row(i)["tokens"])[b.row(i)["loss_mask"][1:].astype(bool)]
              for b in batches for i in range(b.rows)]
    return float(np.concatenate(values).mean())


@pytest.mark.parametrize("shift, direction", [(1.0, 1), (-1.0, -1)])
def test_pure_distillation_moves_the_sampled_tokens_toward_the_teacher(spec, shift: float, direction: int) -> None:
    """Rewards all equal (no GRPO signal): the teacher's term alone raises the logprob of tokens the teacher
    likes more than the student did, and lowers it for tokens it likes less (the raw term: no baseline, which
    would centre this uniform shift to 0)."""
    trainer = PolicyTrainer(replace(spec, distill_coef=1.0, distill_mode="loss", distill_baseline=False), 10)
    trainer.schedule(0)
    batches = groups(shift, [0.5] * 4, trainer.model)
    before = sampled_logprob(trainer, batches)
    for _ in range(3):
        trainer.train(batches)
    assert direction * (sampled_logprob(trainer, batches) - before) > 0.05


def test_a_teacher_that_agrees_leaves_grpo_as_it_was(spec) -> None:
    batches = groups(0.0, [1.0, 0.0, 0.0, 1.0])
    plain, distilled = PolicyTrainer(spec, 10), PolicyTrainer(replace(spec, distill_coef=1.0), 10)
    for trainer in (plain, distilled):
        trainer.schedule(0)
    a, b = plain.train(batches), distilled.train(batches)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-7)
    weights = plain.weights(), distilled.weights()
    assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0]) < 1e-7
    assert b["distill/log_ratio_mean"] == 0.0 and b["distill/log_ratio_std"] == 0.0


def test_the_log_ratio_metrics_and_a_batch_without_teacher(spec) -> None:
    figures = group_figures(groups(-0.25, [1.0, 0.0, 0.0, 1.0]))
    assert figures["distill/log_ratio_mean"] == pytest.approx(0.25, abs=1e-5)
    assert figures["distill/log_ratio_std"] == pytest.approx(0.0, abs=1e-5)
    batch = groups(0.0, [1.0, 0.0, 0.0, 1.0])[0]
    bare = RolloutBatch(batch.offsets, {k: v for k, v in batch.token_fields.items() if k != TEACHER_FIELD},
                        batch.row_fields, batch.meta)
    trainer = PolicyTrainer(replace(spec, distill_coef=1.0), 10)
    trainer.schedule(0)
    with pytest.raises(ValueError, match=r"no teacher_logprobs.*\[distill\]"):
        trainer.train([bare])
    assert PRODUCER_FIELD == TEACHER_FIELD, "the learner reads the field the producer writes"
