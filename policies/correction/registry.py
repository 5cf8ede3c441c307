"""The learner's choice of objective: `Correction(kind, settings...)`, and the registry that maps each kind to
its function and the settings it reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from policies.correction.common import Reduce, Stats, token_mean
from policies.correction.gspo import gspo
from policies.correction.m2po import m2po
from policies.correction.mis import mis_seq, mis_token
from policies.correction.ppo import decoupled, none, tis

CorrectionKind = Literal["none", "tis", "decoupled", "m2po", "mis-token", "mis-seq", "gspo"]
KINDS: tuple[str, ...] = get_args(CorrectionKind)

# kind -> (its function, the settings it reads from a Correction); `gspo` brings its own clip range
OBJECTIVES: dict[str, tuple[Callable[..., tuple[torch.Tensor, Stats]], Callable[[Any], dict[str, Any]]]] = {
    "tis": (tis, lambda c: {"cap": c.tis_cap}),
    "decoupled": (decoupled, lambda c: {"cap": c.decoupled_cap}),
    "m2po": (m2po, lambda c: {"threshold": c.m2_threshold, "positive": c.m2_positive}),
    "mis-token": (mis_token, lambda c: {"low": c.mis_token_low, "high": c.mis_token_high}),
    "mis-seq": (mis_seq, lambda c: {"low": c.mis_seq_low, "high": c.mis_seq_high}),
    "gspo": (gspo, lambda c: {"clip_eps": c.gspo_clip_low, "clip_high": c.gspo_clip_high}),
}

def auto_kind(k: int) -> str:
    """The objective the config's `auto` picks for bound k: `none` up to k = 2, where it learns as well as any
    (docs/results/learning.md), and `m2po` above, the one objective that held in every measured row from
    k = 4 to 32 (PPO-style clipping against a stale behaviour policy cuts exactly the tokens that moved)."""
    if k < 0:
        raise ValueError(f"staleness.k must be >= 0, got {k}")
    return "none" if k <= 2 else "m2po"


# the settings that only one kind reads
KIND_OF_SETTING: dict[str, str] = {
    "tis_cap": "tis", "decoupled_cap": "decoupled", "m2_threshold": "m2po", "m2_positive": "m2po",
    "mis_token_low": "mis-token", "mis_token_high": "mis-token", "mis_seq_low": "mis-seq", "mis_seq_high": "mis-seq",
    "gspo_clip_low": "gspo", "gspo_clip_high": "gspo",
}


def _check_bounds(kind: str, low: float, high: float, example: str) -> None:
    key = kind.replace("-", "_")
    if not 0 <= low <= 1 <= high or low == high:
        raise ValueError(
            f"correction.{key}_low and correction.{key}_high must satisfy 0 <= low <= 1 <= high, low < high "
            f"(an on-policy weight, 1, must be kept), got {low} and {high}; e.g. {example}"
        )


@dataclass(frozen=True)
class Correction:
    """The learner's choice of correction: `Correction("tis", tis_cap=2.0)`, `Correction("m2po")`."""

    kind: CorrectionKind = "none"
    tis_cap: float = 2.0  # tis: weights above it are truncated to it
    decoupled_cap: float | None = None  # decoupled: tokens whose weight exceeds it are left out; None: keep all
    m2_threshold: float = 0.2  # m2po: most mean squared log-weight of the kept tokens (the paper: 0.04)
    m2_positive: Literal["weighted", "on_policy"] = "on_policy"  # m2po: good tokens at weight 1; "weighted": paper
    mis_token_low: float = 0.5  # mis-token: tokens whose weight lies outside [low, high] are left out
    mis_token_high: float = 2.0
    mis_seq_low: float = 0.9  # mis-seq: rows whose geometric-mean weight lies outside [low, high] are left out
    mis_seq_high: float = 1.1
    gspo_clip_low: float = 3e-4  # gspo: the sequence ratio's clip range [1 - low, 1 + high]
    gspo_clip_high: float = 4e-4

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"correction.kind must be one of {', '.join(map(repr, KINDS))}, got {self.kind!r}")
        if not self.tis_cap >= 1:
            raise ValueError(
                f"correction.tis_cap must be >= 1 (a cap below 1 would shrink on-policy tokens), got {self.tis_cap}"
            )
        if self.decoupled_cap is not None and not self.decoupled_cap >= 1:
            raise ValueError(f"correction.decoupled_cap must be >= 1 (or unset), got {self.decoupled_cap}")
        if not self.m2_threshold > 0:
            raise ValueError(
                f"correction.m2_threshold must be > 0 (the kept tokens' mean squared log-weight; 0 would leave out "
                f"every stale token), got {self.m2_threshold}; the M2PO paper uses 0.04"
            )
        if self.m2_positive not in ("weighted", "on_policy"):
            raise ValueError(
                f"correction.m2_positive must be 'weighted' or 'on_policy' (positive tokens at weight 1), "
                f"got {self.m2_positive!r}"
            )
        _check_bounds("mis-token", self.mis_token_low, self.mis_token_high, "0.5 and 2.0")
        _check_bounds("mis-seq", self.mis_seq_low, self.mis_seq_high, "0.9 and 1.1")
        if not (0 < self.gspo_clip_low < 1 and self.gspo_clip_high > 0):
            raise ValueError(
                f"correction.gspo_clip_low must lie in (0, 1) and correction.gspo_clip_high be > 0, got "
                f"{self.gspo_clip_low} and {self.gspo_clip_high}; the GSPO paper uses 3e-4 and 4e-4"
            )

    @property
    def needs_proximal(self) -> bool:
        """Whether the loss reads the learner's logprobs at the start of the step."""
        return self.kind != "none"

    def loss(
        self,
        logprobs: torch.Tensor,
        behaviour_logprobs: torch.Tensor,
        proximal_logprobs: torch.Tensor | None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        clip_eps: float = 0.2,
        clip_high: float | None = None,
        reduce: Reduce = token_mean,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Stats]:
        """The loss of this correction, clip range [1 - clip_eps, 1 + clip_high] (`gspo`: its own), aggregated
        by `reduce`. `entropy` (per token, shape of `logprobs`) adds the cut tokens by entropy bucket to the stats."""
        shared = {"clip_eps": clip_eps, "clip_high": clip_high, "reduce": reduce, "entropy": entropy}
        if self.kind == "none":
            return none(logprobs, behaviour_logprobs, advantages, mask, proximal_logprobs=proximal_logprobs, **shared)
        if proximal_logprobs is None:
            raise ValueError(
                f"correction {self.kind!r} needs the proximal logprobs (the learner's, at the step's start)"
            )
        objective, settings = OBJECTIVES[self.kind]
        return objective(logprobs, behaviour_logprobs, proximal_logprobs, advantages, mask, **(shared | settings(self)))
