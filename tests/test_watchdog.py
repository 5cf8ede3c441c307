"""The watchdog: a pipeline that stops moving is reported (which stage waits on what), then failed
with `PipelineHung` instead of hanging; a pipeline that moves is left alone."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import anyio
import pytest
import structlog
import torch

from buffers.memory import MemoryStore
from buffers.ref_buffer import RefBuffer
from pipeline.channel import Channel
from pipeline.dsl import Pipeline
from pipeline.faults import FaultSpec
from pipeline.watchdog import Activity, HangReport, PipelineHung, Watchdog, WatchdogSettings
from policies import MaxStaleness
from stages.config import RunConfig
from stages.engines.torch import TorchEngine
from stages.learner import GRPOLearner
from stages.model import make_tiny_model
from stages.rollout import Rollout
from stages.tasks import ReverseDigits

torch.set_num_threads(1)


class HangingEngine(TorchEngine):
    """A real torch engine whose generation never returns (a wedged inference server)."""

    async def generate(self, prompts, params):
        self.hung_with = len(prompts)
        await anyio.sleep_forever()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


def test_a_wedged_engine_is_reported_then_fails_the_run_with_pipeline_hung(model: Path, tmp_path: Path) -> None:
    engine = HangingEngine(model, name="wedged-0")
    pipe = Pipeline(
        name="hang",
        producer=Rollout(ReverseDigits(digits=2), [engine], tokenizer=model, group_size=4, batch_groups=4),
        buffer=RefBuffer(MemoryStore()),
        consumer=GRPOLearner(model, groups_per_step=4),
        staleness=MaxStaleness(k=1),
        steps=5, run_root=tmp_path, progress=False,
        watchdog=WatchdogSettings(warn_after_s=0.4, fail_after_s=1.2, poll_s=0.1),
    )
    t0 = time.monotonic()
    with structlog.testing.capture_logs() as logs, pytest.raises(PipelineHung) as caught:
        pipe.run()
    took = time.monotonic() - t0
    assert took < 1.2 + 5.0, f"PipelineHung came {took:.1f}s after the start, the limit is 1.2s of no progress"

    warnings = [e for e in logs if e.get("event") == "pipeline stalled"]
    assert warnings and warnings[0]["log_level"] == "warning"
    first = warnings[0]
    assert first["channels"]["produced"].startswith("0/64 items") and first["channels"]["ready"].startswith("0/16")
    assert "HangingEngine.generate('wedged-0')" in first["waiting"]["rollout:wedged-0"]
    assert first["at"].startswith("version=0, produced=0")
    assert (Path(first["report_file"]).read_text()).startswith("no progress for")

    report = caught.value.report
    assert report.idle_s >= 1.2
    assert {c.name: (c.depth, c.max_items) for c in report.channels} == {
        "produced": (0, 64), "ready": (0, 16), "feedback": (0, 1 << 20)
    }
    actors = {a.name: a for a in report.actors}
    rollout = actors["rollout:wedged-0"]
    assert rollout.last_event == "generating 4 groups (16 requests) on engine wedged-0 at version 0", rollout
    assert rollout.last_event_age_s >= 1.0
    assert any(any("HangingEngine.generate('wedged-0')" in f for f in chain) for chain in rollout.awaiting), rollout
    learner = actors["learner"]
    assert any(any("Channel.receive" in f and "'ready'" in f for f in chain) for chain in learner.awaiting), learner
    assert report.gate["started"] >= 1 and report.gate["discarded"] == 0
    assert any(line.startswith("learner: version 0, window 0/4 groups") for line in report.status)
    text = str(caught.value)
    assert "no progress for" in text and "rollout:wedged-0" in text and "watchdog.fail_after_s = 1.2" in text


@pytest.mark.slow
def test_on_ray_a_wedged_engine_is_reported_across_the_hosts_then_fails_the_run(model: Path, tmp_path: Path) -> None:
    """The driver's watchdog asks the conductor, the channel hosts and every stage host (`diagnose()`) while
    the producer host's run is blocked in the engine; the run fails with the report, not a wrapped error."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from buffers.ray_store import RayStoreSpec

    pipe = Pipeline(
        name="hang-ray",
        producer=Rollout(
            ReverseDigits(digits=2), [TorchEngine(model, name="torch-0")], tokenizer=model, group_size=4,
            batch_groups=4, request_timeout_s=600.0,  # longer than the run: the watchdog, not the timeout, ends it
        ),
        buffer=RefBuffer(RayStoreSpec(name=f"hang-{uuid.uuid4().hex[:8]}")),
        consumer=GRPOLearner(model, groups_per_step=4),
        staleness=MaxStaleness(k=1),
        steps=5, run_root=tmp_path, progress=False, runtime="ray",
        faults=[FaultSpec("engine.hang", at=(1,), delay_s=600.0)],  # the engine's first call never answers
        watchdog=WatchdogSettings(warn_after_s=2.0, fail_after_s=6.0, poll_s=0.5),
    )
    t0 = time.monotonic()
    with structlog.testing.capture_logs() as logs, pytest.raises(PipelineHung) as caught:
        pipe.run()
    took = time.monotonic() - t0
    assert took < 90, f"the run took {took:.0f}s to fail"

    warnings = [e for e in logs if e.get("event") == "pipeline stalled"]
    assert warnings and warnings[0]["log_level"] == "warning", "warned before failing"
    report = caught.value.report
    assert report.idle_s >= 6.0
    assert report.progress.startswith("version=0, produced=0")
    assert {c.name: (c.depth, c.max_items) for c in report.channels} == {
        "produced": (0, 64), "ready": (0, 16), "feedback": (0, 1 << 20)
    }
    assert report.gate["version"] == 0 and report.gate["started"] >= 1 and report.gate["discarded"] == 0
    assert "admits_now" in report.gate

    actors = {a.name: a for a in report.actors}
    rollout = actors["rollout:torch-0"]
    assert rollout.host == "producer-0" and rollout.pid is not None and rollout.pid != os.getpid(), rollout
    assert not rollout.unreachable
    assert rollout.last_event is not None and rollout.last_event.startswith("generating 4 groups"), rollout
    assert any(any("FaultyEngine.generate('torch-0')" in f for f in chain) for chain in rollout.awaiting), rollout
    assert any(chain[0] == "StageHost.run('producer-0')" for chain in rollout.awaiting), "the host's run task"
    assert not any(any("diagnose" in f for f in chain) for a in report.actors for chain in a.awaiting), (
        "the probe's own call is not reported as the actor's"
    )
    learner = actors["learner"]
    assert learner.host == "consumer-0"
    assert any(any("receive" in f and "'ready'" in f for f in chain) for chain in learner.awaiting), learner
    assert {a.host for a in report.actors if a.host} >= {"producer-0", "buffer-0", "consumer-0"}
    assert any(line.startswith("learner: version 0, window 0/4 groups") for line in report.status), report.status

    text = str(caught.value)
    assert "rollout:torch-0 [producer-0, pid" in text and "FaultyEngine.generate('torch-0')" in text
    written = list(tmp_path.glob("hang-ray-*/hang-report.txt"))
    assert len(written) == 1 and written[0].read_text().startswith("no progress for")
    assert "admission gate: version=0" in written[0].read_text()


class _Remote:
    """A Ray actor method's stand-in: `.remote()` awaits `answer`."""

    def __init__(self, answer) -> None:
        self.answer = answer

    async def remote(self):
        return await self.answer()


class _Host:
    def __init__(self, answer) -> None:
        self.diagnose = _Remote(answer)


def test_a_dead_or_wedged_host_is_shown_as_unreachable_and_does_not_stop_the_report() -> None:
    import msgspec

    from pipeline.runtime.ray_watchdog import ray_probes
    from pipeline.watchdog import ActorLine, ProcessDiagnosis

    async def dead():
        raise RuntimeError("The actor died unexpectedly before finishing this task.")

    async def wedged():
        await anyio.sleep_forever()

    async def alive():
        line = ActorLine("learner", [["LearnerActor.run('learner')"]], "collecting", 1.0, host="consumer-0", pid=7)
        return msgspec.msgpack.encode(ProcessDiagnosis("consumer-0", 7, [line], ["learner: window 0/4"]))

    hosts = {"producer-0": _Host(dead), "buffer-0": _Host(wedged), "consumer-0": _Host(alive)}
    probes = ray_probes(conductor=None, channels={}, hosts=hosts, timeout_s=0.3)

    async def main():
        t0 = time.monotonic()
        lines, status = await probes.actors()
        return lines, status, time.monotonic() - t0

    lines, status, took = anyio.run(main)
    assert took < 1.0, "the hosts were asked at once, each bounded"
    by_name = {a.name: a for a in lines}
    assert by_name["producer-0"].unreachable.startswith("no answer: RuntimeError: The actor died")
    assert by_name["buffer-0"].unreachable.startswith("no answer within 0.3s")
    assert by_name["learner"].host == "consumer-0" and not by_name["learner"].unreachable
    assert status == ["learner: window 0/4"]
    text = HangReport(1.0, "version=0", [], {}, lines, status).text()
    assert "producer-0 [producer-0]: no answer: RuntimeError" in text and "learner [consumer-0, pid 7]" in text


def test_the_watchdog_warns_repeatedly_and_resets_when_progress_resumes() -> None:
    counter = {"n": 0}
    channel = Channel("work", max_items=4)
    channel.send_nowait("item")
    activity = Activity()
    activity.note("worker", "took an item")
    dog = Watchdog(WatchdogSettings(warn_after_s=0.15, fail_after_s=0.0, poll_s=0.02), progress=lambda: counter["n"],
                   channels={"work": channel}, actors=[], activity=activity)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(dog.run)
            await anyio.sleep(0.5)  # stalled: at least two warnings, ~0.15 s apart
            stalled = len(dog.reports)
            for _ in range(10):  # moving: no warning at all
                counter["n"] += 1
                await anyio.sleep(0.05)
            assert len(dog.reports) == stalled
            tg.cancel_scope.cancel()
        assert stalled >= 2

    anyio.run(main)
    report = dog.reports[0]
    assert report.channels[0].depth == 1 and report.channels[0].max_items == 4
    assert report.actors[0].name == "worker" and report.actors[0].last_event == "took an item"


def test_watchdog_config_names_the_key_and_the_fix() -> None:
    from pipeline.config import ConfigError, validate

    with pytest.raises(ConfigError, match="watchdog.warn_after_s = 400 must be below watchdog.fail_after_s = 300"):
        validate(RunConfig, {"watchdog": {"warn_after_s": 400}}, source="test")
    watchdog = {"warn_after_s": 10, "fail_after_s": 30}
    cfg = validate(RunConfig, {"runtime": "ray", "store": {"kind": "ray"}, "watchdog": watchdog}, source="test")
    assert cfg.watchdog.fail_after_s == 30  # the watchdog works on both runtimes
