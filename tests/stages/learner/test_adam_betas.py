"""AdamW's decay rates (`learner.adam_betas`): the config key reaches the optimizer, a rate outside [0, 1) is
refused before anything starts, and the first rate is momentum: with it, a step whose own gradient is zero
still moves the weights by the earlier steps' push; without it (0), such a step moves nothing."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from baton.builder import grpo_learner
from baton.config import validate
from baton.schema import RunConfig
from stages.data.model import make_tiny_model
from stages.learner import GRPOLearner
from stages.learner.step import PolicyTrainer
from tests.stages.learner.test_ranks import groups

torch.set_num_threads(1)


def test_the_key_reaches_the_optimizer_and_a_bad_rate_is_refused(tmp_path: Path) -> None:
    cfg = validate(RunConfig, {"model": {"path": str(tmp_path / "m")}, "learner": {"adam_betas": [0.5, 0.99]}})
    assert grpo_learner(cfg.learner, cfg, model=tmp_path / "m").adam_betas == (0.5, 0.99)
    with pytest.raises(ValueError, match="adam_betas"):
        GRPOLearner(tmp_path / "m", adam_betas=(1.0, 0.999))
    with pytest.raises(Exception, match="adam_betas"):
        validate(RunConfig, {"learner": {"adam_betas": [0.9, -0.1]}})


def test_momentum_carries_a_push_into_a_step_without_gradient(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "tiny")
    signal = groups(0)
    flat = groups(1)
    for batch in flat:  # equal rewards, no entropy bonus: this step's own gradient is zero
        batch.row_fields["rewards"][:] = 1.0
    spec = GRPOLearner(folder, lr=1e-2, device="cpu", entropy_coef=0.0)

    def second_step_moves(betas: tuple[float, float]) -> float:
        trainer = PolicyTrainer(replace(spec, adam_betas=betas), 10)
        trainer.schedule(0)
        assert trainer.optimizer.param_groups[0]["betas"] == betas
        trainer.train(signal, 0.0)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train(flat, 0.0)
        return sum(float((p.detach() - before[n]).abs().sum()) for n, p in trainer.model.named_parameters())

    assert second_step_moves((0.0, 0.999)) == 0.0
    assert second_step_moves((0.9, 0.999)) > 0.0
