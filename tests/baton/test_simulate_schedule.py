"""`baton simulate` with a run whose shape changes (baton.simulate.fleet, baton.simulate.schedule): engines
that join after their fence and leave by draining, a learner group that restarts, and figures per phase.
Pure logic in virtual time: no servers, no files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.cli import main as cli
from baton.config import ConfigError
from baton.simulate import replay
from baton.simulate.schedule import observe_schedule, phases_of, schedule_overrides
from baton.simulate.simulation import Simulation, load_simulation_config, simulate

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.toml")
# engine-bound: one engine's call of 8 groups x 8 samples x 8 tokens takes ~1.7 s, a step ~0.15 s
ENGINE_BOUND = ["mode='async'", "staleness.k=4", "simulate.decode_tokens_per_s=300", "simulate.response_tokens_sigma=0",
                "simulate.warmup=5"]


def engine_bound(*overrides: str, steps: int = 80):
    return load_simulation_config(QUICKSTART, [*ENGINE_BOUND, f"steps={steps}", *overrides])


def run(*overrides: str, steps: int = 80) -> Simulation:
    cfg, spec = engine_bound(*overrides, steps=steps)
    sim = Simulation(cfg, spec, _declared(cfg, spec))
    sim.result = sim.run()  # type: ignore[attr-defined]
    return sim


def _declared(cfg, spec):
    from baton.simulate.costs import DeclaredCosts

    return DeclaredCosts(spec, cfg.rollout.group_size, cfg.weights.transport, cfg.runtime, cfg.learner_ranks)


def test_a_constant_schedule_is_todays_prediction_exactly() -> None:
    cfg, spec = engine_bound()
    today = simulate(cfg, spec, engines=2)
    for schedule in ("[[0, 2]]", "[[0, 2], [30, 2], [90, 2]]"):  # the second runs the fleet process: no change
        cfg, spec = engine_bound(f"simulate.engine_schedule={schedule}")
        scheduled = simulate(cfg, spec, engines=5)  # a step at 0 sets the starting count
        assert scheduled.records == today.records
        assert scheduled.figures == today.figures and scheduled.staleness_hist == today.staleness_hist
        assert {k: v for k, v in scheduled.counts.items() if k != "fleet_changes"} == today.counts
        assert {p["engines"] for p in scheduled.phases} == {2}


def test_engine_bound_samples_per_s_doubles_after_a_join_from_one_to_two() -> None:
    sim = run("simulate.engine_schedule=[[0, 1], [60, 2]]", "simulate.engine_join_s=1.0", steps=90)
    before, after = sim.result.phases  # type: ignore[attr-defined]
    assert (before["engines"], after["engines"]) == (1, 2)
    assert 1.8 <= after["samples_per_s"] / before["samples_per_s"] <= 2.2
    assert max(r["engines"] for r in sim.records) == 2


def test_a_joiner_takes_work_only_after_its_join_cost() -> None:
    quick = run("simulate.engine_schedule=[[0, 1], [60, 2]]", "simulate.engine_join_s=0", steps=90)
    slow = run("simulate.engine_schedule=[[0, 1], [60, 2]]", "simulate.engine_join_s=30", steps=90)
    q, s = quick.result.phases[1], slow.result.phases[1]  # type: ignore[attr-defined]
    assert slow.fleet.admitted[1] > 0
    # 30 of the second phase's first seconds without the joiner: fewer versions per second after the join
    assert s["samples_per_s"] < 0.9 * q["samples_per_s"]


def test_a_leave_drains_its_call_and_loses_no_group() -> None:
    sim = run("simulate.engine_schedule=[[0, 2], [40, 1]]", steps=60)
    leaver = 1  # the newest engine leaves first
    assert leaver not in sim.fleet.members and sim.fleet.members == [0]
    assert sim.fleet.left_at[leaver] > 40.0  # it finished the call it had in flight at the leave, after it
    fleet = sim.fleet
    assert fleet.admitted[leaver] == fleet.produced_by[leaver] > 0  # every admitted group was generated and sent
    assert fleet.settled_by[leaver] == fleet.produced_by[leaver]  # and trained or dropped (counted) by the end
    before, after = sim.result.phases  # type: ignore[attr-defined]
    assert after["samples_per_s"] < 0.7 * before["samples_per_s"]


def test_a_shrink_while_a_joiner_fences_removes_the_joiner_before_it_takes_work() -> None:
    sim = run("simulate.engine_schedule=[[0, 1], [30, 2], [31, 1]]", "simulate.engine_join_s=5", steps=40)
    assert sim.fleet.admitted[1] == 0 and sim.fleet.members == [0] and 1 in sim.fleet.left_at


def test_a_learner_restart_stops_versions_for_its_seconds_and_raises_peak_staleness() -> None:
    calm = run("simulate.engine_schedule=[[0, 1]]", steps=60)
    hit = run("simulate.engine_schedule=[[0, 1]]", "simulate.learner_restarts=[60.0]", "simulate.learner_restart_s=20",
              steps=60)
    version_s = max(r["version_s"] for r in calm.records)
    after = hit.result.phases[1]  # type: ignore[attr-defined]
    assert after["restart"] and 20.0 <= after["max_gap_s"] <= 20.0 + 2 * version_s
    assert sum(r["restart_s"] for r in hit.records) >= 20.0
    assert hit.result.figures["max_staleness"] > calm.result.figures["max_staleness"]  # type: ignore[attr-defined]
    (restart,) = hit.restarts.done
    every = hit.cfg.checkpoint.every
    assert restart["seconds"] == 20.0 and restart["rolled_back_versions"] == restart["at_version"] % every
    assert hit.counts["trained"] == calm.counts["trained"]  # the lost step's groups were trained afterwards
    assert hit.records[-1]["t"] > calm.records[-1]["t"] + 5.0


def test_phases_tile_the_run_in_order() -> None:
    phases = phases_of(3, [(0.0, 1), (10.0, 2), (30.0, 1), (99.0, 4)], [20.0], 50.0)
    assert [(p.start_s, p.end_s, p.engines, p.restart) for p in phases] == [
        (0.0, 10.0, 1, False), (10.0, 20.0, 2, False), (20.0, 30.0, 2, True), (30.0, 50.0, 1, False)]
    assert phases_of(2, [], [], 7.0)[0].engines == 2


@pytest.mark.parametrize("key, value, message", [
    ("engine_schedule", "[[10, 1], [5, 2]]", "increasing"),
    ("engine_schedule", "[[0, 0]]", ">= 1"),
    ("learner_restarts", "[30.0, 10.0]", "in order"),
])
def test_a_schedule_that_cannot_be_is_refused_naming_the_key(key, value, message) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        engine_bound(f"simulate.{key}={value}")
    assert key in str(err.value)


def test_cli_flags_become_the_simulate_keys(capsys) -> None:
    assert schedule_overrides("0:1,60:2", "40,90") == ["simulate.engine_schedule=[[0.0, 1], [60.0, 2]]",
                                                       "simulate.learner_restarts=[40.0, 90.0]"]
    with pytest.raises(ConfigError, match="TIME_S:ENGINES"):
        schedule_overrides("0-1", None)
    assert cli(["simulate", QUICKSTART, "--engine-schedule", "0:1;60:2"]) == 2
    assert "--engine-schedule" in capsys.readouterr().err


def test_a_real_runs_joins_leaves_and_restarts_become_its_schedule() -> None:
    """From a run folder's records (events in wall-clock time, calls and metrics in run time): the clock
    offset from the joiner's first call and the leaver's last, each request `join_s`/`drain_s` before its
    event, a restart `seconds` before its event."""
    t0 = 1_000.0  # the run's start in wall-clock time
    calls = [{"engine": "torch-0", "t": 0.5, "gate_s": 0.0, "gen_s": 0.4, "send_s": 0.0},
             {"engine": "torch-1", "t": 12.5, "gate_s": 0.1, "gen_s": 0.4, "send_s": 0.0},  # began at 12.0
             {"engine": "torch-1", "t": 30.0, "gate_s": 0.0, "gen_s": 0.4, "send_s": 0.0}]
    events = [{"t": t0 + 12.0, "kind": "fleet.joined", "worker": "rollout:torch-1", "join_s": 2.0, "live": 2},
              {"t": t0 + 30.0, "kind": "fleet.left", "worker": "rollout:torch-1", "drain_s": 1.5, "live": 1},
              {"t": t0 + 50.0, "kind": "learner.restart", "seconds": 8.0, "at_version": 40},
              {"t": t0 + 51.0, "kind": "engine.hang"}]
    observed = observe_schedule(events, calls, [])
    assert observed.engine_schedule == [(0.0, 1), (10.0, 2), (28.5, 1)]
    assert (observed.engine_join_s, observed.learner_restarts, observed.learner_restart_s) == (2.0, [42.0], 8.0)
    assert "simulate.engine_schedule=[[0.0, 1], [10.0, 2], [28.5, 1]]" in observed.overrides()
    assert observe_schedule([e for e in events if e["kind"] == "engine.hang"], calls, []) is None
    # without fleet events the restart's version places it: the record of version 40 was written at t = 41.0
    alone = observe_schedule(events[2:], calls, [{"version": 40, "t": 41.0}])
    assert alone.learner_restarts == [41.0] and alone.engine_schedule == [(0.0, 2)]


def test_replay_simulates_a_run_folder_on_its_own_join_and_compares_each_phase(tmp_path) -> None:
    """A synthetic engine-bound run folder (one call of 16 groups = one version, 0.5 s per call and engine;
    a second engine joins at 20 s): the replay places the join where it was and predicts both phases."""
    run = tmp_path / "run"
    run.mkdir()
    config = Path(QUICKSTART).read_text().replace("steps = 500", "steps = 120")
    (run / "config.toml").write_text(config)
    times = [0.5 * v for v in range(1, 41)] + [20 + 0.25 * v for v in range(1, 81)]
    records = [{"version": v, "t": t, "step_s": 0.01, "collect_s": 0.24, "push_s": 0.0, "version_s": 0.25,
                "staleness_mean": 0.0, "staleness_max": 0} for v, t in enumerate(times, 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    call = {"groups": 16, "group_size": 8, "gate_s": 0.0, "gen_s": 0.5, "put_s": 0.0, "send_s": 0.0, "tokens": 256,
            "lengths": [2] * 128, "nbytes": 26624}
    calls = sorted([{"engine": "torch-0", "t": 0.5 * i, **call} for i in range(1, 81)] +
                   [{"engine": "torch-1", "t": 20 + 0.5 * i, **call} for i in range(1, 41)], key=lambda c: c["t"])
    (run / "generation.jsonl").write_text("".join(json.dumps(c) + "\n" for c in calls))
    (run / "summary.json").write_text(json.dumps({"samples": {"trained": 120 * 128}}))
    event = {"t": 5_000.0 + 20.0, "kind": "fleet.joined", "worker": "rollout:torch-1", "join_s": 0.1, "live": 2}
    (run / "events.jsonl").write_text(json.dumps(event) + "\n")
    result, cal = replay(str(run))
    assert cal.schedule is not None and cal.schedule.engine_schedule == [(0.0, 1), (19.9, 2)]
    measured, simulated = cal.measured["phases"], result.phases
    assert [p["engines"] for p in simulated] == [1, 2] and len(measured) == 2
    assert 1.8 <= simulated[1]["samples_per_s"] / simulated[0]["samples_per_s"] <= 2.2
    for m, s in zip(measured, simulated, strict=True):
        assert s["samples_per_s"] == pytest.approx(m["samples_per_s"], rel=0.15)
