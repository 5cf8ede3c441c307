"""A LoRA run learns the quickstart (configs/quickstart-lora.toml): the adapters alone train and travel,
every version's adapter passes the engine's parity probe, and reward climbs from ~0.01 to the quickstart's
level; then it resumes from a checkpoint of the adapter. ~1-2 min on 2 cores."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from baton.builder import build_pipeline
from baton.config import load_toml, validate
from baton.resume import resume_run
from baton.schema import RunConfig
from stages.learner.state import read_adapter
from tests import ROOT

pytestmark = pytest.mark.long
STEPS = 300


def test_the_quickstart_with_lora_learns_and_resumes(tmp_path: Path) -> None:
    data = load_toml(ROOT / "configs" / "quickstart-lora.toml")
    data.update(steps=STEPS, run_root=str(tmp_path / "runs"), model={"path": str(tmp_path / "model")},
                telemetry={"progress": False, "log_level": "warning"}, checkpoint={"every": 100})
    summary = build_pipeline(validate(RunConfig, data)).run()
    assert summary["version"] == STEPS and summary["ledger_balanced"]
    run_dir = Path(summary["run_dir"])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    early, late = (statistics.mean(m["reward"] for m in part) for part in (metrics[:20], metrics[-30:]))
    assert early < 0.1 and late >= 0.75, (early, late)
    full_bytes = (tmp_path / "model" / "model.safetensors").stat().st_size
    assert all(m["weights"]["state_bytes"] < 0.2 * full_bytes for m in metrics), "each version is the adapter alone"
    assert not any(key.startswith("events/weights.refused") for m in metrics for key in m), "every probe passed"
    checkpoint = sorted((run_dir / "checkpoints").glob("v*/consumer"))[-1]
    _, adapter = read_adapter(checkpoint)  # every model weight the checkpoint holds: the adapter's, no base
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    resumed = resume_run(run_dir, [f"steps={STEPS + 20}"])
    assert resumed["version"] == STEPS + 20 and resumed["ledger_balanced"]
