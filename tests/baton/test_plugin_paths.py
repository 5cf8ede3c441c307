"""A user's plug-ins resolve the way `baton` is really started: by its console script, whose sys.path[0]
is the script's own folder, not the working directory. A module in the working directory
(`my_rewards:score`) and a file path (`rewards/mine.py:score`, `envs/sandbox.py:Sandbox`) both work;
one that is in neither place fails naming the working directory and the file it tried."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT

QUICKSTART = ROOT / "configs" / "quickstart.toml"
REWARD = "def score(completion, answer, **_):\n    return float(completion.strip() == answer)\n"
ENVIRONMENT = '''
class Sandbox:
    tools = ()

    def __init__(self, turns=2):
        self.turns = turns

    async def start(self, sample):
        return [{"role": "user", "content": sample.prompt}]

    async def step(self, turn):
        raise NotImplementedError

    async def close(self):
        pass
'''


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A user's project folder: a reward module, a reward file and an environment file."""
    work = tmp_path / "project"
    (work / "rewards").mkdir(parents=True)
    (work / "envs").mkdir()
    (work / "my_rewards.py").write_text(REWARD)
    (work / "rewards" / "mine.py").write_text(REWARD)
    (work / "envs" / "sandbox.py").write_text(ENVIRONMENT)
    return work


def console_script(tmp_path: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`baton ARGS` run as its console script runs (a script in a folder of its own calling
    `baton.cli:main`), in `cwd`, with this tree importable through PYTHONPATH only."""
    script = tmp_path / "bin" / "baton"
    script.parent.mkdir(exist_ok=True)
    script.write_text("import sys\nfrom baton.cli import main\nsys.exit(main())\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def check(tmp_path: Path, cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    sets = [arg for override in overrides for arg in ("--set", override)]
    return console_script(tmp_path, cwd, "check", str(QUICKSTART), "--set", "model.path='model'", *sets)


def test_a_module_in_the_working_directory_resolves(tmp_path: Path, workdir: Path) -> None:
    proc = check(tmp_path, workdir, "reward.function='my_rewards:score'")
    assert proc.returncode == 0, proc.stderr
    assert 'function = "my_rewards:score"' in proc.stdout


def test_file_paths_resolve_from_the_working_directory(tmp_path: Path, workdir: Path) -> None:
    proc = check(tmp_path, workdir, "reward.function='rewards/mine.py:score'",
                 "environment.kind='envs/sandbox.py:Sandbox'", "environment.turns=3")
    assert proc.returncode == 0, proc.stderr
    assert 'function = "rewards/mine.py:score"' in proc.stdout and 'kind = "envs/sandbox.py:Sandbox"' in proc.stdout


def test_a_missing_module_names_the_working_directory_and_the_files_tried(tmp_path: Path, workdir: Path) -> None:
    proc = check(tmp_path, workdir, "reward.function='their_rewards:score'")
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"in the working directory {workdir}" in proc.stderr, proc.stderr
    assert str(workdir / "their_rewards.py") in proc.stderr


def test_a_missing_file_names_the_path_it_tried(tmp_path: Path, workdir: Path) -> None:
    proc = check(tmp_path, workdir, "reward.function='rewards/theirs.py:score'")
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"no file {workdir / 'rewards' / 'theirs.py'}" in proc.stderr, proc.stderr
    assert f"the working directory {workdir}" in proc.stderr


class RecordingEngine:
    """A user's engine, outside the package: records how `baton` built it (the calling convention of a
    plug-in engine: `Class(model, name=..., index=..., **the table's other keys)`)."""

    def __init__(self, model: Path, *, name: str, index: int, flavour: str = "plain") -> None:
        self.model, self.name, self.index, self.flavour = model, name, index, flavour


def test_a_plugin_engine_is_built_like_the_built_ins(tmp_path: Path) -> None:
    """`count` workers, each given the model folder and its index; the sampling keys reach the rollout,
    not the class; the table's other keys reach the class."""
    from baton.builder import make_rollout
    from baton.config import validate
    from baton.schema import RunConfig

    engine = {"kind": f"{__name__}:RecordingEngine", "count": 2, "batch_groups": 3, "temperature": 0.7,
              "top_p": 0.9, "flavour": "spicy"}
    cfg = validate(RunConfig, {"model": {"path": str(tmp_path / "tiny")}, "engine": engine})
    assert cfg.engine_count == 2 and cfg.engine_sampling() == {"batch_groups": 3, "temperature": 0.7, "top_p": 0.9}
    model = cfg.model.make()
    rollout = make_rollout(cfg, model)
    assert [type(e).__name__ for e in rollout.engines] == ["RecordingEngine", "RecordingEngine"]
    assert [(e.model, e.index, e.name, e.flavour) for e in rollout.engines] == [
        (model, 0, "recordingengine-0", "spicy"), (model, 1, "recordingengine-1", "spicy")]
    assert (rollout.batch_groups, rollout.temperature, rollout.top_p) == (3, 0.7, 0.9)
