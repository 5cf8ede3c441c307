"""What every objective shares: the token mean, the PPO-clip surrogate, importance weights, row means, and
the stats, among them what the objective cut by entropy bucket.

Tensors are [rows, T] logprobs and a 0/1 `mask`; advantages broadcast against them (GRPO's are [rows, 1]).
Nothing here keeps state or does I/O; every weight and every mask is computed without gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from policies.correction_settings import (  # noqa: F401 (the objectives' settings machinery, named here too)
    BOUND_TEXT,
    Settings,
    check_bounds,
    range_text,
    setting,
)

Stats = dict[str, float]
Reduce = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (per-token values, mask) -> scalar


ENTROPY_EDGES: tuple[float, ...] = (0.1, 0.5, 1.5)  # nats; the buckets are [0, 0.1), [0.1, 0.5), [0.5, 1.5), [1.5, inf)


def entropy_buckets(edges: tuple[float, ...] = ENTROPY_EDGES) -> list[tuple[str, float, float]]:
    """(name, low, high) per bucket of per-token entropy, low inclusive: `entropy_lt_0.1`, `entropy_0.1_0.5`,
    ..., `entropy_ge_1.5`. The names are the suffixes of the `masked_frac/...` and `tokens_frac/...` stats
    (letters, digits, `.` and `_` only: every dashboard takes them as metric names)."""
    bounds = [0.0, *edges, float("inf")]
    names = (
        [f"entropy_lt_{edges[0]:g}"]
        + [f"entropy_{low:g}_{high:g}" for low, high in zip(edges, edges[1:], strict=False)]
        + [f"entropy_ge_{edges[-1]:g}"]
    )
    return [(name, bounds[i], bounds[i + 1]) for i, name in enumerate(names)]


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: each row's mean of `values` over its masked tokens (0 for a row without any); tokens outside
    the mask are never read, even when they are infinite."""
    on = mask > 0
    total = torch.where(on, values, torch.zeros_like(values)).sum(-1, keepdim=True)
    return total / on.sum(-1, keepdim=True).clamp(min=1)


def clipped_surrogate(
    logprobs: torch.Tensor, reference: torch.Tensor, advantages: torch.Tensor, clip_eps: float,
    clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss -min(r A, clip(r, 1 - clip_eps, 1 + clip_high) A) with r = exp(logprobs -
    reference), and the ratio r (`clip_high` unset: clip_eps). The gradient flows through `logprobs` only
    where the clip is not binding."""
    ratio = (logprobs - reference).exp()
    return ratio_surrogate(ratio, advantages, clip_eps, clip_high), ratio


def ratio_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_eps: float, clip_high: float | None = None
) -> torch.Tensor:
    """-min(r A, clip(r, 1 - clip_eps, 1 + clip_high) A) for any ratio r, a token's or a sequence's."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + (clip_eps if clip_high is None else clip_high)) * advantages
    return -torch.minimum(unclipped, clipped)


def binding_clip(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_eps: float, clip_high: float | None = None
) -> torch.Tensor:
    """Where the clip of `ratio_surrogate` binds, so the token gets no gradient: the ratio is above
    1 + clip_high with A > 0, or below 1 - clip_eps with A < 0 (on the other side min() keeps r A)."""
    with torch.no_grad():
        high = 1 + (clip_eps if clip_high is None else clip_high)
        return ((ratio > high) & (advantages > 0)) | ((ratio < 1 - clip_eps) & (advantages < 0))


def importance_weights(proximal: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
    """pi_prox / pi_behav per token, without gradient."""
    return (proximal - behaviour).detach().exp()


def surrogate_stats(
    logprobs: torch.Tensor, reference: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor, clip_eps: float,
    clip_high: float | None = None,
) -> Stats:
    """`clip_frac` (tokens whose ratio lies outside the clip range, `clip_frac_low` below it, `clip_frac_high`
    above it, whatever their advantage) and `approx_kl` (mean of reference - logprobs)."""
    with torch.no_grad():
        low = float(token_mean((ratio < 1 - clip_eps).float(), mask))
        high = float(token_mean((ratio > 1 + (clip_eps if clip_high is None else clip_high)).float(), mask))
        return {
            "clip_frac": low + high, "clip_frac_low": low, "clip_frac_high": high,
            "approx_kl": float(token_mean(reference - logprobs, mask)),
        }


def weight_stats(weights: torch.Tensor, capped: torch.Tensor, mask: torch.Tensor) -> Stats:
    """`is_weight_mean` / `is_weight_max` over the mask, and `is_capped_frac`: tokens whose weight a cap or
    a bound truncated or left out."""
    with torch.no_grad():
        on = mask > 0
        return {
            "is_weight_mean": float(token_mean(weights, mask)),
            "is_weight_max": float(weights[on].max()) if bool(on.any()) else 0.0,
            "is_capped_frac": float(token_mean(capped.float(), mask)),
        }


def seq_weight_stats(row_weights: torch.Tensor, mask: torch.Tensor) -> Stats:
    """`seq_weight_mean` / `seq_weight_max` of [rows, 1] weights over the rows that have a masked token."""
    with torch.no_grad():
        rows = (mask > 0).any(-1)
        if not bool(rows.any()):
            return {"seq_weight_mean": 0.0, "seq_weight_max": 0.0}
        chosen = row_weights.squeeze(-1)[rows]
        return {"seq_weight_mean": float(chosen.mean()), "seq_weight_max": float(chosen.max())}


def cut_stats(cut: torch.Tensor, mask: torch.Tensor, entropy: torch.Tensor | None = None) -> Stats:
    """`masked_frac`: the fraction of the mask's tokens the objective cut (left out, or held by a binding clip:
    either way they get no gradient). With per-token `entropy`, per bucket of `entropy_buckets()`:
    `masked_frac/<bucket>` (the fraction of the mask's tokens that lie in the bucket and were cut; they add up
    to `masked_frac`) and `tokens_frac/<bucket>` (the bucket's share of the mask's tokens; they add up to 1).
    Their quotient is the fraction of the bucket's tokens cut. Every stat is a fraction of the mask's tokens,
    so a token-weighted mean over micro-batches and ranks gives the step's exactly."""
    with torch.no_grad():
        on = mask > 0
        stats = {"masked_frac": float(token_mean((cut & on).float(), mask))}
        if entropy is None:
            return stats
        entropy = entropy.detach()
        for name, low, high in entropy_buckets():
            inside = on & (entropy >= low) & (entropy < high)
            stats[f"masked_frac/{name}"] = float(token_mean((cut & inside).float(), mask))
            stats[f"tokens_frac/{name}"] = float(token_mean(inside.float(), mask))
        return stats


def against_proximal(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float, clip_high: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Stats]:
    """What the token-level objectives against the proximal policy share: the per-token PPO-clip loss
    against it (no gradient through it), the weights pi_prox / pi_behav, the ratio pi_theta / pi_prox, and
    the surrogate's stats."""
    proximal = proximal_logprobs.detach()
    per_token, ratio = clipped_surrogate(logprobs, proximal, advantages, clip_eps, clip_high)
    stats = surrogate_stats(logprobs, proximal, ratio, mask, clip_eps, clip_high)
    return per_token, importance_weights(proximal, behaviour_logprobs), ratio, stats
