"""The token-level PPO-clip objectives: `none` (clip against the behaviour policy), `tis` (truncated
importance weights) and `decoupled` (AReaL's decoupled PPO).

* `none`: plain PPO-clip with the ratio pi_theta / pi_behav (the clip's trust region is centred on
  the behaviour policy, however stale). It equals `stages.learner.losses.ppo_clip_loss` exactly.
* `tis` (truncated importance sampling, as slime's `--use-tis` and verl's rollout IS): PPO-clip with
  the ratio pi_theta / pi_prox, each token's loss multiplied by the weight min(pi_prox / pi_behav, cap).
  Truncation bounds the variance a very stale token can add; it keeps every token.
* `decoupled` (AReaL's decoupled PPO): PPO-clip with the ratio pi_theta / pi_prox, each token's loss
  multiplied by the weight pi_prox / pi_behav. With `cap` set, tokens whose weight exceeds it are
  left out of the loss (weight 0; AReaL's `behav_imp_weight_cap`), so they still count in the
  token mean's denominator.
"""

from __future__ import annotations

import torch

from policies.correction.common import (
    Reduce,
    Stats,
    against_proximal,
    binding_clip,
    clipped_surrogate,
    cut_stats,
    importance_weights,
    surrogate_stats,
    token_mean,
    weight_stats,
)


def none(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    proximal_logprobs: torch.Tensor | None = None,
    clip_high: float | None = None,
    reduce: Reduce = token_mean,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """PPO-clip against the behaviour policy; `proximal_logprobs`, if given, only feeds the weight stats.
    `masked_frac`: tokens where the clip against the behaviour policy binds."""
    per_token, ratio = clipped_surrogate(logprobs, behaviour_logprobs, advantages, clip_eps, clip_high)
    loss = reduce(per_token, mask)
    stats = surrogate_stats(logprobs, behaviour_logprobs, ratio, mask, clip_eps, clip_high)
    if proximal_logprobs is not None:
        weights = importance_weights(proximal_logprobs, behaviour_logprobs)
        stats |= weight_stats(weights, torch.zeros_like(mask, dtype=torch.bool), mask)
    return loss, stats | cut_stats(binding_clip(ratio, advantages, clip_eps, clip_high), mask, entropy)


def tis(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float = 0.2, cap: float = 2.0,
    clip_high: float | None = None, reduce: Reduce = token_mean, entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """PPO-clip against the proximal policy, each token weighted by min(pi_prox / pi_behav, cap).
    `masked_frac`: tokens where the clip binds (truncated tokens keep a gradient; `is_capped_frac` counts them)."""
    per_token, weights, ratio, stats = against_proximal(
        logprobs, behaviour_logprobs, proximal_logprobs, advantages, mask, clip_eps, clip_high
    )
    loss = reduce(per_token * weights.clamp(max=cap), mask)
    cut = binding_clip(ratio, advantages, clip_eps, clip_high)
    return loss, stats | weight_stats(weights, weights > cap, mask) | cut_stats(cut, mask, entropy)


def decoupled(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float = 0.2, cap: float | None = None,
    clip_high: float | None = None, reduce: Reduce = token_mean, entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """PPO-clip against the proximal policy, each token weighted by pi_prox / pi_behav; with `cap`,
    tokens whose weight exceeds it get weight 0 (they stay in the denominator). `masked_frac`: tokens
    left out by the cap or held by a binding clip."""
    per_token, weights, ratio, stats = against_proximal(
        logprobs, behaviour_logprobs, proximal_logprobs, advantages, mask, clip_eps, clip_high
    )
    capped = weights > cap if cap is not None else torch.zeros_like(weights, dtype=torch.bool)
    loss = reduce(per_token * torch.where(capped, torch.zeros_like(weights), weights), mask)
    cut = capped | binding_clip(ratio, advantages, clip_eps, clip_high)
    return loss, stats | weight_stats(weights, capped, mask) | cut_stats(cut, mask, entropy)
