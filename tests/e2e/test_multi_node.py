"""baton on a Ray cluster of three nodes (issue 52, item 4), as docs/guides/multi-node.md runs it on three
machines, here on one: a head on 127.0.0.2 and workers on 127.0.0.3 and 127.0.0.4, each with a custom
resource naming it (`tests.helpers.ray_nodes`), shared by the module's tests. `ray.resources` sends the
engines, the buffer (the Mooncake segment's holder), the learner and its other rank to different nodes;
each run ends with a clean audit, Ray's own record of the run's actors says each ran on the node asked for,
and the run's log says every address it served on is its process's node's: the rendezvous of the learner's
ranks, the segment, the Mooncake master (on the driver's node, the head)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.ledger_checks import check_ledger
from tests.helpers.ray_nodes import NODES, LoopbackCluster, loopback_cluster
from tests.helpers.runs import baton_run

pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # and each test `long` (CI runs it after the suite) or `nightly`
HEAD = NODES["node_a"]


@pytest.fixture(scope="module")
def cluster() -> LoopbackCluster:
    with loopback_cluster(cpus_per_node=3) as running:
        yield running


def placed(tag: str, where: dict[str, str]) -> list[str]:
    """`--set` overrides for `ray.resources`: {role: node}, a hundredth of the node's resource each process."""
    return [f"ray.resources.{role}={{{node} = 0.01}}" for role, node in where.items()] + [f"name='{tag}'"]


ACTOR_TABLE = """
import json, ray
ray.init(address="{address}", include_dashboard=False, log_to_driver=False)
print(json.dumps([[a.get("Name") or "", a["ActorClassName"], a["JobID"], a["Address"]["IPAddress"]]
                  for a in ray._private.state.actors().values()]))
"""


def actor_nodes(cluster: LoopbackCluster, run_dir: Path) -> dict[str, list[str]]:
    """{role: [node IP, ...]} of the run's actors (its hosts by role; its helpers, the learner's other ranks,
    as "learner_ranks"), from Ray's own record of them: the GCS's actor table, which keeps dead actors (read
    by a driver of its own, in a process of its own: Ray takes its token from the environment it imports in)."""
    out = subprocess.run([sys.executable, "-c", ACTOR_TABLE.format(address=cluster.address)],
                         env={**os.environ, **cluster.env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    table = json.loads(out.stdout.strip().splitlines()[-1])
    hosts = [(name, job, ip) for name, _, job, ip in table if f"/{run_dir.name}/" in name]
    nodes: dict[str, list[str]] = {}
    for name, _, ip in hosts:
        nodes.setdefault(name.rsplit("/", 1)[1].split("-")[0], []).append(ip)
    for _, cls, job, ip in table:  # the run's helpers: unnamed, started by its job
        if cls == "HelperHost" and job == hosts[0][1]:
            nodes.setdefault("learner_ranks", []).append(ip)
    return nodes


def logged(run_dir: Path, event: str, key: str) -> list[str]:
    """The values of `key` on the run log's lines of `event` (every host's events reach run.log)."""
    lines = [line for line in (run_dir / "run.log").read_text().splitlines() if event in line]
    return [m.group(1) for line in lines if (m := re.search(rf"\b{key}=(\S+)", line))]


def run_across(cluster: LoopbackCluster, tmp_path: Path, tag: str, where: dict[str, str], *sets: str) -> dict:
    env = {k: v for k, v in {**os.environ, **cluster.env}.items() if k != "BATON_HOST"}  # each process finds its own
    s = baton_run(tmp_path, "ray-mooncake.toml", f"ray.address='{cluster.address}'", "telemetry.progress=false",
                  *placed(tag, where), *sets, env=env)
    assert s["runtime"] == "ray" and s["ledger_balanced"] and s["samples"]["lost"] == 0, s
    return s


@pytest.mark.long
@pytest.mark.timeout(900)  # with the module's cluster start (50-80 s on a loaded 2-core machine)
def test_two_ranks_train_with_engines_segment_and_ranks_on_different_nodes(
        cluster: LoopbackCluster, tmp_path: Path) -> None:
    """Learner rank 0 on node b, rank 1 on node c with the engines, the buffer (the segment) on the head:
    every sample trained once within the bound (learning itself: the nightly local two-rank run in
    tests/e2e/test_sharded_learner.py); the followers dialled rank 0's node for the rendezvous."""
    where = {"engine": "node_c", "buffer": "node_a", "learner": "node_b", "learner_ranks": "node_c"}
    s = run_across(cluster, tmp_path, "mn-ranks", where, "steps=30", "learner.world_size=2")
    run_dir = Path(s["run_dir"])
    assert s["version"] == 30
    records = check_ledger(run_dir, bound=2)
    assert sum(r["fate"] == "trained" for r in records) == s["samples"]["trained"] > 0
    nodes = actor_nodes(cluster, run_dir)
    assert nodes == {"producer": [NODES["node_c"]] * 2, "buffer": [HEAD], "consumer": [NODES["node_b"]],
                     "learner_ranks": [NODES["node_c"]]}, nodes
    (rendezvous,) = logged(run_dir, "rank rendezvous", "address")
    assert rendezvous.rsplit(":", 1)[0] == NODES["node_b"], rendezvous
    assert_store_addresses(run_dir, holder=HEAD, clients={NODES["node_b"], NODES["node_c"]})


@pytest.mark.nightly  # +85 s: the two-rank run above places every role on a node of its own already
@pytest.mark.timeout(900)
def test_the_quickstart_runs_across_three_nodes(cluster: LoopbackCluster, tmp_path: Path) -> None:
    """configs/ray-mooncake.toml (the quickstart distributed), engines on node b, the buffer on node c,
    the learner on the head: a clean audit, each actor on its node, the segment on node c's address."""
    where = {"engine": "node_b", "buffer": "node_c", "learner": "node_a"}
    s = run_across(cluster, tmp_path, "mn-quickstart", where, "steps=20")
    run_dir = Path(s["run_dir"])
    assert s["version"] == 20
    check_ledger(run_dir, bound=2)
    nodes = actor_nodes(cluster, run_dir)
    assert nodes == {"producer": [NODES["node_b"]] * 2, "buffer": [NODES["node_c"]], "consumer": [HEAD]}, nodes
    assert_store_addresses(run_dir, holder=NODES["node_c"], clients={NODES["node_b"], HEAD})


def assert_store_addresses(run_dir: Path, holder: str, clients: set[str]) -> None:
    """The segment's holder advertised its node's address, every other process its own, and all of them
    used the master the driver started on its node (the head)."""
    hosts, sizes = logged(run_dir, "host placed", "local_hostname"), logged(run_dir, "host placed", "segment_bytes")
    masters = set(logged(run_dir, "host placed", "master"))
    assert [h for h, size in zip(hosts, sizes, strict=True) if int(size) > 0] == [holder], (hosts, sizes)
    assert {h for h, size in zip(hosts, sizes, strict=True) if int(size) == 0} == clients, (hosts, sizes)
    assert len(masters) == 1 and next(iter(masters)).rsplit(":", 1)[0] == HEAD, masters
