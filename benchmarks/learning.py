"""Learning that holds up: the quickstart's settings with only the task changed, over seeds, staleness
bounds k and off-policy objectives (`policies.correction`).

    python benchmarks/learning.py [--tasks reverse2,reverse3,reverse4,addition,math,math-scratch] [--seeds 0,1,2]
                                  [--ks 0,2,4,8,32] [--objectives decoupled,m2po] [--budget-s 120] [--steps 1500]
                                  [--runtime local|ray] [--set key=value ...]

k = 0 is sync mode (the on-policy reference). Without `--objectives` a run uses the config's own correction
(`auto`: `none` up to k = 2, `m2po` above), or above k = 2 `--correction` when given; with `--objectives`,
every run uses each objective listed, at every k.

Each row is one run (`baton run`, its own process): task, seed, k, the time from process start to a trailing
mean train reward (last `--window` versions) of `--target` (0.8) and the version it happened at, the final
trailing reward (and at versions 100, 200, 400, 800), the lowest entropy before the target, and the run's wall
time. A run stops at the target plus `--after` versions (to show it holds), at `--steps`, or at `--budget-s`
(then it counts as not reached; addition gets at least 4,000 versions and 420 s, the math task 2,000 and 720
s: `TASK_LIMITS`). Versions are reported beside seconds: on a shared machine seconds depend on the load,
versions do not. The math task trains configs/math.toml's dataset with the quickstart's learner and staleness
settings, from a model that already reads the question (`make_math_example.py --answer-warmup 300`: 58 %
greedy eval accuracy, no eval question trained on; built in `runs/math-warm` on first use, ~30 s, not
counted), which is what a user's checkpoint is; `math-scratch` (not in the default matrix) trains the same
from random init, which learns the commonest answer and nothing else (README "Learning defaults"). Their
threshold is the accuracy of greedy answers on the held-out eval split (200 problems, evaluated every 50
versions): `--eval-target` (0.8) of them right by math-verify. Their rows also carry the eval accuracy at each
evaluation and the trailing train reward.

`--repeats R` runs every cell R times (the local runtime's interleaving is not deterministic, and above
k = 2 the same seed has taken v713 and v950 to one target): a seed's figure in the ratios is then the
median of its runs. `--parallel P` runs P at a time (on 2 cores at most 3, and then versions, not seconds,
are the figure).

Last stdout line: one JSON object with "rows" (one per task, seed, k and objective), "figures" (reached /
runs and the median seconds and versions to the target per k and objective) and "ratios": reached_fraction
(goal 1.0); against the k = 2 rows measured in the same invocation, the median time to target at each k;
and per task, k and objective, versions to the target at k over versions at k = 2 with the same objective
(without `--objectives`: k = 2's own default, `none`, the defaults against the defaults),
at the worst seed (`versions_vs_k2/<task>/k<k>/<objective>`; goal at k = 8: at most 1.2), and the same counting
the versions of the weights that generated the target's samples (`policy_versions_vs_k2/...`: a train reward
at version v is that of samples made about k versions before, a lag of k that is not slower learning); with k = 0 among
the ks, the median seconds to the target at k over sync's (`seconds_vs_sync/<task>/k<k>/<objective>`: below 1,
the larger bound got there sooner).

`--runtime ray` runs every row on the Ray runtime (`RAY_SETS`: each stage in its own process, Ray's object
store, the weights over mooncake_p2p, one engine), where sync mode leaves the engine idle while the learner
trains and the other way round, and a bound k > 0 lets them overlap.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARM_MATH = "runs/math-warm"  # the math example warmed on direct answers (58 %)
EVAL_TASKS = {"math", "math-scratch"}  # judged by held-out accuracy (eval.jsonl), not by the trailing train reward
TASKS = {  # name -> (config, overrides)
    "reverse2": ("configs/quickstart.toml", ["task.digits=2"]),
    "reverse3": ("configs/quickstart.toml", ["task.digits=3"]),
    "reverse4": ("configs/quickstart.toml", ["task.digits=4"]),
    "addition": ("configs/quickstart.toml", ['task={kind="addition"}']),
    "math": ("configs/math.toml", ["eval.every=50", f"model.path='{WARM_MATH}/model'",
                                   f"task.path='{WARM_MATH}/data/train.jsonl'",  # runs/math-example's data
                                   f"task.eval_path='{WARM_MATH}/data/eval.jsonl'"]),
    "math-scratch": ("configs/math.toml", ["eval.every=50"]),
}
# the folder a task trains from, and the command that makes it when it is missing
PREREQUISITES = {
    "math": (WARM_MATH, ["tools/make_math_example.py", WARM_MATH, "--answer-warmup", "300"]),
    "math-scratch": ("runs/math-example", ["tools/make_math_example.py", "runs/math-example"]),
}
DEFAULT_TASKS = "reverse2,reverse3,reverse4,addition,math"
RAY_SETS = ["runtime='ray'", "store={kind='ray'}", "weights.transport='mooncake_p2p'"]
# a task that needs more than --steps / --budget-s gets at least this (addition reaches the target at v1,536-3,244)
TASK_LIMITS = {"addition": (4000, 420.0), "math": (2000, 720.0)}  # name -> (versions, seconds)


def prepare(tasks: list[str]) -> None:
    """Make every missing model and dataset the tasks train on, before any run's clock starts."""
    for task in tasks:
        path, command = PREREQUISITES.get(task, (None, None))
        if command and not (ROOT / path / "data").exists():
            subprocess.run([sys.executable, *command], cwd=ROOT, check=True, stdout=sys.stderr)


def limits(task: str, a: argparse.Namespace) -> tuple[int, float]:
    """A run's most versions and seconds: the command line's, raised to the task's own where it needs more."""
    steps, budget_s = TASK_LIMITS.get(task, (0, 0.0))
    return max(a.steps, steps), max(a.budget_s, budget_s)


def objective_sets(k: int, objective: str | None, a: argparse.Namespace) -> list[str]:
    """The overrides that pick a run's objective and mode (k = 0: sync, the same code path)."""
    mode = ["mode='sync'", "staleness.k=0"] if k == 0 else [f"staleness.k={k}"]  # the quickstart names k = 2
    if objective is not None:
        return [*mode, f"correction.kind='{objective}'"]
    return [*mode, *([] if k <= 2 or a.correction is None else [f"correction.kind='{a.correction}'"])]


def run_once(task: str, seed: int, k: int, a: argparse.Namespace, root: Path, objective: str | None = None,
             repeat: int | None = None) -> dict:
    """One row: `baton run` of the task at seed and k, watched to its target or limits. `repeat` (with
    --repeats) numbers the runs of one cell and is part of the row and of the run's name."""
    config, task_sets = TASKS[task]
    steps, _ = limits(task, a)
    name = f"{task}-s{seed}-k{k}" + (f"-{objective}" if objective else "")
    name += f"-r{repeat}" if repeat is not None else ""
    sets = [*task_sets, f"seed={seed}", f"steps={steps}", f"run_root='{root}'",
            f"name='{name}'", "telemetry.progress=false", "telemetry.log_level='warning'",
            "checkpoint.every=0", *objective_sets(k, objective, a), *(RAY_SETS if a.runtime == "ray" else []),
            *a.overrides]
    cmd = [sys.executable, "-m", "baton.cli", "run", config, *[x for s in sets for x in ("--set", s)]]
    started = time.perf_counter()
    log = root / f"{name}.log"  # a file, not a pipe: a pipe nobody reads until the end can fill
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        wall, killed = _watch(proc, task, name, a, root, started)
    metrics = _metrics_file(root, name)
    cell = {"task": task, "seed": seed, "k": k, **({"repeat": repeat} if repeat is not None else {})}
    if metrics is None or not _records(metrics):
        return {**cell, "objective": objective, "error": log.read_text()[-500:]}
    row = {**_row(task, seed, k, metrics, a, wall), **cell, "objective": objective or _objective_of(metrics)}
    row["auto_objective"] = objective is None and (k <= 2 or a.correction is None)  # the config's own choice
    if killed:  # it ignored SIGTERM for a minute: a bug of its own, worth seeing in the table
        row["killed_after_sigterm"] = True
    return row


def _objective_of(metrics: Path) -> str:
    """The correction kind the run's resolved config names."""
    import tomllib

    return tomllib.loads((metrics.parent / "config.toml").read_text()).get("correction", {}).get("kind", "none")


def _watch(proc: subprocess.Popen, task: str, name: str, a: argparse.Namespace, root: Path,
           started: float) -> tuple[float, bool]:
    """Wait for the run, stopping it once it has shown `after` versions past the target or used its
    budget; its wall seconds, and whether it had to be killed."""
    metrics, killed = None, False
    while proc.poll() is None:  # stop the run once it has shown `after` versions past the target
        time.sleep(1.0)
        metrics = metrics or _metrics_file(root, name)
        elapsed = time.perf_counter() - started
        if elapsed > limits(task, a)[1] or (metrics and _target_point(task, metrics, a, a.after) is not None):
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:  # a run that does not stop is this row's error, not the matrix's end
                proc.kill()
                proc.wait()
                killed = True
    return time.perf_counter() - started, killed


def _metrics_file(root: Path, name: str) -> Path | None:
    """The run's metrics.jsonl once its folder exists (the folder name is `name-<timestamp>`)."""
    return next(iter(sorted(root.glob(f"{name}-2*/metrics.jsonl"))), None)


def _records(path: Path) -> list[dict]:
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def _trailing(records: list[dict], window: int) -> list[float]:
    rewards = [r["reward"] for r in records]
    return [statistics.fmean(rewards[max(0, i + 1 - window): i + 1]) for i in range(len(rewards))]


def _evaluations(metrics: Path) -> list[dict]:
    """The run's eval.jsonl records (greedy accuracy on the held-out split), oldest first."""
    path = metrics.parent / "eval.jsonl"
    return _records(path) if path.is_file() else []


def _target_point(task: str, metrics: Path, a: argparse.Namespace, after: int = 0) -> dict | None:
    """The record at which the run first met its target, once `after` more versions were recorded (an
    eval task: the first evaluation with accuracy >= --eval-target, at once); None while it has not."""
    if task in EVAL_TASKS:
        return next((e for e in _evaluations(metrics) if e["eval/pass_rate"] >= a.eval_target), None)
    records = _records(metrics)
    hit = _reached(records, a, after)
    return records[hit] if hit is not None else None


def _reached(records: list[dict], a: argparse.Namespace, after: int = 0) -> int | None:
    """Index of the first record whose trailing reward is >= target (with `after` more recorded), or None."""
    for i, value in enumerate(_trailing(records, a.window)):
        if i + 1 >= a.window and value >= a.target:
            return i if len(records) > i + after else None
    return None


def _row(task: str, seed: int, k: int, metrics: Path, a: argparse.Namespace, wall: float) -> dict:
    records = _records(metrics)
    point = _target_point(task, metrics, a)
    before = [r for r in records if point is None or r["version"] <= point["version"]] or records[:1]
    startup = max(0.0, wall - records[-1]["t"])  # imports, model load: process start to the run's clock
    trailing = _trailing(records, a.window)
    row = {
        "task": task, "seed": seed, "k": k,
        "target": f"eval accuracy >= {a.eval_target}" if task in EVAL_TASKS else f"trailing reward >= {a.target}",
        "reached": point is not None,
        "seconds_to_target": round(startup + point["t"], 1) if point is not None else None,
        "versions_to_target": point["version"] if point is not None else None,
        # the weights that generated the samples which met the target: the train reward at version v is
        # that of samples made `staleness` versions earlier, so at k = 32 it lags the learner by ~32
        "policy_version_at_target": _policy_version(point),
        "final_reward": round(trailing[-1], 4),
        "reward_at": {v: round(trailing[v - 1], 4) for v in (100, 200, 400, 800)
                      if len(records) >= v},  # trailing reward at these versions: comparable across loads
        "versions": records[-1]["version"],
        "min_entropy_before_target": round(min(r.get("entropy", 0.0) for r in before), 4),
        "mean_staleness": round(statistics.fmean(r["staleness_mean"] for r in records), 2),
        "wall_s": round(wall, 1),
    }
    if task in EVAL_TASKS:
        row["eval_accuracy_at"] = {e["version"]: e["eval/pass_rate"] for e in _evaluations(metrics)}
    return row


def _policy_version(point: dict | None) -> int | None:
    """The version of the weights whose samples the target record trained on (an eval record: its own)."""
    if point is None:
        return None
    return round(point["version"] - point.get("staleness_mean", 0.0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default=DEFAULT_TASKS, help=f"from {', '.join(TASKS)}")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--ks", default="2,4,8", help="staleness bounds (0: sync)")
    p.add_argument("--correction", default=None, help="the objective above k = 2 (default: the config's auto, m2po)")
    p.add_argument("--objectives", default=None, help="correction kinds to run at every k, e.g. decoupled,m2po")
    p.add_argument("--steps", type=int, default=1500, help="most versions per run")
    p.add_argument("--budget-s", type=float, default=180.0, help="most seconds per run")
    p.add_argument("--target", type=float, default=0.8, help="trailing train reward (the built-in tasks)")
    p.add_argument("--eval-target", type=float, default=0.8, help="held-out greedy accuracy (the math dataset)")
    p.add_argument("--window", type=int, default=20, help="versions in the trailing mean reward")
    p.add_argument("--after", type=int, default=40, help="versions a run goes on past the target")
    p.add_argument("--runtime", choices=["local", "ray"], default="local", help="ray: every stage its own process")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override for every run")
    p.add_argument("--keep", type=Path, default=None, help="a folder that keeps every run's own (metrics, log)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per task, seed, k and objective; a seed's figure is the median of its runs")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time (2 cores: at most 3)")
    a = p.parse_args()
    prepare(a.tasks.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        root = a.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        rows = run_matrix(a, root)
    print(json.dumps({"benchmark": "learning", "runtime": a.runtime, "overrides": a.overrides,
                      "repeats": a.repeats, **summarise(rows)}))


def run_matrix(a: argparse.Namespace, root: Path) -> list[dict]:
    """Every row of the matrix, `a.parallel` runs at a time, each printed to stderr as it ends; returned in
    the matrix's order (k, task, objective, seed, repeat) whatever order they ended in."""
    objectives = a.objectives.split(",") if a.objectives else [None]
    repeats = list(range(a.repeats)) if a.repeats > 1 else [None]
    cells = [(task, seed, k, objective, repeat) for k in (int(x) for x in a.ks.split(","))
             for task in a.tasks.split(",") for objective in objectives
             for seed in (int(x) for x in a.seeds.split(",")) for repeat in repeats]

    def one(cell: tuple) -> dict:
        task, seed, k, objective, repeat = cell
        row = run_once(task, seed, k, a, root, objective, repeat)
        print(json.dumps(row), file=sys.stderr, flush=True)
        return row

    with ThreadPoolExecutor(max_workers=max(1, a.parallel)) as pool:
        return list(pool.map(one, cells))


def summarise(rows: list[dict]) -> dict:
    """Per k and objective: runs that reached the target and the medians over them; ratios against k = 2."""
    figures: dict[str, dict] = {}
    for k, objective in sorted({(r["k"], r.get("objective") or "") for r in rows}):
        mine = [r for r in rows if r["k"] == k and (r.get("objective") or "") == objective]
        hit = [r for r in mine if r.get("reached")]
        figures[f"k{k}" + (f"/{objective}" if objective else "")] = {
            "reached": f"{len(hit)}/{len(mine)}",
            "median_seconds_to_target": statistics.median(r["seconds_to_target"] for r in hit) if hit else None,
            "median_versions_to_target": statistics.median(r["versions_to_target"] for r in hit) if hit else None,
        }
    ratios = {"reached_fraction": round(sum(bool(r.get("reached")) for r in rows) / max(1, len(rows)), 3)}
    at_k2 = [figure for n, figure in figures.items() if n.split("/")[0] == "k2"]
    only_k2 = at_k2[0] if len(at_k2) == 1 else {}  # k = 2 ran with one objective: every k's reference
    for name, f in figures.items():
        reference = figures.get(name.replace(name.split("/")[0], "k2", 1), only_k2).get("median_seconds_to_target")
        if not name.startswith("k2") and reference and f["median_seconds_to_target"]:
            ratios[f"{name}_time_vs_k2"] = round(f["median_seconds_to_target"] / reference, 3)
    ratios.update(versions_vs_k2(rows))
    ratios.update(versions_vs_k2(rows, field="policy_version_at_target", name="policy_versions_vs_k2"))
    ratios.update(seconds_vs_sync(rows))
    return {"rows": rows, "figures": figures, "ratios": ratios}


def versions_vs_k2(rows: list[dict], field: str = "versions_to_target",
                   name: str = "versions_vs_k2") -> dict[str, float | None]:
    """Per task, k and objective: versions to the target at k over those at k = 2 (same task and objective),
    at the worst seed (with --repeats, each seed's median run: `seed_medians`); None when some seed's did not
    reach the target. `field` "policy_version_at_target"
    (`name` policy_versions_vs_k2): the same, counting the versions of the weights that generated them."""
    out: dict[str, float | None] = {}
    for task, k, objective in sorted({(r["task"], r["k"], r.get("objective") or "") for r in rows}):
        mine = [r for r in rows if (r["task"], r["k"], r.get("objective") or "") == (task, k, objective)]
        base = _k2_reference(rows, mine, task, objective)
        if k == 2 or not base:
            continue
        key = f"{name}/{task}/k{k}" + (f"/{objective}" if objective else "")
        at_k, at_k2 = seed_medians(mine, field), seed_medians(base, field)
        if any(v is None for v in [*at_k.values(), *at_k2.values()]):
            out[key] = None
            continue
        out[key] = round(max(at_k[seed] / at_k2[seed] for seed in at_k if seed in at_k2), 3)
    return out


def _k2_reference(rows: list[dict], mine: list[dict], task: str, objective: str) -> list[dict]:
    """The k = 2 rows a cell is compared with: the same objective, or, for a cell on the config's own `auto`
    objective (`m2po` above k = 2), k = 2's `auto` rows (`none`): the defaults against the defaults."""
    same = [r for r in rows if (r["task"], r["k"], r.get("objective") or "") == (task, 2, objective)]
    if same or not all(r.get("auto_objective") for r in mine):
        return same
    return [r for r in rows if (r["task"], r["k"]) == (task, 2) and r.get("auto_objective")]


def seed_medians(rows: list[dict], field: str) -> dict[int, float | None]:
    """Per seed, the median of `field` over its runs (--repeats), a run that missed the target counting as
    later than any that reached it: None where the median is such a run. One run a seed: its own figure."""
    out: dict[int, float | None] = {}
    for seed in sorted({r["seed"] for r in rows}):
        middle = statistics.median(r[field] if r.get("reached") else math.inf for r in rows if r["seed"] == seed)
        out[seed] = None if math.isinf(middle) else float(middle)
    return out


def seconds_vs_sync(rows: list[dict]) -> dict[str, float | None]:
    """Per task, k > 0 and objective: the median seconds to the target over sync's (k = 0, same task, any
    objective: its data is on-policy), medians over the seeds that reached it; None when either reached it at
    no seed."""
    out: dict[str, float | None] = {}
    for task, k, objective in sorted({(r["task"], r["k"], r.get("objective") or "") for r in rows}):
        sync = [r for r in rows if (r["task"], r["k"]) == (task, 0)]
        if k == 0 or not sync:
            continue
        mine = [r for r in rows if (r["task"], r["k"], r.get("objective") or "") == (task, k, objective)]
        key = f"seconds_vs_sync/{task}/k{k}" + (f"/{objective}" if objective else "")
        at_k, at_sync = _median_seconds(mine), _median_seconds(sync)
        out[key] = round(at_k / at_sync, 3) if at_k and at_sync else None
    return out


def _median_seconds(rows: list[dict]) -> float | None:
    hit = [r["seconds_to_target"] for r in rows if r.get("reached")]
    return statistics.median(hit) if hit else None

if __name__ == "__main__":
    main()
