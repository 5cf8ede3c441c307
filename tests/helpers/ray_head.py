"""A Ray head started by hand for a test, in a temp dir of its own (RAY_TMPDIR), and stopped by its pid."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def pids_under(tmp: Path) -> list[int]:
    """Processes whose command line names `tmp` (the head's own processes)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(tmp).encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def stop_head(head: subprocess.Popen, tmp: Path) -> None:
    """SIGTERM the `ray start --block` process (it stops what it started), then SIGKILL by pid whatever outlived it."""
    head.send_signal(signal.SIGTERM)
    head.wait(timeout=60)
    deadline = time.monotonic() + 30
    while pids_under(tmp) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in pids_under(tmp):
        os.kill(pid, signal.SIGKILL)
