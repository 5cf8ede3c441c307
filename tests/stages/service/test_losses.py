"""Tinker's losses as the service computes them (`stages.service.losses`) against the formulas Tinker documents,
written out here: sums over the real positions, the importance ratio unclipped for `importance_sampling`, clipped to
[low, high] thresholds for `ppo`, a detached clipped coefficient on the logprob for `cispo`, a quadratic penalty for
`dro` (their values and their gradients, each written out by hand); and what `check_loss` refuses, by name."""

from __future__ import annotations

import pytest
import torch

from stages.service.losses import check_loss, loss_of
from stages.service.refusals import Refused

torch.manual_seed(0)
LOGP = -torch.rand(3, 5) * 2
SAMPLED = LOGP + (torch.rand(3, 5) - 0.5)  # ratios from about 0.6 to 1.65: some outside [0.8, 1.2]
ADV = torch.randn(3, 5)
MASK = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 4 + [0.0]])


def test_cross_entropy_is_the_weighted_sum_of_negative_logprobs() -> None:
    weights = torch.rand(3, 5)
    loss, _ = loss_of("cross_entropy", {}, LOGP, {"weights": weights}, MASK)
    assert torch.isclose(loss, -(weights * LOGP * MASK).sum())


def test_importance_sampling_is_the_unclipped_ratio_times_the_advantage() -> None:
    loss, _ = loss_of("importance_sampling", {}, LOGP, {"logprobs": SAMPLED, "advantages": ADV}, MASK)
    assert torch.isclose(loss, -((LOGP - SAMPLED).exp() * ADV * MASK).sum())


@pytest.mark.parametrize("low, high", [(0.8, 1.2), (0.5, 1.5)])
def test_ppo_clips_the_ratio_to_the_thresholds(low: float, high: float) -> None:
    settings = check_loss("ppo", {"clip_low_threshold": low, "clip_high_threshold": high},
                          {"target_tokens", "logprobs", "advantages"})
    loss, stats = loss_of("ppo", settings, LOGP, {"logprobs": SAMPLED, "advantages": ADV}, MASK)
    ratio = (LOGP - SAMPLED).exp()
    expected = -(torch.minimum(ratio * ADV, ratio.clamp(low, high) * ADV) * MASK).sum()
    assert torch.isclose(loss, expected)
    outside = ((ratio < low) | (ratio > high)).float()
    assert stats["clip_frac"] == pytest.approx(float((outside * MASK).sum() / MASK.sum()))


PG_INPUTS = {"target_tokens", "logprobs", "advantages"}
FAR = LOGP + torch.linspace(-2, 2, 15).reshape(3, 5)  # ratios from 7.4 (first row) down to 0.14: some above 4


def value_and_gradient(name: str, config: dict, sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The service's loss for LOGP and its gradient with respect to LOGP."""
    logp = LOGP.clone().requires_grad_(True)
    loss, _ = loss_of(name, check_loss(name, config, PG_INPUTS), logp, {"logprobs": sampled, "advantages": ADV}, MASK)
    loss.backward()
    return loss.detach(), logp.grad


@pytest.mark.parametrize("config, sampled, low, high", [({}, FAR, 0.0, 4.0),
                                                        ({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
                                                         SAMPLED, 0.8, 1.2)])
def test_cispo_weighs_the_logprob_by_the_clipped_ratio_without_its_gradient(config, sampled, low, high) -> None:
    """Tinker's defaults (0, 4) and explicit thresholds: loss -sum(clip(r) * logp * A), and its gradient with
    respect to logp is -clip(r) * A wherever the token is real: the clip bounds the weight, never cuts a token."""
    ratio = (LOGP - sampled).exp()
    assert bool((((ratio < low) | (ratio > high)) & (MASK > 0)).any())  # the clip binds somewhere
    loss, grad = value_and_gradient("cispo", config, sampled)
    weight = torch.clamp(ratio, low, high)
    assert torch.isclose(loss, -(weight * LOGP * ADV * MASK).sum())
    assert torch.allclose(grad, -weight * ADV * MASK)
    assert bool((grad[MASK > 0] != 0).all())


@pytest.mark.parametrize("beta", [0.05, 1.0])
def test_dro_is_the_logprob_times_the_advantage_less_a_quadratic_penalty(beta: float) -> None:
    """-sum(logp * A - beta / 2 * (logp - sampled)^2); its gradient -(A - beta * (logp - sampled)) on real tokens."""
    loss, grad = value_and_gradient("dro", {"beta": beta}, SAMPLED)
    delta = LOGP - SAMPLED
    assert torch.isclose(loss, -((LOGP * ADV - 0.5 * beta * delta * delta) * MASK).sum())
    assert torch.allclose(grad, -(ADV - beta * delta) * MASK)


def test_what_check_loss_refuses_names_it() -> None:
    inputs = PG_INPUTS
    with pytest.raises(Refused, match="'gspo' \\(a Tinker built-in loss\\)"):
        check_loss("gspo", {}, inputs)
    with pytest.raises(Refused, match="'my_loss' \\(not a Tinker loss name\\)"):
        check_loss("my_loss", {}, inputs)
    with pytest.raises(Refused, match="missing \\['weights'\\], unknown \\['advantages', 'logprobs'\\]"):
        check_loss("cross_entropy", {}, inputs)
    with pytest.raises(Refused, match="\\['beta'\\] are not supported for 'ppo'"):
        check_loss("ppo", {"beta": 0.1}, inputs)
    with pytest.raises(Refused, match="clip_low_threshold <= 1"):
        check_loss("ppo", {"clip_low_threshold": 1.3}, inputs)
    with pytest.raises(Refused, match="\\['beta'\\] are not supported for 'cispo'"):
        check_loss("cispo", {"beta": 0.1}, inputs)
    with pytest.raises(Refused, match="for 'cispo' needs 0 <= clip_low_threshold"):
        check_loss("cispo", {"clip_high_threshold": 0.5}, inputs)
    with pytest.raises(Refused, match="\\['clip_low_threshold'\\] are not supported for 'dro'"):
        check_loss("dro", {"beta": 0.1, "clip_low_threshold": 0.5}, inputs)
    with pytest.raises(Refused, match="'dro' needs loss_fn_config \\['beta'\\]"):
        check_loss("dro", {}, inputs)
    with pytest.raises(Refused, match="beta for 'dro' must be >= 0"):
        check_loss("dro", {"beta": -0.1}, inputs)
    with pytest.raises(Refused, match="beta for 'dro' must be a number"):
        check_loss("dro", {"beta": "high"}, inputs)
