"""`baton run` of a config in a subprocess, as a user runs it; its summary (the last stdout line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests import ROOT

# a guard against a hung run, not a speed target: on a machine at half speed (2026-12-02) the agent-feedback
# run took over 240 s; the test's own pytest timeout still bounds the whole test
RUN_TIMEOUT_S = 600


def baton_run(tmp_path: Path, config: str, *overrides: str, env: dict[str, str] | None = None) -> dict:
    """`env`: the run's environment (default: this process's)."""
    overrides = (f"run_root='{tmp_path}'", f"model.path='{tmp_path / 'model'}'", *overrides)
    sets = [x for o in overrides for x in ("--set", o)]
    proc = subprocess.run(
        [sys.executable, "-m", "baton.cli", "run", str(ROOT / "configs" / config), *sets],
        capture_output=True, text=True, cwd=ROOT, timeout=RUN_TIMEOUT_S, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    return json.loads(last)


