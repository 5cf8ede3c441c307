"""`init_own_cluster` (pipeline.runtime.ray), the one way baton, its local-runtime Ray store and its
benchmarks start Ray, starts a cluster of the process's own on a machine where a head was started by
hand and stopped (its address left in ray_current_cluster) and where RAY_ADDRESS names a dead cluster:
there plain `ray.init(num_cpus=...)` fails, as benchmarks/datapath.py did. Ray's temp dir is a folder
of this test's own (RAY_TMPDIR), so no other Ray user on the machine is touched."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from pipeline.net import free_port  # noqa: E402
from pipeline.runtime.ray import init_own_cluster  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def stale_machine(monkeypatch: pytest.MonkeyPatch):
    """Ray's temp dir holding the address of a head that is gone; RAY_ADDRESS naming another dead one."""
    tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths live under it
    (tmp / "ray").mkdir()
    (tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp))
    yield tmp, monkeypatch
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ray_address", [None, "dead"])
def test_an_own_cluster_starts_where_a_stale_one_is_recorded(stale_machine, ray_address: str | None) -> None:
    tmp, monkeypatch = stale_machine
    dead = (tmp / "ray" / "ray_current_cluster").read_text()
    if ray_address is not None:
        dead = f"127.0.0.1:{free_port()}"
        monkeypatch.setenv("RAY_ADDRESS", dead)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="When connecting to an existing cluster, num_cpus"):
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)  # what the benchmarks did
    init_own_cluster(num_cpus=2, log_to_driver=False)
    try:
        gcs = ray.get_runtime_context().gcs_address
        assert gcs != dead and ray.cluster_resources()["CPU"] == 2
    finally:
        ray.shutdown()


def test_nothing_else_starts_ray_itself() -> None:
    """Benchmarks, stores and stages start Ray through `init_own_cluster` (or join `ray.address` in
    pipeline/runtime/ray.py), never by a `ray.init` of their own that a stale cluster would capture."""
    from tests import ROOT

    own = ROOT / "pipeline" / "runtime" / "ray.py"
    sources = [p for folder in ("baton", "benchmarks", "buffers", "pipeline", "policies", "stages", "tools")
               for p in (ROOT / folder).rglob("*.py")]
    call = re.compile(r"^\s*ray\.init\(", re.MULTILINE)
    callers = [str(p.relative_to(ROOT)) for p in sources if p != own and call.search(p.read_text())]
    assert callers == []
