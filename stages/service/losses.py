"""Tinker's built-in losses, mapped onto the learner's own objectives (`policies.correction`).

Every Tinker loss is a sum over a datum's positions, never a mean (the client normalises through its weights or
advantages), so each one here is the objective's per-token loss reduced by a masked sum. `logp` is the policy's
target logprobs, `logprobs` the sampler's (behaviour policy's), A the advantages:

* `cross_entropy` (inputs `target_tokens`, `weights`): -sum(weights * logp). The learner has no supervised loss;
  this one line is the whole of it.
* `importance_sampling` (`target_tokens`, `logprobs`, `advantages`): -sum(exp(logp - logprobs) * A), the
  learner's `none` objective (PPO-clip against the behaviour policy) with an unbounded clip range.
* `ppo` (same inputs; `loss_fn_config` `clip_low_threshold` 0.8, `clip_high_threshold` 1.2 by default, ratio
  bounds): the learner's `none` objective with clip_eps = 1 - low and clip_high = high - 1.
* `cispo` (same inputs; `clip_low_threshold` 0.0, `clip_high_threshold` 4.0 by default, Tinker's one-sided
  clip): -sum(sg(clip(exp(logp - logprobs), low, high)) * logp * A), `policies.correction.cispo`.
* `dro` (same inputs; `loss_fn_config` `beta`, required: Tinker documents no default):
  -sum(logp * A - beta / 2 * (logp - logprobs)^2). The learner has no such objective; this line is the whole of it.

Every other loss name (`gspo`, `stable_reinforce`, `custom`), input or config key is refused by name
(`check_loss`) before anything runs, as is a config value out of its range.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from policies import correction
from stages.service.refusals import Refused

TINKER_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce", "custom")
_POLICY_GRADIENT = ("target_tokens", "logprobs", "advantages")
INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": _POLICY_GRADIENT,
    "ppo": _POLICY_GRADIENT,
    "cispo": _POLICY_GRADIENT,
    "dro": _POLICY_GRADIENT,
}
REQUIRED = None  # a config key without a default: the client must pass it
CONFIG_DEFAULTS: dict[str, dict[str, float | None]] = {
    "cross_entropy": {}, "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": REQUIRED},
}
SUPPORTED = tuple(INPUTS)


def check_loss(name: str, config: Mapping[str, float | str], input_names: set[str]) -> dict[str, float]:
    """The loss's settings (its config over the defaults); `Refused` naming the loss, a missing or unknown input,
    an unknown or missing config key, or a value out of its range."""
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
    settings = {**CONFIG_DEFAULTS[name], **{k: _number(name, k, v) for k, v in config.items()}}
    missing = sorted(k for k, v in settings.items() if v is REQUIRED)
    if missing:
        raise Refused(f"loss_fn {name!r} needs loss_fn_config {missing} (no default), e.g. {{'beta': 0.05}}")
    _check_ranges(name, settings)
    return settings


def _number(name: str, key: str, value: float | str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise Refused(f"loss_fn_config {key} for {name!r} must be a number, got {value!r}") from None


def _check_ranges(name: str, settings: dict[str, float]) -> None:
    """The clip thresholds must hold ratio 1 (on-policy tokens keep their full weight); beta must not be negative
    (a negative penalty would reward moving away from the sampler)."""
    if name in ("ppo", "cispo") and not 0 <= settings["clip_low_threshold"] <= 1 <= settings["clip_high_threshold"]:
        raise Refused(f"loss_fn_config for {name!r} needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got "
                      f"{settings['clip_low_threshold']} and {settings['clip_high_threshold']}")
    if name == "dro" and not settings["beta"] >= 0:
        raise Refused(f"loss_fn_config beta for 'dro' must be >= 0, got {settings['beta']}")


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The `reduce` of every loss here: a sum over the real positions (Tinker's losses are sums)."""
    return (values * mask).sum()


def loss_of(name: str, settings: dict[str, float], logp: torch.Tensor, inputs: dict[str, torch.Tensor],
            mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss `name` (checked by `check_loss`) of target logprobs `logp` [rows, T] over the real positions
    `mask`, and its stats; `inputs` are the datums' loss inputs padded to [rows, T]."""
    if name == "cross_entropy":
        return masked_sum(-inputs["weights"] * logp, mask), {}
    sampled, advantages = inputs["logprobs"], inputs["advantages"]
    if name == "dro":
        return masked_sum(-(logp * advantages - settings["beta"] / 2 * (logp - sampled) ** 2), mask), {}
    if name == "importance_sampling":
        low, high = math.inf, math.inf
    else:
        low, high = 1 - settings["clip_low_threshold"], settings["clip_high_threshold"] - 1
    if name == "cispo":
        loss, stats = correction.cispo(logp, sampled, advantages, mask, low, high, reduce=masked_sum)
    else:
        loss, stats = correction.none(logp, sampled, advantages, mask, low, clip_high=high, reduce=masked_sum)
    return loss, {k: v for k, v in stats.items() if k in ("clip_frac", "approx_kl")}
