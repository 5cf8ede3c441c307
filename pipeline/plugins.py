"""Dotted paths: how a user's class or function plugs in exactly like a built-in one.

`resolve("pkg.module:Name")` imports the module and returns the attribute; `aliases` maps short
names (a built-in kind) to such paths. Every failure is a `PluginError` naming the target and the
fix, never an ImportError from deep inside.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


class PluginError(ValueError):
    """A dotted path that does not name an importable object."""


def resolve(target: str, aliases: Mapping[str, str] | None = None, what: str = "kind") -> Any:
    """`"alias"` or `"pkg.mod:Name"` -> the object; `what` names the target in errors ("kind", "reward")."""
    path = (aliases or {}).get(target, target)
    module_name, sep, attr = path.partition(":")
    if not sep:
        known = ", ".join(sorted(aliases or {}))
        raise PluginError(f"unknown {what} {target!r}: use one of {known} or a 'package.module:Name' path")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"{what} {target!r}: cannot import {module_name!r}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PluginError(f"{what} {target!r}: module {module_name!r} has no {attr!r}") from None


__all__ = ["PluginError", "resolve"]
