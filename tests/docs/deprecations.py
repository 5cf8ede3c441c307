"""What counts as a DeprecationWarning from the project's own code, for the docs' tests: a documented
command or sample that sets one off is using a path the next release removes, so it fails.

A warning is the project's when
- it was attributed to a file of this checkout (not a virtual environment or site-packages in it), or
- its text names one of the module paths that moved (`stages.MOVED`): that alias warns on behalf of the
  code that imported it, so the warning is attributed to the importer (a user's script, a plug-in path
  resolved by importlib), wherever that file is.
A third-party library's own deprecation, set off by its own code, is not.

In this process: `recording()` records every DeprecationWarning (filters reset to "always"), and
`project_deprecations(records)` keeps the project's. In a subprocess: run it with `WARNINGS_ENV`
(DeprecationWarnings shown, once per place) and read its stderr with `project_deprecations_in(stderr)`.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.docs.pages import ROOT

WARNINGS_ENV = {"PYTHONWARNINGS": "default::DeprecationWarning"}
NOT_OURS = ("site-packages", "dist-packages", ".venv")
# how Python prints a warning: `FILE:LINE: CATEGORY: MESSAGE`, the source line indented below it
PRINTED = re.compile(r"^(?P<file>.+?):(?P<line>\d+): (?P<category>\w*DeprecationWarning): (?P<message>.*)$", re.M)


def moved_paths() -> dict[str, str]:
    from stages import MOVED

    return MOVED


def names_a_moved_path(text: str) -> bool:
    return any(re.search(rf"(?<![\w.]){re.escape(old)}(?!\w)", text) for old in moved_paths())


def in_checkout(filename: str) -> bool:
    try:
        relative = Path(filename).resolve().relative_to(ROOT)
    except (ValueError, OSError):
        return False
    return not any(part in NOT_OURS or part.startswith(".venv") for part in relative.parts)


def is_project_deprecation(filename: str, message: str) -> bool:
    return in_checkout(filename) or names_a_moved_path(message)


def project_deprecations(records: list[warnings.WarningMessage]) -> list[str]:
    """The project's DeprecationWarnings among recorded warnings, each as `file:line: message`."""
    return [f"{r.filename}:{r.lineno}: {r.message}" for r in records
            if issubclass(r.category, DeprecationWarning) and is_project_deprecation(r.filename, str(r.message))]


def project_deprecations_in(stderr: str) -> list[str]:
    """The project's DeprecationWarnings a process printed (run with `WARNINGS_ENV`)."""
    return [m.group(0) for m in PRINTED.finditer(stderr)
            if is_project_deprecation(m.group("file"), m.group("message"))]


@contextmanager
def recording() -> Iterator[list[warnings.WarningMessage]]:
    """Every DeprecationWarning raised inside, however often, whatever the filters outside say."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always", DeprecationWarning)
        yield records


def deprecated_paths_in(code: str) -> list[str]:
    """The moved module paths a sample's code uses (an import, a `module:attr` plug-in path, a dotted use)."""
    return sorted(old for old in moved_paths() if re.search(rf"(?<![\w.]){re.escape(old)}(?!\w)", code))
