"""What every config section shares: `Section` (unknown keys refused), `PluginSpec` (a `"pkg.mod:Class"`
kind), `kinds(...)` (the discriminated union on `kind`), `declared_defaults` (a part's defaults, declared
here and checked against the part), `default_of` (a default read from a light part's own class) and
`BuildContext`, the little a section's `make(ctx)` may read of the rest of the run.

Validation is light: a config is checked, and its errors reported, without importing torch, transformers,
ray, sglang or a stage's implementation. So a section imports no heavy `stages` or `buffers` module at its
top: it declares the defaults of the part it mirrors (`GRPO_LEARNER =
declared_defaults("stages.learner:GRPOLearner")`, then `GRPO_LEARNER("lr", 4e-4)`) and the constants it
copies (`same_as`), and imports the part inside `make` and in the checks that need it;
tests/baton/test_light_validation.py asserts that every declared value is the part's own, so the two
cannot drift, and that checking a config loads none of them. A default of a light part (policies,
pipeline.faults) is read off it with `default_of`.

A section module (engines, stores, ...) registers its kinds in one place: the union it exports
(e.g. `engines.EngineSection = kinds(TorchEngineSpec, SGLangEngineSpec, plugin=EnginePluginSpec)`), which
`baton.schema.RunConfig` composes. Each member owns `make(ctx)`, the object it describes. Nothing here
imports `baton.schema`: the sections sit below it.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from baton.config import resolve

if TYPE_CHECKING:
    from stages.learner.lora import LoraSpec

# every declared default: (where, name, value, attribute), each checked against `where` by the tests
DECLARED: list[tuple[str, str, Any, str | None]] = []


def declared_defaults(where: str) -> Callable[..., Any]:
    """The defaults of the part at `where` ("pkg.mod:Class" or a function) that a section mirrors, declared
    in the section so that validating a config never imports the part: `declared(name, value)` is `value`,
    the default of the part's keyword `name` (`attribute=`: that attribute of the part's default, e.g. a
    selection's `kind`), recorded in `DECLARED`."""

    def declared(name: str, value: Any, attribute: str | None = None) -> Any:
        DECLARED.append((where, name, value, attribute))
        return value

    return declared


# every constant declared by same_as: (where, value), each checked against `where` by the tests
DECLARED_CONSTANTS: list[tuple[str, Any]] = []


def same_as(where: str, value: Any) -> Any:
    """`value`, the part's constant at `where` ("pkg.mod:NAME"; a mapping's: its keys, as a tuple), declared
    here so that validating a config never imports the part; recorded in `DECLARED_CONSTANTS`."""
    DECLARED_CONSTANTS.append((where, value))
    return value


def default_of(part: Any, name: str) -> Any:
    """The default of keyword `name` in the part's own class (or function): the one place it is defined."""
    if dataclasses.is_dataclass(part):
        return next(f.default for f in dataclasses.fields(part) if f.name == name)
    return inspect.signature(part).parameters[name].default


@dataclass(frozen=True)
class BuildContext:
    """What a section's factory may read besides its own keys: never the whole RunConfig. `model` is the
    model folder once made (None before); `k` the resolved staleness bound; `index` the engine's index
    among `engine.count`; `lora` the learner's adapters (None: full fine-tuning)."""

    seed: int
    dtype: str
    k: int
    runtime: str
    name: str
    model: Path | None = None
    index: int = 0
    lora: LoraSpec | None = None


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PluginSpec(BaseModel):
    """`kind = "package.module:Class"`; every other key is passed to the class as a keyword (baton.builder)."""

    model_config = ConfigDict(extra="allow")
    kind: Annotated[str, Field(pattern=r"^[\w.]+:\w+$")] = Field(
        description="your own class as 'package.module:Class'; every other key of the table is passed to it as a "
        "keyword argument"
    )

    def plugin_keys(self) -> dict[str, Any]:
        """The table's keys other than `kind`: the class's keyword arguments."""
        return dict(self.model_extra or {})

    def make(self, ctx: BuildContext, **_: Any) -> Any:
        """The class `kind` names, called with the section's other keys (the build context is not passed)."""
        return resolve(self.kind)(**self.plugin_keys())


def kinds(*members: type[BaseModel], plugin: type[PluginSpec] = PluginSpec) -> Any:
    """A discriminated union on `kind` (the first member is the default when `kind` is omitted),
    plus the `pkg.mod:Class` plug-in form (`plugin`: the section class such a kind validates as)."""
    default = members[0].model_fields["kind"].default

    def tag(value: Any) -> str:
        kind = value.get("kind", default) if isinstance(value, dict) else getattr(value, "kind", default)
        return "plugin" if isinstance(kind, str) and ":" in kind else kind

    union: Any = Annotated[plugin, Tag("plugin")]
    for member in members:
        union = union | Annotated[member, Tag(member.model_fields["kind"].default)]
    return Annotated[union, Discriminator(tag)]
