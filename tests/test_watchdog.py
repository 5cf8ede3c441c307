"""The watchdog: a pipeline that stops moving is reported (which stage waits on what), then failed
with `PipelineHung` instead of hanging; a pipeline that moves is left alone."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
import structlog
import torch

from buffers.memory import MemoryStore
from buffers.replay import ReplayBuffer
from pipeline.channel import Channel
from pipeline.dsl import Pipeline
from pipeline.watchdog import Activity, PipelineHung, Watchdog, WatchdogSettings
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
        buffer=ReplayBuffer(MemoryStore()),
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
    with pytest.raises(ConfigError, match=r"\[checkpoint\] works with runtime = 'local' only"):
        validate(RunConfig, {"runtime": "ray", "store": {"kind": "ray"}, "checkpoint": {"every": 5}}, source="test")
    cfg = validate(RunConfig, {"runtime": "ray", "store": {"kind": "ray"}}, source="test")
    assert cfg.checkpoint.every == 20  # the default applies to local runs; a ray run just does not checkpoint
