"""`cispo`: clipped importance-sampling weights on the log-probability (MiniMax 2025, "MiniMax-M1", CISPO).

Each token's loss is -sg(clip(r, 1 - clip_eps, 1 + clip_high)) * A * log pi_theta with r = pi_theta / pi_behav:
the clipped ratio is a coefficient without gradient, so unlike PPO-clip no token's gradient is ever cut; the clip
only bounds how much a stale token can weigh (its gradient is clip(r) * A * grad log pi_theta). The defaults are
Tinker's: no lower bound (clip_eps 1: the weight may fall to 0) and an upper bound of 4 (clip_high 3).

Not a learner kind (`registry.KINDS`): its loss is the REINFORCE form, whose value on-policy is -reduce(A log
pi_theta), not -reduce(A) as the kinds promise (its gradient there is the plain policy gradient's). The Tinker
service (`stages.service.losses`) serves it as Tinker's built-in `cispo`.
"""

from __future__ import annotations

import torch

from policies.correction.common import Reduce, Stats, surrogate_stats, token_mean


def cispo(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    clip_eps: float = 1.0, clip_high: float = 3.0, reduce: Reduce = token_mean,
) -> tuple[torch.Tensor, Stats]:
    """reduce(-sg(clip(r)) * A * logprobs, mask) with r = exp(logprobs - behaviour_logprobs) clipped to
    [1 - clip_eps, 1 + clip_high]. Stats: `clip_frac*` (tokens whose ratio lies outside the range: their weight
    was bounded, their gradient kept) and `approx_kl`."""
    ratio = (logprobs - behaviour_logprobs).exp()
    weight = ratio.detach().clamp(1 - clip_eps, 1 + clip_high)
    loss = reduce(-weight * advantages * logprobs, mask)
    return loss, surrogate_stats(logprobs, behaviour_logprobs, ratio, mask, clip_eps, clip_high)
