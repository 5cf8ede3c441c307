"""`baton simulate` (baton.simulate on baton.simulate.events): it runs the runtimes' own policy, gate,
clock, channel and replay-window objects; its properties; its CLI; and (slow) its accuracy against real
Ray runs of benchmarks/async_vs_sync.py's pair, each simulated from its own calibration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import pipeline.admission
import pipeline.channel
import pipeline.versions
import policies.selection
from baton.cli import main as cli
from baton.config import ConfigError
from baton.simulate.calibrate import calibrate
from baton.simulate.costs import DeclaredCosts
from baton.simulate.events import TIMEOUT, EventLoop, Wait, channel_receive, channel_send
from baton.simulate.simulation import Simulation, load_simulation_config, simulate
from policies.staleness import MaxStaleness

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.toml")
FAST = settings(max_examples=25, deadline=None)


def tiny(*overrides: str, steps: int = 40):
    """The quickstart config with deterministic declared costs (every response as long as the mean)."""
    sets = ["simulate.response_tokens_sigma=0", "simulate.warmup=5", f"steps={steps}", *overrides]
    return load_simulation_config(QUICKSTART, sets)


# ------------------------------------------------------------------------- the runtimes' own objects


def test_the_simulation_is_built_from_the_runtimes_classes() -> None:
    cfg, spec = tiny()
    s = Simulation(cfg, spec, DeclaredCosts(spec, 8, "inproc", "local"))
    assert type(s.policy) is MaxStaleness and s.policy.k == 2
    assert type(s.gate) is pipeline.admission.AdmissionGate and s.gate.policy is s.policy
    assert type(s.clock) is pipeline.versions.VersionClock and s.gate.clock is s.clock
    assert type(s.produced) is pipeline.channel.Channel and type(s.ready) is pipeline.channel.Channel
    assert (s.produced.max_items, s.produced.max_bytes) == (cfg.buffer.produced_channel, int(cfg.buffer.produced_bytes))
    assert (s.ready.max_items, s.ready.max_bytes) == (cfg.buffer.ready_channel, int(cfg.buffer.ready_bytes))
    assert type(s.window) is policies.selection.ReplayWindow and s.window.staleness is s.policy
    assert type(s.selection) is policies.selection.Fifo


def test_the_simulation_asks_the_policy_and_moves_refs_through_the_channel(monkeypatch) -> None:
    calls: dict[str, int] = {"admit": 0, "accept": 0, "send_nowait": 0, "receive_nowait": 0}

    def counting(cls, name):
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            calls[name] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    counting(MaxStaleness, "admit")
    counting(MaxStaleness, "accept")
    counting(pipeline.channel.Channel, "send_nowait")
    counting(pipeline.channel.Channel, "receive_nowait")
    cfg, spec = tiny()
    result = simulate(cfg, spec)
    groups = cfg.steps * cfg.learner.groups_per_step
    assert result.counts["trained"] == groups
    assert calls["admit"] >= groups and calls["accept"] >= groups
    # every trained group passed through both channels (produced -> buffer, buffer -> ready)
    assert calls["send_nowait"] >= 2 * groups and calls["receive_nowait"] >= 2 * groups


def test_a_patched_policy_changes_what_the_simulation_does(monkeypatch) -> None:
    """k = 2, but an admit rule that only ever admits the current version's groups makes it on-policy:
    the simulation runs whatever the policy object decides."""
    cfg, spec = tiny()
    assert simulate(cfg, spec).figures["mean_staleness"] > 0.5

    def on_policy_admit(self, version, started, discarded, groups_per_step):
        return started - discarded < (version + 1) * groups_per_step

    monkeypatch.setattr(MaxStaleness, "admit", on_policy_admit)
    result = simulate(cfg, spec)
    assert result.staleness_hist == {0: cfg.steps * cfg.learner.groups_per_step}


def test_interrupt_decides_whether_generation_in_flight_restarts(monkeypatch) -> None:
    """With k = 1 the policy lets a call span one version change (continue); patched to restart, every
    call a new version reaches starts again on the new weights."""
    cfg, spec = tiny("staleness.k=1", "simulate.decode_tokens_per_s=500")
    assert simulate(cfg, spec, engines=2).counts.get("restarted", 0) == 0
    monkeypatch.setattr(MaxStaleness, "interrupt", lambda self, oldest, new: "restart")
    assert simulate(cfg, spec, engines=2).counts.get("restarted", 0) > 0


# --------------------------------------------------------------------------------------- properties


@FAST
@given(
    gps=st.integers(1, 8), batch=st.integers(1, 8), mean=st.integers(2, 16),
    train=st.sampled_from([500.0, 2_000.0, 20_000.0]), push=st.sampled_from([0.0, 0.01]),
    engines=st.integers(1, 6),
)
def test_in_sync_mode_more_engines_never_lower_throughput(gps, batch, mean, train, push, engines) -> None:
    cfg, spec = tiny(
        "mode='sync'", "staleness.k=0", f"learner.groups_per_step={gps}", f"engine.batch_groups={batch}",
        f"simulate.response_tokens_mean={mean}", f"simulate.train_tokens_per_s={train}",
        f"simulate.push_latency_s={push}", steps=24,
    )
    fewer = simulate(cfg, spec, engines=engines).figures["samples_per_s"]
    more = simulate(cfg, spec, engines=engines + 1).figures["samples_per_s"]
    assert more >= fewer * (1 - 1e-9)


@FAST
@given(
    k=st.integers(0, 3), engines=st.integers(1, 5), batch=st.integers(1, 8), gps=st.integers(1, 6),
    admission=st.sampled_from(["pace", "eager"]), on_stale=st.sampled_from(["drop", "requeue"]),
    sigma=st.sampled_from([0.0, 0.5, 1.0]), produced=st.integers(1, 16), refs=st.integers(1, 32),
    ready=st.integers(1, 8), reuse=st.integers(1, 2), decode=st.sampled_from([300.0, 3_000.0, 30_000.0]),
    seed=st.integers(0, 3),
)
def test_the_staleness_bound_holds_in_every_simulated_run(
    k, engines, batch, gps, admission, on_stale, sigma, produced, refs, ready, reuse, decode, seed
) -> None:
    assume(reuse <= k + 1)
    try:
        cfg, spec = load_simulation_config(QUICKSTART, [
            f"mode='{'sync' if k == 0 else 'async'}'", f"staleness.k={k}", f"staleness.admission='{admission}'",
            f"staleness.on_stale='{on_stale}'", f"engine.batch_groups={batch}", f"learner.groups_per_step={gps}",
            f"buffer.produced_channel={produced}", f"buffer.max_refs={refs}", f"buffer.ready_channel={ready}",
            f"replay.max_reuse={reuse}", f"engine.count={engines}", "steps=20", f"simulate.seed={seed}",
            f"simulate.response_tokens_sigma={sigma}", f"simulate.decode_tokens_per_s={decode}",
            "simulate.warmup=4",
        ])
    except ConfigError:
        assume(False)  # a shape `baton run` refuses (policies.bounds) is not simulated either
    result = simulate(cfg, spec)
    assert result.counts["trained"] >= 20 * gps // reuse
    assert max(result.staleness_hist) <= k
    assert all(r["staleness_max"] <= k for r in result.records)


def test_ten_thousand_steps_cost_ten_times_a_thousand() -> None:
    """The simulator's work (process resumptions in its event loop) grows linearly with the steps, so
    a long run stays seconds long (benchmarks measure the seconds)."""
    shape = ("learner.groups_per_step=4", "engine.batch_groups=4")
    short = simulate(*tiny(*shape, steps=1_000))
    long = simulate(*tiny(*shape, steps=10_000))
    assert len(short.records) == 1_000 and len(long.records) == 10_000
    assert 0 < long.events <= 10 * short.events


# ----------------------------------------------------------------------------------------- event loop


def test_event_loop_wakes_waiters_in_order_and_honours_timeouts() -> None:
    loop = EventLoop()
    log: list[tuple[str, float, object]] = []

    def waiter(name: str, timeout: float | None):
        got = yield Wait("key", timeout=timeout)
        log.append((name, loop.now, got))

    def notifier():
        yield 2.0
        loop.notify("key")

    loop.spawn(waiter("a", None))
    loop.spawn(waiter("b", 1.0))
    loop.spawn(waiter("c", 5.0))
    loop.spawn(notifier())
    loop.run()
    assert log == [("b", 1.0, TIMEOUT), ("a", 2.0, "key"), ("c", 2.0, "key")]


def test_channel_operations_keep_the_channels_bounds_in_virtual_time() -> None:
    loop = EventLoop()
    channel = pipeline.channel.Channel("c", max_items=2)
    depths, received = [], []

    def producer():
        for i in range(6):
            yield from channel_send(loop, channel, i)
            depths.append(channel.depth)

    def consumer():
        for _ in range(6):
            yield 1.0
            received.append((yield from channel_receive(loop, channel)))

    loop.spawn(producer())
    loop.spawn(consumer())
    loop.run()
    assert received == list(range(6)) and max(depths) == 2 and loop.now == 6.0
    with pytest.raises(anyio.WouldBlock):
        channel.receive_nowait()


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_simulate_writes_a_run_folder_with_a_plot(tmp_path, capsys) -> None:
    code = cli(["simulate", QUICKSTART, "--engines", "2", "--steps", "30", "--set", f"run_root='{tmp_path}'"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    run = Path(out["run_dir"])
    assert (run / "report.png").stat().st_size > 0 and (run / "summary.json").exists()
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 30 and {"depth_produced", "depth_buffer", "depth_ready"} <= records[0].keys()
    for key in ("samples_per_s", "learner_busy", "engine_idle", "mean_staleness", "dropped_frac"):
        assert key in out["figures"]


def test_cli_sweep_prints_a_table_and_writes_a_plot(tmp_path, capsys) -> None:
    code = cli(["simulate", QUICKSTART, "--steps", "20", "--set", f"run_root='{tmp_path}'",
                "--sweep", "engines=1,2", "k=0,1"])
    assert code == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert [(p["engines"], p["k"]) for p in out["points"]] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert (Path(out["sweep_dir"]) / "sweep.png").stat().st_size > 0
    assert "samples/s" in captured.err


@pytest.mark.parametrize(("args", "message"), [
    (["--sweep", "gpus=1,2"], "KEY one of engines, k, learners"),
    (["--set", "simulate.decode_tokens_per_sec=1"], "decode_tokens_per_sec"),
    (["--set", "simulate.response_tokens_mean=99", "--set", "simulate.max_response_tokens=16"],
     "raise max_response_tokens"),
    (["--engines", "0"], "--engines must be >= 1"),
])
def test_cli_names_the_bad_key_and_the_fix(tmp_path, capsys, args, message) -> None:
    assert cli(["simulate", QUICKSTART, "--set", f"run_root='{tmp_path}'", *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_calibrate_needs_a_run_folder(tmp_path, capsys) -> None:
    assert cli(["simulate", "--calibrate", str(tmp_path)]) == 2
    assert "run `baton run CONFIG` first" in capsys.readouterr().err


def test_calibration_reads_a_run_folder_and_reproduces_a_steady_pipeline(tmp_path, capsys) -> None:
    """A synthetic run folder of a learner-bound pipeline (steps 80 ms, engine calls 30 ms): the
    calibrated simulation finds the learner busy and the measured throughput."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(Path(QUICKSTART).read_text())
    records = [{"version": v, "t": 0.1 * v, "step_s": 0.08, "collect_s": 0.0, "push_s": 0.01, "version_s": 0.1,
                "staleness_mean": 2.0 if v > 2 else 0.0, "load_s": 0.0016, "loads": 16} for v in range(1, 41)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    calls = [{"engine": "torch-0", "t": 0.05 * i, "groups": 16, "group_size": 8, "gate_s": 0.0, "prompts_s": 0.001,
              "gen_s": 0.03, "put_s": 0.002, "send_s": 0.001, "tokens": 256, "lengths": [2] * 128, "nbytes": 26624}
             for i in range(80)]
    (run / "generation.jsonl").write_text("".join(json.dumps(c) + "\n" for c in calls))
    (run / "summary.json").write_text(json.dumps({"samples": {"trained": 40 * 128}}))
    cal = calibrate(run)
    assert cal.measured["samples_per_s"] == pytest.approx(1280, rel=1e-3) and cal.engines == 1
    assert cal.costs.get_s_per_group == pytest.approx(0.0001)
    code = cli(["simulate", "--calibrate", str(run), "--set", f"run_root='{tmp_path}'"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["figures"]["samples_per_s"] == pytest.approx(1280, rel=0.05)
    assert out["figures"]["learner_busy"] == pytest.approx(0.8, rel=0.05)


# ---------------------------------------------------------------------------------- accuracy (slow)


def _ray_run(root: Path, mode: str, k: int, steps: int) -> Path:
    """One run of benchmarks/async_vs_sync.py's pair: configs/ray-mooncake.toml, one engine."""
    sets = [f"steps={steps}", f"run_root='{root}'", "telemetry.progress=false", "engine.count=1",
            f"mode='{mode}'", f"staleness.k={k}"]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "baton.cli", "run", str(ROOT / "configs" / "ray-mooncake.toml"),
           *[x for s in sets for x in ("--set", s)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(json.loads(proc.stdout.strip().splitlines()[-1])["run_dir"])


ACCURACY_STEPS = 36  # 9 warm-up versions (a quarter), 27 in steady state: about 50 s per run on 2 cores


@pytest.mark.nightly
@pytest.mark.xfail(reason="the simulator models one engine call per batch of groups; episodes run as concurrent "
                   "coroutines (the engine merges the calls of one event-loop tick), and the prediction is within "
                   "20 % in some runs only (2026-12-01: passed once, failed once): open", strict=False)
def test_simulated_ray_runs_match_their_measurements_within_20_percent(tmp_path) -> None:
    errors = {}
    for mode, k in (("sync", 0), ("async", 1)):
        cal = calibrate(_ray_run(tmp_path, mode, k, ACCURACY_STEPS))
        cfg, spec = load_simulation_config(str(cal.config_path))
        predicted = simulate(cfg, spec, cal.costs, engines=cal.engines, steps=ACCURACY_STEPS).figures
        for key in ("samples_per_s", "learner_busy", "mean_staleness"):
            measured = cal.measured[key]
            errors[f"{mode} {key}"] = (predicted[key], measured)
            if measured == 0:
                assert predicted[key] == 0, (mode, key, predicted[key])
            else:
                assert abs(predicted[key] - measured) / measured <= 0.2, (mode, key, predicted[key], measured)
    print(json.dumps(errors))


def test_learner_ranks_divide_the_step_and_push_from_their_shards() -> None:
    """On N ranks the compute divides by N and FSDP's traffic is added; mooncake_p2p pushes from every
    shard at once (1/N of the time), another transport gathers on rank 0 first."""
    import random

    from baton.schema import SimulateSpec
    from baton.simulate.costs import DeclaredCosts

    spec = SimulateSpec(train_tokens_per_s=1000, weight_bytes=4_000_000_000, shard_bytes_per_s=1e9,
                        push_bytes_per_s=1e9)
    rng = random.Random(0)
    one, four = (DeclaredCosts(spec, 8, "mooncake_p2p", "ray", ranks=n) for n in (1, 4))
    assert one.step_s(rng, 4000) == pytest.approx(4.0)
    assert four.step_s(rng, 4000) == pytest.approx(1.0 + 3 * 4.0 * 0.75)
    assert four.push_s(rng) == pytest.approx(one.push_s(rng) / 4)
    gather = DeclaredCosts(spec, 8, "disk", "ray", ranks=4)
    assert gather.push_s(rng) == pytest.approx(4.0 * 0.75 + one.push_s(rng))


def test_an_moe_computes_with_its_active_parameters_and_pushes_all_of_them() -> None:
    """An MoE with 1/8 of its parameters active: a step and a generation cost 1/8 of the dense model's
    compute, the weight push and FSDP's traffic (total parameters) stay the same."""
    import random

    from baton.schema import SimulateSpec
    from baton.simulate.costs import DeclaredCosts

    shape = dict(params=8e9, train_flops_per_s=6e13, decode_flops_per_s=2e13, push_bytes_per_s=1e9,
                 shard_bytes_per_s=1e9)
    dense, moe = (DeclaredCosts(SimulateSpec(**shape, active_params=a), 8, "disk", "ray", ranks=2)
                  for a in (8e9, 1e9))
    rng = random.Random(0)
    assert dense.weight_bytes == moe.weight_bytes == 16e9  # bf16, every expert pushed
    assert moe.push_s(rng) == dense.push_s(rng)
    assert moe.train_tokens_per_s == pytest.approx(8 * dense.train_tokens_per_s)
    assert moe.decode_tokens_per_s == pytest.approx(8 * dense.decode_tokens_per_s)
    fsdp = 3 * 16e9 * 0.5 / 1e9  # gathers and scatters follow the total
    assert moe.step_s(rng, 10_000) - fsdp == pytest.approx((dense.step_s(rng, 10_000) - fsdp) / 8)
    assert moe.step_s(rng, 10_000) < dense.step_s(rng, 10_000)
    assert DeclaredCosts(SimulateSpec(**shape, weight_bytes="1GB"), 8, "disk", "ray").weight_bytes == 1e9


@pytest.mark.parametrize("keys, message", [
    (dict(active_params=1e9, train_flops_per_s=1e15), "need simulate.params"),
    (dict(params=1e9, active_params=2e9, train_flops_per_s=1e15), "above simulate.params"),
    (dict(params=8e9, active_params=1e9), "changes nothing"),
])
def test_moe_parameter_keys_that_cannot_work_are_refused(keys, message) -> None:
    from pydantic import ValidationError

    from baton.schema import SimulateSpec

    with pytest.raises(ValidationError, match=message):
        SimulateSpec(**keys)
