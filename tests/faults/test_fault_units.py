"""The fault machinery's logic, without a pipeline run: schedules, fire-once markers, no hooks when
off, each boundary's wrapper against a real MemoryStore / codec / InprocTransport, config validation,
and the matrix's judgement of a ledger (on hand-written run folders)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from baton.config import ConfigError, to_toml, validate
from baton.fault_matrix import RunOutcome, judge, recovery_seconds
from buffers.codec import CodecError, RolloutBatch, decode, encode
from buffers.faulty import FaultyStore, InjectedStoreError, open_store
from buffers.memory import MemoryStore
from buffers.retry import with_retries
from buffers.store import StoreError
from pipeline.channel import Channel
from pipeline.contracts import Services
from pipeline.faults import (
    FAULT_KINDS,
    CrashingClock,
    FaultPlan,
    FaultPlanError,
    FaultSpec,
    LearnerCrashed,
    install,
    read_events,
)
from pipeline.telemetry import RunFolder
from pipeline.versions import VersionClock
from stages.engines.faulty import EngineCrashed, with_engine_faults
from stages.weights.base import WeightPushError
from stages.weights.faulty import with_weight_faults
from stages.weights.inproc import InprocTransport

pytestmark = pytest.mark.anyio


def fires(plan: FaultPlan, kind: str, calls: int, scope: str = "") -> list[int]:
    schedule = plan.schedule(kind, scope)
    assert schedule is not None
    return [n for n in range(1, calls + 1) if schedule.hit()]


def test_at_fires_exactly_on_those_occurrences_and_unplanned_kinds_install_nothing() -> None:
    plan = FaultPlan([FaultSpec("store.put_fail", at=(2, 5))])
    assert fires(plan, "store.put_fail", 10) == [2, 5]
    assert plan.schedule("store.get_fail") is None
    assert plan.planned("store.") and not plan.planned("engine.")
    with pytest.raises(FaultPlanError, match="unknown fault kind"):
        plan.schedule("store.put_fial")


def test_probability_is_reproducible_per_seed() -> None:
    def draw(seed: int) -> list[int]:
        return fires(FaultPlan([FaultSpec("channel.stall", probability=0.2, seed=seed)]), "channel.stall", 200)

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)
    assert 20 < len(draw(1)) < 60  # ~40 of 200


def test_a_fault_fires_once_per_run_folder_even_in_a_restarted_process(tmp_path: Path) -> None:
    spec = FaultSpec("engine.crash", at=(3,))
    first = FaultPlan([spec]).bound(tmp_path)
    assert fires(first, "engine.crash", 5, "torch-0") == [3]
    restarted = FaultPlan([spec]).bound(tmp_path)  # fresh counters, same run folder
    assert fires(restarted, "engine.crash", 5, "torch-0") == []
    assert fires(restarted, "engine.crash", 5, "torch-1") == [3], "another scope has its own occurrences"
    events = read_events(tmp_path)
    assert [(e["event"], e["scope"], e["occurrence"]) for e in events] == [
        ("fired", "torch-0", 3), ("fired", "torch-1", 3)
    ]


@pytest.mark.parametrize("bad, match", [
    (dict(kind="engine.crsh", at=(1,)), "unknown fault kind"),
    (dict(kind="engine.crash"), "give `at`"),
    (dict(kind="engine.crash", at=(1,), probability=0.5), "either"),
    (dict(kind="engine.crash", at=(0,)), "count from 1"),
    (dict(kind="channel.stall", probability=1.5), "within"),
])
def test_bad_specs_say_what_to_fix(bad: dict, match: str) -> None:
    with pytest.raises(FaultPlanError, match=match):
        FaultSpec(**bad)


async def test_no_fault_planned_means_no_wrapper_and_no_hook(tmp_path: Path) -> None:
    store, engine, transport = MemoryStore(), SimpleNamespace(name="e"), InprocTransport()
    other = FaultPlan([FaultSpec("channel.stall", at=(1,))])
    assert open_store(store, holder=True, faults=None) is store
    assert open_store(store, holder=True, faults=other) is store, "no store kind planned: the store itself"
    assert with_engine_faults(engine, None) is engine and with_engine_faults(engine, other) is engine
    assert with_weight_faults(transport, None) is transport and with_weight_faults(transport, other) is transport
    channel = Channel("produced", max_items=4)
    ctx = SimpleNamespace(folder=RunFolder(tmp_path), services=Services(), clock=object(),
                          channels={"produced": channel})
    clock = ctx.clock
    assert install(ctx, None) is None
    assert ctx.services == Services() and ctx.clock is clock and channel.before_send is None


def batch_payload() -> memoryview:
    batch = RolloutBatch.from_rows(
        [{"tokens": np.arange(6, dtype=np.int32)}], row_fields={"rewards": np.array([1.0], np.float32)}, meta={}
    )
    return encode(batch)


async def test_store_put_fail_is_a_typed_store_error_that_retries_get_past() -> None:
    store = FaultyStore(MemoryStore(), FaultPlan([FaultSpec("store.put_fail", at=(1,))]))
    with pytest.raises(InjectedStoreError) as err:
        await store.put("k", b"x")
    assert isinstance(err.value, StoreError)
    store2 = FaultyStore(MemoryStore(), FaultPlan([FaultSpec("store.put_fail", at=(1,))]))
    with pytest.raises(InjectedStoreError):  # the fault holds for that key's retries: its group is redone
        await with_retries(lambda: store2.put("k", b"x"))
    await with_retries(lambda: store2.put("other", b"y"))  # other keys go through, retried or not
    assert bytes(await store2.get("other")) == b"y"
    await store2.put("k", b"x")  # once the retries gave up, the key is healthy again
    assert bytes(await store2.get("k")) == b"x"
    always = FaultyStore(MemoryStore(), FaultPlan([FaultSpec("store.get_fail", probability=1.0)]))
    await always.put("k", b"x")
    with pytest.raises(InjectedStoreError):
        await with_retries(lambda: always.get("k"))  # every retry fails: the typed error surfaces


async def test_a_corrupted_payload_is_refused_by_the_codec_checksum() -> None:
    store = FaultyStore(MemoryStore(), FaultPlan([FaultSpec("store.corrupt", at=(1,))]))
    payload = batch_payload()
    await store.put("k", payload)
    with pytest.raises(CodecError, match="checksum"):
        decode(await store.get("k"))
    assert decode(await store.get("k")).rows == 1, "only the scheduled get is damaged; the stored value is intact"


def test_infrastructure_faults_need_their_target() -> None:
    with pytest.raises(FaultPlanError, match="store.master = 'auto'"):
        FaultyStore(MemoryStore(), FaultPlan([FaultSpec("store.master_restart", at=(1,))]))
    with pytest.raises(FaultPlanError, match="baton faults"):
        FaultyStore(MemoryStore(), FaultPlan([FaultSpec("store.holder_crash", at=(1,))]))


class Receiver:
    name = "engine"

    def __init__(self) -> None:
        self.versions: list[int] = []

    async def receive_weights(self, version: int, tensors: dict) -> None:
        self.versions.append(version)


async def test_a_refused_push_is_retried_and_then_surfaced_never_reported_done() -> None:
    weights = {"w": torch.ones(3)}
    receiver = Receiver()
    transport = with_weight_faults(InprocTransport(), FaultPlan([FaultSpec("weights.push_fail", at=(1,))]))
    transport.subscribe(receiver)
    await transport.publish(1, weights)
    assert receiver.versions == [1], "one refusal: retried and delivered"

    receiver = Receiver()
    failing = with_weight_faults(InprocTransport(), FaultPlan([FaultSpec("weights.push_fail", at=(1, 2, 3))]))
    failing.subscribe(receiver)
    with pytest.raises(WeightPushError, match="refused"):
        await failing.publish(1, weights)
    assert receiver.versions == [], "nothing was delivered, and the push did not claim it was"


async def test_an_engine_refusal_is_counted_and_the_version_sent_again() -> None:
    class RefusesOnce(Receiver):
        async def receive_weights(self, version: int, tensors: dict) -> None:
            if not self.refused:
                self.refused = True
                raise RuntimeError("version file damaged: checksum")
            await super().receive_weights(version, tensors)

    receiver = RefusesOnce()
    receiver.refused = False
    transport = InprocTransport()
    transport.subscribe(receiver)
    await transport.publish(1, {"w": torch.ones(3)})
    assert receiver.versions == [1] and transport.stats["refused"] == 1


def test_server_faults_need_an_engine_that_launched_its_server() -> None:
    from stages.engines.vllm import VLLMEngine

    attached = VLLMEngine("model", url="http://127.0.0.1:9")
    with pytest.raises(FaultPlanError, match="engine.kind = 'vllm', no engine.urls.*attached by url"):
        with_engine_faults(attached, FaultPlan([FaultSpec("engine.server_kill", at=(1,))]))
    in_process = SimpleNamespace(name="torch-0")
    with pytest.raises(FaultPlanError, match=r"engine.push_refused needs .*\(engine.kind = 'vllm'\)"):
        with_engine_faults(in_process, FaultPlan([FaultSpec("engine.push_refused", at=(1,))]))
    launched = VLLMEngine("model")  # unstarted: nothing is launched until start
    assert with_engine_faults(launched, FaultPlan([FaultSpec("engine.server_kill_push", at=(1,))])) is not launched


async def test_engine_crash_raises_a_typed_engine_error_after_the_work_is_lost() -> None:
    class Engine:
        name, version = "e", 0
        calls = 0

        async def generate(self, prompts, params):
            Engine.calls += 1
            return ["done"] * len(prompts)

    engine = with_engine_faults(Engine(), FaultPlan([FaultSpec("engine.crash", at=(1,))]))
    with pytest.raises(EngineCrashed):
        await engine.generate([[1]], None)
    assert await engine.generate([[1]], None) == ["done"]
    assert Engine.calls == 2


async def test_learner_crash_fires_at_its_version(tmp_path: Path) -> None:
    from pipeline.context import LocalClock

    plan = FaultPlan([FaultSpec("learner.crash", at=(2,))]).bound(tmp_path)
    clock = CrashingClock(LocalClock(VersionClock()), plan.schedule("learner.crash"))
    await clock.advance_to(1)
    with pytest.raises(LearnerCrashed):
        await clock.advance_to(2)
    assert await clock.current() == 1, "the crashed version was never advanced to"


async def test_a_channel_stall_delays_a_send_and_loses_nothing(tmp_path: Path) -> None:
    import anyio

    channel = Channel("produced", max_items=4)
    ctx = SimpleNamespace(folder=RunFolder(tmp_path), services=Services(), clock=None, channels={"produced": channel})
    install(ctx, FaultPlan([FaultSpec("channel.stall", at=(2,), delay_s=0.2)]))
    t0 = anyio.current_time()
    for item in range(3):
        await channel.send(item)
    assert anyio.current_time() - t0 >= 0.2
    assert [channel.receive_nowait() for _ in range(3)] == [0, 1, 2]
    assert [e["event"] for e in read_events(tmp_path)] == ["fired", "recovered"]


def config(**extra) -> dict:
    return {"steps": 5, **extra}


@pytest.mark.parametrize("data, expected", [
    (config(faults=[{"kind": "engine.crsh", "at": [1]}]), "faults.0.kind"),
    (config(faults=[{"kind": "store.get_fail"}]), "give exactly one"),
    (config(faults=[{"kind": "engine.hang", "at": [1]}]), "set rollout.request_timeout_s"),
    (config(faults=[{"kind": "store.master_restart", "at": [1]}]), "set store.kind = 'mooncake'"),
    (config(store={"kind": "mooncake"}, faults=[{"kind": "store.holder_crash", "at": [1]}]),
     "set store.replicas = 2"),
    (config(faults=[{"kind": "channel.stall", "at": [1]}, {"kind": "channel.stall", "at": [2]}]), "merge"),
])
def test_config_names_the_key_and_the_fix(data: dict, expected: str) -> None:
    from baton.schema import RunConfig

    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(".", r"\.")):
        validate(RunConfig, data)


def test_faults_survive_the_resolved_config_round_trip() -> None:
    import tomllib

    from baton.schema import RunConfig

    cfg = validate(RunConfig, config(faults=[{"kind": "store.corrupt", "at": [2, 4]}]))
    again = validate(RunConfig, tomllib.loads(cfg.resolved_toml()))
    assert [(f.kind, f.at) for f in again.faults] == [("store.corrupt", [2, 4])]
    assert set(FAULT_KINDS) == set(RunConfig.model_fields["faults"].annotation.__args__[0]
                                   .model_fields["kind"].annotation.__args__)
    assert "[[faults]]" in to_toml({"faults": [{"kind": "x"}]})


def write_run(folder: Path, records: list[dict], rewards: list[float], events: list[dict], version: int) -> Path:
    folder.mkdir()
    (folder / "ledger.json").write_text(json.dumps(records))
    (folder / "summary.json").write_text(json.dumps({"version": version, "staleness_bound": 2,
                                                     "ledger_balanced": True}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"version": i + 1, "reward": r}) + "\n"
                                                  for i, r in enumerate(rewards)))
    (folder / "faults.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return folder


def rec(i: int, group: str, versions: tuple[int, int], trained_at: list[int], fate: str) -> dict:
    return {"id": f"s{i}", "group": group, "versions": list(versions), "trained_at": trained_at, "fate": fate,
            "reason": ""}


def test_the_matrix_judges_from_the_ledger(tmp_path: Path) -> None:
    fired = [{"t": 1.0, "event": "fired", "kind": "store.corrupt", "scope": ""},
             {"t": 3.5, "event": "recovered", "kind": "store.corrupt", "scope": ""}]
    rising = [0.0, 0.0, 0.1, 0.2]
    good = [rec(0, "g0", (0, 0), [1], "trained"), rec(1, "g1", (1, 1), [], "lost"),
            rec(2, "g2", (3, 3), [], "in_flight")]
    ok = judge(RunOutcome("store.corrupt", 0), write_run(tmp_path / "ok", good, rising, fired, 4), 4, window_groups=3)
    assert ok.passed, ok.problems
    assert (ok.lost, ok.max_staleness, ok.recovery_s) == (1, 1, 2.5)

    bad = [rec(0, "g0", (0, 0), [1, 2], "trained"),  # trained twice
           rec(1, "g1", (0, 0), [3], "trained"),  # staleness 3 > 2
           *[rec(10 + i, f"f{i}", (3, 3), [], "in_flight") for i in range(5)]]  # 5 groups in flight, window 3
    broken = judge(RunOutcome("store.corrupt", 0), write_run(tmp_path / "bad", bad, [0.1, 0.1, 0.1, 0.1], [], 3),
                   4, window_groups=3)
    assert not broken.passed
    assert (broken.trained_twice, broken.over_bound, broken.lost_uncounted) == (1, 1, 2)
    assert any("never fired" in p for p in broken.problems)
    assert any("did not finish" in p for p in broken.problems)
    assert any("reward did not rise" in p for p in broken.problems)


def test_recovery_is_the_longest_time_from_a_firing_to_its_recovery() -> None:
    events = [{"t": 0.0, "event": "fired", "kind": "k", "scope": "a"},
              {"t": 1.0, "event": "recovered", "kind": "k", "scope": "b"},
              {"t": 4.0, "event": "recovered", "kind": "k", "scope": "a"}]
    assert recovery_seconds(events, "k") == 4.0
    assert recovery_seconds(events[:1], "k") == float("inf")
    assert recovery_seconds(events, "other") is None


def test_the_master_target_restarts_on_the_same_port_and_stops_by_pid(tmp_path: Path) -> None:
    import socket

    from buffers.faulty import MasterByPid
    from buffers.mooncake_master import MooncakeMaster

    master = MooncakeMaster(lease_ttl_ms=500, client_ttl_s=3).start()
    pid_file = tmp_path / "master.pid"
    pid_file.write_text(str(master.pid))
    target = MasterByPid(master.port, str(pid_file))
    try:
        target.restart()
        new_pid = int(pid_file.read_text())
        assert new_pid != master.pid and not master.running(), "the old master was killed"
        with socket.create_connection(("127.0.0.1", master.port), timeout=1):
            pass  # the new one listens on the same port
    finally:
        target.stop()
        master.stop()
    assert not Path(f"/proc/{new_pid}").exists() or "Z" in Path(f"/proc/{new_pid}/stat").read_text().split()[2]


def test_with_routing_replay_every_step_must_route_as_its_engine_did(tmp_path: Path) -> None:
    """An MoE run with routing replay passes only when every step reports router_disagreement 0."""
    fired = [{"t": 1.0, "event": "fired", "kind": "engine.crash", "scope": ""},
             {"t": 1.5, "event": "recovered", "kind": "engine.crash", "scope": ""}]
    records = [rec(0, "g0", (0, 0), [1], "trained")]

    def outcome(name: str, shares: list[float | None], replay: bool = True) -> RunOutcome:
        folder = write_run(tmp_path / name, records, [0.0, 0.0, 0.1, 0.2], fired, 4)
        (folder / "metrics.jsonl").write_text("".join(
            json.dumps({"version": i + 1, "reward": r, **({"router_disagreement": d} if d is not None else {})}) + "\n"
            for i, (r, d) in enumerate(zip([0.0, 0.0, 0.1, 0.2], shares, strict=True))))
        return judge(RunOutcome("engine.crash", 0), folder, 4, None, replay=replay)

    clean = outcome("clean", [0.0] * 4)
    assert clean.passed and clean.router_disagreement == 0.0, clean.problems
    drifted = outcome("drifted", [0.0, 0.25, 0.0, 0.0])
    assert not drifted.passed and drifted.router_disagreement == 0.25
    assert any("router_disagreement reached 0.25" in p for p in drifted.problems)
    bare = outcome("bare", [0.0, None, 0.0, 0.0])
    assert any("1 steps report no router_disagreement" in p for p in bare.problems)
    dense = outcome("dense", [None] * 4, replay=False)
    assert dense.passed and dense.router_disagreement is None
    from baton.fault_matrix import render, rows

    assert rows([clean])[0]["router disagreement"] == "0" and "router disagreement" not in rows([dense])[0]
    assert "router disagreement" in render([dense, clean])  # a row without the column shows "-"
