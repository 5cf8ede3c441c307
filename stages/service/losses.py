"""Tinker's built-in losses, mapped onto the learner's own objectives (`policies.correction`).

Every Tinker loss is a sum over a datum's positions, never a mean (the client normalises through its weights or
advantages), so each one here is the objective's per-token loss reduced by a masked sum:

* `cross_entropy` (inputs `target_tokens`, `weights`): -sum(weights * logp). The learner has no supervised loss;
  this one line is the whole of it.
* `importance_sampling` (`target_tokens`, `logprobs`, `advantages`): -sum(exp(logp - sampling) * A), the
  learner's `none` objective (PPO-clip against the behaviour policy) with an unbounded clip range.
* `ppo` (same inputs; `loss_fn_config` `clip_low_threshold` 0.8, `clip_high_threshold` 1.2 by default, ratio
  bounds): the learner's `none` objective with clip_eps = 1 - low and clip_high = high - 1.

Every other loss name, input or config key is refused by name (`check_loss`) before anything runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from policies import correction
from stages.service.refusals import Refused

TINKER_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce", "custom")
INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
}
CONFIG_DEFAULTS = {"cross_entropy": {}, "importance_sampling": {}, "ppo": {"clip_low_threshold": 0.8,
                                                                           "clip_high_threshold": 1.2}}
SUPPORTED = tuple(INPUTS)


def check_loss(name: str, config: Mapping[str, float | str], input_names: set[str]) -> dict[str, float]:
    """The loss's settings (its config over the defaults); `Refused` naming the loss, a missing or unknown input,
    or an unknown config key."""
    if name not in INPUTS:
        known = "a Tinker built-in loss" if name in TINKER_LOSSES else "not a Tinker loss name"
        raise Refused(f"loss_fn {name!r} ({known}) is not supported by baton serve; supported: {', '.join(SUPPORTED)}")
    needed = set(INPUTS[name])
    if input_names != needed:
        missing, extra = sorted(needed - input_names), sorted(input_names - needed)
        raise Refused(f"loss_fn {name!r} takes loss_fn_inputs {sorted(needed)}; missing {missing}, unknown {extra}")
    unknown = sorted(set(config) - set(CONFIG_DEFAULTS[name]))
    if unknown:
        raise Refused(f"loss_fn_config keys {unknown} are not supported for {name!r}; "
                      f"known: {sorted(CONFIG_DEFAULTS[name]) or 'none'}")
    settings = {**CONFIG_DEFAULTS[name], **{k: float(v) for k, v in config.items()}}
    if name == "ppo" and not 0 <= settings["clip_low_threshold"] <= 1 <= settings["clip_high_threshold"]:
        raise Refused("loss_fn_config needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got "
                      f"{settings['clip_low_threshold']} and {settings['clip_high_threshold']}")
    return settings


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The `reduce` of every loss here: a sum over the real positions (Tinker's losses are sums)."""
    return (values * mask).sum()


def loss_of(name: str, settings: dict[str, float], logp: torch.Tensor, inputs: dict[str, torch.Tensor],
            mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss `name` (checked by `check_loss`) of target logprobs `logp` [rows, T] over the real positions
    `mask`, and its stats; `inputs` are the datums' loss inputs padded to [rows, T]."""
    if name == "cross_entropy":
        return masked_sum(-inputs["weights"] * logp, mask), {}
    if name == "importance_sampling":
        low, high = math.inf, math.inf
    else:
        low, high = 1 - settings["clip_low_threshold"], settings["clip_high_threshold"] - 1
    loss, stats = correction.none(logp, inputs["logprobs"], inputs["advantages"], mask, low, clip_high=high,
                                  reduce=masked_sum)
    return loss, {k: v for k, v in stats.items() if k in ("clip_frac", "approx_kl")}
