"""The learner's choice of objective: `Correction(kind, settings...)`, and `OBJECTIVES`, each kind's loss
function and settings dataclass as `settings.OBJECTIVE_KINDS` registers them, once (the settings, and the
registry of kinds, live in the torch-free `settings` module: baton.sections.correction builds the
`[correction]` section from the settings' fields without loading the objectives)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from policies.correction.common import Reduce, Stats, token_mean
from policies.correction.ppo import none
from policies.correction_settings import KIND_OF_SETTING, KINDS, OBJECTIVE_KINDS, auto_kind  # noqa: F401


@dataclass(frozen=True)
class Objective:
    """One off-policy objective: its loss function and its settings (a frozen dataclass with defaults, whose
    fields are its `[correction]` keys, validated in `__post_init__` and turned into the function's keywords
    by `keywords()`)."""

    loss: Callable[..., tuple[torch.Tensor, Stats]]
    settings: type[Any]


def _function(path: str) -> Callable[..., Any]:
    """The function at "module:name"."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


# kind -> its objective, as `settings.OBJECTIVE_KINDS` registers it (`none` has no settings)
OBJECTIVES: dict[str, Objective] = {
    kind: Objective(_function(loss), settings) for kind, (settings, loss) in OBJECTIVE_KINDS.items()
}
CorrectionKind = str  # one of KINDS


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
