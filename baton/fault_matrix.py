"""`baton faults CONFIG`: run the fault matrix and judge every run from its own ledger.

For each fault kind (all of `pipeline.faults.FAULT_KINDS`, or `kinds`) and each seed, the config is
run once with that one fault planned (the config's own `[[faults]]` entry of that kind, else
`DEFAULT_SCHEDULES[kind]`), on infrastructure this module starts and stops by pid: a fresh
`mooncake_master` per run (so store.master_restart has a master to restart) and, for
store.holder_crash, a second segment-holder process with `store.replicas = 2`. A learner.crash run
checkpoints every 4 versions and is continued from its last checkpoint (`Pipeline.resume`); on the
Ray runtime the fault SIGKILLs the learner's process, locally it raises in the learner. A
learner.rank_crash run has a learner of two ranks, checkpoints every 4 versions, and SIGKILLs rank 1:
the learner restarts its rank group within the run (`learner.max_restarts = 1`), nothing is resumed.

A run passes when, from its ledger.json, metrics.jsonl and faults.jsonl:
* the fault fired at least once, its boundary recovered after each firing, and the run finished
  (`version == steps`);
* no sample was trained twice (`trained_at` longer than the run's max_uses);
* nothing was lost uncounted: the ledger's fates sum to what was produced, and the samples still in
  flight at the end fit the admission window ((k + 1) x groups_per_step groups; more would mean refs
  vanished without a fate);
* every trained sample is within the staleness bound;
* the mean reward of the run's last quarter beats its first quarter by `REWARD_MARGIN`;
* with routing replay on (a mixture-of-experts model, `[learner] routing_replay = "rollout"`), every step
  reports `router_disagreement` 0: the groups a fault made the run regenerate or re-send were replayed
  with their own recorded experts (`baton faults configs/quickstart-moe.toml` runs the matrix on the MoE
  quickstart).

The faults on an engine's own inference server (`engine.server_kill`, `engine.server_kill_push`,
`engine.push_refused`; `engine.kind = "vllm"`, skipped on other configs) are judged the same way, and also
count the servers their engine restarted and the pushes it refused (run events); `run_together` plans several
kinds in one run, so such rows share one server process (`baton faults` runs one kind per run).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from baton.config import apply_override, load_toml, validate
from pipeline.actor import ActorFailed, innermost
from pipeline.events import EventCounts
from pipeline.faults import FAULT_KINDS, SERVER_FAULT_KINDS, FaultPlan, LearnerCrashed, read_events
from pipeline.telemetry import RunFolder, get_logger

REWARD_MARGIN = 0.02  # last-quarter mean reward minus first-quarter mean, at least
DEFAULT_SCHEDULES: dict[str, dict[str, Any]] = {
    "engine.crash": {"at": [3]},
    "engine.hang": {"at": [3], "delay_s": 3600.0},  # answered never: the request timeout must catch it
    "store.put_fail": {"at": [5]},  # that put and its retries fail: the group is regenerated
    "store.get_fail": {"at": [5, 6, 7]},  # three in a row: the get retries give up, the group is lost and redone
    "store.corrupt": {"at": [5]},
    "store.master_restart": {"at": [20]},
    "store.holder_crash": {"at": [20]},
    "weights.push_fail": {"at": [3]},
    "engine.server_kill": {"at": [3]},  # the engine's 3rd generate call
    "engine.server_kill_push": {"at": [5]},  # the 5th version pushed to the engine
    "engine.push_refused": {"at": [9]},
    "learner.crash": {"at": [12]},  # the version it dies at
    "channel.stall": {"at": [3], "delay_s": 2.0},
    "learner.rank_crash": {"at": [12]},  # rank 1 of a two-rank learner is SIGKILLed after this version
    "engine.join": {"at": [5]},  # a second engine joins at version 5 (the run may grow to 2: ELASTIC)
    "engine.leave": {"at": [5]},  # one of the two engines leaves at version 5, draining what it holds
    "engine.join_in_push": {"at": [5]},  # a second engine joins while version 5 is pushed
    "engine.preempt_in_push": {"at": [5]},  # one of the two engines is preempted while version 5 is pushed
}
# the elastic kinds run with room for a second engine; a leave starts with two
ELASTIC = {"engine.join": ["rollout.max_engines=2"], "engine.leave": ["rollout.max_engines=2", "engine.count=2"],
           "engine.join_in_push": ["rollout.max_engines=2"],
           "engine.preempt_in_push": ["rollout.max_engines=2", "engine.count=2"]}
MOONCAKE_ONLY = ("store.master_restart", "store.holder_crash")


@dataclass
class RunOutcome:
    """One run of the matrix, judged from its run folder."""

    kind: str
    seed: int
    run_dir: str = ""
    status: str = "failed"  # "passed" | "failed" | "skipped"
    finished: bool = False
    fired: int = 0
    trained_twice: int = 0
    lost_uncounted: int = 0
    over_bound: int = 0
    max_staleness: int | None = None
    bound: int | None = None
    recovery_s: float | None = None
    reward_first: float | None = None
    reward_last: float | None = None
    lost: int = 0  # samples the ledger counts as lost (and whose groups were redone)
    regenerated_groups: int = 0  # groups a producer generated again before they were stored
    resumed: bool = False
    reinjected_groups: int = 0  # learner.crash: checkpointed in-flight groups trained from the store after the resume
    runtime: str = "local"
    restarts: int = 0  # processes the Ray runtime restarted
    learner_restarts: int = 0  # learner.rank_crash: restarts of the learner's rank group within the run
    engine_restarts: int = 0  # inference servers their engine restarted (run events `engine.restarted`)
    pushes_refused: int = 0  # weight pushes an engine refused and the transport sent again (`weights.refused`)
    carried_requests: int = 0  # requests of preempted engines continued on another (run events `engine.left`)
    router_disagreement: float | None = None  # an MoE run with routing replay: the most over its steps (0 expected)
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def judge(outcome: RunOutcome, run_dir: Path, steps: int, window_groups: int | None, max_uses: int = 1,
          replay: bool = False) -> RunOutcome:
    """Fill `outcome` from the run folder and decide its status (see the module docstring)."""
    outcome.run_dir = str(run_dir)
    problems = outcome.problems
    ledger_path = run_dir / "ledger.json"
    records = json.loads(ledger_path.read_text()) if ledger_path.exists() else []
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    outcome.bound = summary.get("staleness_bound", outcome.bound)
    outcome.finished = summary.get("version") == steps
    outcome.restarts = sum(summary.get("restarts", {}).values())
    outcome.reinjected_groups = summary.get("resume", {}).get("reinjected_groups", 0)
    outcome.learner_restarts = len(summary.get("learner_restarts", []))
    if not outcome.finished:
        problems.append(f"did not finish (version {summary.get('version')} of {steps})")
    outcome.trained_twice = sum(len(r["trained_at"]) > max_uses for r in records)
    stale = [r["trained_at"][0] - r["versions"][0] for r in records if r["trained_at"]]
    outcome.max_staleness = max(stale, default=None)
    if outcome.bound is not None:
        outcome.over_bound = sum(s > outcome.bound for s in stale)
    outcome.lost = sum(r["fate"] == "lost" for r in records)
    fates = ("trained", "dropped", "lost", "regenerated", "in_flight")
    uncounted = sum(r["fate"] not in fates or (r["fate"] == "trained") != bool(r["trained_at"]) for r in records)
    if summary and not summary.get("ledger_balanced", False):
        uncounted = max(uncounted, 1)
    if window_groups is not None and records:
        groups_in_flight = {r["group"] for r in records if r["fate"] == "in_flight"}
        rows = max(1, len(records) // max(1, len({r["group"] for r in records})))
        uncounted += max(0, len(groups_in_flight) - window_groups) * rows
    outcome.lost_uncounted = uncounted
    for name, n in (("trained twice", outcome.trained_twice), ("lost uncounted", outcome.lost_uncounted),
                    ("over the staleness bound", outcome.over_bound)):
        if n:
            problems.append(f"{n} samples {name}")
    metrics = RunFolder(run_dir).read_metrics()
    rewards = [m["reward"] for m in metrics]
    if rewards:
        quarter = max(1, len(rewards) // 4)
        outcome.reward_first = round(sum(rewards[:quarter]) / quarter, 4)
        outcome.reward_last = round(sum(rewards[-quarter:]) / quarter, 4)
        if outcome.reward_last - outcome.reward_first < REWARD_MARGIN:
            problems.append(f"reward did not rise: {outcome.reward_first} -> {outcome.reward_last} "
                            f"(needs +{REWARD_MARGIN})")
    else:
        problems.append("no learner step recorded")
    if replay:
        _judge_replay(outcome, metrics)
    _judge_fault(outcome, run_dir)
    outcome.status = "failed" if problems else "passed"
    return outcome


def _judge_fault(outcome: RunOutcome, run_dir: Path) -> None:
    """The fault's own evidence: it fired, each firing recovered (how long it took), the groups generated again,
    and the run events that count recoveries (engine restarts, refused pushes)."""
    events = read_events(run_dir)
    fired = [e for e in events if e["event"] == "fired" and e["kind"] == outcome.kind]
    outcome.fired = len(fired)
    if not fired:
        outcome.problems.append(f"{outcome.kind} never fired (schedule beyond the run?)")
    outcome.recovery_s = recovery_seconds(events, outcome.kind)
    if outcome.recovery_s == math.inf:
        outcome.problems.append(f"{outcome.kind} fired but its boundary never recovered")
    outcome.regenerated_groups = sum(e.get("groups", 0) for e in events if e["event"] == "regenerated")
    counts = EventCounts(run_dir).update()
    outcome.engine_restarts = counts.get("engine.restarted", 0)
    outcome.pushes_refused = counts.get("weights.refused", 0)
    outcome.carried_requests = sum(e.get("requests", 0) for e in run_events(run_dir, "engine.left"))


def run_events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    """The run's events (events.jsonl) of `kind`, in order; [] when it has none."""
    path = run_dir / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e.get("kind") == kind]


def _judge_replay(outcome: RunOutcome, metrics: list[dict[str, Any]]) -> None:
    """With routing replay on, every step must have routed every generated token as its engine did."""
    shares = [m["router_disagreement"] for m in metrics if "router_disagreement" in m]
    if metrics and len(shares) < len(metrics):
        outcome.problems.append(f"routing replay is on but {len(metrics) - len(shares)} steps report no "
                                "router_disagreement (a batch without its experts?)")
    outcome.router_disagreement = max(shares, default=None)
    if outcome.router_disagreement:
        outcome.problems.append(f"routing replay is on but router_disagreement reached {outcome.router_disagreement}")


def recovery_seconds(events: list[dict[str, Any]], kind: str) -> float | None:
    """The longest time from a firing of `kind` to the next recovery of it at the same scope (None
    when it never fired; inf when a firing was never followed by a recovery)."""
    worst: float | None = None
    for i, event in enumerate(events):
        if event["event"] != "fired" or event["kind"] != kind:
            continue
        later = (e for e in events[i + 1:] if e["kind"] == kind and e["event"] == "recovered"
                 and (e["scope"] == event["scope"] or kind == "learner.crash"))
        back = next(later, None)
        took = back["t"] - event["t"] if back is not None else math.inf
        worst = took if worst is None else max(worst, took)
    return None if worst is None else round(worst, 3)


@contextlib.contextmanager
def infrastructure(
    kinds: Sequence[str], mooncake: bool, workdir: Path, segment_bytes: int
) -> Iterator[tuple[dict, list]]:
    """(fault targets, config overrides) for one run: a fresh master (and, for store.holder_crash and
    learner.crash, a second segment holder with `store.replicas = 2`: the copies the holder keeps outlive
    the run's own processes), all stopped by pid when the block ends."""
    if not mooncake:
        yield {}, []
        return
    from buffers.faulty import HolderByPid, MasterByPid, start_holder
    from buffers.mooncake_master import MooncakeMaster

    workdir.mkdir(parents=True, exist_ok=True)
    master = MooncakeMaster(lease_ttl_ms=500, client_ttl_s=3).start()
    pid_file = workdir / "master.pid"
    pid_file.write_text(str(master.pid))
    restarter = MasterByPid(master.port, str(pid_file), lease_ttl_ms=500, client_ttl_s=3)
    holder = None
    try:
        targets: dict[str, Any] = {"master": restarter}
        overrides = [f"store.master='{master.address}'"]
        if any(kind in ("store.holder_crash", "learner.crash") for kind in kinds):
            holder = start_holder(master.address, segment_bytes, log_path=workdir / "holder.log")
            targets["holder"] = HolderByPid(holder.pid)
            overrides.append("store.replicas=2")
        yield targets, overrides
    finally:
        if holder is not None:
            if holder.poll() is None:
                holder.terminate()
            holder.wait(10)
        restarter.stop()  # the master running now (a restarted one, if any), by its pid
        master.stop()


def run_one(
    config: str, kind: str, seed: int, root: Path, overrides: Sequence[str] = (), base: dict | None = None
) -> RunOutcome:
    """One run of `config` with fault `kind` planned, judged (see the module docstring)."""
    return run_together(config, [kind], seed, root, overrides, base)[0]


def run_together(
    config: str, kinds: Sequence[str], seed: int, root: Path, overrides: Sequence[str] = (), base: dict | None = None
) -> list[RunOutcome]:
    """One run of `config` with every fault of `kinds` planned, each on its own schedule, judged once per kind:
    the rows that need a costly part (a vLLM server, ~1 min to start here) share one run of it."""
    from baton.schema import RunConfig

    data = base if base is not None else load_toml(config, overrides)
    own = {f["kind"]: f for f in data.get("faults", [])}
    specs = [{"kind": kind, **DEFAULT_SCHEDULES[kind], **own.get(kind, {}), "seed": seed} for kind in kinds]
    mooncake = data.get("store", {}).get("kind") == "mooncake"
    outcomes = [RunOutcome(kind, seed, runtime=data.get("runtime", "local")) for kind in kinds]
    if reason := unsupported(kinds, data):
        for outcome in outcomes:
            outcome.status = "skipped"
            outcome.problems.append(reason)
        return outcomes
    name = f"{data.get('name', 'baton')}-{'-'.join(kinds)}-s{seed}"
    run_overrides = [f"seed={seed}", f"name='{name}'", f"run_root='{root}'", "telemetry.progress=false"]
    if any(kind in ("learner.crash", "learner.rank_crash") for kind in kinds):
        run_overrides.append("checkpoint.every=4")  # rolled back: at most 3 (resume), 4 (restart)
    if "learner.rank_crash" in kinds:
        run_overrides += ["learner.world_size=2", "learner.max_restarts=1"]  # healed within the run
    for kind in kinds:
        run_overrides.extend(ELASTIC.get(kind, []))
    with infrastructure(kinds, mooncake, root / f"{name}.infra", 256 << 20) as (targets, infra):
        raw = json.loads(json.dumps(data))  # a deep copy: each run gets its own overrides
        for item in (*run_overrides, *infra):
            apply_override(raw, item)
        raw["faults"] = specs
        cfg = validate(RunConfig, raw, source=config)
        problems, resumed = _run_planned(cfg, targets, root, name)
        run_dir = _latest(root, name)
        for outcome in outcomes:
            outcome.problems.extend(problems)
            outcome.resumed = resumed
            if run_dir is None:
                outcome.problems.append("no run folder")
        if run_dir is None:
            return outcomes
        replay = getattr(cfg.learner, "routing_replay", "off") == "rollout"
        return [judge(o, run_dir, cfg.steps, _window_groups(cfg), replay=replay) for o in outcomes]


def _run_planned(cfg: Any, targets: dict, root: Path, name: str) -> tuple[list[str], bool]:
    """Run `cfg` with its faults (a learner.crash run resumed from its checkpoint): what went wrong, as text,
    and whether it was resumed."""
    from baton.builder import build_pipeline, make_faults

    plan = FaultPlan(make_faults(cfg), targets=targets)
    log = get_logger("faults").bind(run=name)
    problems: list[str] = []
    resumed_ok = False
    pipe = build_pipeline(cfg)
    pipe.faults = plan
    try:
        pipe.run()
    except ActorFailed as exc:
        run_dir = _latest(root, name)
        if not (isinstance(innermost(exc.__cause__ or exc), LearnerCrashed) or _learner_crashed(run_dir)):
            problems.append(str(exc))
        else:
            log.info("learner crashed as planned; resuming", run_dir=str(run_dir))
            resumed = build_pipeline(cfg)
            resumed.faults = plan
            try:
                resumed.resume(run_dir)
                resumed_ok = True
            except Exception as resume_exc:  # judged below: the run did not finish
                problems.append(f"resume failed: {type(resume_exc).__name__}: {resume_exc}")
    except Exception as exc:  # the run could not even run: recorded, and the matrix goes on
        problems.append(f"{type(exc).__name__}: {exc}")
    return problems, resumed_ok


def unsupported(kinds: Sequence[str], data: dict) -> str:
    """Why `config` (as loaded) cannot run these fault kinds ('' when it can)."""
    if any(k in MOONCAKE_ONLY for k in kinds) and data.get("store", {}).get("kind") != "mooncake":
        return "needs store.kind = 'mooncake'"
    engine = data.get("engine", {})
    if any(k in SERVER_FAULT_KINDS for k in kinds) and (engine.get("kind") != "vllm" or engine.get("urls")):
        return "needs engine.kind = 'vllm' with servers baton launches (no engine.urls)"
    return ""


def _learner_crashed(run_dir: Path | None) -> bool:
    """Did a planned learner.crash fire in `run_dir` (on Ray the learner's process is killed, so the run's
    error names a dead actor, not the fault)?"""
    return run_dir is not None and any(
        e["event"] == "fired" and e["kind"] == "learner.crash" for e in read_events(run_dir)
    )


def _latest(root: Path, name: str) -> Path | None:
    runs = sorted(root.glob(f"{name}-*[0-9]"), key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def _window_groups(cfg: Any) -> int | None:
    """Groups that may be in flight when the run ends, under pace admission (`policies.bounds.live_groups`:
    started - discarded < (steps + lead + 1) x B, of which steps x B were trained)."""
    from policies.bounds import live_groups

    shape = cfg.pipeline_shape()
    return live_groups(shape) if shape is not None and shape.admission == "pace" else None


def run_matrix(
    config: str, kinds: Sequence[str], seeds: Sequence[int], overrides: Sequence[str] = (), root: Path | None = None,
) -> tuple[Path, list[RunOutcome]]:
    """Every kind x seed; returns the matrix folder and the outcomes (also written there as results.json)."""
    base = load_toml(config, overrides)
    folder = RunFolder.create(root or base.get("run_root", "runs"), f"{base.get('name', 'baton')}-matrix")
    outcomes = []
    for kind in kinds:
        for seed in seeds:
            outcome = run_one(config, kind, seed, folder.path, base=base)
            get_logger("faults").info("fault run done", kind=kind, seed=seed, status=outcome.status,
                                      problems=outcome.problems)
            outcomes.append(outcome)
            folder.write_json("results.json", [asdict(o) for o in outcomes])
    return folder.path, outcomes


def rows(outcomes: Sequence[RunOutcome]) -> list[dict[str, Any]]:
    """One row per fault kind: seeds, passed, trained twice, lost uncounted, max staleness / bound, recovery."""
    table = []
    for kind in dict.fromkeys(o.kind for o in outcomes):
        runs = [o for o in outcomes if o.kind == kind]
        stale = [o.max_staleness for o in runs if o.max_staleness is not None]
        bounds = {o.bound for o in runs if o.bound is not None}
        recovery = [o.recovery_s for o in runs if o.recovery_s is not None]
        status = {o.status for o in runs} - {"passed", "failed"}
        table.append({
            "fault": kind,
            "seeds": ",".join(str(o.seed) for o in runs),
            "passed": f"{sum(o.passed for o in runs)}/{len(runs)}" + (f" ({', '.join(sorted(status))})" * bool(status)),
            "trained twice": sum(o.trained_twice for o in runs),
            "lost uncounted": sum(o.lost_uncounted for o in runs),
            "max staleness / bound": f"{max(stale) if stale else '-'} / {'/'.join(map(str, sorted(bounds))) or '-'}",
            "recovery s": f"{max(recovery):.2f}" if recovery else "-",
            "fired": sum(o.fired for o in runs),
            "lost+redone / regen groups": f"{sum(o.lost for o in runs)} / {sum(o.regenerated_groups for o in runs)}",
        })
        if any(o.engine_restarts or o.pushes_refused for o in runs):  # a fault on an engine's own server
            table[-1]["server restarts / refused pushes"] = (f"{sum(o.engine_restarts for o in runs)} / "
                                                             f"{sum(o.pushes_refused for o in runs)}")
        shares = [o.router_disagreement for o in runs if o.router_disagreement is not None]
        if shares:  # an MoE run with routing replay
            table[-1]["router disagreement"] = f"{max(shares):g}"
    return table


def totals(outcomes: Sequence[RunOutcome], folder: Path | None = None) -> dict[str, Any]:
    """The matrix's totals (skipped runs, e.g. Mooncake faults on another store, are not runs)."""
    outcomes = [o for o in outcomes if o.status != "skipped"]
    return {
        "runs": len(outcomes),
        "passed": sum(o.passed for o in outcomes),
        "trained_twice": sum(o.trained_twice for o in outcomes),
        "lost_uncounted": sum(o.lost_uncounted for o in outcomes),
        "over_bound": sum(o.over_bound for o in outcomes),
        **({"dir": str(folder)} if folder is not None else {}),
    }


def render(outcomes: Sequence[RunOutcome]) -> str:
    """The matrix as a rich table, rendered to text."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fault matrix")
    data = rows(outcomes)
    columns = list(dict.fromkeys(key for row in data for key in row)) or ["fault"]
    for column in columns:
        table.add_column(column, justify="left" if column == "fault" else "right")
    for row in data:
        table.add_row(*(str(row.get(column, "-")) for column in columns))
    console = Console(width=160, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(table)
    failed = [o for o in outcomes if not o.passed]
    if failed:
        console.print("problems:")
        for o in failed:
            console.print(f"  {o.kind} seed {o.seed} ({o.status}): {'; '.join(o.problems)}  [{o.run_dir}]",
                          markup=False, highlight=False)
    return console.export_text()


def main(config: str, kinds: str | None, seeds: int, overrides: Sequence[str]) -> int:
    """`baton faults`: exit 0 when every run passed, 1 when any invariant broke, 2 for bad arguments."""
    chosen = [k.strip() for k in kinds.split(",")] if kinds else list(FAULT_KINDS)
    unknown = [k for k in chosen if k not in FAULT_KINDS]
    if unknown or seeds < 1:
        problem = f"unknown fault kind(s) {unknown}; allowed: {', '.join(FAULT_KINDS)}" if unknown else (
            f"--seeds must be >= 1, got {seeds}")
        print(f"baton: {problem}", flush=True)
        return 2
    folder, outcomes = run_matrix(config, chosen, range(seeds), overrides)
    text = render(outcomes)
    (folder / "faults.txt").write_text(text)
    print(text, flush=True)
    summary = totals(outcomes, folder)
    print(json.dumps(summary), flush=True)
    return 0 if summary["passed"] == summary["runs"] else 1


__all__ = ["DEFAULT_SCHEDULES", "RunOutcome", "judge", "main", "recovery_seconds", "run_matrix", "run_one",
           "run_together", "totals", "unsupported"]
