"""The load-balancing loss as a learner setting (`learner.load_balance_coef`, stages.learner.step): reported as
`load_balance_loss` for a mixture-of-experts model whatever the coefficient, absent for a dense one; a positive
coefficient adds coef x that loss (it moves the routers' gradients, not those of what follows the last router),
0 adds nothing; a negative one, or a positive one on a dense model, is refused naming the key."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from stages.data.model import make_tiny_model, make_tiny_moe_model
from stages.learner import GRPOLearner
from stages.learner.step import PolicyTrainer
from tests.stages.learner.test_ranks import groups

torch.set_num_threads(1)
ROUTER = "model.layers.0.mlp.gate.weight"


@pytest.fixture(scope="module")
def moe_spec(tmp_path_factory) -> GRPOLearner:
    # no clipping: the gradients compared below are the loss's own
    return GRPOLearner(make_tiny_moe_model(tmp_path_factory.mktemp("moe")), device="cpu", max_grad_norm=1e9,
                       micro_batch_tokens=24)


def stepped(spec: GRPOLearner) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One step's metrics on fixed groups, and the gradients it left."""
    trainer = PolicyTrainer(spec, 10)
    trainer.schedule(0)
    info = trainer.train(groups(0, n=3))
    return info, {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def test_the_coefficient_adds_the_reported_loss_and_moves_the_router_only(moe_spec) -> None:
    off, off_grads = stepped(moe_spec)
    on, on_grads = stepped(replace(moe_spec, load_balance_coef=0.5))
    assert off["load_balance_loss"] == pytest.approx(on["load_balance_loss"], rel=1e-6)
    assert 1.0 < off["load_balance_loss"] < 8.0  # top-2 of 8: 2 when balanced, 8 when all on one expert
    # coef 0 adds nothing: the losses differ by exactly coef x the reported load-balancing loss
    assert on["loss"] - off["loss"] == pytest.approx(0.5 * off["load_balance_loss"], abs=2e-5)
    assert not torch.allclose(on_grads[ROUTER], off_grads[ROUTER]), "the router's gradient moved"
    # what lies after the last router (its layer's experts, the final norm) gets the policy loss's gradient only
    for after in ("model.layers.1.mlp.experts.down_proj", "model.norm.weight"):
        assert torch.equal(on_grads[after], off_grads[after]), after


def test_a_dense_model_reports_none_and_refuses_a_coefficient(tmp_path) -> None:
    dense = GRPOLearner(make_tiny_model(tmp_path / "dense"), device="cpu")
    info, _ = stepped(dense)
    assert "load_balance_loss" not in info and "loss" in info
    with pytest.raises(ValueError, match="learner.load_balance_coef = 0.1 .* set learner.load_balance_coef = 0"):
        PolicyTrainer(replace(dense, load_balance_coef=0.1), 10)


def test_a_negative_coefficient_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="learner.load_balance_coef must be >= 0"):
        GRPOLearner("m", load_balance_coef=-0.01)
