"""`baton faults` end to end (a subprocess, a real master): a weight push refused more often than it
is retried fails its run instead of passing as success, and the matrix says so: the table, the
totals as the last stdout line, the table in the matrix folder, exit code 1. And `baton run` plans
what `[[faults]]` lists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.long  # CI time: in the long suite
def test_a_push_that_keeps_failing_breaks_the_matrix_with_exit_1(tmp_path: Path) -> None:
    sets = [f"run_root='{tmp_path}'", f"model.path='{tmp_path / 'model'}'",
            'faults=[{kind="weights.push_fail", at=[1, 2, 3]}]']  # the first push and both of its retries
    proc = subprocess.run(
        [sys.executable, "-m", "baton.cli", "faults", str(ROOT / "configs" / "faults.toml"),
         "--kinds", "weights.push_fail", "--seeds", "1", *[x for s in sets for x in ("--set", s)]],
        capture_output=True, text=True, cwd=ROOT, timeout=240,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    totals = json.loads(lines[-1])
    assert {k: totals[k] for k in ("runs", "passed", "trained_twice", "lost_uncounted", "over_bound")} == {
        "runs": 1, "passed": 0, "trained_twice": 0, "lost_uncounted": 0, "over_bound": 0
    }
    table = "\n".join(lines[:-1])
    assert "weights.push_fail" in table and "0/1" in table
    assert "PushError" in table and "was refused" in table, "the problem line names the surfaced error"
    assert "did not finish" in table
    assert (Path(totals["dir"]) / "faults.txt").read_text().count("weights.push_fail") >= 1
    run_dir = next(Path(totals["dir"]).glob("faults-weights.push_fail-s0-*"))
    events = [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["fired"] * 3, "refused three times, never recorded as delivered"


def test_baton_faults_refuses_an_unknown_kind() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "baton.cli", "faults", str(ROOT / "configs" / "faults.toml"), "--kinds", "engine.boom"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown fault kind" in proc.stdout + proc.stderr and "engine.crash" in proc.stdout + proc.stderr


def test_the_config_plans_its_faults(tmp_path: Path) -> None:
    from baton.builder import build_pipeline
    from baton.config import load_toml, validate
    from baton.schema import RunConfig
    from pipeline.faults import FaultSpec

    data = load_toml(ROOT / "configs" / "faults.toml", [f"model.path='{tmp_path / 'model'}'"])
    data["store"] = {"kind": "memory"}  # building a Mooncake store would start a master
    pipe = build_pipeline(validate(RunConfig, data))
    assert pipe.faults == [FaultSpec("store.get_fail", (5, 6, 7), 0.0, 0, 5.0)]
    assert pipe.producer.request_timeout_s == 5.0
    data.pop("faults")
    assert build_pipeline(validate(RunConfig, data)).faults is None, "no [[faults]]: no plan at all"
