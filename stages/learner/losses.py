"""GRPO pieces, each a pure function of tensors: advantages, the PPO-clip surrogate on behaviour logprobs,
loss aggregation, the entropy and KL terms, diagnostics, and the learning-rate schedule.

All per-token tensors are [rows, T] with a 0/1 `mask` marking the trained (model) tokens; a multi-turn
row has several masked spans, and every function here only ever reads tokens through the mask.

Loss aggregation (`aggregate`, verl's `loss_agg_mode`):
* `token-mean` (DAPO): sum over all masked tokens of the batch / their count: every token weighs the
  same, so a long response is not down-weighted;
* `seq-mean-token-mean` (the original GRPO): each row's token mean, then the mean over rows that have
  any masked token;
* `seq-mean-token-sum-norm` (Dr. GRPO): each row's token sum divided by one constant `max_tokens`
  (the same for every row, so no length normalisation), then the mean over rows.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

from policies import correction
from policies.correction_settings import INITIAL_ENTROPY_CAP, auto_entropy_cap  # noqa: F401 (named here too)
from policies.staleness import staleness_lr_factor  # noqa: F401 (the learner's lr, named here too)

LossAggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)
LrDecay = Literal["constant", "linear", "cosine"]
LR_DECAYS: tuple[str, ...] = get_args(LrDecay)
EntropyScope = Literal["all", "zero-variance"]
ENTROPY_SCOPES: tuple[str, ...] = get_args(EntropyScope)
DistillMode = Literal["advantage", "loss"]
DISTILL_MODES: tuple[str, ...] = get_args(DistillMode)


def group_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-4, scale_by_std: bool = True
) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps), per row; without `scale_by_std` (Dr. GRPO)
    just r - mean of its group. A group of equal rewards gives 0 either way."""
    groups = int(group_index.max()) + 1
    count = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, torch.ones_like(rewards))
    mean = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, rewards) / count
    centred = rewards - mean[group_index]
    if not scale_by_std:
        return centred
    var = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, centred**2) / (count - 1).clamp(min=1)
    return centred / (var.sqrt()[group_index] + eps)


def distill_advantages(
    advantages: torch.Tensor, behaviour: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, coef: float,
    mode: DistillMode = "advantage", group_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """On-policy distillation's per-token advantages [rows, T]: the teacher's term `-coef * (behaviour -
    teacher)` on every model token (0 elsewhere) added to GRPO's per-row `advantages` ("advantage"), or
    alone ("loss": pure distillation, the rewards steer nothing). The term is the negative single-sample
    estimate of the reverse KL(student || teacher) at that token, so the policy gradient of the loss on it
    lowers that KL; it is built from logged logprobs only (no gradient flows through it: stop-gradient).

    The student's logprob is the behaviour one, the logprob the engine sampled the token with: the
    tokens were drawn from that policy, so `behaviour - teacher` is the estimate of the KL of the
    policy that produced them; it is fixed for the step (every PPO epoch, micro-batch and rank sees the
    same advantage, as with rewards), costs no extra forward, and the loss's off-policy correction
    already weighs the learner's current policy against it.

    With `group_index` (rows -> group) the term is centred per group (`leave_one_out_centred`): each row's
    baseline comes from the other, independently sampled rows only, so the gradient's expectation is
    unchanged and its variance falls (the term is large and mostly negative for a far-off student)."""
    if mode not in DISTILL_MODES:
        raise ValueError(f"distill mode must be one of {', '.join(DISTILL_MODES)}, got {mode!r}")
    term = -coef * (behaviour - teacher) * mask
    if group_index is not None:
        term = leave_one_out_centred(term, mask, group_index)
    return term if mode == "loss" else advantages + term


def leave_one_out_centred(term: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """`term` minus, at each position, the mean of the other rows of its group that have a model token there
    (unchanged where no other row has one); 0 off the `mask`."""
    groups = int(group_index.max()) + 1
    shape = (groups, term.shape[1])
    sums = torch.zeros(shape, dtype=term.dtype).index_add_(0, group_index, term * mask)
    counts = torch.zeros(shape, dtype=term.dtype).index_add_(0, group_index, mask)
    others = counts[group_index] - mask
    baseline = (sums[group_index] - term * mask) / others.clamp(min=1)
    return (term - baseline * (others > 0)) * mask


def zero_variance_groups(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Per group, whether its rewards are all equal, to 1e-6 (such a group gives GRPO no gradient)."""
    spread = group_advantages(rewards, group_index, scale_by_std=False).abs()
    groups = int(group_index.max()) + 1
    per_group = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, spread)
    return per_group < 1e-6  # float sums of equal rewards may not cancel exactly


def zero_variance_fraction(rewards: torch.Tensor, group_index: torch.Tensor) -> float:
    """Fraction of groups whose rewards are all equal (`zero_variance_groups`)."""
    return float(zero_variance_groups(rewards, group_index).float().mean())


def entropy_bonus_rows(rewards: torch.Tensor, group_index: torch.Tensor, scope: EntropyScope = "all") -> torch.Tensor:
    """Per row, 1.0 where the entropy bonus counts, else 0.0. `all`: every row. `zero-variance`: only the
    rows of groups whose rewards are all equal: a group without signal is where the policy has stopped
    exploring (or never found a reward), and there the bonus is the only gradient. Groups with signal
    are left to the policy gradient. Within a group without signal the bonus raises every token's
    entropy, and a learned position that strays gives its group signal again, which pulls it back."""
    if scope == "all":
        return torch.ones_like(rewards)
    if scope == "zero-variance":
        return zero_variance_groups(rewards, group_index)[group_index].to(rewards.dtype)
    raise ValueError(f"entropy scope must be one of {', '.join(ENTROPY_SCOPES)}, got {scope!r}")


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: LossAggregation = "token-mean", max_tokens: int | None = None,
    denominator: float | None = None,
) -> torch.Tensor:
    """One scalar from a per-token loss, by `mode` (see the module docstring). `max_tokens` is Dr. GRPO's
    constant divisor; unset, it is the batch's width T. `denominator` replaces the count the mean divides
    by (masked tokens for token-mean, rows with a masked token otherwise): a micro-batch or a rank's part
    of a step divides by the whole step's count, so the parts' losses sum to the step's."""
    masked = per_token * mask
    if mode == "token-mean":
        return masked.sum() / (mask.sum().clamp(min=1) if denominator is None else max(denominator, 1.0))
    rows = (mask.sum(-1) > 0).float()
    if mode == "seq-mean-token-mean":
        per_row = masked.sum(-1) / mask.sum(-1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        per_row = masked.sum(-1) / float(max_tokens or per_token.shape[-1])
    else:
        raise ValueError(f"loss aggregation must be one of {', '.join(AGGREGATIONS)}, got {mode!r}")
    return (per_row * rows).sum() / (rows.sum().clamp(min=1) if denominator is None else max(denominator, 1.0))


def ppo_clip_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean PPO-clip surrogate against the behaviour policy (the `none` correction), clip range
    [1 - clip_eps, 1 + clip_high]. All tensors [rows, T]; `advantages` broadcast per row."""
    return correction.none(logprobs, behaviour_logprobs, advantages, mask, clip_eps, clip_high=clip_high)


def token_entropy(logp_all: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's next-token distribution, from log-probabilities [rows, T, vocab]."""
    return -(logp_all.exp() * logp_all).sum(-1)


def entropy_bonus_term(entropy: torch.Tensor, cap: float | None = None) -> torch.Tensor:
    """Per token, the entropy the bonus rewards: the token's entropy, or with `cap` at most `cap`, so a
    token whose entropy is above it gets no gradient from the bonus. Uncapped, a bonus on a batch whose
    rewards are flat is the loss's only gradient, and Adam, which scales steps by the gradient's own size,
    turns it into full-size steps towards uniform (seen at k = 8 on the math example with `m2po`: entropy
    1.2 to 5.8 nats a token, the vocabulary's log, within 60 versions)."""
    return entropy if cap is None else entropy.clamp(max=cap)


def kl_k3(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) on tokens sampled from pi (Schulman's; verl's
    `low_var_kl`): exp(ref - logp) - (ref - logp) - 1, which is >= 0 and 0 exactly where they agree."""
    delta = reference_logprobs - logprobs
    return delta.exp() - delta - 1


def lr_factor(step: int, warmup_steps: int, total_steps: int, decay: LrDecay = "constant",
              min_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rate at optimizer step `step`: linear warmup from 1/(warmup+1)
    to 1 over `warmup_steps`, then constant, or a linear or cosine decay to `min_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if decay == "linear":
        shape = 1.0 - progress
    elif decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr decay must be one of {', '.join(LR_DECAYS)}, got {decay!r}")
    return min_ratio + (1.0 - min_ratio) * shape


def lr_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, decay: LrDecay = "constant",
    min_ratio: float = 0.0, start: int = 0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `lr_factor`, its first step being optimizer step `start` (a resumed run's version):
    the rate is a function of the step alone, so a resumed run needs no scheduler state."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(start + step, warmup_steps, total_steps, decay, min_ratio)
    )
