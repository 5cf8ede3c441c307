"""What a resume runs with is what its run folder says: the resumed run's resolved config becomes the folder's
`config.toml` (the one before kept as `attempts/<n>/config.toml`, the keys that changed in the summary), so a
later plain resume runs with it; a step count at or below the checkpoint's version is refused, naming
`steps` and the version. Over a real checkpointer, clock and ledger (no model: fast)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import anyio
import pytest

from pipeline.checkpoint import CheckpointError
from pipeline.resume import Resume, config_changes
from tests.helpers.checkpoint_helpers import FileConsumer, make_checkpointer

FIRST = 'name = "unit"\nsteps = 30\n\n[learner]\nworld_size = 2\nlr = 0.001\n'
SECOND = 'name = "unit"\nsteps = 40\n\n[learner]\nworld_size = 1\nlr = 0.001\n'


def checkpointed_run(folder: Path, version: int) -> Path:
    """A run folder holding FIRST as its config.toml and a checkpoint of `version`."""
    ckpt, clock, _ = make_checkpointer(folder)
    (folder / "config.toml").write_text(FIRST)
    clock.advance(version)
    anyio.run(ckpt.save, version, FileConsumer(b"w"))
    return folder


def test_a_resume_writes_what_it_runs_with_and_keeps_what_came_before(tmp_path: Path) -> None:
    run_dir = checkpointed_run(tmp_path, 3)
    resumed = Resume.open(run_dir, "unit", steps=40, config_text=SECOND)
    assert (run_dir / "config.toml").read_text() == SECOND
    assert (run_dir / "attempts" / "1" / "config.toml").read_text() == FIRST
    changed = {"steps": [30, 40], "learner.world_size": [2, 1]}
    assert resumed.changed == changed and resumed.summary()["changed"] == changed

    again = Resume.open(run_dir, "unit", steps=40, config_text=SECOND)  # a plain resume: the folder's config
    assert tomllib.loads((run_dir / "config.toml").read_text())["steps"] == 40
    assert (run_dir / "attempts" / "2" / "config.toml").read_text() == SECOND
    assert again.changed == {} and "changed" not in again.summary()


def test_a_pipeline_without_a_config_leaves_the_folders_config(tmp_path: Path) -> None:
    run_dir = checkpointed_run(tmp_path, 3)
    assert Resume.open(run_dir, "unit", steps=40).changed == {}
    assert (run_dir / "config.toml").read_text() == FIRST


@pytest.mark.parametrize(("steps", "says"), [(2, "above steps = 2"), (3, "and steps = 3: the run is finished")])
def test_a_step_count_at_or_below_the_checkpoint_is_refused(tmp_path: Path, steps: int, says: str) -> None:
    run_dir = checkpointed_run(tmp_path, 3)
    with pytest.raises(CheckpointError, match="the latest checkpoint is version 3") as refused:
        Resume.open(run_dir, "unit", steps=steps, config_text=SECOND)
    assert says in str(refused.value) and "--set steps=N, N > 3" in str(refused.value)
    assert not (run_dir / "attempts").exists(), "a refused resume moves nothing"
    assert (run_dir / "config.toml").read_text() == FIRST


def test_config_changes_lists_changed_added_and_removed_keys() -> None:
    was = 'a = 1\n[t]\nb = "x"\nc = [1, 2]\n'
    now = 'a = 1\n[t]\nb = "y"\nd = true\n'
    assert config_changes(was, now) == {"t.b": ["x", "y"], "t.c": [[1, 2], None], "t.d": [None, True]}
