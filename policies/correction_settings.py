"""Each off-policy objective's settings (policies.correction), and the registry of the objectives'
kinds, ONE entry per kind (`OBJECTIVE_KINDS`: its settings and its loss function's path). A settings
class is a frozen dataclass whose fields are the objective's `[correction]` keys, with defaults,
descriptions and their own checks; `auto_kind` and `auto_entropy_cap` are what the config's `auto`s pick.

This module imports no torch: validating a config (baton.sections.correction builds the section from
these fields) never loads the objectives; `policies.correction.registry.OBJECTIVES` resolves each loss
function when the learner needs it. Adding an objective is its module (the loss), its settings here and
one line in `OBJECTIVE_KINDS`.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal


def setting(default: Any, doc: str, arg: str, why: str = "", **bounds: float) -> Any:
    """A field of an objective's settings: its name is the `[correction]` key, `doc` its description, `arg`
    the keyword of the objective's function it feeds, `bounds` (ge, gt, le, lt) its range (`why`: said
    when it is out of it); baton.sections.correction builds the config section from these fields."""
    return field(default=default, metadata={"doc": doc, "arg": arg, "why": why, "bounds": bounds})


BOUND_TEXT = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b), "le": ("<=", lambda v, b: v <= b),
              "lt": ("<", lambda v, b: v < b)}


def range_text(bounds: dict[str, float]) -> str:
    """`be >= 1`, or `lie in (0, 1)` for a range bounded on both sides."""
    low = next(((b, v) for b, v in bounds.items() if b in ("ge", "gt")), None)
    high = next(((b, v) for b, v in bounds.items() if b in ("le", "lt")), None)
    if low and high:
        return f"lie in {'[(' [low[0] == 'gt']}{low[1]}, {high[1]}{'])' [high[0] == 'lt']}"
    return " and ".join(f"be {BOUND_TEXT[b][0]} {limit}" for b, limit in bounds.items())


@dataclass(frozen=True)
class Settings:
    """Base of an objective's settings (a frozen dataclass of `setting` fields): `check()` (the objective's
    own checks across fields) and then every field's range and choices are checked when one is made, each
    error naming its key; `keywords()` are the objective function's keywords."""

    def check(self) -> None:
        """Checks across fields, run first (none by default)."""

    def __post_init__(self) -> None:
        self.check()
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value, key = getattr(self, f.name), f"correction.{f.name}"
            choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is Literal else ()
            if choices and value not in choices:
                raise ValueError(f"{key} must be {' or '.join(map(repr, choices))}, got {value!r}")
            bounds = f.metadata["bounds"]
            if value is not None and not all(BOUND_TEXT[b][1](value, limit) for b, limit in bounds.items()):
                why = f"; {f.metadata['why']}" if f.metadata["why"] else ""
                raise ValueError(f"{key} must {range_text(bounds)} (got {value}){why}")

    def keywords(self) -> dict[str, Any]:
        return {f.metadata["arg"]: getattr(self, f.name) for f in dataclasses.fields(self)}


def check_bounds(kind: str, low: float, high: float, example: str) -> None:
    """The [low, high] weight bounds of a `mis-*` objective keep an on-policy weight (1), naming the keys."""
    key = kind.replace("-", "_")
    if not 0 <= low <= 1 <= high:
        raise ValueError(
            f"correction.{key}_low and correction.{key}_high must satisfy 0 <= low <= 1 <= high, low < high "
            f"(an on-policy weight, 1, must be kept), got {low} and {high}; e.g. {example}"
        )
    if low == high:
        raise ValueError(f"correction.{key}_low = {low} equals correction.{key}_high: only weights of exactly 1 "
                         f"would be kept; widen them, e.g. {example}")


@dataclass(frozen=True)
class TisSettings(Settings):
    """What `tis` reads from [correction]."""

    tis_cap: float = setting(2.0, "tis: importance weights above this are truncated to it", "cap", ge=1,
                             why="a cap below 1 would shrink on-policy tokens")


@dataclass(frozen=True)
class DecoupledSettings(Settings):
    """What `decoupled` reads from [correction]."""

    decoupled_cap: float | None = setting(
        None, "decoupled: tokens whose importance weight exceeds this are left out; unset: none are", "cap", ge=1)


@dataclass(frozen=True)
class M2POSettings(Settings):
    """What `m2po` reads from [correction]."""

    m2_threshold: float = setting(0.2, (
        "m2po: the most mean squared log(pi_prox / pi_behav) of the kept tokens (the batch's second moment); the "
        "largest are left out until it holds (the M2PO paper's 0.04, chosen on long reasoning traces, leaves out "
        "the tokens the learner is moving on short answers)"), "threshold", gt=0,
        why="0 would leave out every stale token; the M2PO paper uses 0.04")
    m2_positive: Literal["weighted", "on_policy"] = setting("on_policy", (
        "m2po: on_policy (the default): a positive-advantage token trains at weight 1 and is never left out (the "
        "bound acts on the others), so a good sample the learner has since moved away from is not shrunk away; "
        "weighted (the M2PO paper's): it is weighted and bounded like any"), "positive")


@dataclass(frozen=True)
class MisTokenSettings(Settings):
    """What `mis-token` reads from [correction]."""

    mis_token_low: float = setting(0.5, "mis-token: tokens whose weight is below this are left out", "low", ge=0,
                                   le=1)
    mis_token_high: float = setting(2.0, "mis-token: tokens whose weight is above this are left out", "high", ge=1)

    def check(self) -> None:
        check_bounds("mis-token", self.mis_token_low, self.mis_token_high, "mis_token_low = 0.5, mis_token_high = 2.0")


@dataclass(frozen=True)
class MisSeqSettings(Settings):
    """What `mis-seq` reads from [correction]."""

    mis_seq_low: float = setting(0.9, "mis-seq: rows whose geometric-mean weight (per token, so tighter than a "
                                      "token's bounds) is below this are left out", "low", ge=0, le=1)
    mis_seq_high: float = setting(1.1, "mis-seq: rows whose geometric-mean weight is above this are left out",
                                  "high", ge=1)

    def check(self) -> None:
        check_bounds("mis-seq", self.mis_seq_low, self.mis_seq_high, "mis_seq_low = 0.9, mis_seq_high = 1.1")


@dataclass(frozen=True)
class GSPOSettings(Settings):
    """What `gspo` reads from [correction]: its own clip range, replacing the learner's."""

    gspo_clip_low: float = setting(3e-4, "gspo: the sequence ratio is clipped at 1 - this (replaces learner.clip_eps; "
                                         "3e-4 in the GSPO paper)", "clip_eps", gt=0, lt=1)
    gspo_clip_high: float = setting(4e-4, "gspo: the sequence ratio is clipped at 1 + this (replaces "
                                          "learner.clip_eps_high; 4e-4 in the GSPO paper)", "clip_high", gt=0)


# kind -> (its settings, its loss function "module:function"); `none` (PPO-clip against the behaviour policy)
# has no settings and no proximal policy
OBJECTIVE_KINDS: dict[str, tuple[type[Settings], str]] = {
    "tis": (TisSettings, "policies.correction.ppo:tis"),
    "decoupled": (DecoupledSettings, "policies.correction.ppo:decoupled"),
    "m2po": (M2POSettings, "policies.correction.m2po:m2po"),
    "mis-token": (MisTokenSettings, "policies.correction.mis:mis_token"),
    "mis-seq": (MisSeqSettings, "policies.correction.mis:mis_seq"),
    "gspo": (GSPOSettings, "policies.correction.gspo:gspo"),
}
KINDS: tuple[str, ...] = ("none", *OBJECTIVE_KINDS)

# the settings that only one kind reads: each settings field -> its kind
KIND_OF_SETTING: dict[str, str] = {
    f.name: kind for kind, (settings, _) in OBJECTIVE_KINDS.items() for f in dataclasses.fields(settings)
}


def auto_kind(k: int) -> str:
    """The objective the config's `auto` picks for bound k: `none` up to k = 2, where it learns as well as any
    (docs/results/learning.md), and `m2po` above, the one objective that held in every measured row from
    k = 4 to 32 (PPO-style clipping against a stale behaviour policy cuts exactly the tokens that moved)."""
    if k < 0:
        raise ValueError(f"staleness.k must be >= 0, got {k}")
    return "none" if k <= 2 else "m2po"


INITIAL_ENTROPY_CAP = "initial"  # the cap is the policy's own mean token entropy on its first step


def auto_entropy_cap(k: int) -> str | None:
    """The entropy cap the config's `auto` picks for staleness bound k: none where `auto_kind` picks no
    off-policy objective (k <= 2); above, where the objective leaves tokens out and the bonus can become most
    of the gradient, "initial": the policy's mean token entropy on its first step. The bonus can then hold a
    token as uncertain as the policy started, never push it above that, so it cannot drive a trained
    checkpoint (about 1.2 nats a token on the math example) towards uniform (log |vocab|), and it leaves a
    random-init model (near uniform already) as uncapped, which a fixed cap of 1.0 slowed by up to 1.5 times
    the versions (docs/results/learning.md)."""
    return None if auto_kind(k) == "none" else INITIAL_ENTROPY_CAP
