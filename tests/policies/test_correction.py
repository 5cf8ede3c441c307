"""Off-policy corrections (policies.correction): hand-computed cases, caps, where gradients flow,
`none` equal to today's PPO-clip loss, and the config keys that select them."""

from __future__ import annotations

import math

import torch

torch.set_num_threads(1)

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from baton.config import ConfigError, validate  # noqa: E402
from baton.schema import RunConfig  # noqa: E402
from policies.correction import Correction, decoupled, importance_weights, none, tis  # noqa: E402
from stages.learner.losses import ppo_clip_loss  # noqa: E402

log = math.log


def _leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values).log().requires_grad_(True)


# ------------------------------------------------------------------------------- none == today's loss


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 4), width=st.integers(1, 6), eps=st.sampled_from([0.1, 0.2]))
def test_none_is_exactly_the_ppo_clip_loss(seed: int, rows: int, width: int, eps: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(rows, width, generator=gen) * 3
    start = behaviour + (torch.rand(rows, width, generator=gen) - 0.5) * 2
    adv = torch.randn(rows, 1, generator=gen)
    mask = (torch.rand(rows, width, generator=gen) > 0.3).float()
    a, b = start.clone().requires_grad_(True), start.clone().requires_grad_(True)
    loss_a, stats_a = ppo_clip_loss(a, behaviour, adv, mask, eps)
    loss_b, stats_b = none(b, behaviour, adv, mask, eps)
    loss_a.backward()
    loss_b.backward()
    assert torch.equal(loss_a, loss_b)
    assert torch.equal(a.grad, b.grad)
    assert stats_a == {k: stats_b[k] for k in stats_a}
    via_config, _ = Correction().loss(start, behaviour, start.detach(), adv, mask, eps)
    assert torch.equal(via_config, loss_a.detach())  # the default correction is `none`


# ------------------------------------------------------------------------------- hand-computed cases


def test_tis_hand_computed_weights_truncated_at_the_cap() -> None:
    # three tokens of one row, A = 1; on-policy for the learner (logprobs == proximal), so ratio 1, no clip
    proximal = [[0.5, 0.3, 0.8]]
    behaviour = torch.tensor([[0.5, 0.6, 0.1]]).log()  # weights 1, 0.5, 8 -> truncated 1, 0.5, 2
    logprobs = _leaf(proximal)
    loss, stats = tis(logprobs, behaviour, logprobs.detach(), torch.ones(1, 1), torch.ones(1, 3), cap=2.0)
    assert loss.item() == pytest.approx(-(1 + 0.5 + 2) / 3)
    assert stats["is_weight_mean"] == pytest.approx((1 + 0.5 + 8) / 3)
    assert stats["is_weight_max"] == pytest.approx(8.0)
    assert stats["is_capped_frac"] == pytest.approx(1 / 3)
    assert stats["clip_frac"] == 0.0
    loss.backward()
    # d/dlogp of -w * exp(logp - prox) * A / N at logp == prox: -w / N
    assert torch.allclose(logprobs.grad, torch.tensor([[-1.0, -0.5, -2.0]]) / 3)


def test_decoupled_hand_computed_uncapped_and_capped() -> None:
    proximal = [[0.5, 0.3, 0.8]]
    behaviour = torch.tensor([[0.5, 0.6, 0.1]]).log()  # weights 1, 0.5, 8
    adv, mask = torch.tensor([[2.0]]), torch.ones(1, 3)
    logprobs = _leaf(proximal)
    loss, stats = decoupled(logprobs, behaviour, logprobs.detach(), adv, mask)
    assert loss.item() == pytest.approx(-2 * (1 + 0.5 + 8) / 3)
    assert stats["is_capped_frac"] == 0.0
    capped_lp = _leaf(proximal)
    capped, stats = decoupled(capped_lp, behaviour, capped_lp.detach(), adv, mask, cap=4.0)
    # the token over the cap is left out, but still counts in the denominator (AReaL)
    assert capped.item() == pytest.approx(-2 * (1 + 0.5 + 0) / 3)
    assert stats["is_capped_frac"] == pytest.approx(1 / 3) and stats["is_weight_max"] == pytest.approx(8.0)
    capped.backward()
    assert capped_lp.grad[0, 2] == 0 and capped_lp.grad[0, 0] != 0


def test_corrections_clip_against_the_proximal_policy_not_the_behaviour() -> None:
    """The trained policy moved to 1.5x the proximal one on token 0 (outside eps = 0.2): clipped, no
    gradient; token 1 sits inside the clip of the proximal policy, though 4x the (stale) behaviour one."""
    proximal = torch.tensor([[0.2, 0.2]]).log()
    behaviour = torch.tensor([[0.2, 0.05]]).log()
    logprobs = _leaf([[0.3, 0.2]])
    adv, mask = torch.ones(1, 1), torch.ones(1, 2)
    for correct in (
        lambda lp: tis(lp, behaviour, proximal, adv, mask, cap=10.0),
        lambda lp: decoupled(lp, behaviour, proximal, adv, mask),
    ):
        lp = logprobs.detach().clone().requires_grad_(True)
        loss, stats = correct(lp)
        # token 0: -clip(1.5) * w(1) = -1.2 ; token 1: -1 * w(4) = -4
        assert loss.item() == pytest.approx(-(1.2 + 4.0) / 2)
        assert stats["clip_frac"] == pytest.approx(0.5)
        loss.backward()
        assert lp.grad[0, 0] == 0 and lp.grad[0, 1] == pytest.approx(-4.0 / 2)
    # `none` clips both against the behaviour policy: ratios 1.5 and 4 are both clipped, so no gradient at all
    lp = logprobs.detach().clone().requires_grad_(True)
    loss, stats = none(lp, behaviour, adv, mask, proximal_logprobs=proximal)
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros(1, 2))
    assert stats["clip_frac"] == 1.0 and stats["is_weight_max"] == pytest.approx(4.0)  # weights: diagnostic only


# ------------------------------------------------------------------------------- gradients and masks


@pytest.mark.parametrize("kind", ["tis", "decoupled"])
def test_gradient_flows_only_into_the_trained_logprobs(kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    behaviour = (-torch.rand(3, 4, generator=gen) * 2).requires_grad_(True)
    proximal = (behaviour.detach() + torch.rand(3, 4, generator=gen) - 0.5).requires_grad_(True)
    logprobs = (proximal.detach() + (torch.rand(3, 4, generator=gen) - 0.5) * 0.1).requires_grad_(True)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    adv = torch.tensor([[1.0], [-2.0], [5.0]])
    loss, _ = Correction(kind).loss(logprobs, behaviour, proximal, adv, mask)
    loss.backward()
    assert behaviour.grad is None and proximal.grad is None  # the importance weight is a constant
    assert (logprobs.grad[mask == 0] == 0).all()
    assert (logprobs.grad[mask == 1] != 0).all()


@pytest.mark.parametrize("kind", ["none", "tis", "decoupled"])
def test_on_policy_data_gives_minus_mean_advantage_for_every_correction(kind: str) -> None:
    logprobs = torch.log(torch.full((2, 3), 0.4)).requires_grad_(True)
    adv = torch.tensor([[1.0], [-3.0]])
    loss, stats = Correction(kind).loss(logprobs, logprobs.detach(), logprobs.detach(), adv, torch.ones(2, 3))
    assert loss.item() == pytest.approx(1.0)  # -(3 * 1 + 3 * -3) / 6
    assert stats["is_weight_mean"] == pytest.approx(1.0) and stats["is_capped_frac"] == 0.0


def test_empty_mask_gives_zero_loss_not_nan() -> None:
    lp, zeros = torch.zeros(2, 3, requires_grad=True), torch.zeros(2, 3)
    for kind in ("none", "tis", "decoupled"):
        loss, stats = Correction(kind).loss(lp, zeros, zeros, torch.ones(2, 1), zeros)
        assert loss.item() == 0.0 and all(math.isfinite(v) for v in stats.values())


def test_importance_weights_are_ratios_without_gradient() -> None:
    prox = torch.tensor([log(0.5), log(0.2)], requires_grad=True)
    w = importance_weights(prox, torch.tensor([log(0.25), log(0.4)]))
    assert torch.allclose(w, torch.tensor([2.0, 0.5])) and not w.requires_grad


# ------------------------------------------------------------------------------- choosing one


def test_correction_needs_proximal_except_none() -> None:
    assert not Correction().needs_proximal
    assert Correction("tis").needs_proximal and Correction("decoupled").needs_proximal
    with pytest.raises(ValueError, match="needs the proximal logprobs"):
        Correction("tis").loss(torch.zeros(1, 1), torch.zeros(1, 1), None, torch.ones(1, 1), torch.ones(1, 1))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "is"}, "correction.kind must be one of"),
        ({"tis_cap": 0.5}, "correction.tis_cap must be >= 1"),
        ({"kind": "decoupled", "decoupled_cap": 0.9}, "correction.decoupled_cap must be >= 1"),
    ],
)
def test_correction_rejects_bad_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Correction(**kwargs)


def test_config_selects_the_correction() -> None:
    from baton.schema import CorrectionSpec

    assert RunConfig().correction == CorrectionSpec(kind="none", tis_cap=2.0, decoupled_cap=None)
    cfg = validate(RunConfig, {"correction": {"kind": "decoupled", "decoupled_cap": 5.0}})
    assert cfg.correction.kind == "decoupled" and cfg.correction.decoupled_cap == 5.0
    with pytest.raises(ConfigError, match="correction.kind"):
        validate(RunConfig, {"correction": {"kind": "ppo"}})
    with pytest.raises(ConfigError, match="tis_cap"):
        validate(RunConfig, {"correction": {"kind": "tis", "tis_cap": 0.5}})
    with pytest.raises(ConfigError, match=r"remove correction.decoupled_cap or set correction.kind = 'decoupled'"):
        validate(RunConfig, {"correction": {"kind": "tis", "decoupled_cap": 3.0}})


def test_build_pipeline_hands_the_correction_to_the_learner(tmp_path) -> None:
    from baton.builder import build_pipeline

    cfg = validate(
        RunConfig,
        {
            "model": {"path": str(tmp_path / "m")},
            "run_root": str(tmp_path),
            "correction": {"kind": "tis", "tis_cap": 3.0},
            "staleness": {"k": 30, "admission": "eager"},  # queues fit in k: `baton check` accepts it
        },
    )
    pipe = build_pipeline(cfg)
    assert pipe.consumer.correction == Correction("tis", tis_cap=3.0)
    assert pipe.staleness.admission == "eager"
