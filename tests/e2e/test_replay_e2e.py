"""Replay reuse and dynamic sampling in short real runs (torch engine, GRPO learner, memory store):
the ledger balances with reuse and filtering counted, and a run whose groups never carry signal fails
with a clear error instead of waiting forever."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# passes `baton check`: 4 + (2 + 4 + 2) + 16 = 28 groups can be in flight, x 2 uses / 16 per step = 4 <= k
REUSE = (
    "steps=16", "staleness.k=4", "replay.max_reuse=2", "replay.drop_zero_signal=true", "engine.batch_groups=4",
    "buffer.produced_channel=2", "buffer.max_refs=4", "buffer.ready_channel=2", "telemetry.progress=false",
)


def baton(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    overrides = (f"run_root='{tmp_path}'", f"model.path='{tmp_path / 'model'}'", *overrides)
    sets = [x for o in overrides for x in ("--set", o)]
    return subprocess.run(
        [sys.executable, "-m", "baton.cli", "run", str(ROOT / "configs" / "quickstart.toml"), *sets],
        capture_output=True, text=True, cwd=ROOT, timeout=240,
    )


@pytest.mark.long  # CI time: in the long suite
def test_reuse_and_filtering_are_accounted_for_exactly(tmp_path: Path) -> None:
    proc = baton(tmp_path, *REUSE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    samples, run_dir = s["samples"], Path(s["run_dir"])
    assert s["ledger_balanced"] and s["version"] == 16
    assert samples["produced"] == (
        samples["trained"] + samples["dropped"] + samples["lost"] + samples["regenerated"] + s["in_flight"]
    )
    assert samples["reused"] > 0 and samples["filtered"] > 0  # a random-init model gives many all-0 groups
    assert samples["filtered"] <= samples["dropped"]
    records = json.loads((run_dir / "ledger.json").read_text())
    uses = [len(r["trained_at"]) for r in records]
    assert max(uses) == 2 and sum(u - 1 for u in uses if u > 1) == samples["reused"]
    for r in records:
        assert all(at - r["versions"][0] <= 4 for at in r["trained_at"]), r  # every use within k
        assert r["trained_at"] == sorted(set(r["trained_at"]))  # reuse is at later versions, never twice in one
        if r["reason"].startswith("filtered"):
            assert r["fate"] == "dropped" and r["trained_at"] == []
    assert sum(r["reason"].startswith("filtered") for r in records) == samples["filtered"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    group_size = 8
    assert sum(m["groups_filtered"] for m in metrics) * group_size == samples["filtered"]
    assert sum(m["groups_reused"] for m in metrics) * group_size == samples["reused"]
    assert all(0.0 <= m["filtered_frac"] <= 1.0 for m in metrics) and any(m["filtered_frac"] > 0 for m in metrics)
    assert max(m["staleness_max"] for m in metrics) <= 4
    assert (run_dir / "report.png").stat().st_size > 0


@pytest.mark.long  # CI time: in the long suite
def test_a_run_whose_groups_never_carry_signal_fails_instead_of_hanging(tmp_path: Path) -> None:
    # near-greedy sampling: the 8 completions of a prompt are identical, so their rewards are equal
    proc = baton(tmp_path, "steps=5", "engine.temperature=0.001", "replay.drop_zero_signal=true",
                 "replay.max_filtered_batches=1", "telemetry.progress=false")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "NoSignalError" in proc.stderr and "replay.max_filtered_batches" in proc.stderr
