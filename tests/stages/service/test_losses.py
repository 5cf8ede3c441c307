"""Tinker's losses as the service computes them (`stages.service.losses`) against the formulas Tinker documents,
written out here: sums over the real positions, the importance ratio unclipped for `importance_sampling`, clipped to
[low, high] thresholds for `ppo`; and what `check_loss` refuses, by name."""

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


def test_what_check_loss_refuses_names_it() -> None:
    inputs = {"target_tokens", "logprobs", "advantages"}
    with pytest.raises(Refused, match="'cispo' \\(a Tinker built-in loss\\)"):
        check_loss("cispo", {}, inputs)
    with pytest.raises(Refused, match="'my_loss' \\(not a Tinker loss name\\)"):
        check_loss("my_loss", {}, inputs)
    with pytest.raises(Refused, match="missing \\['weights'\\], unknown \\['advantages', 'logprobs'\\]"):
        check_loss("cross_entropy", {}, inputs)
    with pytest.raises(Refused, match="\\['beta'\\] are not supported for 'ppo'"):
        check_loss("ppo", {"beta": 0.1}, inputs)
    with pytest.raises(Refused, match="clip_low_threshold <= 1"):
        check_loss("ppo", {"clip_low_threshold": 1.3}, inputs)
