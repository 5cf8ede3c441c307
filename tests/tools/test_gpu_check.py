"""tools/gpu_check.py, the device check, on the CPU with the tiny shape: the same code a lent GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long  # CI time: in the long suite
def test_the_device_check_runs_on_cpu_and_its_deltas_rebuild_each_version(tmp_path: Path) -> None:
    cmd = [sys.executable, "tools/gpu_check.py", "--shape", "tiny", "--device", "cpu", "--batch", "8",
           "--new-tokens", "8", "--steps", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    assert result["engine"]["tokens"] == 8 * 8 and result["engine"]["version"] == 1
    assert len(result["learner"]["step_s"]) == 4
    sends = result["sparse"]["lr=1e-06"] + result["sparse"]["lr=1e-05"]
    assert [s["base"] for s in sends] == [0, 1, 2, 3]  # each version a delta on the one before, verified
    assert all(0 < s["changed_frac"] < 1 and s["bytes_vs_full"] < 1 for s in sends)
    lora = result["lora"]  # the adapter trained, was published with its probe, and the engine merged it
    assert lora["adapters_merged"] == 1 and lora["adapters_refused"] == 0 and lora["engine_version"] == 2
    assert 0 < lora["adapter_bytes_vs_full"] < 1 and lora["trainable"] < result["learner"]["params"]
    assert "skipped" in result["mooncake_cuda"]  # no CUDA here (nor, maybe, mooncake)


@pytest.mark.slow
def test_the_moe_row_replays_the_engines_routing_on_cpu(tmp_path: Path) -> None:
    """`--rows moe`: the learner steps on rows a bf16 copy of the tiny MoE scored; with routing replay it
    routes every completion token as that engine did, without it the numerics alone make some differ."""
    cmd = [sys.executable, "tools/gpu_check.py", "--shape", "tiny", "--device", "cpu", "--rows", "moe",
           "--batch", "8", "--steps", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    assert set(result) == {"shape", "device", "torch", "gpu", "moe"}  # the MoE row alone
    moe = result["moe"]
    off, on = moe["replay_off"], moe["replay_rollout"]
    assert len(off["step_s"]) == len(on["step_s"]) == 2
    assert on["router_disagreement"] == 0 and off["router_disagreement"] == off["router_drift"]
    assert on["router_drift"] == off["router_drift"]  # the same weights route the same on their own
    assert 0 <= on["logprob_gap"] < 0.05 and 0 <= off["logprob_gap"] < 0.05
