"""`ray job submit` as the README shows it: a head started by hand on loopback, with its dashboard (the job
API, from Ray's `default` extra) and token authentication on; `baton run configs/ray-mooncake.toml --set
ray.address=auto` submitted through the job API with the token runs on that head and ends with its summary
line. Without the token the job API refuses. The head runs in a temp dir of its own (RAY_TMPDIR) with a
token file of its own, and is stopped by its pid."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pipeline.net import free_port
from tests.helpers.ray_head import stop_head

pytest.importorskip("ray")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def _api(dashboard: str, path: str, token: str | None) -> tuple[int, str]:
    """(HTTP status, body) of a GET on the job API, with the token as a bearer header when given."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(dashboard + path, headers=headers), timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _start_head(tmp: Path, env: dict[str, str], dashboard_port: int) -> subprocess.Popen:
    """The README's `ray start --head` on 127.0.0.1, with ports of its own (`--block`: its pid is the head's)."""
    return subprocess.Popen(
        [shutil.which("ray") or "ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={free_port()}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
         f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
         "--num-cpus=4", "--disable-usage-stats"],
        stdout=(tmp / "head.log").open("w"), stderr=subprocess.STDOUT, env=env, cwd=tmp,
    )


def _wait_until_up(head: subprocess.Popen, tmp: Path, dashboard: str, token: str) -> None:
    """Until the head says it started (as `ray start` without `--block` returns) and the job API answers."""
    deadline = time.monotonic() + 240
    while True:
        assert head.poll() is None and time.monotonic() < deadline, (tmp / "head.log").read_text()[-3000:]
        try:
            started = "Ray runtime started" in (tmp / "head.log").read_text()
            if started and _api(dashboard, "/api/version", token)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1)


@pytest.mark.long  # ~40 s: the default suite stays under 15 minutes on 2 cores
@pytest.mark.timeout(900)
def test_ray_job_submit_runs_baton_on_a_head_started_by_hand() -> None:
    try:  # what Ray's dashboard imports beyond a minimal install; without it there is no job API
        import ray.dashboard.optional_deps  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"the job API needs Ray's `default` extra, a project dependency (pip install -e .): {exc}")
    tmp = Path(tempfile.mkdtemp(prefix="rj", dir="/tmp"))  # short: Ray's socket paths live under it
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: every Ray server of the head listens on 127.0.0.1 (without it Ray
    # replaces --node-ip-address=127.0.0.1 with the machine's address and listens on all interfaces)
    env.update(RAY_TMPDIR=str(tmp), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    dashboard = f"http://127.0.0.1:{free_port()}"
    head = _start_head(tmp, env, int(dashboard.rsplit(":", 1)[1]))
    try:
        _wait_until_up(head, tmp, dashboard, token)
        assert _api(dashboard, "/api/jobs/", None)[0] == 401  # no token: refused
        assert _api(dashboard, "/api/jobs/", "not-the-token")[0] == 403
        job_id = f"baton-{secrets.token_hex(4)}"
        # `python -m baton.cli` rather than the installed `baton`: the job runs this checkout's code
        submit = subprocess.run(
            [shutil.which("ray") or "ray", "job", "submit", "--address", dashboard, "--submission-id", job_id,
             "--working-dir", str(ROOT), "--", "python", "-m", "baton.cli", "run", "configs/ray-mooncake.toml",
             "--set", "ray.address=auto", "--set", f"steps={STEPS}", "--set", "telemetry.progress=false",
             "--set", f"run_root='{tmp / 'runs'}'"],
            env=env, cwd=tmp, capture_output=True, text=True, timeout=600,
        )
        status, body = _api(dashboard, f"/api/jobs/{job_id}", token)
        assert status == 200 and json.loads(body)["status"] == "SUCCEEDED", submit.stdout[-4000:] + submit.stderr
        logs = json.loads(_api(dashboard, f"/api/jobs/{job_id}/logs", token)[1])["logs"]
        summary = json.loads(logs.strip().splitlines()[-1])
        assert summary["version"] == STEPS and summary["ledger_balanced"] is True, logs[-4000:]
        assert Path(summary["run_dir"]).parent == tmp / "runs"
        assert (Path(summary["run_dir"]) / "summary.json").exists()
    finally:
        stop_head(head, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
