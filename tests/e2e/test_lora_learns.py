"""A LoRA run learns the quickstart (configs/quickstart-lora.toml): the adapters alone train and travel,
every version's adapter passes the engine's parity probe, and reward climbs from ~0.01 to the quickstart's
level (nightly, ~1-2 min on 2 cores); a short run resumes from a checkpoint of the adapter (long)."""

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

STEPS = 300


def lora_run(tmp_path: Path, steps: int, every: int) -> tuple[Path, list[dict]]:
    data = load_toml(ROOT / "configs" / "quickstart-lora.toml")
    data.update(steps=steps, run_root=str(tmp_path / "runs"), model={"path": str(tmp_path / "model")},
                telemetry={"progress": False, "log_level": "warning"}, checkpoint={"every": every})
    summary = build_pipeline(validate(RunConfig, data)).run()
    assert summary["version"] == steps and summary["ledger_balanced"]
    run_dir = Path(summary["run_dir"])
    return run_dir, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.nightly  # 300 versions; the resume below is in CI's long suite
def test_the_quickstart_with_lora_learns(tmp_path: Path) -> None:
    _, metrics = lora_run(tmp_path, STEPS, every=0)
    early, late = (statistics.mean(m["reward"] for m in part) for part in (metrics[:20], metrics[-30:]))
    assert early < 0.1 and late >= 0.75, (early, late)


@pytest.mark.long
def test_a_lora_run_travels_adapters_and_resumes_from_one(tmp_path: Path) -> None:
    steps = 12
    run_dir, metrics = lora_run(tmp_path, steps, every=5)
    full_bytes = (tmp_path / "model" / "model.safetensors").stat().st_size
    assert all(m["weights"]["state_bytes"] < 0.2 * full_bytes for m in metrics), "each version is the adapter alone"
    assert not any(key.startswith("events/weights.refused") for m in metrics for key in m), "every probe passed"
    checkpoint = sorted((run_dir / "checkpoints").glob("v*/consumer"))[-1]
    _, adapter = read_adapter(checkpoint)  # every model weight the checkpoint holds: the adapter's, no base
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    resumed = resume_run(run_dir, [f"steps={steps + 4}"])
    assert resumed["version"] == steps + 4 and resumed["ledger_balanced"]
