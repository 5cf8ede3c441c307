"""GRPO pieces: group-normalised advantages and the PPO-clip surrogate on behaviour logprobs."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps), per row. A group of equal rewards gives 0."""
    groups = int(group_index.max()) + 1
    count = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, torch.ones_like(rewards))
    mean = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, rewards) / count
    centred = rewards - mean[group_index]
    var = torch.zeros(groups, dtype=rewards.dtype).index_add_(0, group_index, centred**2) / (count - 1).clamp(min=1)
    return centred / (var.sqrt()[group_index] + eps)


def ppo_clip_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean PPO-clip surrogate. All tensors [rows, T]; `advantages` broadcast per row."""
    ratio = (logprobs - behaviour_logprobs).exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    tokens = mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / tokens
    with torch.no_grad():
        clip_frac = (((ratio - 1).abs() > clip_eps).float() * mask).sum() / tokens
        approx_kl = ((behaviour_logprobs - logprobs) * mask).sum() / tokens
    return loss, {"clip_frac": float(clip_frac), "approx_kl": float(approx_kl)}
