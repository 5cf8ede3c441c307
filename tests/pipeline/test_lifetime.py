"""What a run starts ends with it, also when it is SIGKILLed: a real mooncake_master and a plain child
started with `die_with_parent` are gone soon after their parent is killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import ROOT

PARENT = """
import json, subprocess, sys, time
from buffers.mooncake_master import MooncakeMaster
from pipeline.lifetime import die_with_parent
master = MooncakeMaster().start()
child = subprocess.Popen(["sleep", "600"], preexec_fn=die_with_parent)
print(json.dumps({"master": master.pid, "child": child.pid}), flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (reaped by init soon) is as good as gone
        return stat.read().split(") ")[1][0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_die_with_a_sigkilled_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        pids = json.loads(parent.stdout.readline())
        assert alive(pids["master"]) and alive(pids["child"])
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while (alive(pids["master"]) or alive(pids["child"])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pids["master"]), "the mooncake_master outlived the process that started it"
        assert not alive(pids["child"])
    finally:
        parent.kill()
