"""Validating a config is light: `baton check`, and `baton run` up to a config error, import no torch,
transformers, ray, sglang, vllm or stage implementation, so a typo is reported before anything starts
(baton/sections/base.py says how). The defaults and constants a section declares instead of reading them
off the parts are checked here against the parts themselves, so the two cannot drift."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from baton.config import resolve
from baton.sections.base import DECLARED, DECLARED_CONSTANTS, default_of

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.toml"

HEAVY = ("torch", "transformers", "ray", "sglang", "vllm")
# the stage modules validation may load: registries and pure-Python parts that import none of HEAVY
LIGHT_STAGE_MODULES = {
    "stages", "stages.data", "stages.data.rewards", "stages.data.tasks", "stages.environments",
    "stages.environments.base", "stages.environments.tokens", "stages.weights",
}

# runs `baton ARGS` in a fresh interpreter; prints its exit code and the modules it left loaded, as JSON
PROBE = """
import contextlib, io, json, sys
from baton.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "stderr": err.getvalue(), "modules": sorted(sys.modules)}))
"""


def baton_in_a_fresh_process(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def heavy_modules(modules: list[str]) -> str:
    """The loaded modules validation must not load (HEAVY packages, stage modules outside the light ones), in
    a line: empty when there are none."""
    heavy = [m for m in modules if m.split(".")[0] in HEAVY
             or (m.split(".")[0] == "stages" and m not in LIGHT_STAGE_MODULES)]
    return f"{len(heavy)} heavy modules loaded, among them {heavy[:8]}" if heavy else ""


@pytest.mark.parametrize("command", ["check", "run"])
def test_a_config_error_is_reported_without_loading_torch_or_a_stage(command: str) -> None:
    result = baton_in_a_fresh_process(command, str(QUICKSTART), "--set", "rollout.group_sise=4")
    assert result["code"] == 2
    assert "did you mean 'rollout.group_size'" in result["stderr"]
    assert heavy_modules(result["modules"]) == ""


def test_checking_a_valid_config_loads_no_torch_or_stage() -> None:
    result = baton_in_a_fresh_process("check", str(QUICKSTART))
    assert result["code"] == 0, result["stderr"]
    assert "staleness window" in result["stderr"]  # the whole check ran, its report included
    assert heavy_modules(result["modules"]) == ""


def test_the_defaults_a_section_declares_are_the_parts_own() -> None:
    import baton.schema  # noqa: F401 (every section declares its defaults when it is defined)

    assert len(DECLARED) > 100
    drifted = []
    for where, name, value, attribute in DECLARED:
        actual = default_of(resolve(where), name)
        if attribute is not None:
            actual = getattr(actual, attribute)
        if actual != value or type(actual) is not type(value):
            drifted.append(f"{where} {name}: the part's default is {actual!r}, the section declares {value!r}")
    assert drifted == []


def test_the_constants_a_section_copies_are_the_parts_own() -> None:
    import baton.schema  # noqa: F401

    assert DECLARED_CONSTANTS
    for where, value in DECLARED_CONSTANTS:
        actual = resolve(where)
        assert (tuple(actual) if isinstance(actual, dict | tuple | list) else actual) == value, where
