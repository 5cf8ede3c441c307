"""runtime = "ray" against a real local Ray cluster and a real mooncake_master: every actor in its
own process, the run learns and accounts for every sample, and a producer killed mid-run is
restarted with nothing lost and nothing trained twice."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import ray  # noqa: E402

from buffers.mooncake import MooncakeSettings, MooncakeStoreSpec  # noqa: E402
from buffers.ref_buffer import RefBuffer  # noqa: E402
from pipeline.actor import ActorFailed  # noqa: E402
from pipeline.dsl import Pipeline  # noqa: E402
from policies import MaxStaleness  # noqa: E402
from stages import GRPOLearner, Rollout, TorchEngine, make_tiny_model, tasks  # noqa: E402
from tests.helpers.ledger_checks import check_ledger

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


def pipeline(model: Path, root: Path, steps: int, weights: object = "inproc") -> Pipeline:
    return Pipeline(
        name="t",
        steps=steps,
        run_root=root,
        runtime="ray",
        progress=False,
        producer=Rollout(
            tasks.ReverseDigits(digits=2),
            [TorchEngine(model, name="torch-0"), TorchEngine(model, name="torch-1", seed=1)],
            tokenizer=model, group_size=8, batch_groups=8,
        ),
        buffer=RefBuffer(MooncakeStoreSpec(MooncakeSettings(global_segment_size=256 << 20), master="auto")),
        consumer=GRPOLearner(model, groups_per_step=8, weights=weights),
        staleness=MaxStaleness(k=2),
    )


def test_every_actor_in_its_own_process_and_nothing_unaccounted(ray_cluster, model: Path, tmp_path: Path) -> None:
    s = pipeline(model, tmp_path, steps=15).run()
    assert s["runtime"] == "ray" and s["version"] == 15
    assert s["samples"]["trained"] == 15 * 8 * 8
    assert s["samples"]["lost"] == 0
    assert s["ledger_balanced"]
    assert s["max_staleness_trained"] <= 2
    records = check_ledger(Path(s["run_dir"]), bound=2)
    workers = {r["group"].split(".")[0] for r in records if r["fate"] == "trained"}
    assert workers == {"torch-0", "torch-1"}, "both producer processes contributed"
    metrics = [json.loads(line) for line in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == list(range(1, 16))
    assert "run starting on ray" in (Path(s["run_dir"]) / "run.log").read_text()  # the run's log, on Ray too
    assert (tmp_path / "latest").resolve() == Path(s["run_dir"]).resolve()
    # the driver's node address was for that run only: a later run (here, another test) finds its own
    assert "BATON_HOST" not in os.environ


def kill_host_when(root: Path, version: int, killed: list[int], host: str = "producer-0") -> threading.Thread:
    def watch() -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            runs = list(root.glob("t-*"))
            metrics = runs[0] / "metrics.jsonl" if runs else None
            if metrics and metrics.exists() and len(metrics.read_text().splitlines()) >= version:
                actor = ray.get_actor(f"baton/t/{runs[0].name}/{host}")
                pid = ray.get(actor.pid.remote())
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.long  # a slow integration run: in the long suite
def test_a_killed_producer_is_restarted_and_nothing_is_lost(ray_cluster, model: Path, tmp_path: Path) -> None:
    """With weights pushed over TransferEngine (mooncake_p2p): pushes to the dead process are skipped,
    the other engine keeps getting every version, and the restarted one is caught up at once."""
    from stages.weights.mooncake_p2p import MooncakeP2PTransport

    killed: list[int] = []
    watcher = kill_host_when(tmp_path, version=3, killed=killed)
    s = pipeline(model, tmp_path, steps=80, weights=MooncakeP2PTransport(bucket_bytes=256 << 10)).run()
    watcher.join(timeout=1)
    assert killed, "the producer was killed mid-run"
    assert s["restarts"] == {"producer-0": 1}
    assert s["version"] == 80, "the run finished after the restart"
    assert s["ledger_balanced"]
    assert s["samples"]["lost"] == 0
    records = check_ledger(Path(s["run_dir"]), bound=2)
    trained = [r["group"] for r in records if r["fate"] == "trained"]
    incarnations = {g.split(".")[1] for g in trained if g.startswith("torch-0.")}
    # trained within the bound, so the restarted engine got the learner's weights (not version 0)
    assert len(incarnations) == 2, "the restarted producer process produced groups that were trained"


@pytest.mark.long  # a slow integration run: in the long suite
def test_a_dead_buffer_stops_the_run_naming_it(ray_cluster, model: Path, tmp_path: Path) -> None:
    killed: list[int] = []
    watcher = kill_host_when(tmp_path, version=2, killed=killed, host="buffer-0")
    with pytest.raises(ActorFailed) as err:
        pipeline(model, tmp_path, steps=40).run()
    watcher.join(timeout=1)
    assert killed
    assert err.value.actor in ("buffer-0", "consumer-0")  # the buffer, or the learner reading its store
    assert "buffer-0" in str(err.value) or "died" in str(err.value) or "Mooncake" in str(err.value)
