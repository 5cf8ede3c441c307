"""Multi-turn episodes on the Ray runtime (issue 18, items 6-7): the episodes run in the producer
processes, whose environments are built there from the pickled `Rollout` (a `functools.partial`
factory included), in a run whose second engine joins and leaves (issue 52: elastic engines on Ray);
a producer process killed mid-episode (engine.crash) is restarted and trains
nothing twice; and pace admission drops no group as stale, checkpoint pauses included."""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from buffers.ray_store import RayStoreSpec  # noqa: E402
from buffers.ref_buffer import RefBuffer  # noqa: E402
from pipeline.checkpoint import read_state  # noqa: E402
from pipeline.control import CONTROL_FILE, scale_run  # noqa: E402
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


def joining_engine(model: Path, index: int) -> TorchEngine:
    """The engine of worker `index` joining the run (the producer's `engine_factory`, pickled to its host)."""
    return SlowEngine(model, name=f"torch-{index}", seed=index)


class SlowEngine(TorchEngine):
    """A torch engine whose decode steps take 20 ms more: a preempted leave finds requests with tokens decoding."""

    def _step(self, batch) -> None:
        time.sleep(0.02)
        super()._step(batch)


class GatedEngine(TorchEngine):
    """A torch engine that, from version `after` on, generates nothing while the file `gate` exists (its
    process is another: a file is what reaches it), so the run goes on only with the engine that joined."""

    def __init__(self, *args: Any, gate: Path, after: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate, self.after = gate, after

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "gate": self.gate, "after": self.after}

    async def generate(self, prompts, params):
        while self.version >= self.after and self.gate.exists():
            await anyio.sleep(0.05)
        return await super().generate(prompts, params)


def events_of(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["kind"] == kind]


def versions_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_for(what: Callable[[], bool], timeout_s: float, why: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, f"{why} within {timeout_s} s"
        time.sleep(0.1)


def grow_then_shrink(pipe: Pipeline, runs: Path, gate: Path, said: dict, steps: int) -> None:
    """The operator's side (a thread beside the run): grow to two engines through the control endpoint
    (`baton scale`), let the joiner alone carry the run for a few versions (the first engine is gated), then
    shrink back through `Pipeline.scale`, preempting the joiner: its requests continue in the first engine's
    process."""
    try:
        wait_for(lambda: (runs / "latest" / CONTROL_FILE).exists(), 240, "the control endpoint served")
        run_dir = (runs / "latest").resolve()
        said["joined"] = scale_run(run_dir, 2, wait_s=240)
        alone = min(versions_done(run_dir) + 3, steps - 2)  # the first engine is gated: the joiner alone to here
        wait_for(lambda: versions_done(run_dir) >= alone, 240, f"the joiner carried the run to version {alone}")
        gate.unlink()
        said["left"] = pipe.scale(1, preempt=True)
    except BaseException as exc:  # noqa: BLE001 - the test thread asserts it
        said["error"] = exc
        gate.unlink(missing_ok=True)


@pytest.mark.long
def test_multi_turn_episodes_run_in_the_producer_processes(ray_cluster, model: Path, tmp_path: Path) -> None:
    """Producer processes each running the feedback environment's episodes (built there from a partial), in
    an elastic run (issue 52): it starts on one engine; a second joins as a new Ray actor (`baton scale`'s
    endpoint: subscribed to the pushes, through the version fence before it asks for work) and carries the run
    alone for a few versions, then is preempted (`Pipeline.scale(1, preempt=True)`): its requests in flight continue
    on the first engine, in another process, from their tokens. Every group accounted for, nothing
    trained twice, the joiner served only on weights at least its fence's, episodes take more than one turn;
    a checkpoint at every version, the cuts taken while the joiner was live asking its host too."""
    steps, groups = 10, 4
    gate, runs = tmp_path / "gate", tmp_path / "runs"
    gate.touch()
    pipe = Pipeline(
        name="t", steps=steps, run_root=runs, runtime="ray", progress=False, max_workers=2,
        checkpoint_every=1, checkpoint_keep=steps + 1,  # a cut at every version: some while the joiner is live
        producer=Rollout(
            tasks.ReverseDigits(digits=3), [GatedEngine(model, name="torch-0", gate=gate, after=2)],
            tokenizer=model, group_size=4, batch_groups=4,
            environment=functools.partial(DigitFeedback, max_turns=3), limits=EpisodeLimits(max_turns=3),
            engine_factory=functools.partial(joining_engine, model),
        ),
        buffer=RefBuffer(RayStoreSpec(name="ray-episodes")),
        consumer=GRPOLearner(model, groups_per_step=groups),
        staleness=MaxStaleness(k=2),
    )
    said: dict[str, Any] = {}
    operator = threading.Thread(target=grow_then_shrink, args=(pipe, runs, gate, said, steps), daemon=True)
    operator.start()
    s = pipe.run()
    operator.join(timeout=10)
    assert "error" not in said, said.get("error")
    assert said["joined"]["live"] == 2 and said["left"]["workers"] == ["rollout:torch-0"]
    assert s["runtime"] == "ray" and s["version"] == steps
    assert s["ledger_balanced"] and s["samples"]["lost"] == 0
    assert s["samples"]["trained"] == steps * groups * 4
    run_dir = Path(s["run_dir"])
    records = check_ledger(run_dir, bound=2)
    assert {r["group"].split(".")[0] for r in records if r["fate"] == "trained"} == {"torch-0", "torch-1"}
    (joined,) = events_of(run_dir, "engine.joined")
    assert joined["engine"] == "torch-1" and joined["source"] in ("model", "snapshot", "push")
    served = [r["versions"][0] for r in records if r["group"].startswith("torch-1.")]
    trained = [r for r in records if r["group"].startswith("torch-1.") and r["fate"] == "trained"]
    assert len(trained) >= 3 * groups * 4, "the joiner alone carried three versions (the first engine gated)"
    assert min(served) >= joined["version"], "the joiner served on weights older than its fence"
    (fleet_joined,) = events_of(run_dir, "fleet.joined")
    assert fleet_joined["t"] >= joined["t"], "the fleet let it take work only once its fence passed"
    (left,) = events_of(run_dir, "fleet.left")
    assert left["worker"] == "rollout:torch-1" and left["live"] == 1 and left["preempted"]
    (gone,) = events_of(run_dir, "engine.left")
    assert gone["engine"] == "torch-1" and gone["preempted"] and gone.get("requests", 0) >= 1, gone
    assert gone.get("tokens_carried", 0) >= 1, "tokens the preempted joiner made went on in torch-0's process"
    outcomes = s["outcomes"]  # the ledger's: every carried token is in a settled sample
    assert sum(o.get("carried_tokens", 0) for o in outcomes.values()) == gone["tokens_carried"], (outcomes, gone)
    metrics = metrics_of(run_dir)
    assert len(metrics) == steps
    cuts = {read_state(c).version: read_state(c).rngs for c in sorted((run_dir / "checkpoints").glob("v*"))}
    assert max(cuts) == steps
    assert any("rollout:torch-1" in rngs for rngs in cuts.values()), "a cut asked the joined producer's host"
    assert "rollout:torch-1" not in cuts[steps], "a host that left is not asked"
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
