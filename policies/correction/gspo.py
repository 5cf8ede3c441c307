"""`gspo`: sequence-level ratios (Zheng et al. 2025, "Group Sequence Policy Optimization").

A row's ratio is the geometric mean of its tokens' ratios, s = exp(mean of log pi_theta / pi_prox over its
masked tokens), and the clip acts on s with a range of its own scale, [1 - clip_eps, 1 + clip_high] (the
paper's 3e-4 / 4e-4: a per-token average moves far less than single tokens do). Every token of a row
carries the row's loss -min(s A, clip(s) A), so a row is clipped, and cut, whole; under the token mean each
token's gradient is then -s A / N, as in the token-level policy gradient.

Staleness is corrected at the sequence level too: each row is weighted by the geometric mean of its tokens'
pi_prox / pi_behav (no gradient, no cap; the geometric mean does not grow with length). The ratio is taken
against the step's proximal policy, so at the first epoch s = 1 and the clip cannot bind; later PPO epochs
stay within the clip range of the step's own start. GRPO's advantages are per row, which makes this GSPO's
sequence objective; per-token advantages broadcast against the row's ratio.
"""

from __future__ import annotations

import torch

from policies.correction.common import (
    Reduce,
    Stats,
    binding_clip,
    cut_stats,
    importance_weights,
    ratio_surrogate,
    row_mean,
    seq_weight_stats,
    surrogate_stats,
    token_mean,
    weight_stats,
)


def gspo(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float = 3e-4, clip_high: float | None = 4e-4,
    reduce: Reduce = token_mean, entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """The sequence-ratio loss, each row weighted by its geometric-mean pi_prox / pi_behav. `clip_frac*`
    count the tokens of rows whose ratio lies outside the range; `is_weight_*` are the tokens' own weights,
    `seq_weight_*` the rows'; `masked_frac`: tokens of rows held by a binding clip."""
    proximal = proximal_logprobs.detach()
    seq_ratio = row_mean(logprobs - proximal, mask).exp().expand(mask.shape)  # gradient through logprobs
    row_weights = row_mean(proximal - behaviour_logprobs.detach(), mask).exp()  # [rows, 1]
    per_token = (ratio_surrogate(seq_ratio, advantages, clip_eps, clip_high) * row_weights).expand(mask.shape)
    loss = reduce(per_token, mask)
    stats = surrogate_stats(logprobs, proximal, seq_ratio, mask, clip_eps, clip_high)
    no_cap = torch.zeros_like(mask, dtype=torch.bool)
    stats |= weight_stats(importance_weights(proximal, behaviour_logprobs), no_cap, mask)
    stats |= seq_weight_stats(row_weights, mask)
    return loss, stats | cut_stats(binding_clip(seq_ratio, advantages, clip_eps, clip_high), mask, entropy)
