"""The watchdog: a pipeline that stops moving is reported (which stage waits on what), then failed
with `PipelineHung` instead of hanging; a pipeline that moves is left alone."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest
import structlog
import torch

from baton.schema import RunConfig
from buffers.memory import MemoryStore
from buffers.ref_buffer import RefBuffer
from pipeline.channel import Channel
from pipeline.dsl import Pipeline
from pipeline.faults import FaultSpec
from pipeline.watchdog import Activity, HangReport, PipelineHung, Watchdog, WatchdogSettings
from policies import MaxStaleness
from stages.data.model import make_tiny_model
from stages.data.tasks import ReverseDigits
from stages.engines.torch import TorchEngine
from stages.learner import GRPOLearner
from stages.rollout import Rollout

torch.set_num_threads(1)


class HangingEngine(TorchEngine):
    """A real torch engine whose generation never returns (a wedged inference server)."""

    async def generate(self, prompts, params):
        self.hung_with = len(prompts)
        await anyio.sleep_forever()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


def assert_failed_at_its_first_look_past_the_limit(logs: list[dict], warn_after_s: float, fail_after_s: float) -> None:
    """The watchdog's reports end with one failure, and the warnings before it (one per `warn_after_s`
    of the stall) stop short of `fail_after_s`: it failed the run when the limit passed, not later."""
    events = [e["event"] for e in logs if e.get("event") in ("pipeline stalled", "pipeline hung: failing the run")]
    assert events[-1] == "pipeline hung: failing the run" and events.count(events[-1]) == 1, events
    assert len(events) - 1 < fail_after_s / warn_after_s, events


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
    with structlog.testing.capture_logs() as logs, pytest.raises(PipelineHung) as caught:
        pipe.run()

    warnings = [e for e in logs if e.get("event") == "pipeline stalled"]
    assert warnings and warnings[0]["log_level"] == "warning"
    assert_failed_at_its_first_look_past_the_limit(logs, warn_after_s=0.4, fail_after_s=1.2)
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
    assert rollout.last_event == "generating 4 groups (16 episodes) on engine wedged-0 at version 0", rollout
    assert rollout.last_event_age_s >= 1.0
    assert any(any("HangingEngine.generate('wedged-0')" in f for f in chain) for chain in rollout.awaiting), rollout
    learner = actors["learner"]
    assert any(any("Channel.receive" in f and "'ready'" in f for f in chain) for chain in learner.awaiting), learner
    assert report.gate["started"] >= 1 and report.gate["discarded"] == 0
    assert any(line.startswith("learner: version 0, window 0/4 groups") for line in report.status)
    text = str(caught.value)
    assert "no progress for" in text and "rollout:wedged-0" in text and "watchdog.fail_after_s = 1.2" in text


@pytest.mark.long  # a slow integration run: in the long suite
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
    with structlog.testing.capture_logs() as logs, pytest.raises(PipelineHung) as caught:
        pipe.run()

    warnings = [e for e in logs if e.get("event") == "pipeline stalled"]
    assert warnings and warnings[0]["log_level"] == "warning", "warned before failing"
    assert_failed_at_its_first_look_past_the_limit(logs, warn_after_s=2.0, fail_after_s=6.0)
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

    asked: list[str] = []

    async def dead():
        asked.append("producer-0")
        raise RuntimeError("The actor died unexpectedly before finishing this task.")

    async def wedged():
        asked.append("buffer-0")
        try:
            await anyio.sleep_forever()
        finally:
            asked.append("buffer-0 given up")

    async def alive():
        asked.append("consumer-0")
        line = ActorLine("learner", [["LearnerActor.run('learner')"]], "collecting", 1.0, host="consumer-0", pid=7)
        return msgspec.msgpack.encode(ProcessDiagnosis("consumer-0", 7, [line], ["learner: window 0/4"]))

    hosts = {"producer-0": _Host(dead), "buffer-0": _Host(wedged), "consumer-0": _Host(alive)}
    probes = ray_probes(conductor=None, channels={}, hosts=hosts, timeout_s=0.3)

    lines, status = anyio.run(probes.actors)
    assert sorted(asked[:3]) == ["buffer-0", "consumer-0", "producer-0"], "the hosts were asked at once"
    assert asked[3:] == ["buffer-0 given up"], "the wedged host's question was bounded"
    by_name = {a.name: a for a in lines}
    assert by_name["producer-0"].unreachable.startswith("no answer: RuntimeError: The actor died")
    assert by_name["buffer-0"].unreachable.startswith("no answer within 0.3s")
    assert by_name["learner"].host == "consumer-0" and not by_name["learner"].unreachable
    assert status == ["learner: window 0/4"]
    text = HangReport(1.0, "version=0", [], {}, lines, status).text()
    assert "producer-0 [producer-0]: no answer: RuntimeError" in text and "learner [consumer-0, pid 7]" in text


def test_the_watchdog_warns_repeatedly_and_resets_when_progress_resumes(monkeypatch) -> None:
    clock = [0.0]  # the watchdog's monotonic clock, moved by the test
    monkeypatch.setattr("pipeline.watchdog.time", SimpleNamespace(monotonic=lambda: clock[0]))
    counter = {"n": 0}
    looks = [0]

    def progress() -> int:
        looks[0] += 1
        return counter["n"]

    channel = Channel("work", max_items=4)
    channel.send_nowait("item")
    activity = Activity()
    activity.note("worker", "took an item")
    dog = Watchdog(WatchdogSettings(warn_after_s=0.15, fail_after_s=0.0, poll_s=0.001), progress=progress,
                   channels={"work": channel}, actors=[], activity=activity)

    async def after_a_whole_poll(seconds: float) -> None:
        clock[0] += seconds
        seen = looks[0]
        while looks[0] < seen + 2:  # the poll that started after the clock moved has finished
            await anyio.sleep(0.001)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(dog.run)
            for _ in range(50):  # stalled for 0.5 s: a warning every 0.15 s
                await after_a_whole_poll(0.01)
            stalled = len(dog.reports)
            for _ in range(10):  # moving every 0.05 s: no warning at all
                counter["n"] += 1
                await after_a_whole_poll(0.05)
            assert len(dog.reports) == stalled
            tg.cancel_scope.cancel()
        assert stalled == 3

    anyio.run(main)
    report = dog.reports[0]
    assert report.channels[0].depth == 1 and report.channels[0].max_items == 4
    assert report.actors[0].name == "worker" and report.actors[0].last_event == "took an item"


def test_watchdog_config_names_the_key_and_the_fix() -> None:
    from baton.config import ConfigError, validate

    with pytest.raises(ConfigError, match="watchdog.warn_after_s = 400 must be below watchdog.fail_after_s = 300"):
        validate(RunConfig, {"watchdog": {"warn_after_s": 400}}, source="test")
    watchdog = {"warn_after_s": 10, "fail_after_s": 30}
    cfg = validate(RunConfig, {"runtime": "ray", "store": {"kind": "ray"}, "watchdog": watchdog}, source="test")
    assert cfg.watchdog.fail_after_s == 30  # the watchdog works on both runtimes
