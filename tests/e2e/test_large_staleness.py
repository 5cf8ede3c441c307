"""Large staleness bounds are configurations a user can run: k = 32 end to end (the admission gate lets
producers run 32 versions ahead, the buffer's version-range eviction and the learner's window hold them,
a checkpoint cut with that much in flight resumes), with a clean ledger: no sample trained over the
bound, none trained twice, every sample's fate known."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests import ROOT
from tests.helpers.ledger_checks import check_ledger

pytestmark = pytest.mark.long
K = 32


def baton(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([shutil.which("baton"), *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_k32_runs_checkpoints_resumes_and_keeps_its_bound(tmp_path: Path) -> None:
    sets = [f"run_root='{tmp_path}'", f"model.path='{tmp_path / 'model'}'", "steps=80", f"staleness.k={K}",
            "checkpoint.every=20", "telemetry.progress=false"]
    check = subprocess.run([shutil.which("baton"), "check", str(ROOT / "configs" / "quickstart.toml"),
                            *(x for s in sets for x in ("--set", s))], capture_output=True, text=True, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert check.returncode == 0, check.stderr
    assert f"staleness window (k = {K}, pace admission): up to" in check.stderr, "baton check says what k holds"
    assert f"a step on groups {K} versions old trains at 1.00 x lr" in check.stderr, "and the lr it trains at"
    run = baton("run", str(ROOT / "configs" / "quickstart.toml"), *(x for s in sets for x in ("--set", s)),
                cwd=tmp_path)
    deadline = time.monotonic() + 600
    while not list(tmp_path.glob("quickstart-*/checkpoints/v00000040-*/manifest.json")):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
        time.sleep(0.2)
    run.send_signal(signal.SIGKILL)  # mid-run, with up to k versions of work in flight
    run.wait(timeout=30)
    (run_dir,) = tmp_path.glob("quickstart-*")
    resumed = baton("run", "--resume", str(run_dir), "--set", "telemetry.progress=false", cwd=tmp_path)
    out, err = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["version"] == 80 and summary["ledger_balanced"] and summary["staleness_bound"] == K
    assert summary["max_staleness_trained"] <= K
    records = check_ledger(run_dir, bound=K)  # among its checks: none trained twice, none over the bound
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(m["staleness_max"] for m in metrics) > 8, "producers really ran far ahead"
    assert sum(r["fate"] == "trained" for r in records) == summary["samples"]["trained"]
