"""The learner's choice of objective: `Correction(kind, settings...)`, and the registry, ONE entry per
objective, mapping its kind to its function and its settings dataclass (both in the objective's own
module). The `[correction]` keys are the settings' field names (baton.sections.correction builds the
section from them); adding an objective is its module plus one line here."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from policies.correction.common import Reduce, Stats, token_mean
from policies.correction.gspo import GSPOSettings, gspo
from policies.correction.m2po import M2POSettings, m2po
from policies.correction.mis import MisSeqSettings, MisTokenSettings, mis_seq, mis_token
from policies.correction.ppo import DecoupledSettings, TisSettings, decoupled, none, tis


@dataclass(frozen=True)
class Objective:
    """One off-policy objective: its loss function and its settings (a frozen dataclass with defaults, whose
    fields are its `[correction]` keys, validated in `__post_init__` and turned into the function's keywords
    by `keywords()`)."""

    loss: Callable[..., tuple[torch.Tensor, Stats]]
    settings: type[Any]


# kind -> its objective; `none` (PPO-clip against the behaviour policy) has no settings and no proximal policy
OBJECTIVES: dict[str, Objective] = {
    "tis": Objective(tis, TisSettings),
    "decoupled": Objective(decoupled, DecoupledSettings),
    "m2po": Objective(m2po, M2POSettings),
    "mis-token": Objective(mis_token, MisTokenSettings),
    "mis-seq": Objective(mis_seq, MisSeqSettings),
    "gspo": Objective(gspo, GSPOSettings),
}
KINDS: tuple[str, ...] = ("none", *OBJECTIVES)
CorrectionKind = str  # one of KINDS

# the settings that only one kind reads: each settings field -> its kind
KIND_OF_SETTING: dict[str, str] = {
    f.name: kind for kind, objective in OBJECTIVES.items() for f in dataclasses.fields(objective.settings)
}


def auto_kind(k: int) -> str:
    """The objective the config's `auto` picks for bound k: `none` up to k = 2, where it learns as well as any
    (docs/results/learning.md), and `m2po` above, the one objective that held in every measured row from
    k = 4 to 32 (PPO-style clipping against a stale behaviour policy cuts exactly the tokens that moved)."""
    if k < 0:
        raise ValueError(f"staleness.k must be >= 0, got {k}")
    return "none" if k <= 2 else "m2po"


@dataclass(frozen=True, init=False)
class Correction:
    """The learner's choice of correction: `Correction("tis", tis_cap=2.0)`, `Correction("m2po")`. Takes the
    settings of every objective by their keys (each validated by its own settings class, whatever the kind)
    and reads them as attributes (`Correction().m2_threshold`); only the kind's own reach its loss."""

    kind: str
    settings: tuple[Any, ...]  # one settings instance per objective, in OBJECTIVES' order

    def __init__(self, kind: str = "none", **settings: Any) -> None:
        if kind not in KINDS:
            raise ValueError(f"correction.kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
        unknown = sorted(set(settings) - KIND_OF_SETTING.keys())
        if unknown:
            raise TypeError(f"Correction got unknown setting(s) {unknown}; known: {sorted(KIND_OF_SETTING)}")
        made = tuple(objective.settings(**{k: v for k, v in settings.items() if KIND_OF_SETTING[k] == name})
                     for name, objective in OBJECTIVES.items())
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "settings", made)

    def __getattr__(self, name: str) -> Any:
        for made in self.__dict__.get("settings", ()):
            if name in made.__dataclass_fields__:
                return getattr(made, name)
        raise AttributeError(name)

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
        objective = OBJECTIVES[self.kind]
        own = self.settings[list(OBJECTIVES).index(self.kind)]
        return objective.loss(logprobs, behaviour_logprobs, proximal_logprobs, advantages, mask,
                              **(shared | own.keywords()))
