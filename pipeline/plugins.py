"""Dotted paths and file paths: how a user's class or function plugs in exactly like a built-in one.

`resolve(target)` returns the object `target` names:
* `"pkg.module:Name"`: the module is imported from Python's path, else from the working directory
  (a console script such as `baton` does not have the working directory on `sys.path`; when the
  module is found there, the working directory is appended to `sys.path`, after everything else, so
  the module's own imports and later workers find it too);
* `"path/to/file.py:Name"`: the file is loaded as a module of its own (a relative path is read from
  the working directory); loading the same file again returns the same module.

`aliases` maps short names (a built-in kind) to such paths. Every failure is a `PluginError` naming
the target, where it looked and the fix, never an ImportError from deep inside.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any


class PluginError(ValueError):
    """A path that does not name an importable object."""


def resolve(target: str, aliases: Mapping[str, str] | None = None, what: str = "kind") -> Any:
    """`"alias"`, `"pkg.mod:Name"` or `"dir/file.py:Name"` -> the object; `what` names the target in
    errors ("kind", "reward")."""
    path = (aliases or {}).get(target, target)
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        known = ", ".join(sorted(aliases or {}))
        raise PluginError(f"unknown {what} {target!r}: use one of {known}, a 'package.module:Name' path "
                          "or a 'path/to/file.py:Name' path")
    if _is_file(module_name):
        module = _load_file(module_name, target, what)
    else:
        module = _import(module_name, target, what)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PluginError(f"{what} {target!r}: module {module_name!r} ({module.__file__}) has no {attr!r}") from None


def _is_file(module_name: str) -> bool:
    return module_name.endswith(".py") or "/" in module_name or os.sep in module_name


def _import(module_name: str, target: str, what: str) -> ModuleType:
    """The module from Python's path, else from the working directory (which then stays on the path)."""
    module = _try_import(module_name, target, what)
    if module is not None:
        return module
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
        importlib.invalidate_caches()
        module = _try_import(module_name, target, what)
        if module is not None:
            return module
        sys.path.remove(cwd)
    as_file = Path(cwd, *module_name.split("."))
    raise PluginError(
        f"{what} {target!r}: cannot import {module_name!r}: it is not on Python's path, nor in the working "
        f"directory {cwd} (tried {as_file}.py and {as_file}/__init__.py); run from the folder that holds it, "
        "install it, or give its file: 'path/to/file.py:Name'"
    )


def _try_import(module_name: str, target: str, what: str) -> ModuleType | None:
    """The module; None when it (or a package above it) is not found; PluginError when it is found but
    one of its own imports fails."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if _names_the_module(exc, module_name):
            return None
        raise PluginError(f"{what} {target!r}: cannot import {module_name!r}: {exc}") from None
    except ImportError as exc:
        raise PluginError(f"{what} {target!r}: cannot import {module_name!r}: {exc}") from None


def _names_the_module(exc: ModuleNotFoundError, module_name: str) -> bool:
    """Whether `exc` says `module_name` itself (or a package above it) is missing, not one it imports."""
    return exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + "."))


def _load_file(file_name: str, target: str, what: str) -> ModuleType:
    """The module a .py file makes, loaded once per process (kept in `sys.modules` under a name made
    from its absolute path, so dataclasses and pickling by reference work in this process)."""
    given = Path(file_name).expanduser()
    path = given if given.is_absolute() else Path.cwd() / given
    if not path.is_file():
        where = "" if given.is_absolute() else f" (a relative path is read from the working directory {Path.cwd()})"
        raise PluginError(f"{what} {target!r}: no file {path}{where}")
    path = path.resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"_baton_plugin_{''.join(c if c.isalnum() else '_' for c in path.stem)}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"{what} {target!r}: {path} cannot be loaded as a Python module (a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[name]  # a failed load leaves nothing behind, as a failed import does
        if isinstance(exc, ImportError):
            raise PluginError(f"{what} {target!r}: cannot load {path}: {exc}") from None
        raise
    return module


__all__ = ["PluginError", "resolve"]
