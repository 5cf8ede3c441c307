"""Modules moved in 0.2 import from their old paths for one release: the same module object, with a
DeprecationWarning that names the new path, also through a plug-in's dotted path."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from pipeline.plugins import resolve
from stages import MOVED
from tests import ROOT


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_module_at_its_new_place(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    with pytest.warns(DeprecationWarning, match=MOVED[old].replace(".", r"\.")):
        sys.modules.pop(old, None)
        moved = importlib.import_module(old)
    assert moved is new
    assert new.__spec__.name == MOVED[old], "the module keeps its own spec"


def test_a_plugin_path_through_an_old_module_resolves() -> None:
    from stages.data.rewards import exact_match

    with pytest.warns(DeprecationWarning):
        sys.modules.pop("stages.rewards", None)
        assert resolve("stages.rewards:exact_match") is exact_match


def test_the_two_stages_load_without_each_other() -> None:
    """A learner process never loads the rollout, gateway or environment modules, and the other way round."""
    code = ("import sys, stages.{0}; bad = [m for m in sys.modules if m.startswith(({1}))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    others = "'stages.rollout', 'stages.gateway', 'stages.environments'"
    learner = subprocess.run([sys.executable, "-c", code.format("learner", others)], cwd=ROOT, capture_output=True,
                             text=True)
    assert learner.returncode == 0, learner.stdout + learner.stderr
    rollout = subprocess.run([sys.executable, "-c", code.format("rollout", "'stages.learner',")], cwd=ROOT,
                             capture_output=True, text=True)
    assert rollout.returncode == 0, rollout.stdout + rollout.stderr
