"""An elastic run's samples/s as its engine count changes: one engine, then two (a join), then one again (a
leave), in one run of the README's Python quickstart whose engines are the bottleneck. Two cores cannot show
that with engines that compete for them, so each engine here answers every call `--delay` seconds late (a
slow engine: `SlowEngine`, a TorchEngine that waits that long before it generates and `--step-delay` seconds in
each decode step, so that a preemption finds requests with tokens; it uses no CPU meanwhile).

    python benchmarks/elastic.py [--steps 90] [--join-at 25] [--leave-at 60] [--delay 1.0] [--step-delay 0.05]
                                 [--drain]

The run starts with one engine and may grow to two (`max_workers = 2`). When the learner reaches version
`--join-at`, a thread calls `Pipeline.scale(2)`, which returns once the joiner has loaded the model, passed the
version fence and taken requests; at `--leave-at` it calls `Pipeline.scale(1, preempt=True)`: the leaving
engine is preempted, the requests it had in flight continue on the other engine from the tokens they have, and
the call returns once they are done (`--drain`: they finish where they are). Each phase's samples/s is read
from the run's metrics (trained samples over wall time, between the first and last version of the phase, the
versions around a scale call left out).

Figures: samples/s with one engine (the reference, same run), with two, and after the leave; the join's
seconds beside an engine's start measured alone in this process (its model's load), the leave's seconds, and
the run's ledger. Last stdout line: one JSON object with "figures" and "ratios": two_vs_one (goal >= 1.5),
after_leave_vs_one (about 1), join_beyond_load_s (the join's seconds past a model load; goal <= 2) and
ledger_balanced (1: nothing lost, nothing trained twice), lost (samples lost; goal 0) and, for a preempted
leave that had tokens in flight, carried_over_generated (tokens carried over over those the preempted engine had
generated; goal >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def slow_engine_type(delay_s: float, step_delay_s: float) -> type:
    from stages import TorchEngine

    class SlowEngine(TorchEngine):
        """A TorchEngine that answers each call `delay_s` late (it waits first) and whose decode steps take
        `step_delay_s` longer (so a preemption finds requests with tokens); neither uses CPU."""

        async def generate(self, prompts, params):
            await anyio.sleep(delay_s)
            return await super().generate(prompts, params)

        def _step(self, batch) -> None:
            time.sleep(step_delay_s)
            super()._step(batch)

    return SlowEngine


def make_pipeline(model: Path, run_root: Path, steps: int, delay_s: float, step_delay_s: float) -> Any:
    from buffers import MemoryStore, RefBuffer
    from pipeline import Pipeline
    from policies import MaxStaleness
    from stages import GRPOLearner, Rollout, tasks

    engine = slow_engine_type(delay_s, step_delay_s)
    return Pipeline(
        name="elastic", steps=steps, run_root=run_root, progress=False, max_workers=2,
        producer=Rollout(tasks.ReverseDigits(digits=2), [engine(model, name="torch-0")], tokenizer=model,
                         group_size=8, batch_groups=8,
                         engine_factory=lambda i: engine(model, name=f"torch-{i}", seed=i)),
        buffer=RefBuffer(MemoryStore(), max_bytes=256 << 20),
        consumer=GRPOLearner(model, lr=4e-4, groups_per_step=8, weights="inproc"),
        staleness=MaxStaleness(k=2, on_stale="drop"),
    )


def metrics(run_root: Path) -> list[dict]:
    """The run's per-version records so far ([] before its folder exists)."""
    found = sorted(run_root.glob("elastic-*/metrics.jsonl"))
    if not found:
        return []
    lines = found[-1].read_text().splitlines()
    return [json.loads(line) for line in lines[:-1] if line]  # the last line may be half written


def wait_for_version(run_root: Path, version: int, done: threading.Event) -> int:
    while not done.is_set():
        records = metrics(run_root)
        if records and records[-1]["version"] >= version:
            return records[-1]["version"]
        time.sleep(0.05)
    raise SystemExit(f"the run ended before version {version}")


def drive(pipe: Any, run_root: Path, join_at: int, leave_at: int, preempt: bool, done: threading.Event,
          out: dict) -> None:
    """Scale to 2 at `join_at` and back to 1 at `leave_at` (`preempt`: the leaver's requests continue on the
    other engine); record each call's versions and seconds."""
    for name, version, engines in (("join", join_at, 2), ("leave", leave_at, 1)):
        before = wait_for_version(run_root, version, done)
        t0 = time.perf_counter()
        status = pipe.scale(engines, preempt=preempt and name == "leave")
        seconds = time.perf_counter() - t0
        after = metrics(run_root)[-1]["version"]
        out[name] = {"from_version": before, "to_version": after, "seconds": round(seconds, 3), "live": status["live"]}


def phase_rate(records: list[dict], first: int, last: int) -> dict:
    """Trained samples over wall time between versions `first` and `last` (both included as boundaries)."""
    window = [r for r in records if first <= r["version"] <= last]
    if len(window) < 3:
        raise SystemExit(f"too few versions between {first} and {last}: lengthen the run (--steps) or its phases")
    samples = sum(r["outcomes"]["trained"]["n"] for r in window[1:])
    wall = window[-1]["t"] - window[0]["t"]
    return {"versions": f"{first}-{last}", "samples_per_s": round(samples / wall, 1), "seconds": round(wall, 2)}


def engine_start_s(model: Path) -> float:
    """One engine's start alone (its model's load): the reference for the join's seconds."""
    from stages import TorchEngine

    async def start() -> float:
        engine = TorchEngine(model, name="alone")
        t0 = time.perf_counter()
        await engine.start()
        seconds = time.perf_counter() - t0
        await engine.stop()
        return seconds

    return anyio.run(start)


def simulated_phases(run_dir: Path) -> list[dict]:
    """The simulator's samples/s per phase of this run (replayed from its folder: measured costs, the
    engine schedule its events show) beside the run's own, as the simulator splits the phases."""
    from baton.config import load_toml, to_toml
    from baton.simulate import replay

    # the DSL writes no config.toml: the simulator reads the quickstart config set as make_pipeline builds it
    steps = json.loads((run_dir / "summary.json").read_text())["version"]
    sets = [f"steps={steps}", "engine.batch_groups=8", "learner.groups_per_step=8", "rollout.max_engines=2"]
    (run_dir / "config.toml").write_text(to_toml(load_toml(ROOT / "configs" / "quickstart.toml", sets)))
    result, cal = replay(str(run_dir))
    rows = []
    for sim, real in zip(result.phases, cal.measured.get("phases", []), strict=False):
        s_rate, m_rate = sim.get("samples_per_s") or 0.0, real.get("samples_per_s") or 0.0
        rows.append({"engines": real.get("engines"), "measured": m_rate, "simulated": s_rate,
                     "ratio": round(s_rate / m_rate, 3) if m_rate else None})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=90)
    p.add_argument("--join-at", type=int, default=25)
    p.add_argument("--leave-at", type=int, default=60)
    p.add_argument("--delay", type=float, default=1.0, help="seconds each engine call waits before it generates")
    p.add_argument("--step-delay", type=float, default=0.05, help="seconds each engine's decode step waits")
    p.add_argument("--simulate", action="store_true", help="also simulate the run from its own folder (`baton "
                   "simulate --calibrate`: its measured costs, joins and leaves) and compare each phase's samples/s")
    p.add_argument("--drain", action="store_true", help="the leave drains (its requests finish where they are) "
                   "instead of preempting the engine (its requests continue on the other from their tokens)")
    a = p.parse_args()
    import torch

    from stages import make_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model, run_root = make_tiny_model(Path(tmp) / "tiny-qwen2"), Path(tmp) / "runs"
        load_s = engine_start_s(model)
        pipe, done, scaled = make_pipeline(model, run_root, a.steps, a.delay, a.step_delay), threading.Event(), {}
        driver = threading.Thread(target=drive, args=(pipe, run_root, a.join_at, a.leave_at, not a.drain, done, scaled))
        driver.start()
        try:
            summary = pipe.run()
        finally:
            done.set()
            driver.join()
        run_dir = Path(summary["run_dir"])
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        (left,) = [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
                   if e["kind"] == "engine.left"]
        simulated = simulated_phases(run_dir) if a.simulate else None
    join, leave = scaled["join"], scaled["leave"]
    phases = {"one": phase_rate(records, 3, join["from_version"]),
              "two": phase_rate(records, join["to_version"] + 1, leave["from_version"]),
              "after_leave": phase_rate(records, leave["to_version"] + 1, records[-1]["version"])}
    one = phases["one"]["samples_per_s"]
    figures = {"phases": phases, "join": join, "leave": leave, "engine_start_alone_s": round(load_s, 3),
               "delay_s": a.delay, "step_delay_s": a.step_delay, "samples": summary["samples"],
               "version": summary["version"],
               "max_staleness_trained": summary["max_staleness_trained"],
               "left": {k: left.get(k, 0) for k in ("preempted", "episodes_drained", "requests", "tokens_carried",
                                                    "tokens_lost")}}
    carried, lost = left.get("tokens_carried", 0), left.get("tokens_lost", 0)
    if simulated is not None:
        figures["simulated"] = simulated
    print(json.dumps(figures, indent=1), file=sys.stderr)
    print(json.dumps({"benchmark": "elastic", "figures": figures, "reference": {"samples_per_s_one_engine": one},
                      "ratios": {"two_vs_one": round(phases["two"]["samples_per_s"] / one, 3),
                                 "after_leave_vs_one": round(phases["after_leave"]["samples_per_s"] / one, 3),
                                 "join_beyond_load_s": round(join["seconds"] - load_s, 3),
                                 "ledger_balanced": int(bool(summary["ledger_balanced"])),
                                 "lost": summary["samples"]["lost"],
                                 **({"carried_over_generated": round(carried / (carried + lost), 3)}
                                    if carried + lost else {}),
                                 **({f"simulated_over_measured_{i}": p["ratio"] for i, p in enumerate(simulated)}
                                    if simulated else {})}}))


if __name__ == "__main__":
    main()
