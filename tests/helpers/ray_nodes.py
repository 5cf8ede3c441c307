"""A Ray cluster of three nodes on this machine, as `docs/guides/multi-node.md` starts one on three machines:
a head on 127.0.0.2 and two workers on 127.0.0.3 and 127.0.0.4 (on Linux all of 127.0.0.0/8 is loopback),
each started by `ray start --block` with its own `--node-ip-address` and a custom resource naming it
(`node_a`, `node_b`, `node_c`), so a config can place a stage on one of them (`ray.resources`).

Each node advertises its own address: Ray gives it to the node's processes, which dial each other there
(Ray's own gRPC servers listen on every interface). None is on 127.0.0.1: Ray replaces a node or head address
of 127.0.0.1 by the machine's unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, and with 0 a worker refuses to join,
so the nodes run with 1; a token authenticates every node and driver (Ray asks for one off 127.0.0.1). A driver
on this machine (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, as baton sets it) joins the head, Ray's pick among a
host's nodes. The nodes share one temp dir of their own (RAY_TMPDIR), and are stopped by their pids, workers
first, then the head (`tests.helpers.ray_head.stop_head`, which SIGKILLs whatever of the temp dir outlived them).
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pipeline.net import free_port
from tests.helpers.ray_head import stop_head

NODES = {"node_a": "127.0.0.2", "node_b": "127.0.0.3", "node_c": "127.0.0.4"}  # the head first


@dataclass(frozen=True)
class LoopbackCluster:
    """The running cluster: `address` is the head's GCS (`ray.address` of a run), `env` the environment a
    driver joining it needs (its temp dir)."""

    address: str
    env: dict[str, str]
    tmp: Path


def _ray_start(name: str, ip: str, head_port: int, cpus: int, tmp: Path, env: dict[str, str]) -> subprocess.Popen:
    if name == "node_a":
        role = ["--head", f"--port={head_port}", "--include-dashboard=false",
                f"--ray-client-server-port={free_port()}"]  # not the default 10001, which another head may hold
    else:
        role = [f"--address={NODES['node_a']}:{head_port}"]
    return subprocess.Popen(
        [shutil.which("ray") or "ray", "start", "--block", *role, f"--node-ip-address={ip}",
         f"--dashboard-agent-listen-port={free_port(ip)}", f"--num-cpus={cpus}", "--num-gpus=0",
         f"--resources={json.dumps({name: 1})}", "--disable-usage-stats"],
        stdout=(tmp / f"{name}.log").open("w"), stderr=subprocess.STDOUT, cwd=tmp,
        env={**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"},  # with 0 a worker refuses to join a cluster
    )


def _wait_for(started: dict[str, subprocess.Popen], tmp: Path,
              again: Callable[[str, str], subprocess.Popen] | None = None) -> None:
    """Until every node's `ray start --block` says its runtime started (as `ray start` without `--block`
    returns then: its raylet has registered with the head). With `again`, a worker whose start failed is
    started once more: Ray gives a raylet 30 s to register, which two workers starting at once on a
    loaded 2-core machine overran (once in six starts)."""
    deadline = time.monotonic() + 150
    retried: set[str] = set()
    for name in list(started):
        log = tmp / f"{name}.log"
        while "Ray runtime started" not in log.read_text():
            if started[name].poll() is not None and again is not None and name not in retried:
                retried.add(name)
                started[name] = again(name, NODES[name])
                continue
            assert started[name].poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)


@contextmanager
def loopback_cluster(cpus_per_node: int = 3) -> Iterator[LoopbackCluster]:
    """Start the head and the two workers, wait until each says it started; stop them on exit."""
    tmp = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    # a cluster on addresses other than 127.0.0.1 wants token authentication: one token for every node and driver
    env.update(RAY_TMPDIR=str(tmp), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")  # the driver's (the nodes': 1)
    port = free_port()
    address = f"{NODES['node_a']}:{port}"
    nodes: dict[str, subprocess.Popen] = {}
    try:
        start = functools.partial(_ray_start, head_port=port, cpus=cpus_per_node, tmp=tmp, env=env)
        nodes["node_a"] = start("node_a", NODES["node_a"])
        _wait_for(nodes, tmp)
        for name in ("node_b", "node_c"):
            nodes[name] = start(name, NODES[name])
        _wait_for(nodes, tmp, start)
        yield LoopbackCluster(address, env, tmp)
    finally:
        for name in reversed(list(nodes)):
            stop_head(nodes[name], tmp) if name == "node_a" else _stop_worker(nodes[name])
        shutil.rmtree(tmp, ignore_errors=True)


def _stop_worker(node: subprocess.Popen) -> None:
    """SIGTERM a worker's `ray start --block` (it stops its raylet and workers); the head's stop then SIGKILLs
    by pid whatever of the temp dir's processes outlived it."""
    node.terminate()
    node.wait(timeout=60)
