"""`baton simulate`: a config's pipeline in virtual time, with cost models instead of engines and a learner.

What is real and what is modelled:

* **Real** (the runtimes' own objects, instantiated here): the staleness policy (`policies.staleness.
  MaxStaleness`, or a plug-in's class) for admit / accept / interrupt, the `AdmissionGate` and
  `VersionClock` of `pipeline`, the bounded `Channel`s (produced, ready) with the config's item and
  byte bounds, and the learner's `ReplayWindow` with the config's selection policy
  (`policies.selection`). The event loop (`baton.simulate.events`) drives them in virtual time.
* **Modelled**: the work each stage does, as a `Costs` object (declared from published figures in a
  `[simulate]` table, or measured from a real run with `--calibrate`).

The stage models follow stages/rollout/, buffers/ref_buffer.py and stages/learner/ step by step:

* **Engine** (one producer per engine): acquire up to `engine.batch_groups` slots at the gate (waiting
  for a version change or a discarded slot when closed); pay the call's overhead (taking prompts, a
  channel hop for the gate); generate for the call's generation time; when a new version reaches the
  engine meanwhile, pay `engine_load_s` and ask `policy.interrupt`: `restart` begins the call again on
  the new weights, `continue` keeps the group's oldest version. Then store each group (put time by
  bytes), and send its ref to the produced channel (waiting while it is full).
  Assumes: engines do not slow each other down (each has its own accelerator), and a call's groups
  finish together (the batch ends with its longest sample).
* **Buffer**: takes refs from the produced channel into an index bounded by `buffer.max_refs` /
  `max_bytes`, forwards them FIFO to the ready channel in batches of up to its capacity, and, whenever the
  version moves, refuses the refs the policy no longer accepts (their slots go back to the gate).
  Assumes: the buffer's own work is free (it handles refs, not payloads); each channel call crossing
  processes costs `hop_s`.
* **Learner**: collects `groups_per_step` groups into the replay window (loading each from the store:
  get time by bytes; refusing what the policy does not accept), trains for the step time while a
  prefetch receives and loads the next step's groups, pushes the weights (push time), advances the clock,
  and pays its per-version bookkeeping (`learner_overhead_s`). On N ranks (`learner.world_size`, or
  `--learners N`) the step's compute divides by N and FSDP's gathers and scatters are added; a push
  from the shards (`mooncake_p2p`) takes 1/N of the time, another transport first gathers on rank 0
  (formulas in baton.schema.SimulateSpec). Assumes compute scales linearly over the ranks.

Figures (steady state: versions after `warmup`, the same window `benchmarks/async_vs_sync.py` uses):
samples/s trained, learner busy fraction (step time / wall time), engine idle fraction (time not
generating, storing or loading weights / wall time), mean staleness of trained groups, dropped fraction
(groups refused / groups judged), and queue depths at every version.

A run whose shape changes (`[simulate] engine_schedule`, `learner_restarts`): engines join after
`engine_join_s` and leave by draining, the learner group restarts for `learner_restart_s`; see
baton.simulate.fleet. Its figures also come per phase (baton.simulate.schedule).

Modules: `costs` (declared and measured cost models), `calibrate` (measured costs from a run folder),
`simulation` (the simulated run and its outputs), `fleet` (engines joining and leaving, learner restarts),
`schedule` (phases, a real run's schedule), `sweep` (`--sweep`), `events` (the event loop).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from baton.config import ConfigError
from baton.simulate.calibrate import Calibration, calibrate
from baton.simulate.costs import Costs
from baton.simulate.schedule import schedule_overrides
from baton.simulate.simulation import SimResult, load_simulation_config, print_result, simulate, write_run
from baton.simulate.sweep import parse_sweep, print_sweep, run_sweep, write_sweep


def main(config: str | None, calibrate_dir: str | None, engines: int | None, learners: int | None,
         steps: int | None, overrides: Sequence[str], sweep: Sequence[str] | None,
         schedule: tuple[str | None, str | None] = (None, None)) -> int:
    """`baton simulate`: prints a table (stderr) and one JSON line (stdout); writes a run folder.
    `schedule`: the --engine-schedule and --learner-restarts flags."""
    try:
        overrides = [*overrides, *schedule_overrides(*schedule)]
        costs: Costs | None = None
        measured = None
        if calibrate_dir is not None:
            cal = calibrate(calibrate_dir, learners=learners or 1)
            config = config or str(cal.config_path)
            costs, measured = cal.costs, cal.measured
            engines = engines or cal.engines
            if cal.schedule is not None and not any(schedule):  # the run's own joins, leaves and restarts
                overrides = [*cal.schedule.overrides(), *overrides]
        if config is None:
            raise ConfigError("simulate needs a CONFIG, or --calibrate RUN_DIR")
        sets = [*overrides, *([f"simulate.learners={learners}"] if learners else [])]
        cfg, spec = load_simulation_config(config, sets)
        if sweep:
            axes = parse_sweep(sweep)
            result = run_sweep(config, sets, axes, steps, costs, engines, learners)
            print_sweep(result)
            folder = write_sweep(cfg.run_root, cfg.name, result)
            print(json.dumps({"sweep_dir": str(folder), "points": [p.__dict__ for p in result.points]}), flush=True)
            return 0
        result = simulate(cfg, spec, costs, engines=engines, steps=steps)
    except ConfigError as exc:
        print(f"baton: {exc}", file=sys.stderr)
        return 2
    extra = {"calibrated_from": str(calibrate_dir), "measured": measured} if calibrate_dir else {}
    folder = write_run(cfg.run_root, cfg.name, result, extra)
    print_result(result, measured)
    print(json.dumps({"run_dir": str(folder), "figures": result.figures, "staleness_hist": result.staleness_hist,
                      "counts": result.counts, "phases": result.phases, "learner_restarts": result.restarts, **extra}),
          flush=True)
    return 0


def replay(run_dir: str, overrides: Sequence[str] = ()) -> tuple[SimResult, Calibration]:
    """Simulate a real run from its own folder: its config, its measured costs and (when its engines joined
    or left, or its learner restarted) its schedule; `overrides` (`--set` items) come last. The measured
    figures are `Calibration.measured` (per phase: `measured["phases"]`), for a benchmark to compare."""
    cal = calibrate(run_dir)
    sets = [*(cal.schedule.overrides() if cal.schedule is not None else ()), *overrides]
    cfg, spec = load_simulation_config(cal.config_path, sets)
    return simulate(cfg, spec, cal.costs, engines=cal.engines), cal
