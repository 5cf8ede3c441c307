"""Multi-turn episodes on the Ray runtime (issue 18, items 6-7): the episodes run in the producer
processes, whose environments are built there from the pickled `Rollout` (a `functools.partial`
factory included); a producer process killed mid-episode (engine.crash) is restarted and trains
nothing twice; and pace admission drops no group as stale, checkpoint pauses included."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from buffers.ray_store import RayStoreSpec  # noqa: E402
from buffers.ref_buffer import RefBuffer  # noqa: E402
from pipeline.dsl import Pipeline  # noqa: E402
from policies import MaxStaleness  # noqa: E402
from stages import GRPOLearner, Rollout, TorchEngine, make_tiny_model, tasks  # noqa: E402
from stages.environments.feedback import DigitFeedback  # noqa: E402
from stages.rollout.episode import EpisodeLimits  # noqa: E402
from tests.helpers.ledger_checks import check_ledger  # noqa: E402

pytestmark = pytest.mark.slow  # and each test `long` (CI runs it after the suite) or `nightly`
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.long
def test_multi_turn_episodes_run_in_the_producer_processes(ray_cluster, model: Path, tmp_path: Path) -> None:
    """Two producer processes, each running the feedback environment's episodes (built there from a
    partial); every group accounted for, and episodes take more than one turn."""
    steps, groups = 6, 4
    s = Pipeline(
        name="t", steps=steps, run_root=tmp_path, runtime="ray", progress=False,
        producer=Rollout(
            tasks.ReverseDigits(digits=3),
            [TorchEngine(model, name="torch-0"), TorchEngine(model, name="torch-1", seed=1)],
            tokenizer=model, group_size=4, batch_groups=4,
            environment=functools.partial(DigitFeedback, max_turns=3), limits=EpisodeLimits(max_turns=3),
        ),
        buffer=RefBuffer(RayStoreSpec(name="ray-episodes")),
        consumer=GRPOLearner(model, groups_per_step=groups),
        staleness=MaxStaleness(k=2),
    ).run()
    assert s["runtime"] == "ray" and s["version"] == steps
    assert s["ledger_balanced"] and s["samples"]["lost"] == 0
    assert s["samples"]["trained"] == steps * groups * 4
    records = check_ledger(Path(s["run_dir"]), bound=2)
    assert {r["group"].split(".")[0] for r in records if r["fate"] == "trained"} == {"torch-0", "torch-1"}
    metrics = metrics_of(Path(s["run_dir"]))
    assert len(metrics) == steps
    # the tiny model rarely reverses 3 digits at once: most episodes get feedback and try again
    assert all(m["turns_mean"] > 1 for m in metrics), [m["turns_mean"] for m in metrics]


@pytest.mark.nightly  # Ray's producer restart: tests/pipeline/test_ray_runtime.py in CI
def test_engine_crash_on_ray_restarts_the_producer_of_multi_turn_episodes(ray_cluster, model: Path,
                                                                           tmp_path: Path) -> None:
    """The fault matrix's engine.crash on configs/agent-feedback.toml on Ray: the producer process is
    SIGKILLed mid-episode, Ray restarts it, the slots of its unfinished groups are freed and the run
    finishes with nothing trained twice and nothing lost uncounted."""
    from baton.config import load_toml
    from baton.fault_matrix import run_one

    config = str(ROOT / "configs" / "agent-feedback.toml")
    base = load_toml(config, [f"model.path='{model}'", "model.create=false", "runtime='ray'", "store.kind='ray'",
                              "steps=10", "engine.count=2", "learner.groups_per_step=4",
                              "engine.batch_groups=4", "rollout.group_size=4"])
    outcome = run_one(config, "engine.crash", 0, tmp_path, base=base)
    assert outcome.fired >= 1, outcome.problems
    assert outcome.restarts >= 1, "the killed producer process was restarted"
    assert outcome.finished, outcome.problems
    assert outcome.trained_twice == 0
    assert outcome.lost_uncounted == 0
    assert outcome.over_bound == 0
    summary = json.loads((Path(outcome.run_dir) / "summary.json").read_text())
    assert summary["ledger_balanced"]
    check_ledger(Path(outcome.run_dir), bound=2)
    restarted = [json.loads(line) for line in (Path(outcome.run_dir) / "events.jsonl").read_text().splitlines()
                 if '"producer.restarted"' in line]
    assert restarted, "the restart is a run event"


@pytest.mark.long
def test_pace_admission_drops_nothing_around_checkpoint_pauses(ray_cluster, model: Path, tmp_path: Path) -> None:
    """admission = "pace" on Ray with a checkpoint cut every 3 versions (each pauses the ledger while the
    hosts answer) and two producers of multi-turn episodes of uneven length: no group is dropped as
    stale, so every sample produced is trained or still in flight at the end. lead = 0: with producers
    allowed ahead, a long episode can be overtaken by groups admitted after it and arrive past k whatever
    the checkpoints do (policies/staleness.py; it happened here under load), so a drop would be theirs."""
    steps, groups = 24, 4
    s = Pipeline(
        name="t", steps=steps, run_root=tmp_path, runtime="ray", progress=False, checkpoint_every=3,
        producer=Rollout(
            tasks.ReverseDigits(digits=3),
            [TorchEngine(model, name="torch-0"), TorchEngine(model, name="torch-1", seed=1)],
            tokenizer=model, group_size=4, batch_groups=4,
            environment=functools.partial(DigitFeedback, max_turns=3), limits=EpisodeLimits(max_turns=3),
        ),
        buffer=RefBuffer(RayStoreSpec(name="ray-pace")),
        consumer=GRPOLearner(model, groups_per_step=groups),
        staleness=MaxStaleness(k=1, admission="pace", lead=0),
    ).run()
    assert s["version"] == steps and s["ledger_balanced"]
    assert s["checkpoint_pause_s"] > 0, "checkpoint cuts paused the ledger"
    assert s["samples"]["dropped"] == 0, s["samples"]
    records = check_ledger(Path(s["run_dir"]), bound=1)
    assert [r for r in records if r["fate"] == "dropped"] == []
    assert s["samples"]["trained"] == steps * groups * 4
