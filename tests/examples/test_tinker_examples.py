"""examples/tinker/sft.py in a smoke form against a real `baton serve` it starts: the official tinker SDK's SFT
loop lowers its loss, and the same batches trained directly on baton's learner trainer give the same losses.
Skips without the SDK (`pip install -e '.[tinker]'`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker", reason="the tinker SDK is not installed: pip install -e '.[tinker]'")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
@pytest.mark.timeout(180)
def test_the_sft_example_lowers_its_loss_as_the_direct_run_does(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TINKER_TELEMETRY": "0"}
    env.pop("TINKER_BASE_URL", None)
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "tinker" / "sft.py"), "--steps", "6", "--batch",
                           "16", "--lr", "1e-2", "--folder", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    sdk, direct = result["sdk_loss"], result["direct_loss"]
    assert len(sdk) == len(direct) == 6
    assert sdk[-1] < 0.75 * sdk[0], f"the loss did not fall: {sdk}"
    assert max(abs(a - b) for a, b in zip(sdk, direct, strict=True)) < 1e-4, (sdk, direct)
