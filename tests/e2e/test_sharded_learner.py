"""The quickstart with a learner of two ranks (FSDP2 over gloo, real processes), through the real `baton`
console script: it learns as the one-rank learner does, with a balanced ledger (two ranks on Ray, on nodes
of their own: tests/e2e/test_multi_node.py); a rank SIGKILLed mid-run fails the run promptly naming the
rank when no restart is left (`learner.max_restarts = 0`), the run resumes from its checkpoint, and with a
restart left a rank killed again is healed within the run, with nothing trained twice."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import ROOT
from tests.helpers.ledger_checks import check_ledger
from tests.helpers.runs import baton_run

STEPS = 240  # as tests/e2e/test_e2e.py: reverse-2's reward is ~0.4 at v200 at the quickstart's lr


@pytest.mark.nightly  # CI's long suite: two ranks on Ray (test_multi_node.py), a killed local rank's resume, restart
def test_two_ranks_learn_the_quickstart(tmp_path: Path) -> None:
    s = baton_run(tmp_path, "quickstart.toml", f"steps={STEPS}", "learner.world_size=2")
    assert s["version"] == STEPS and s["ledger_balanced"]
    assert s["reward_end"] >= s["reward_start"] + 0.15, s
    assert s["max_staleness_trained"] <= 2 and s["samples"]["lost"] == 0
    records = check_ledger(Path(s["run_dir"]), bound=2)
    assert sum(r["fate"] == "trained" for r in records) == STEPS * 16 * 8


def rank_pids(parent: int) -> list[int]:
    """The learner's follower processes: the children of `parent` that multiprocessing spawned."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([shutil.which("baton"), "run", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def kill_rank_1_once(run: subprocess.Popen, ready: Callable[[], bool]) -> None:
    """SIGKILL the run's learner rank 1 once `ready()` holds (the run still going)."""
    deadline = time.monotonic() + 300
    while not ready() and time.monotonic() < deadline:
        assert run.poll() is None, run.communicate()[1][-3000:]
        time.sleep(0.5)
    (follower,) = rank_pids(run.pid)
    os.kill(follower, signal.SIGKILL)


def trained_to(run_dir: Path) -> int:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").is_file() else []
    return max((json.loads(line).get("version", 0) for line in lines if line.strip()), default=0)


@pytest.mark.long
def test_a_killed_rank_fails_the_run_without_restarts_and_heals_itself_with_them(tmp_path: Path) -> None:
    """`learner.max_restarts = 0` (the restarts spent): a SIGKILLed rank fails the run promptly, naming the rank.
    Resumed with `max_restarts = 1`, a rank SIGKILLed again is healed within the run: the group restarts from the
    latest checkpoint, the run finishes by itself with nothing trained twice, and the summary states the restart
    and its cost."""
    sets = [f"run_root='{tmp_path}'", f"model.path='{tmp_path / 'model'}'", "steps=40", "learner.world_size=2",
            "checkpoint.every=5", "telemetry.progress=false", "learner.max_restarts=0"]
    run = start([str(ROOT / "configs" / "quickstart.toml"), *(x for o in sets for x in ("--set", o))], tmp_path)
    kill_rank_1_once(run, lambda: bool(list(tmp_path.glob("quickstart-*/checkpoints/v*"))))
    killed = time.monotonic()
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == 1, stderr[-3000:]
    assert time.monotonic() - killed < 60, "the run stops promptly"
    assert "learner rank 1" in stderr and "exited with code -9" in stderr, stderr[-3000:]
    assert "learner.max_restarts = 0" in stderr, stderr[-3000:]
    (run_dir,) = tmp_path.glob("quickstart-*")
    resumed = start(["--resume", str(run_dir), "--set", "telemetry.progress=false", "--set", "learner.max_restarts=1"],
                    tmp_path)
    kill_rank_1_once(resumed, lambda: trained_to(run_dir) >= 17)  # past the resumed checkpoint (5, 10 or 15)
    stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-3000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["version"] == 40 and summary["ledger_balanced"]
    (restart,) = summary["learner_restarts"]
    assert "learner rank 1" in restart["cause"] and "code -9" in restart["cause"]
    assert restart["restored_version"] % 5 == 0 and restart["restored_version"] >= 15
    assert restart["rolled_back_versions"] == restart["at_version"] - restart["restored_version"] >= 0
    assert restart["seconds"] > 0
    assert summary["events"].get("learner.restart") == 1
    check_ledger(run_dir, bound=2)  # among its checks: no sample trained twice
