"""The objectives of policies.correction on crafted tensors: what each leaves out and keeps, its loss by hand,
the sign of its gradient, zero gradient exactly where it cuts, and what it cut by entropy bucket."""

from __future__ import annotations

import math
from functools import partial

import torch

torch.set_num_threads(1)

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from baton.builder import make_correction  # noqa: E402
from baton.config import ConfigError, validate  # noqa: E402
from baton.schema import RunConfig  # noqa: E402
from policies.correction import (  # noqa: E402
    KINDS,
    Correction,
    entropy_buckets,
    gspo,
    m2po,
    mis_seq,
    mis_token,
    none,
    second_moment_keep,
)
from stages.learner.losses import AGGREGATIONS, aggregate  # noqa: E402

E = math.exp
BUCKETS = ["entropy_lt_0.1", "entropy_0.1_0.5", "entropy_0.5_1.5", "entropy_ge_1.5"]


def _leaf(values: torch.Tensor) -> torch.Tensor:
    return values.detach().clone().requires_grad_(True)


def _stale(log_weights: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(proximal, behaviour) logprobs with log(pi_prox / pi_behav) = `log_weights`."""
    proximal = torch.full((len(log_weights), len(log_weights[0])), math.log(0.3))
    return proximal, proximal - torch.tensor(log_weights)


# ------------------------------------------------------------------------------- m2po


def test_m2po_leaves_out_the_largest_squares_until_the_second_moment_fits() -> None:
    # squares 0, 0.01, 0.04, 0.25: M2 = 0.075 > 0.04; without the 0.25 it is 0.05 / 3 <= 0.04
    proximal, behaviour = _stale([[0.0, 0.1, -0.2, 0.5, 3.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 0]])  # the padding token's square (9) is never read
    entropy = torch.tensor([[0.05, 0.3, 1.0, 2.0, 2.0]])
    for adv, sign in ((1.0, -1), (-1.0, 1)):
        logprobs = _leaf(proximal)
        loss, stats = m2po(logprobs, behaviour, proximal, torch.tensor([[adv]]), mask, entropy=entropy)
        kept = [1.0, E(0.1), E(-0.2), 0.0]  # each kept token keeps its full weight; the left-out one counts as 0
        assert loss.item() == pytest.approx(-adv * sum(kept) / 4)  # still divided by all 4 tokens
        loss.backward()
        assert logprobs.grad[0].tolist() == pytest.approx([sign * w / 4 for w in kept] + [0.0])
        assert stats["m2"] == pytest.approx(0.075) and stats["m2_kept"] == pytest.approx(0.05 / 3)
        assert stats["is_capped_frac"] == stats["masked_frac"] == pytest.approx(0.25)
        assert [stats[f"masked_frac/{b}"] for b in BUCKETS] == [0.0, 0.0, 0.0, 0.25]  # the high-entropy token
        assert [stats[f"tokens_frac/{b}"] for b in BUCKETS] == pytest.approx([0.25] * 4)
    keep = second_moment_keep(proximal - behaviour, mask, threshold=0.01)  # also cut 0.04: 0.01 / 2 <= 0.01
    assert keep.tolist() == [[True, True, False, False, False]]


def test_m2po_leaves_out_everything_when_no_token_fits() -> None:
    proximal, behaviour = _stale([[1.0, -1.0]])
    logprobs = _leaf(proximal)
    loss, stats = m2po(logprobs, behaviour, proximal, torch.ones(1, 1), torch.ones(1, 2))
    loss.backward()
    assert loss.item() == 0.0 and stats["masked_frac"] == 1.0 and stats["m2_kept"] == 0.0
    assert torch.equal(logprobs.grad, torch.zeros(1, 2))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 4), width=st.integers(1, 8),
       scale=st.sampled_from([0.05, 0.3, 1.0, 3.0]), threshold=st.sampled_from([0.001, 0.04, 0.5]))
def test_m2po_keeps_the_largest_set_within_the_bound(
    seed: int, rows: int, width: int, scale: float, threshold: float
) -> None:
    gen = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(rows, width, generator=gen) * scale
    mask = (torch.rand(rows, width, generator=gen) > 0.3).float()
    keep = second_moment_keep(log_ratio, mask, threshold)
    squares = log_ratio.double() ** 2
    kept, left_out = squares[keep], squares[(mask > 0) & ~keep]
    assert not keep[mask == 0].any()
    if kept.numel():
        assert float(kept.mean()) <= threshold + 1e-12
    if kept.numel() and left_out.numel():
        assert float(left_out.min()) >= float(kept.max())
    if left_out.numel():  # adding back the smallest left-out square breaks the bound
        assert float(torch.cat([kept, left_out.min().reshape(1)]).mean()) > threshold


def test_m2po_keeps_the_stale_high_entropy_tokens_that_clipping_cuts() -> None:
    """One token in eight moved to 1.5x under staleness (a high-entropy one): clipping against the behaviour
    policy cuts it, m2po keeps it (M2 = ln(1.5)^2 / 8 = 0.021 <= 0.04) at its full weight 1.5."""
    proximal, behaviour = _stale([[math.log(1.5)] + [0.0] * 7])
    entropy = torch.tensor([[2.0] + [0.05] * 7])
    adv, mask = torch.ones(1, 1), torch.ones(1, 8)
    _, clipped = none(_leaf(proximal), behaviour, adv, mask, clip_high=0.28, entropy=entropy)
    assert clipped["masked_frac/entropy_ge_1.5"] == clipped["tokens_frac/entropy_ge_1.5"] == 1 / 8  # all of them
    assert clipped["masked_frac/entropy_lt_0.1"] == 0.0
    logprobs = _leaf(proximal)
    loss, kept = m2po(logprobs, behaviour, proximal, adv, mask, clip_high=0.28, entropy=entropy)
    loss.backward()
    assert kept["masked_frac"] == 0.0 and logprobs.grad[0, 0] == pytest.approx(-1.5 / 8)


def test_m2po_on_policy_trains_positive_tokens_at_weight_one_and_bounds_the_others() -> None:
    """Row 0 (advantage +1): a discovery the learner moved away from (weight 0.2) and a token it already made
    likely (weight 16). Row 1 (advantage -1): weights 1 and e^0.1. Weighted, the bound leaves out both of row 0's
    (squares 2.6 and 7.7); on_policy trains them at weight 1, and bounds row 1 alone."""
    proximal, behaviour = _stale([[math.log(0.2), math.log(16.0)], [0.0, 0.1]])
    adv, mask = torch.tensor([[1.0], [-1.0]]), torch.ones(2, 2)
    grads = {}
    for positive in ("weighted", "on_policy"):
        logprobs = _leaf(proximal)
        loss, stats = m2po(logprobs, behaviour, proximal, adv, mask, threshold=0.2, positive=positive)
        loss.backward()
        grads[positive] = logprobs.grad
        assert stats["is_weight_max"] == pytest.approx(16.0)  # the tokens' own weights, whatever they train at
    assert grads["weighted"][0].tolist() == [0.0, 0.0]  # both left out
    assert grads["weighted"][1].tolist() == pytest.approx([1 / 4, E(0.1) / 4])
    assert grads["on_policy"][0].tolist() == pytest.approx([-1 / 4, -1 / 4])  # pushed up, at weight 1
    assert grads["on_policy"][1].tolist() == pytest.approx([1 / 4, E(0.1) / 4])  # unchanged: their weights
    _, stats = m2po(proximal, behaviour, proximal, adv, mask, threshold=0.2, positive="on_policy")
    assert stats["is_capped_frac"] == 0.0 and stats["m2_kept"] == pytest.approx(0.01 / 4)


def test_m2po_on_policy_still_bounds_negative_tokens() -> None:
    proximal, behaviour = _stale([[0.0, 3.0]])
    logprobs = _leaf(proximal)
    loss, stats = m2po(logprobs, behaviour, proximal, -torch.ones(1, 1), torch.ones(1, 2), positive="on_policy")
    loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([0.5, 0.0]) and stats["is_capped_frac"] == 0.5


# ------------------------------------------------------------------------------- masked importance sampling


def test_mis_token_leaves_out_tokens_outside_the_bounds_and_keeps_full_weights_inside() -> None:
    proximal, behaviour = _stale([[0.0, math.log(0.4), math.log(1.5), math.log(3.0)]])  # weights 1, 0.4, 1.5, 3
    mask = torch.ones(1, 4)
    for adv in (2.0, -2.0):
        logprobs = _leaf(proximal)
        loss, stats = mis_token(logprobs, behaviour, proximal, torch.tensor([[adv]]), mask, low=0.5, high=2.0)
        assert loss.item() == pytest.approx(-adv * (1 + 1.5) / 4)
        loss.backward()
        assert logprobs.grad[0].tolist() == pytest.approx([-adv * 1 / 4, 0.0, -adv * 1.5 / 4, 0.0])
        assert stats["is_capped_frac"] == stats["masked_frac"] == pytest.approx(0.5)
        assert stats["is_weight_max"] == pytest.approx(3.0)


def test_mis_seq_judges_rows_by_their_geometric_mean_weight() -> None:
    # row 0: weights 2 and 0.5, geometric mean 1: kept, both tokens at weight 1;
    # row 1: weights 1.5 and 1.5: left out whole; row 2: one token at 1.05 and padding with a wild weight
    proximal, behaviour = _stale([[math.log(2), math.log(0.5)], [math.log(1.5)] * 2, [math.log(1.05), 30.0]])
    mask = torch.tensor([[1.0, 1], [1, 1], [1, 0]])
    adv = torch.tensor([[1.0], [1.0], [-1.0]])
    logprobs = _leaf(proximal)
    loss, stats = mis_seq(logprobs, behaviour, proximal, adv, mask, low=0.9, high=1.1)
    assert loss.item() == pytest.approx(-(1 + 1 + 0 + 0 - 1.05) / 5)
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[-1 / 5, -1 / 5], [0.0, 0.0], [1.05 / 5, 0.0]]))
    assert stats["masked_frac"] == stats["is_capped_frac"] == pytest.approx(2 / 5)
    assert stats["seq_weight_max"] == pytest.approx(1.5) and stats["seq_weight_mean"] == pytest.approx(3.55 / 3)


# ------------------------------------------------------------------------------- gspo


def test_gspo_clips_whole_rows_by_their_sequence_ratio() -> None:
    """Row 0: token ratios e^0.1, e^-0.1, sequence ratio 1 (inside), weighted by its geometric-mean staleness
    e^0.1; row 1: ratio e^0.01 > 1 + 4e-4 with A > 0: clipped, no gradient; row 2: the same ratio with A < 0:
    min() keeps s A, so it is not clipped."""
    proximal = torch.full((3, 2), math.log(0.3))
    behaviour = proximal - torch.tensor([[0.2, 0.0], [0.0, 0.0], [0.0, 0.0]])
    logprobs = _leaf(proximal + torch.tensor([[0.1, -0.1], [0.01, 0.01], [0.01, 0.01]]))
    adv = torch.tensor([[1.0], [1.0], [-1.0]])
    loss, stats = gspo(logprobs, behaviour, proximal, adv, torch.ones(3, 2))
    assert loss.item() == pytest.approx((-2 * E(0.1) - 2 * 1.0004 + 2 * E(0.01)) / 6)
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[-E(0.1) / 6] * 2, [0.0, 0.0], [E(0.01) / 6] * 2]))
    assert stats["masked_frac"] == pytest.approx(2 / 6) and stats["clip_frac"] == pytest.approx(4 / 6)
    # its clip range is its own: the learner's clip_eps = 0.2 does not reach it
    via_config, _ = Correction("gspo").loss(logprobs.detach(), behaviour, proximal, adv, torch.ones(3, 2), 0.2, 0.28)
    assert via_config.item() == pytest.approx(loss.item())


# ------------------------------------------------------------------------------- every objective


def _random_step(seed: int, rows: int, width: int, drift: float) -> tuple[torch.Tensor, ...]:
    """Stale data: behaviour, proximal and trained logprobs apart by up to `drift` nats; per-row advantages
    away from 0; a mask with at least one token."""
    gen = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(rows, width, generator=gen) * 3 - 0.1
    proximal = behaviour + (torch.rand(rows, width, generator=gen) - 0.5) * 2 * drift
    logprobs = proximal + (torch.rand(rows, width, generator=gen) - 0.5) * drift
    signs = torch.where(torch.rand(rows, 1, generator=gen) > 0.5, 1.0, -1.0)
    adv = signs * (0.1 + torch.rand(rows, 1, generator=gen))
    mask = (torch.rand(rows, width, generator=gen) > 0.3).float()
    mask[0, 0] = 1.0
    entropy = torch.rand(rows, width, generator=gen) * 3
    return behaviour, proximal, logprobs, adv, mask, entropy


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 4), width=st.integers(1, 6),
       mode=st.sampled_from(AGGREGATIONS))
@pytest.mark.parametrize("kind", KINDS)
def test_on_policy_every_objective_is_the_plain_policy_gradient(kind: str, seed: int, rows: int, width: int,
                                                               mode: str) -> None:
    _, _, start, adv, mask, entropy = _random_step(seed, rows, width, 0.0)
    reduce = partial(aggregate, mode=mode)
    logprobs, plain = _leaf(start), _leaf(start)
    loss, stats = Correction(kind).loss(logprobs, start, start, adv, mask, reduce=reduce, entropy=entropy)
    expected = reduce(-(plain - plain.detach()).exp() * adv, mask)
    loss.backward()
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert torch.allclose(logprobs.grad, plain.grad, atol=1e-6)
    assert stats["masked_frac"] == 0.0 and all(stats[f"masked_frac/{b}"] == 0.0 for b in BUCKETS)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 4), width=st.integers(1, 6),
       drift=st.sampled_from([0.3, 1.0, 2.0]))
@pytest.mark.parametrize("kind", KINDS)
def test_masked_frac_counts_exactly_the_tokens_without_gradient(kind: str, seed: int, rows: int, width: int,
                                                               drift: float) -> None:
    behaviour, proximal, start, adv, mask, entropy = _random_step(seed, rows, width, drift)
    logprobs = _leaf(start)
    loss, stats = Correction(kind).loss(logprobs, behaviour, proximal, adv, mask, 0.2, 0.28, entropy=entropy)
    loss.backward()
    on = mask > 0
    assert not logprobs.grad[~on].any()  # tokens outside the mask never get a gradient
    no_gradient = (logprobs.grad == 0) & on
    assert stats["masked_frac"] == pytest.approx(float(no_gradient.sum() / on.sum()))
    for name, low, high in entropy_buckets():
        inside = on & (entropy >= low) & (entropy < high)
        assert stats[f"masked_frac/{name}"] == pytest.approx(float((no_gradient & inside).sum() / on.sum()))
        assert stats[f"tokens_frac/{name}"] == pytest.approx(float(inside.sum() / on.sum()))
    assert sum(stats[f"masked_frac/{b}"] for b in BUCKETS) == pytest.approx(stats["masked_frac"])
    assert sum(stats[f"tokens_frac/{b}"] for b in BUCKETS) == pytest.approx(1.0)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "none"])
def test_gradient_reaches_only_the_trained_logprobs_with_the_advantages_sign(kind: str) -> None:
    """A slightly stale token inside every objective's bounds: A > 0 gives a negative gradient (descent raises
    its probability), A < 0 a positive one; behaviour and proximal logprobs never get a gradient."""
    for adv, sign in ((1.0, -1.0), (-1.0, 1.0)):
        proximal = torch.full((1, 3), math.log(0.3)).requires_grad_(True)
        behaviour = (proximal.detach() - 0.02).requires_grad_(True)
        logprobs = _leaf(proximal)
        loss, _ = Correction(kind).loss(logprobs, behaviour, proximal, torch.tensor([[adv]]), torch.ones(1, 3))
        loss.backward()
        assert behaviour.grad is None and proximal.grad is None
        assert (torch.sign(logprobs.grad) == sign).all()


def test_without_entropy_only_the_overall_fraction_is_reported() -> None:
    for kind in KINDS:
        _, stats = Correction(kind).loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2),
                                         torch.ones(1, 1), torch.ones(1, 2))
        assert stats["masked_frac"] == 0.0 and not any("/" in key for key in stats)


def test_entropy_buckets_are_named_by_their_edges() -> None:
    assert [name for name, _, _ in entropy_buckets()] == BUCKETS
    assert entropy_buckets((1.0,)) == [("entropy_lt_1", 0.0, 1.0), ("entropy_ge_1", 1.0, math.inf)]


# ------------------------------------------------------------------------------- choosing one


def test_the_registry_hands_each_kind_its_settings() -> None:
    behaviour, proximal, logprobs, adv, mask, _ = _random_step(7, 3, 5, 1.0)
    pairs = [
        (Correction("m2po", m2_threshold=0.01), partial(m2po, threshold=0.01, positive="on_policy")),
        (Correction("m2po", m2_positive="weighted"),
         partial(m2po, threshold=Correction().m2_threshold, positive="weighted")),
        (Correction("mis-token", mis_token_low=0.3, mis_token_high=3.0), partial(mis_token, low=0.3, high=3.0)),
        (Correction("mis-seq", mis_seq_low=0.8, mis_seq_high=1.2), partial(mis_seq, low=0.8, high=1.2)),
        (Correction("gspo", gspo_clip_low=0.01, gspo_clip_high=0.02), partial(gspo, clip_eps=0.01, clip_high=0.02)),
    ]
    for correction, direct in pairs:
        chosen, _ = correction.loss(logprobs, behaviour, proximal, adv, mask)
        expected, _ = direct(logprobs, behaviour, proximal, adv, mask)
        assert torch.equal(chosen, expected), correction.kind
        assert correction.needs_proximal


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "m2po", "m2_threshold": 0.0}, r"correction.m2_threshold must be > 0 .* uses 0.04"),
        ({"kind": "m2po", "m2_positive": "unit"}, r"correction.m2_positive must be 'weighted' or 'on_policy'"),
        ({"kind": "mis-token", "mis_token_low": 1.5}, r"correction.mis_token_low and correction.mis_token_high"),
        ({"kind": "mis-seq", "mis_seq_high": 0.9}, r"correction.mis_seq_low and correction.mis_seq_high"),
        ({"kind": "gspo", "gspo_clip_low": 1.0}, r"correction.gspo_clip_low must lie in \(0, 1\)"),
    ],
)
def test_correction_rejects_bad_settings_naming_the_key(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Correction(**kwargs)


def test_auto_is_none_up_to_k2_and_m2po_above_and_checks_settings_against_what_it_resolved_to() -> None:
    from policies.correction import auto_kind

    assert [auto_kind(k) for k in (0, 1, 2, 3, 8, 32)] == ["none", "none", "none", "m2po", "m2po", "m2po"]
    assert validate(RunConfig, {}).correction.kind == "none"  # the default k = 2
    assert validate(RunConfig, {"mode": "sync"}).correction.kind == "none"
    at_k8 = validate(RunConfig, {"staleness": {"k": 8}, "correction": {"m2_threshold": 0.02}})
    assert make_correction(at_k8) == Correction("m2po", m2_threshold=0.02)
    assert validate(RunConfig, {"staleness": {"k": 8}, "correction": {"kind": "none"}}).correction.kind == "none"
    with pytest.raises(ConfigError, match=r"correction.kind = 'auto' is 'none' at staleness.k = 2; remove "
                                          r"correction.m2_threshold or set correction.kind = 'm2po'"):
        validate(RunConfig, {"correction": {"m2_threshold": 0.02}})


def test_config_selects_each_objective_and_refuses_settings_of_another() -> None:
    cfg = validate(RunConfig, {"correction": {"kind": "m2po", "m2_threshold": 0.1}})
    assert make_correction(cfg) == Correction("m2po", m2_threshold=0.1)
    cfg = validate(RunConfig, {"correction": {"kind": "mis-seq", "mis_seq_low": 0.8, "mis_seq_high": 1.25}})
    assert make_correction(cfg) == Correction("mis-seq", mis_seq_low=0.8, mis_seq_high=1.25)
    assert make_correction(validate(RunConfig, {"correction": {"kind": "gspo"}})).kind == "gspo"
    with pytest.raises(ConfigError, match=r"remove correction.m2_threshold or set correction.kind = 'm2po'"):
        validate(RunConfig, {"correction": {"kind": "mis-token", "m2_threshold": 0.1}})
    with pytest.raises(ConfigError, match="correction.m2_threshold"):
        validate(RunConfig, {"correction": {"kind": "m2po", "m2_threshold": -1}})
    with pytest.raises(ConfigError, match=r"correction.mis_token_low = 1.0 equals correction.mis_token_high"):
        validate(RunConfig, {"correction": {"kind": "mis-token", "mis_token_low": 1.0, "mis_token_high": 1.0}})
