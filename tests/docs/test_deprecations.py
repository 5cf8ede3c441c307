"""The docs use no module path that moved (`stages.MOVED`), and the docs' tests would catch one: a sample's
code is read for them, and a DeprecationWarning from the project's own code fails a docs test in this
process (tests/docs/conftest.py) or a documented command run as a subprocess (tests/docs/test_commands.py)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

from tests.docs.deprecations import (
    WARNINGS_ENV,
    deprecated_paths_in,
    is_project_deprecation,
    project_deprecations,
    project_deprecations_in,
    recording,
)
from tests.docs.pages import PAGES, ROOT, blocks


def test_no_sample_of_the_docs_uses_a_moved_path() -> None:
    """Code blocks only: the changelog's prose names the old paths on purpose."""
    found = [f"{block.where}: {old}" for page in PAGES for block in blocks(page)
             for old in deprecated_paths_in(block.text)]
    assert not found, f"samples that import a moved module path (use the new one, CHANGELOG.md): {found}"


def test_the_sample_check_sees_an_import_and_a_plugin_path() -> None:
    assert deprecated_paths_in("from stages.tasks import ReverseDigits") == ["stages.tasks"]
    assert deprecated_paths_in('function = "stages.rewards:exact_match"') == ["stages.rewards"]
    assert deprecated_paths_in("from stages.data.tasks import ReverseDigits\nimport stages.rollout.evaluation") == []


def import_fresh(alias: str) -> None:
    """Import a moved path's alias as if for the first time (it warns once per process); the module it
    gives, at its new place, stays the one already imported."""
    sys.modules.pop(alias, None)
    importlib.import_module(alias)


def test_a_deprecated_import_fails_the_check_in_process() -> None:
    with recording() as records:
        import_fresh("stages.tasks")
    found = project_deprecations(records)
    assert found and "stages.tasks moved to stages.data.tasks" in found[0]
    with recording() as records:
        importlib.import_module("stages.data.tasks")  # the new path: no warning (never re-imported: one module)
    assert project_deprecations(records) == []


def test_a_deprecated_import_fails_the_check_in_a_subprocess() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **WARNINGS_ENV}

    def printed(code: str) -> str:
        return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120, check=True).stderr

    found = project_deprecations_in(printed("import stages.tasks"))
    assert found and "stages.tasks moved to stages.data.tasks" in found[0]
    assert project_deprecations_in(printed("import stages.data.tasks")) == []


def test_whose_warning_it_is() -> None:
    assert is_project_deprecation(str(ROOT / "stages" / "data" / "tasks.py"), "anything is deprecated")
    assert is_project_deprecation("/home/user/train.py", "stages.rewards moved to stages.data.rewards")
    assert not is_project_deprecation("/usr/lib/python3/site-packages/torch/x.py", "torch.foo is deprecated")
    assert not is_project_deprecation(str(ROOT / ".venv-sglang" / "lib" / "x.py"), "x is deprecated")
    assert not is_project_deprecation("/home/user/train.py", "stages.rollout.evaluation is fine")
