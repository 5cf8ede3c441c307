"""A local Ray run is always its own: without ray.address baton starts a new cluster even when a head
started by hand is running, or was stopped and left its address behind; with ray.address it joins that
cluster; one that cannot be reached fails naming ray.address. The head runs on this machine, in a temp
dir of its own (RAY_TMPDIR, so no other Ray user on the machine sees it), and is stopped by its pid."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from pipeline.net import free_port  # noqa: E402
from pipeline.runtime.ray import RayRun  # noqa: E402
from tests.helpers.ray_head import stop_head  # noqa: E402

# slow integration runs: in the long suite (CI runs it after the suite)
pytestmark = [pytest.mark.slow, pytest.mark.long]


def _start_head(tmp: Path, port: int) -> subprocess.Popen:
    """A head on this machine's own address (the one Ray resolves 127.0.0.1 to when joining)."""
    env = {**os.environ, "RAY_TMPDIR": str(tmp), "RAY_AUTH_MODE": "disabled"}
    log = (tmp / "head.log").open("w")
    head = subprocess.Popen(
        [shutil.which("ray") or "ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=1",
         f"--node-ip-address={ray.util.get_node_ip_address()}",
         "--include-dashboard=false", "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    deadline = time.monotonic() + 180
    while "Ray runtime started" not in (tmp / "head.log").read_text():
        assert head.poll() is None and time.monotonic() < deadline, (tmp / "head.log").read_text()[-2000:]
        time.sleep(0.5)
    return head


def _cluster(address: str | None) -> tuple[str, float]:
    """(GCS address, CPUs) of the cluster RayRun's start joins; disconnects again."""
    RayRun(address=address)._start_ray(hosts_needed=3)
    try:
        return ray.get_runtime_context().gcs_address, ray.cluster_resources()["CPU"]
    finally:
        ray.shutdown()


@pytest.mark.timeout(600)
def test_local_runs_start_their_own_cluster_and_an_address_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths live under it
    monkeypatch.setenv("RAY_TMPDIR", str(tmp))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    port = free_port()
    head = _start_head(tmp, port)
    try:
        joined, head_cpus = _cluster(f"127.0.0.1:{port}")
        assert joined.endswith(f":{port}") and head_cpus == 1
        own, own_cpus = _cluster(None)  # a head runs, but no address is configured
        assert not own.endswith(f":{port}") and own_cpus >= 3
    finally:
        stop_head(head, tmp)
    assert (tmp / "ray" / "ray_current_cluster").exists()  # the dead head's address stays behind
    own, own_cpus = _cluster(None)  # before: tried to join the dead cluster and failed
    assert not own.endswith(f":{port}") and own_cpus >= 3
    with pytest.raises(ConnectionError, match=r"ray\.address = 'no-such-host': could not join"):
        _cluster("no-such-host")
    shutil.rmtree(tmp, ignore_errors=True)


@ray.remote(num_cpus=1)
class Holder:
    def ready(self) -> bool:
        return True


@pytest.mark.timeout(600)
def test_an_actor_the_cluster_cannot_place_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a head of one CPU: an actor asking for a GPU fails before anything waits; one asking for a CPU
    while another actor holds it fails after the bounded wait; both name the actor and what it asked for."""
    import asyncio

    from pipeline.contracts import Resources
    from pipeline.runtime.ray_placement import ActorUnplaceable, Needs, await_placed, check_feasible

    tmp = Path(tempfile.mkdtemp(prefix="rp", dir="/tmp"))
    monkeypatch.setenv("RAY_TMPDIR", str(tmp))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    port = free_port()
    head = _start_head(tmp, port)
    try:
        ray.init(address=f"127.0.0.1:{port}", include_dashboard=False)
        with pytest.raises(ActorUnplaceable, match=r"actor consumer-0 asks for 1 CPU and 1 GPU and no node"):
            check_feasible({"producer-0": Needs(Resources()), "consumer-0": Needs(Resources(gpus=1))})
        # a custom resource no node was started with (ray.resources naming a node that is not there)
        with pytest.raises(ActorUnplaceable, match=r"actor buffer-0 asks for 1 CPU and 0.01 node_z and no node"):
            check_feasible({"buffer-0": Needs(Resources(), {"node_z": 0.01})})
        from ray.util.placement_group import placement_group

        held = placement_group([{"CPU": 1}])  # another job holds the only CPU
        assert ray.get(held.ready(), timeout=60)
        # detached: Ray once cancelled the pending actor as unreferenced under load (ActorDiedError, not a wait)
        waiting = Holder.options(lifetime="detached", name=f"holder-{port}").remote()
        needs = {"producer-0": Needs(Resources())}
        with pytest.raises(ActorUnplaceable, match=r"producer-0 not placed within 5 s \(asking for producer-0: "
                           r"1 CPU\); the cluster has 1 CPU and 0 GPU"):
            asyncio.run(await_placed({"producer-0": waiting.ready.remote()}, needs, timeout_s=5))
    finally:
        ray.shutdown()
        stop_head(head, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
