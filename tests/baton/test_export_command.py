"""`baton export RUN_DIR OUT`: the latest checkpoint (or --version's) as a Hugging Face folder, one JSON line;
exit 2 with a message naming the fix on bad input. `[checkpoint] export_every` must be a multiple of
`checkpoint.every`. Slow: a real quickstart run exports its checkpoints as it goes, and `baton export` of its
latest checkpoint loads with transformers, holds the checkpoint's weights and generates the torch engine's
greedy completions at that version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

from baton import cli
from baton.config import ConfigError
from baton.schema import load_run_config
from pipeline.checkpoint import complete_checkpoints, latest_checkpoint
from stages.data.model import make_tiny_model
from stages.learner import GRPOLearner
from stages.learner.export import EXPORT_DTYPES
from stages.learner.step import PolicyTrainer
from tests import ROOT
from tests.helpers.checkpoint_helpers import make_checkpointer
from tests.helpers.exports import (
    checkpoint_weights,
    engine_greedy,
    exported_weights,
    rollout_prompts,
    transformers_greedy,
)
from tests.helpers.runs import baton_run

torch.set_num_threads(1)


class LearnerPart:
    """The learner's part of a checkpoint, written by a real trainer (what `LearnerActor.write_state` does)."""

    def __init__(self, trainer: PolicyTrainer) -> None:
        self.trainer, self.version = trainer, 0

    def held_refs(self) -> list:
        return []

    def write_state(self, folder: Path) -> None:
        self.trainer.write_state(folder, self.version)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run folder with checkpoints of versions 1 and 2 (the weights moved before each) and its config.toml."""
    root = tmp_path_factory.mktemp("export-run")
    model = make_tiny_model(root / "model")
    run_dir = root / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(f'name = "unit"\n\n[model]\npath = "{model}"\n')
    checkpointer, clock, _ = make_checkpointer(run_dir)
    part = LearnerPart(PolicyTrainer(GRPOLearner(model, device="cpu"), 100))
    for version in (1, 2):
        with torch.no_grad():
            for p in part.trainer.model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(version)) * 0.05)
        clock.advance(version)
        part.version = version
        anyio.run(checkpointer.save, version, part)
    return run_dir


def export(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict | None, str]:
    """`baton export ARGS`: its exit code, its last stdout line as JSON (None when there is none), its stderr."""
    code = cli.main(["export", *args])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return code, json.loads(lines[-1]) if lines else None, captured.err


def test_the_latest_checkpoint_by_default_and_a_version_asked(capsys, run_dir: Path, tmp_path: Path) -> None:
    model = run_dir.parent / "model"
    code, line, err = export(capsys, str(run_dir), str(tmp_path / "latest"))
    assert code == 0, err
    assert line["version"] == 2 and line["dtype"] == "float32" and line["out"] == str(tmp_path / "latest")
    assert line["files"] == sorted(p.name for p in (tmp_path / "latest").iterdir())
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors"} <= set(line["files"])
    assert line["bytes"] == sum(p.stat().st_size for p in (tmp_path / "latest").iterdir())
    latest = exported_weights(tmp_path / "latest")
    assert all(torch.equal(latest[n], t) for n, t in checkpoint_weights(latest_checkpoint(run_dir), model).items())

    code, line, err = export(capsys, str(run_dir), str(tmp_path / "first"), "--version", "1", "--dtype", "bfloat16")
    assert code == 0, err
    assert line["version"] == 1 and line["dtype"] == "bfloat16"
    first = exported_weights(tmp_path / "first")
    expected = checkpoint_weights(complete_checkpoints(run_dir)[1], model)
    assert all(torch.equal(first[n], t.to(torch.bfloat16)) for n, t in expected.items())
    assert not torch.equal(first["model.norm.weight"].float(), latest["model.norm.weight"])


def test_the_model_folder_from_the_option(capsys, run_dir: Path, tmp_path: Path) -> None:
    """A run folder moved away from its model: --model names it (a relative config path, from elsewhere)."""
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "config.toml").write_text('[model]\npath = "runs/models/not-here"\n')
    os.symlink(run_dir / "checkpoints", moved / "checkpoints")
    code, _, err = export(capsys, str(moved), str(tmp_path / "out"))
    assert code == 2 and "'runs/models/not-here'" in err and "--model PATH" in err, err
    code, line, err = export(capsys, str(moved), str(tmp_path / "out"), "--model", str(run_dir.parent / "model"))
    assert code == 0 and line["version"] == 2, err


def test_bad_input_exits_2_with_the_fix(capsys, run_dir: Path, tmp_path: Path) -> None:
    code, line, err = export(capsys, str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert (code, line) == (2, None) and "not a run folder" in err
    (tmp_path / "empty").mkdir()
    code, _, err = export(capsys, str(tmp_path / "empty"), str(tmp_path / "out"))
    assert code == 2 and "holds no complete checkpoint" in err and "checkpoint.every" in err
    code, _, err = export(capsys, str(run_dir), str(tmp_path / "out"), "--version", "7")
    assert code == 2 and "no checkpoint of version 7" in err and "version(s) 1, 2" in err, err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    code, _, err = export(capsys, str(run_dir), str(tmp_path / "full"))
    assert code == 2 and "not empty" in err and "--force" in err
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["notes.txt"]
    code, _, err = export(capsys, str(run_dir), str(tmp_path / "out"), "--max-shard-size", "huge")
    assert code == 2 and "not a size" in err
    assert not (tmp_path / "out").exists()
    code, line, err = export(capsys, str(run_dir), str(tmp_path / "full"), "--force")
    assert code == 0 and "notes.txt" not in line["files"], err


def test_the_dtype_choices_are_the_exports(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["export", "--help"])
    assert exit_info.value.code == 0
    assert "{" + ",".join(EXPORT_DTYPES) + "}" in capsys.readouterr().out


def test_export_every_is_a_multiple_of_every() -> None:
    config = str(ROOT / "configs" / "quickstart.toml")
    assert load_run_config(config, ["checkpoint.every=3", "checkpoint.export_every=6"]).checkpoint.export_every == 6
    with pytest.raises(ConfigError, match=r"checkpoint.export_every = 4.*checkpoint.every = 3.*multiple of 3"):
        load_run_config(config, ["checkpoint.every=3", "checkpoint.export_every=4"])
    with pytest.raises(ConfigError, match=r"checkpoint.every = 0 writes none.*set checkpoint.every"):
        load_run_config(config, ["checkpoint.every=0", "checkpoint.export_every=4"])


@pytest.mark.slow
@pytest.mark.long  # CI time: in the long suite
def test_a_run_exports_as_it_goes_and_its_latest_checkpoint_round_trips(tmp_path: Path) -> None:
    """The quickstart for 7 versions with a checkpoint every 3, exported every 3: exports of 3 and 6, and of the
    last version, 7, which the finished run also keeps as its final checkpoint; `baton export` of the
    finished run (a real process) writes that last version: it equals the run's own export of 7, holds the
    checkpoint's weights, differs from version 6's, and generates the torch engine's greedy completions at
    version 7."""
    summary = baton_run(tmp_path, "quickstart.toml", "steps=7", "checkpoint.every=3", "checkpoint.export_every=3")
    run_dir, model = Path(summary["run_dir"]), tmp_path / "model"
    assert sorted(p.name for p in (run_dir / "exports").iterdir()) == ["v00000003", "v00000006", "v00000007"]
    assert not (run_dir / "events.jsonl").exists() or "export_failed" not in (run_dir / "events.jsonl").read_text()
    proc = subprocess.run([sys.executable, "-m", "baton.cli", "export", str(run_dir), str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["version"] == 7 and line["out"] == str(tmp_path / "out")

    weights = checkpoint_weights(latest_checkpoint(run_dir), model)
    exported = exported_weights(tmp_path / "out")
    assert exported.keys() == weights.keys() and all(torch.equal(exported[n], weights[n]) for n in weights)
    own = exported_weights(run_dir / "exports" / "v00000007")
    assert all(torch.equal(own[n], weights[n]) for n in weights)
    initial = exported_weights(model)
    assert not all(torch.equal(initial[n], weights[n]) for n in weights), "seven versions trained"
    before = exported_weights(run_dir / "exports" / "v00000006")
    assert before.keys() == weights.keys() and not all(torch.equal(before[n], weights[n]) for n in weights)

    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template, "the chat template came along"
    prompts, completions = transformers_greedy(tmp_path / "out")
    assert prompts == rollout_prompts(model)
    assert completions == engine_greedy(model, weights, 7)
