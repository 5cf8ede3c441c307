"""Engines that join and leave a running run (`pipeline.fleet`, `stages.rollout.fence`), on the real
pipeline: torch engines, the GRPO learner, the memory store, in one process (local runtime).

One run (at most four engines) grows from one engine to two at version 3 (`engine.join`), shrinks back
after version 5 by preempting the joiner while it decodes (`Pipeline.scale(1, preempt=True)`, the DSL's
call: its requests continue on the first engine from their tokens), grows again
while version 8 is being pushed (`engine.join_in_push`), to three at version 10 and four at 11
(`engine.join`), back to three at version 12 (`engine.leave`), and to two while version 13 is being pushed,
by preempting the newest engine (`engine.preempt_in_push`). The engines are slowed down (`DELAY_S` a call) so that a
leave finds work in flight. Judged from
its own files like the fault matrix (`baton.fault_matrix.judge`): every fault fired and recovered, the run
finished, nothing trained twice, nothing lost uncounted, nothing over the staleness bound. And:
* no request reached a joining engine before its fence passed, and each of its requests ran on a
  version at least its fence's (a recording engine: each `generate` call's time and version);
* each joiner passed by the snapshot's checksum, and holds the learner's weights at the end;
* the leaving engine's groups all reached the ledger (the ledger balances, none in flight beyond the
  admission window) and the events say what each join and leave cost;
* the preempted engines' requests carried their tokens over, and the ledger's outcomes count exactly those
  (the matrix's `carried_requests` counts the requests).
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import anyio
import pytest
import torch

from baton.fault_matrix import RunOutcome, judge
from pipeline.faults import FaultPlan
from stages.engines.torch import TorchEngine
from stages.weights.layout import state_checksum

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
STEPS = 16  # versions 14 to 16: room for the preempted leave at 13 to settle before the end
DELAY_S = 0.1


class RecordingEngine(TorchEngine):
    """A torch engine, `DELAY_S` slower per call, that records each `generate` call (its version then) and,
    as it stops, its version and the checksum of its weights."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.preempt_soon = False  # it preempts itself after a step that leaves requests with tokens decoding
        self.calls: list[int] = []
        self.called_at: list[float] = []  # wall clock, like the run's events
        self.final: tuple[int, int] | None = None

    async def generate(self, prompts, params):
        self.calls.append(self.version)
        self.called_at.append(time.time())
        await anyio.sleep(DELAY_S)  # a slower engine: a leave then always finds episodes in flight
        return await super().generate(prompts, params)

    def _step(self, batch) -> None:
        super()._step(batch)
        if self.preempt_soon and any(r.tokens for r in batch.rows):  # rows left have tokens and are not done
            self.preempt_soon = False
            self.preempt()

    async def stop(self) -> None:
        if self._model is not None:
            self.final = (self.version, state_checksum(self._model.state_dict()))
        await super().stop()


def recording(engine: TorchEngine) -> RecordingEngine:
    return RecordingEngine(engine.model_path, name=engine.name, seed=engine.seed, dtype=engine.dtype)


class LeaveWhileBusy:
    """After version 5, the newest engine is preempted while requests with tokens are decoding (its node taken
    away), and the run shrinks to one worker through the DSL's own call (`Pipeline.scale`, from another
    thread) with `preempt`: the requests it had in flight continue on the other engine from the tokens they
    have (stages.rollout.relay)."""

    name = "test:leave"

    def __init__(self, ctx, pipe) -> None:
        self.ctx, self.pipe = ctx, pipe

    async def start(self) -> None:
        return None

    async def run(self) -> None:
        await self.ctx.clock.wait_until(5)
        fleet = self.ctx.services.fleet
        while len(fleet.workers) < 2:
            await anyio.sleep(0.002)
        engine = fleet.workers[-1].receiver
        engine.preempt_soon = True  # its node is taken away while requests with tokens are decoding
        with anyio.fail_after(60):
            while not engine._preempted:
                await anyio.sleep(0.002)
        # as a user's own thread would call it; preempted: its requests continue on the first engine
        status = await anyio.to_thread.run_sync(functools.partial(self.pipe.scale, 1, preempt=True))
        assert status["leaving"] == 0 and "rollout:torch-1" not in status["workers"]

    async def stop(self) -> None:
        return None


@pytest.fixture(scope="module")
def elastic_run(tmp_path_factory) -> dict:
    from baton.builder import build_pipeline, make_faults
    from baton.config import load_toml, validate
    from baton.schema import RunConfig
    from stages.data.model import make_tiny_model

    root = tmp_path_factory.mktemp("elastic")
    model = make_tiny_model(root / "tiny")
    raw = load_toml(str(ROOT / "configs" / "faults.toml"), [
        f"model.path='{model}'", "model.create=false", f"run_root='{root}'", f"steps={STEPS}", "store={kind='memory'}",
        "rollout.max_engines=4", "engine.batch_groups=4", "learner.groups_per_step=4", "name='elastic'"])
    raw.pop("faults", None)
    raw["faults"] = [{"kind": "engine.join", "at": [3, 10, 11]}, {"kind": "engine.join_in_push", "at": [8]},
                     {"kind": "engine.leave", "at": [12]}, {"kind": "engine.preempt_in_push", "at": [13]}]
    cfg = validate(RunConfig, raw, source="test")
    pipe = build_pipeline(cfg)
    pipe.faults = FaultPlan(make_faults(cfg))
    made: list[RecordingEngine] = []
    make = pipe.producer.engine_factory

    def joining(index: int) -> RecordingEngine:
        made.append(recording(make(index)))
        return made[-1]

    pipe.producer.engine_factory = joining
    pipe.producer.engines = [recording(e) for e in pipe.producer.engines]  # the first: it stays all run
    pipe.hooks.append(lambda ctx: [LeaveWhileBusy(ctx, pipe)])
    summary = pipe.run()
    return {"summary": summary, "run_dir": Path(summary["run_dir"]), "made": made,
            "first": pipe.producer.engines[0]}


def events(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind]


def test_the_run_stays_clean_through_joins_and_a_leave(elastic_run: dict) -> None:
    run_dir = elastic_run["run_dir"]
    carried = 0
    for kind in ("engine.join", "engine.join_in_push", "engine.leave", "engine.preempt_in_push"):
        outcome = judge(RunOutcome(kind, 0), run_dir, STEPS, window_groups=(2 + 1) * 4)
        assert outcome.fired == (3 if kind == "engine.join" else 1), (kind, outcome.problems)
        assert outcome.finished, outcome.problems
        assert outcome.trained_twice == 0 and outcome.lost_uncounted == 0 and outcome.over_bound == 0
        assert outcome.recovery_s is not None and outcome.recovery_s < 60
        carried = outcome.carried_requests
    left = events(run_dir, "engine.left")
    assert carried == sum(e.get("requests", 0) for e in left) > 0, "the carried-over requests are counted"
    assert elastic_run["summary"]["ledger_balanced"]


def test_no_request_reaches_a_joiner_before_its_fence(elastic_run: dict) -> None:
    run_dir, made = elastic_run["run_dir"], elastic_run["made"]
    joined = events(run_dir, "engine.joined")
    assert [e["engine"] for e in joined] == [e.name for e in made] == ["torch-1", "torch-2", "torch-3", "torch-4"]
    assert made[0].calls and made[1].calls, "the joiners that stayed a while served requests"
    for engine, event in zip(made, joined, strict=True):
        assert event["source"] in ("snapshot", "push") and event["version"] >= 3
        if event["source"] == "snapshot":
            assert isinstance(event["checksum"], int)
        assert min(engine.calls, default=event["version"]) >= event["version"], "a request ran before the fence"
        assert min(engine.called_at, default=event["t"]) >= event["t"] - 0.001, "a request came before the fence"
    drained = events(run_dir, "engine.left")
    assert [e["engine"] for e in drained] == ["torch-1", "torch-4", "torch-3"]  # the newest leaves first
    assert drained[0]["episodes_drained"] > 0, "it left with episodes in flight, and they finished (the ledger above)"
    preempted, fault_leave, in_push = drained
    assert preempted["preempted"] and preempted["requests"] > 0 and preempted["tokens_carried"] > 0, preempted
    assert preempted.get("tokens_lost", 0) <= preempted["tokens_carried"], "k = 2: carried tokens may continue"
    assert not fault_leave["preempted"], "the engine.leave fault drains"
    assert in_push["preempted"], "engine.preempt_in_push preempts (what it had in flight, if anything, is carried)"
    outcomes = elastic_run["summary"]["outcomes"]  # the ledger's: every carried token is in a settled sample
    carried = preempted["tokens_carried"] + in_push.get("tokens_carried", 0)
    assert sum(o.get("carried_tokens", 0) for o in outcomes.values()) == carried
    left = events(run_dir, "fleet.left")
    # (the join while version 8 is pushed may come before the preempted leave has settled, or after it)
    assert [e["worker"] for e in left] == ["rollout:torch-1", "rollout:torch-4", "rollout:torch-3"]
    assert left[1]["live"] == 3 and left[-1]["live"] == 2 and left[-1]["preempted"]
    joined = [e["live"] for e in events(run_dir, "fleet.joined")]
    assert joined[0] == 2 and joined[-1] == 4 and len(joined) == 4


def test_a_joiners_weights_equal_the_learners(elastic_run: dict) -> None:
    """The joiner that stays (torch-2, joined while version 8 was pushed) and the first engine (which took
    every version the learner pushed) end on the run's last version with the same weights, to the byte."""
    first, last = elastic_run["first"], elastic_run["made"][1]
    assert elastic_run["summary"]["version"] == STEPS
    assert first.final is not None and last.final is not None
    assert last.final == first.final and last.final[0] == STEPS
