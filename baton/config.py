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

import json
import tomllib
from collections.abc import Iterable, Mapping
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


def _key_path(loc: tuple, data: Any) -> str:
    """The user's key path: loc minus the union tags pydantic inserts. A tag is an element absent
    from the input that is not the last one (the last may be a missing key, which is named)."""
    parts, node = [], data
    for i, part in enumerate(loc):
        present = (isinstance(node, Mapping) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and part < len(node)
        )
        if present:
            node = node[part]
        elif i < len(loc) - 1:
            continue
        parts.append(str(part))
    return ".".join(parts)


def _describe(err: Mapping[str, Any], data: Mapping[str, Any]) -> str:
    loc = _key_path(tuple(err["loc"]), data)
    kind, msg, ctx = err["type"], err["msg"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        return f"unknown key {loc!r} (remove it, or check its spelling)"
    if kind == "missing":
        return f"missing key {loc!r}"
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
    shown = "{...}" if isinstance(value, Mapping) else json.dumps(value, default=str)
    if "expected" in ctx and str(ctx["expected"]) not in msg:
        msg = f"{msg}; allowed: {ctx['expected']}"
    return f"{loc} = {shown}: {msg}"


def validate(model: type[M], data: Mapping[str, Any], source: str = "config") -> M:
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        lines = [_describe(e, data) for e in exc.errors()]
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
