"""Masked importance sampling: leave out what is too far off-policy instead of truncating its weight.

* `mis-token`: a token whose weight pi_prox / pi_behav lies outside [low, high] is left out; every other
  token keeps its full weight. Truncation (`tis`) would keep the far token's gradient at a wrong weight.
* `mis-seq`: a row's weight is the geometric mean of its tokens' weights, exp(mean of log pi_prox / pi_behav
  over its masked tokens); a row whose weight lies outside [low, high] is left out whole, and every token of
  a kept row carries the row's weight. The geometric mean is per token, so it does not grow with length
  (the sequence's product would), and its bounds are tighter than a token's.

Both use the decoupled surrogate (PPO-clip of pi_theta / pi_prox) and share the promises: every weight that
reaches the loss lies in [low, high]; a left-out token gets weight 0 and stays in the aggregation's
denominator.
"""

from __future__ import annotations

import torch

from policies.correction.common import (
    Reduce,
    Stats,
    against_proximal,
    binding_clip,
    cut_stats,
    row_mean,
    seq_weight_stats,
    token_mean,
    weight_stats,
)


def _masked_loss(
    per_token: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor, reduce: Reduce
) -> torch.Tensor:
    return reduce(per_token * torch.where(keep, weights, torch.zeros_like(weights)), mask)


def mis_token(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float = 0.2, low: float = 0.5, high: float = 2.0,
    clip_high: float | None = None, reduce: Reduce = token_mean, entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """The decoupled loss on the tokens whose weight lies in [low, high]. `is_capped_frac`: tokens left out
    by the bounds; `masked_frac`: those, plus tokens held by a binding clip."""
    per_token, weights, ratio, stats = against_proximal(
        logprobs, behaviour_logprobs, proximal_logprobs, advantages, mask, clip_eps, clip_high
    )
    keep = (weights >= low) & (weights <= high)
    left_out = (mask > 0) & ~keep
    loss = _masked_loss(per_token, weights, keep, mask, reduce)
    cut = left_out | binding_clip(ratio, advantages, clip_eps, clip_high)
    return loss, stats | weight_stats(weights, left_out, mask) | cut_stats(cut, mask, entropy)


def mis_seq(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float = 0.2, low: float = 0.9, high: float = 1.1,
    clip_high: float | None = None, reduce: Reduce = token_mean, entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """The decoupled loss on the rows whose geometric-mean weight lies in [low, high], each token weighted
    by its row's weight. `is_weight_*` are the tokens' own weights; `seq_weight_mean` / `seq_weight_max` the
    rows' (over rows with tokens); `is_capped_frac`: tokens of left-out rows; `masked_frac`: those, plus
    tokens held by a binding clip."""
    per_token, weights, ratio, stats = against_proximal(
        logprobs, behaviour_logprobs, proximal_logprobs, advantages, mask, clip_eps, clip_high
    )
    row_weights = row_mean((proximal_logprobs - behaviour_logprobs).detach(), mask).exp()  # [rows, 1]
    keep = ((row_weights >= low) & (row_weights <= high)).expand_as(weights)
    left_out = (mask > 0) & ~keep
    loss = _masked_loss(per_token, row_weights.expand_as(weights), keep, mask, reduce)
    cut = left_out | binding_clip(ratio, advantages, clip_eps, clip_high)
    stats |= weight_stats(weights, left_out, mask) | seq_weight_stats(row_weights, mask)
    return loss, stats | cut_stats(cut, mask, entropy)

