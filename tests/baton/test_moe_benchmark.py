"""benchmarks/moe.py: its figures from rows it would record, and its smoke form (`--quick`: one push step and a
4-version routing run of the MoE quickstart, ~45 s on 2 loaded cores, hence `long`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import moe

ROOT = Path(__file__).resolve().parents[2]


def test_ratios_compare_bytes_summed_over_steps_and_need_every_seed() -> None:
    push = [{"row": "push", "full_bfloat16": 100, "element_sparse_bfloat16": 50, "expert_sparse_bfloat16": 40,
             "full_float32": 200, "element_sparse_float32": 150, "expert_sparse_float32": 150}] * 2
    learn = [{"row": "learning", "k": 8, "replay": "rollout", "seed": s, "reached": True, "versions_to_target": v}
             for s, v in ((0, 300), (1, 360))]
    learn += [{"row": "learning", "k": 8, "replay": "off", "seed": 0, "reached": True, "versions_to_target": 400},
              {"row": "learning", "k": 8, "replay": "off", "seed": 1, "reached": False, "versions_to_target": None}]
    learn += [{"row": "learning", "k": 2, "replay": "rollout", "seed": s, "reached": True, "versions_to_target": v}
              for s, v in ((0, 250), (1, 280))]
    routing = [{"row": "routing", "k": 0, "replay": "rollout", "router_disagreement_mean": 0.0,
                "logprob_gap_mean": 8e-8}]
    ratios = moe.ratios([*push, *learn, *routing])
    assert ratios["expert_sparse_vs_element_sparse_bf16"] == 0.8 and ratios["element_sparse_vs_full_bf16"] == 0.5
    assert ratios["expert_sparse_vs_element_sparse_fp32"] == 1.0
    assert ratios["versions_replay_on_vs_off_k8"] is None  # off missed the target at seed 1
    assert (ratios["reached_on"], ratios["reached_off"]) == (1.0, 0.5)  # k = 8 only: k = 2's rows apart
    assert (ratios["reached_k2_on"], ratios["versions_k2_on_worst"]) == (1.0, 280)
    assert ratios["router_disagreement_k0_rollout"] == 0.0
    assert not any("expert_parallel" in key or "ep" in key.split("_") for key in ratios)  # no EP rows: no EP figures


@pytest.mark.long
def test_the_quick_form_prints_push_bytes_and_a_routing_row(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/moe.py", "--quick"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    ratios = result["ratios"]
    assert ratios["expert_sparse_vs_element_sparse_bf16"] <= 1.0 and ratios["element_sparse_vs_full_bf16"] <= 1.0
    assert "router_disagreement_k0_rollout" in ratios
