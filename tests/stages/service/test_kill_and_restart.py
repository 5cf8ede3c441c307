"""`baton serve` killed with SIGKILL in the middle of an SDK training loop, while an `optim_step` it accepted has not
been applied, and started again on the same port over the same folder: the official `tinker` SDK's own retries
carry the client through, unchanged, and the run ends exactly where a run of the same calls without a kill ends
(after a second kill, idle, it comes back from the journal the first restart compacted), on one learner rank and
on two (`--world-size 2`: the killed service's follower rank dies with it, the restarted one starts its own).
No step applied twice, none lost: the adapters agree within 1e-6, the step counts agree (the last commit is older:
the restarts ran the steps after it again), and a sampler saved before the kill still samples, with the same
logprobs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker", reason="the tinker SDK is not installed: pip install -e '.[tinker]'")
from safetensors.torch import load_file  # noqa: E402
from tinker import types  # noqa: E402

from stages.data.model import make_tiny_model  # noqa: E402
from stages.learner.state import STATE_FILE, LearnerState  # noqa: E402
from stages.service.journal import CallRecord, read_journal  # noqa: E402
from stages.service.store import read_commits  # noqa: E402

pytestmark = [pytest.mark.long, pytest.mark.slow]
STEPS = 5
ADAM = types.AdamParams(learning_rate=1e-2)
ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: Path, folder: Path, port: int, *options: str) -> subprocess.Popen:
    """`baton serve` on `port` over `folder`, once it serves (its service.json written afresh)."""
    (folder / "service.json").unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = folder.parent / f"serve-{time.monotonic_ns()}.log"  # a file: a pipe nobody reads blocks once full
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "serve", str(model), "--port", str(port),
                                 "--dir", str(folder), "--threads", "1", *options], env=env, stdout=out, stderr=out)
    deadline = time.monotonic() + 120
    while not (folder / "service.json").exists():
        assert proc.poll() is None, f"baton serve exited: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, "baton serve did not start within 120 s"
        time.sleep(0.1)
    return proc


def batch(step: int) -> list[types.Datum]:
    """64 rows of 48 tokens: a forward_backward long enough that the optim_step behind it is accepted before it
    is applied."""
    rng = np.random.default_rng(step)
    out = []
    for _ in range(64):
        tokens = rng.integers(0, 40, 49)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": tokens[1:],
                                               "weights": np.full(48, 1e-3, dtype=np.float32)}))
    return out


def optim_accepted(state: Path, model_id: str, after: int) -> int | None:
    """The seq of an optim_step of `model_id` the journal holds beyond seq `after`, if any."""
    seqs = [r.seq for r in read_journal(state) if isinstance(r, CallRecord) and r.model == model_id
            and r.kind == "optim_step" and r.seq > after]
    return max(seqs) if seqs else None


def kill_mid_step(proc: subprocess.Popen, state: Path, model_id: str, after: int) -> bool:
    """Once the service has accepted the next optim_step, stop it; kill it (True) if that step is not committed
    yet, else let it go on (False)."""
    while (seq := optim_accepted(state, model_id, after)) is None:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGSTOP)
    commit = read_commits(state).get(model_id)
    if commit is not None and commit.seq >= seq:
        os.kill(proc.pid, signal.SIGCONT)
        return False
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    return True


def final_state(folder: Path, client) -> tuple[dict, int]:
    """The client's adapter and learner version, saved through the SDK."""
    client.save_state("final").result()
    saved = folder / "checkpoints" / client.model_id / "final"
    version = msgspec_version(saved / "state" / STATE_FILE)
    return load_file(saved / "adapter" / "adapter_model.safetensors"), version


def msgspec_version(path: Path) -> int:
    import msgspec

    return msgspec.json.decode(path.read_bytes(), type=LearnerState).version


@pytest.mark.parametrize("options", [(), ("--world-size", "2")], ids=["one-rank", "two-ranks"])
def test_a_service_killed_mid_step_comes_back_and_the_sdk_carries_on(tmp_path, options: tuple[str, ...]) -> None:
    os.environ["TINKER_TELEMETRY"] = "0"
    model, folder, port = make_tiny_model(tmp_path / "tiny"), tmp_path / "serve", free_port()
    state = folder / "state"
    proc = start(model, folder, port, *options)
    try:
        info = json.loads((folder / "service.json").read_text())
        service = tinker.ServiceClient(base_url=info["base_url"], api_key=Path(info["key_file"]).read_text())
        client = service.create_lora_training_client(base_model=info["model"], rank=4).result()
        losses, probe = [], types.ModelInput.from_ints([1, 5, 6, 7, 8, 9])
        client.forward_backward(batch(0), "cross_entropy").result()
        client.optim_step(ADAM).result()
        sampler = client.save_weights_and_get_sampling_client().result()
        before = sampler.compute_logprobs(probe).result()
        killed_at, last = None, optim_accepted(state, client.model_id, 0)
        for step in range(1, STEPS):
            loss, stepped = client.forward_backward(batch(step), "cross_entropy"), client.optim_step(ADAM)
            if killed_at is None and kill_mid_step(proc, state, client.model_id, last):
                killed_at = step
                proc = start(model, folder, port, *options)
            losses.append(loss.result().metrics["loss:sum"])
            stepped.result()
            last = optim_accepted(state, client.model_id, 0)
        assert killed_at is not None, "no optim_step was caught accepted but not yet applied: the kill never came"
        proc.kill()  # once more, idle: it comes back from the journal the first restart rewrote
        proc.wait(timeout=30)
        proc = start(model, folder, port, *options)
        after = sampler.compute_logprobs(probe).result()
        assert np.allclose(np.array(after[1:]), np.array(before[1:]), atol=1e-6)
        assert len(sampler.sample(probe, 1, types.SamplingParams(max_tokens=3, stop=[])).result().sequences) == 1
        adapter, version = final_state(folder, client)
        commit = read_commits(state)[client.model_id]
        # every step once; at the default commit interval (10 s) the restarts ran the steps after the last commit
        # again (a restarted service commits its first step, then none within the interval)
        assert version == STEPS and 1 <= commit.step <= STEPS, (version, commit.step)

        reference = service.create_lora_training_client(base_model=info["model"], rank=4).result()
        reference_losses = []
        for step in range(STEPS):
            loss = reference.forward_backward(batch(step), "cross_entropy")
            reference.optim_step(ADAM).result()
            reference_losses.append(loss.result().metrics["loss:sum"])
        expected, reference_version = final_state(folder, reference)
        assert reference_version == version
        assert np.allclose(losses, reference_losses[1:], rtol=1e-6, atol=0)  # a forward_backward run again: same loss
        worst = max(float((adapter[n] - expected[n]).abs().max()) for n in expected)
        assert worst < 1e-6, f"the killed run's adapter is {worst:.3g} from the run without a kill"
        print(f"killed during step {killed_at + 1} of {STEPS}; adapters {worst:.3g} apart")
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
