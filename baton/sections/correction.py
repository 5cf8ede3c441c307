"""[correction]: off-policy correction in the learner's loss (policies.correction). The section's keys are
not declared here: they are the fields of each objective's settings dataclass (in the torch-free
`policies.correction_settings`, registered once there in `OBJECTIVE_KINDS`), with their defaults and
descriptions, and each objective's own checks validate them, naming the key."""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, create_model, model_validator

from baton.sections.base import Section
from policies.correction_settings import KIND_OF_SETTING, KINDS, OBJECTIVE_KINDS, auto_kind

if TYPE_CHECKING:
    from policies.correction import Correction

KIND_DESCRIPTION = (
    "auto (the default): none up to staleness.k = 2, m2po above (resolved when the config loads; "
    "docs/results/learning.md says why); none: PPO-clip on behaviour logprobs; the others clip against "
    "the learner's logprobs at the step's start and weight tokens by pi_prox / pi_behav: tis truncates "
    "the weight, decoupled keeps it (left out above decoupled_cap), m2po leaves out the tokens whose "
    "squared log-weight lifts the batch's second moment over m2_threshold, mis-token / mis-seq leave out "
    "tokens / rows whose weight lies outside their bounds, gspo uses a sequence-level ratio and clip"
)


class CorrectionBase(Section):
    """The [correction] section's `kind` and checks; `CorrectionSpec` adds every objective's settings."""

    kind: Literal[("auto", *KINDS)] = Field("auto", description=KIND_DESCRIPTION)  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _settings_valid(self) -> CorrectionBase:
        """Each objective's settings pass its own checks; a setting given for another kind is refused."""
        for settings, _ in OBJECTIVE_KINDS.values():
            settings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(settings)})
        if self.kind != "auto":  # auto: checked once RunConfig has resolved it from staleness.k
            self.check_settings(f"correction.kind = {self.kind!r}")
        return self

    def check_settings(self, kind_said: str) -> None:
        """Raise when a setting of another kind than `self.kind` is set; `kind_said` names the kind in the error."""
        for key, kind in KIND_OF_SETTING.items():
            value = getattr(self, key)
            if self.kind != kind and value != SETTING_DEFAULTS[key]:
                raise ValueError(
                    f"correction.{key} = {value} applies only to correction.kind = {kind!r}, but {kind_said}; "
                    f"remove correction.{key} or set correction.kind = {kind!r}"
                )

    def resolve_auto(self, k: int) -> None:
        """`auto` becomes the kind `policies.correction.auto_kind` picks for bound k; its settings are checked."""
        if self.kind == "auto":
            self.kind = auto_kind(k)
            self.check_settings(f"correction.kind = 'auto' is {self.kind!r} at staleness.k = {k}")

    def make(self) -> Correction:
        from policies.correction import Correction

        return Correction(**self.model_dump())


def setting_fields() -> dict[str, Any]:
    """Every objective's settings as pydantic fields: key -> (type, Field(default, description))."""
    fields: dict[str, Any] = {}
    for settings, _ in OBJECTIVE_KINDS.values():
        hints = typing.get_type_hints(settings)
        for f in dataclasses.fields(settings):
            fields[f.name] = (hints[f.name], Field(f.default, description=f.metadata["doc"],
                                                    **f.metadata["bounds"]))
    return fields


SETTING_DEFAULTS = {key: default.default for key, (_, default) in setting_fields().items()}
CorrectionSpec = create_model("CorrectionSpec", __base__=CorrectionBase, __module__=__name__, **setting_fields())
CorrectionSpec.__doc__ = (
    "Off-policy correction in the learner's loss (policies.correction): which objective, and its settings.")
