"""The whole pipeline on Mooncake Store: the quickstart config with an auto-started master, and a
master restart mid-run whose lost keys are detected, counted and redone."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import anyio
import psutil
import pytest
import torch

from buffers.mooncake import MooncakeSettings, MooncakeStore
from buffers.mooncake_master import MooncakeMaster
from buffers.ref_buffer import RefBuffer
from pipeline.actor import BaseActor
from pipeline.dsl import Pipeline
from policies import MaxStaleness
from stages.data.model import make_tiny_model
from stages.data.tasks import ReverseDigits
from stages.engines.torch import TorchEngine
from stages.learner import GRPOLearner
from stages.rollout import Rollout

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def masters_running() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "mooncake/mooncake_master"], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def masters_started_by(pid: int) -> set[int]:
    """The masters among `pid`'s descendants (a Ray run's own cluster is the driver's child too): what a run
    started, whatever other runs on the machine start meanwhile."""
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    return {child.pid for child in descendants if child.pid in masters_running()}


@pytest.mark.long  # CI time: in the long suite
def test_quickstart_on_mooncake_stops_its_master(tmp_path: Path) -> None:
    """The run's own masters (its descendants, watched while it runs: other tests on the machine start
    theirs meanwhile) are gone when it exits."""
    sets = [f"run_root='{tmp_path}'", f"model.path='{tmp_path / 'model'}'", "steps=20"]
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "baton.cli", "run", str(ROOT / "configs" / "quickstart-mooncake.toml"),
             *[x for s in sets for x in ("--set", s)]],
            stdout=stdout, stderr=stderr, text=True, cwd=ROOT,
        )
        started: set[int] = set()
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            started |= masters_started_by(proc.pid)
            time.sleep(0.1)
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err.read_text()[-3000:]
    summary = json.loads(out.read_text().strip().splitlines()[-1])
    assert summary["version"] == 20
    assert summary["samples"]["lost"] == 0
    assert summary["samples"]["trained"] == 20 * 16 * 8
    assert summary["ledger_balanced"]
    assert summary["max_staleness_trained"] <= 2
    assert len(started) == 1, f"the run should start one master of its own, saw {started}"
    assert not started & masters_running(), "the auto-started master was stopped at exit"


@pytest.mark.long  # a slow integration run: in the long suite
@pytest.mark.parametrize("config", [
    "quickstart-mooncake.toml",
    # Ray's init installs its own SIGTERM handlers (one aborts the driver, leaving the master behind)
    pytest.param("ray-mooncake.toml", marks=pytest.mark.long),
])
def test_a_killed_run_stops_the_master_it_started(tmp_path: Path, config: str) -> None:
    """SIGTERM (a scheduler's kill) unwinds `baton run` like Ctrl-C: exit 130, and the mooncake_master
    it started is gone, not left behind. It is delivered as Ctrl-C is (a cancelled run), never as an
    exception raised at a random point: one raised inside a weakref callback is dropped and the run went on."""
    sets = [f"run_root='{tmp_path}'", f"model.path='{tmp_path / 'model'}'", "steps=100000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", "run", str(ROOT / "configs" / config),
         *[x for s in sets for x in ("--set", s)]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        for _ in range(1200):  # until the run trains (its master is up by then)
            if any(tmp_path.glob("*/metrics.jsonl")) or proc.poll() is not None:
                break
            time.sleep(0.1)
        started = masters_started_by(proc.pid)
        assert proc.poll() is None and len(started) == 1, proc.stderr.read()[-3000:] if proc.poll() else started
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err
    for _ in range(50):
        if not started & masters_running():
            break
        time.sleep(0.1)
    assert not started & masters_running(), "the run's master outlived it"


class RestartMasterAt(BaseActor):
    """Kills the master at a version and starts a new one on the same port (every key is lost)."""

    name = "master-restarter"

    def __init__(self, ctx, master: MooncakeMaster, version: int) -> None:
        self.ctx, self.master, self.version = ctx, master, version
        self.restarted: MooncakeMaster | None = None

    async def run(self) -> None:
        await self.ctx.clock.wait_until(self.version)
        while self.ctx.channels["ready"].depth == 0:  # refs whose keys are stored but not yet read
            await anyio.sleep(0.001)
        port = self.master.port
        self.master.kill()
        self.restarted = MooncakeMaster(port, lease_ttl_ms=500).start()


def test_master_restart_loses_keys_that_are_counted_and_redone(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "model")
    master = MooncakeMaster(lease_ttl_ms=500).start()
    restarter: list[RestartMasterAt] = []
    try:
        store = MooncakeStore(
            MooncakeSettings(master_server_address=master.address, global_segment_size=256 << 20, full_wait_s=60)
        )

        def add_restarter(ctx):
            restarter.append(RestartMasterAt(ctx, master, version=3))
            return restarter

        pipe = Pipeline(
            name="restart", steps=10, run_root=tmp_path, progress=False,
            producer=Rollout(ReverseDigits(digits=2), [TorchEngine(model)], tokenizer=model, group_size=4,
                             batch_groups=4),
            buffer=RefBuffer(store),
            consumer=GRPOLearner(model, groups_per_step=4),
            staleness=MaxStaleness(k=2),
            hooks=[add_restarter],
        )
        summary = pipe.run()
    finally:
        master.stop()
        for r in restarter:
            if r.restarted:
                r.restarted.stop()
    assert restarter[0].restarted is not None
    assert summary["version"] == 10, "the run finished after the restart"
    assert summary["samples"]["lost"] > 0, "keys held before the restart were found missing"
    assert summary["ledger_balanced"]
    lost = [r for r in json.loads((Path(summary["run_dir"]) / "ledger.json").read_text()) if r["fate"] == "lost"]
    assert all("NOT_FOUND" in r["reason"] or "TRANSFER_FAIL" in r["reason"] or "RPC_FAIL" in r["reason"] for r in lost)
    assert pipe.producer.stats.get("redone", 0) > 0, "the lost groups' prompts were produced again"
