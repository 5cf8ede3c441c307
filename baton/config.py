"""Config machinery, independent of what is being configured.

* `load_toml(path, overrides)`: read TOML, apply `--set a.b.c=value` overrides (values parsed as
  TOML, falling back to a plain string), return a dict.
* `validate(model, data)`: pydantic validation whose failure is a `ConfigError` listing every bad
  key as `a.b.c = value: what is wrong (what is allowed)`, before anything starts.
* `resolve(target, aliases)`: a kind name or `"package.module:Class"` dotted path to the object, so
  user plug-ins load exactly like built-ins.
* `to_toml(data)`: the resolved config back to TOML for the run folder.
"""

from __future__ import annotations

import difflib
import json
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pydantic

from pipeline import plugins

M = TypeVar("M", bound=pydantic.BaseModel)


class ConfigError(ValueError):
    """A config that cannot run. The message names each key, its value and the fix."""


def load_toml(path: str | Path, overrides: Iterable[str] = ()) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for item in overrides:
        apply_override(data, item)
    return data


def apply_override(data: dict[str, Any], item: str) -> None:
    """`key.path=value`; the value is read as TOML (numbers, booleans, quoted strings, arrays)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set learner.lr=1e-3")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {part!r} is a value, not a table")
        node = child
    node[parts[-1]] = value


def section_classes(annotation: Any) -> list[type[pydantic.BaseModel]]:
    """The section classes a field's annotation holds: one for a table (or an array of tables), several for
    a `kind` union, [] for a plain value."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated or origin is list:
        return section_classes(args[0])
    if origin in (typing.Union, types.UnionType):
        return [cls for arg in args for cls in section_classes(arg)]
    is_model = isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel)
    return [annotation] if is_model else []


def kind_of(section: type[pydantic.BaseModel]) -> str | None:
    """A built-in kind's name (its `kind` default); None for a plug-in section or one without a kind."""
    field = section.model_fields.get("kind")
    return field.default if field is not None and isinstance(field.default, str) else None


@dataclass
class _Place:
    """Where an error is: the user's key path, the section class that holds its last key (None: a plain
    value's), and the other kinds of that section when it is a `kind` union."""

    path: list[str] = field(default_factory=list)
    holder: type[pydantic.BaseModel] | None = None
    kinds: list[type[pydantic.BaseModel]] = field(default_factory=list)

    @property
    def key(self) -> str:
        return ".".join(self.path)

    @property
    def table(self) -> str:
        return ".".join(self.path[:-1])


def _place(loc: tuple, model: type[pydantic.BaseModel], data: Any) -> _Place:
    """The error location pydantic gives (`loc`, with the tags it inserts for unions) as a `_Place`. The
    element after a `kind` union's field is the tag naming the member; any other element absent from the
    input that is not the last one is a tag too (the last may be a missing key, which is named)."""
    place, node = _Place(), data
    section: type[pydantic.BaseModel] | None = model
    members: list[type[pydantic.BaseModel]] = []
    tag_next = False
    for i, part in enumerate(loc):
        if tag_next:
            tag_next = False
            section = next((m for m in members if (kind_of(m) or "plugin") == part), None)
            continue
        present = (isinstance(node, Mapping) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and part < len(node))
        if present:
            node = node[part]
        elif i < len(loc) - 1:
            continue
        place.path.append(str(part))
        if isinstance(part, int):
            continue  # an array's entry: the array's section class holds its keys
        place.holder, place.kinds = section, members
        found = section.model_fields.get(part) if section is not None else None
        classes = section_classes(found.annotation) if found is not None else []
        section, members, tag_next = (None, classes, True) if len(classes) > 1 else (
            (classes or [None])[0], [], False)
    return place


def _unknown_key(place: _Place) -> str:
    """An unknown key: which kind of its table has it (and how to switch kinds), else the nearest key."""
    key, holder = place.path[-1], place.holder
    kind = kind_of(holder) if holder is not None else None
    owners = [json.dumps(kind_of(m)) for m in place.kinds if m is not holder and kind_of(m) and key in m.model_fields]
    if kind and owners:
        required = [n for n, f in holder.model_fields.items() if f.is_required() and n != "kind"]
        example = ", ".join([f"kind = {json.dumps(kind)}", *(f'{n} = ...' for n in required), "..."])
        return (f"unknown key {place.key!r}: {key!r} belongs to {place.table}.kind = {' or '.join(owners)}, not "
                f"{json.dumps(kind)}; --set {place.table}.kind changes the kind, not the table's other keys. To "
                f"switch kinds, edit a copy of the config's [{place.table}] table, or give the whole table: "
                f"--set {place.table}='{{{example}}}'")
    names = list(holder.model_fields) if holder is not None else []
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if close:
        nearest = ".".join([*place.path[:-1], close[0]])
        return f"unknown key {place.key!r}: did you mean {nearest!r}? (or remove it)"
    return f"unknown key {place.key!r} (remove it, or check its spelling)"


def _table_error(loc: str, msg: str) -> str:
    """A check of a whole table failed: its key once, however the check's own message starts."""
    if msg.startswith(f"{loc}."):
        return msg  # the message names the table's own key
    return f"{loc}: {msg.removeprefix(f'{loc}: ')}"


def _describe(err: Mapping[str, Any], data: Mapping[str, Any], model: type[pydantic.BaseModel]) -> str:
    place = _place(tuple(err["loc"]), model, data)
    loc = place.key
    kind, msg, ctx = err["type"], err["msg"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        return _unknown_key(place)
    if kind == "missing":
        table_kind = kind_of(place.holder) if place.holder is not None and place.kinds else None
        return f"missing key {loc!r}" + (f" (kind {json.dumps(table_kind)} needs it)" if table_kind else "")
    if kind == "union_tag_invalid":
        allowed = ", ".join(t for t in str(ctx.get("expected_tags", "")).split(", ") if t != "'plugin'")
        return (
            f"{loc}.kind = {json.dumps(ctx.get('tag'))}: unknown kind; allowed: {allowed} "
            "or a 'package.module:Class' path"
        )
    msg = msg.removeprefix("Value error, ")
    if not loc:
        return msg
    value = err.get("input")
    if isinstance(value, Mapping):
        return _table_error(loc, msg)
    if "expected" in ctx and str(ctx["expected"]) not in msg:
        msg = f"{msg}; allowed: {ctx['expected']}"
    return f"{loc} = {json.dumps(value, default=str)}: {msg}"


def validate(model: type[M], data: Mapping[str, Any], source: str = "config") -> M:
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        lines = [_describe(e, data, model) for e in exc.errors()]
        raise ConfigError(f"{source} is invalid:\n  " + "\n  ".join(lines)) from None


def resolve(target: str, aliases: Mapping[str, str] | None = None) -> Any:
    """`"sglang"` (an alias) or `"pkg.mod:Name"` -> the object (`pipeline.plugins`), as a ConfigError."""
    try:
        return plugins.resolve(target, aliases)
    except plugins.PluginError as exc:
        raise ConfigError(str(exc)) from None


def to_toml(data: Mapping[str, Any]) -> str:
    """A minimal TOML writer for plain config data (tables, arrays of tables, scalars, arrays of scalars)."""
    lines: list[str] = []

    def scalar(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, list | tuple):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        return json.dumps(str(v))

    def is_tables(v: Any) -> bool:  # an array of tables: [[key]] entries
        return isinstance(v, list | tuple) and bool(v) and all(isinstance(x, Mapping) for x in v)

    def table(prefix: str, node: Mapping[str, Any], header: str | None = None) -> None:
        plain = {k: v for k, v in node.items() if not isinstance(v, Mapping) and not is_tables(v) and v is not None}
        nested = {k: v for k, v in node.items() if isinstance(v, Mapping)}
        if header is not None:
            lines.append(f"\n{header}")
        elif prefix and plain:
            lines.append(f"\n[{prefix}]")
        lines.extend(f"{k} = {scalar(v)}" for k, v in plain.items())
        for k, v in nested.items():
            table(f"{prefix}.{k}" if prefix else k, v)
        for k, v in node.items():
            if is_tables(v):
                name = f"{prefix}.{k}" if prefix else k
                for entry in v:
                    table(name, entry, header=f"[[{name}]]")

    table("", data)
    return "\n".join(lines).lstrip("\n") + "\n"
