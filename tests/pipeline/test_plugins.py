"""pipeline.plugins: where a plug-in is looked for (Python's path, then the working directory, or a file
path), that a file is loaded once, and that a module whose own import fails says so rather than "not
found". (tests/baton/test_plugin_paths.py runs the same through the console script.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipeline.plugins import PluginError, resolve


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory is a fresh folder that is not on sys.path (restored afterwards)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    return tmp_path


def test_a_module_in_the_working_directory_resolves_and_its_folder_stays_on_the_path(project: Path) -> None:
    (project / "plugin_cwd_mod.py").write_text("VALUE = 7\n")
    try:
        assert resolve("plugin_cwd_mod:VALUE") == 7
        assert str(project) == sys.path[-1]  # appended: never shadows an installed package
    finally:
        sys.modules.pop("plugin_cwd_mod", None)


def test_a_file_is_loaded_once_and_can_hold_a_dataclass(project: Path) -> None:
    (project / "envs").mkdir()
    (project / "envs" / "sandbox.py").write_text(
        "from dataclasses import dataclass\n\n@dataclass\nclass Sandbox:\n    turns: int = 2\n"
    )
    first = resolve("envs/sandbox.py:Sandbox", what="environment")
    assert first().turns == 2
    assert resolve(str(project / "envs" / "sandbox.py") + ":Sandbox") is first  # same file, same class


def test_not_found_leaves_the_path_as_it_was_and_names_the_fix(project: Path) -> None:
    path_before = list(sys.path)
    expected = rf"'absent_plugin_mod': it is not on Python's path, nor in the working directory {project} \(tried "
    with pytest.raises(PluginError, match=expected + rf"{project}/absent_plugin_mod\.py"):
        resolve("absent_plugin_mod:f", what="reward")
    assert sys.path == path_before


def test_a_failing_import_inside_the_plugin_is_reported_as_such(project: Path) -> None:
    (project / "broken_plugin_mod.py").write_text("import no_such_dependency_xyz\n")
    with pytest.raises(PluginError, match="cannot import 'broken_plugin_mod': No module named 'no_such_dependency"):
        resolve("broken_plugin_mod:f")
    with pytest.raises(PluginError, match="cannot load .*broken_plugin_mod.py: No module named 'no_such_dependency"):
        resolve("broken_plugin_mod.py:f")


def test_names_without_a_colon_list_the_built_ins() -> None:
    with pytest.raises(PluginError, match="unknown environment 'feedbak': use one of calculator, feedback, a "):
        resolve("feedbak", {"feedback": "x:y", "calculator": "x:z"}, what="environment")
