"""`m2po`: a second-moment trust region on the importance weights (Zheng et al. 2025, "Prosperity before
Collapse"; AReaL's `m2_threshold`), instead of clipping stale tokens.

Over all masked tokens of the batch, M2 = mean of (log pi_prox / pi_behav)^2. Tokens are left out largest
squared log-ratio first, as few as needed for the kept tokens' M2 to be at most `threshold` (0.04 in the
paper); every other token keeps its full importance weight, however far from 1. Clipping the ratio against
a stale behaviour policy instead cuts every token whose probability moved, and under staleness those are
the high-entropy tokens that carry the learning.

The kept tokens' loss is the decoupled one: PPO-clip of pi_theta / pi_prox, weighted by pi_prox / pi_behav.
At the step's first epoch pi_theta equals pi_prox, the clip cannot bind, and the loss is M2PO's masked,
unclipped -(pi_theta / pi_behav) A; later PPO epochs stay within the clip range of the step's own start.
A left-out token gets weight 0 and stays in the aggregation's denominator.

`positive = "on_policy"` trains every positive-advantage token at weight 1 and never leaves it out; the bound
then acts on the other tokens only. Under large staleness a good sample the learner has since moved away from
(a rare right answer at a position the policy is locking wrongly) has a weight far below 1 and a large
squared log-weight, so the importance weight shrinks, and the bound removes, exactly the discovery that would
unlock it; a good token the learner already made likely has a weight far above 1, and its full weight only
sharpens what is learned. Negative-advantage tokens keep their importance weights.
"""

from __future__ import annotations

import torch

from policies.correction.common import (
    Reduce,
    Stats,
    against_proximal,
    binding_clip,
    cut_stats,
    token_mean,
    weight_stats,
)


def second_moment_keep(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """Bool, shape of `mask`: the masked tokens kept by the second-moment bound. Invariants: the kept tokens'
    mean of log_ratio^2 is <= `threshold` (vacuously when none is kept: even the smallest alone exceeds
    it); every left-out token's square is >= every kept one's; and the kept set is the largest such, so
    adding back the smallest left-out token would break the bound."""
    with torch.no_grad():
        on = mask > 0
        squares = log_ratio.detach().double()[on] ** 2
        order = torch.argsort(squares, descending=True, stable=True)
        ranked = squares[order]
        counts = torch.arange(ranked.numel(), 0, -1, dtype=ranked.dtype, device=ranked.device)
        suffix_means = ranked.flip(0).cumsum(0).flip(0) / counts  # mean of ranked[i:], i.e. after cutting i
        within = (suffix_means <= threshold).nonzero()
        cut = int(within[0]) if within.numel() else ranked.numel()
        kept = torch.ones_like(squares, dtype=torch.bool)
        kept[order[:cut]] = False
        keep = torch.zeros_like(on)
        keep[on] = kept
        return keep


def m2po(
    logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float = 0.2, threshold: float = 0.04,
    clip_high: float | None = None, reduce: Reduce = token_mean, entropy: torch.Tensor | None = None,
    positive: str = "weighted",
) -> tuple[torch.Tensor, Stats]:
    """The decoupled loss on the tokens `second_moment_keep` keeps (`positive = "on_policy"`: of the others,
    and on every positive-advantage token at weight 1). Stats beyond the shared ones: `m2` (the
    batch's M2 before masking), `m2_kept` (after, a positive token counting at log-weight 0 when it trains at
    weight 1), `is_weight_*` (the tokens' own weights, whatever they train at), `is_capped_frac` (tokens the
    bound left out), and `masked_frac` (those, plus tokens held by a binding clip)."""
    per_token, weights, ratio, stats = against_proximal(
        logprobs, behaviour_logprobs, proximal_logprobs, advantages, mask, clip_eps, clip_high
    )
    log_ratio = (proximal_logprobs - behaviour_logprobs).detach()
    good = (advantages > 0).expand_as(mask) & (mask > 0) if positive == "on_policy" else torch.zeros_like(mask > 0)
    keep = second_moment_keep(log_ratio, mask * ~good, threshold) | good
    left_out = (mask > 0) & ~keep
    trained_at = torch.where(good, torch.ones_like(weights), torch.where(keep, weights, torch.zeros_like(weights)))
    loss = reduce(per_token * trained_at, mask)
    with torch.no_grad():
        squares = torch.where(mask > 0, log_ratio, torch.zeros_like(log_ratio)) ** 2
        trained = torch.where(good, torch.zeros_like(squares), squares)  # what each kept token is weighted at
        moments = {"m2": float(token_mean(squares, mask)), "m2_kept": float(token_mean(trained, keep.float()))}
    cut = left_out | binding_clip(ratio, advantages, clip_eps, clip_high)
    return loss, stats | weight_stats(weights, left_out, mask) | moments | cut_stats(cut, mask, entropy)
