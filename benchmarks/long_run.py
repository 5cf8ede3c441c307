"""A long quickstart-shaped run: does a version cost the same at the end as at the start, and does
memory stay put? Small groups (`--group-size 2`, `--groups 4`) so per-version overhead dominates;
enough versions to settle `--samples` (default 200k) samples. While it runs, the RSS of every baton
process (the run's process tree: on Ray with a local cluster, its gcs, raylet and workers) is sampled
each second.

    python benchmarks/long_run.py [--runtime local|ray] [--samples 200000] [--set key=value ...]

Prints, then as the last stdout line one JSON object with "figures" and "ratios":
* late_vs_early_version_s: median version wall time (metrics' `version_s`) over the last 10 % of
  versions / over versions 50-150 (goal <= 1.1);
* rss_growth_mb_per_100k_samples: RSS growth between version 150 and the end, per 100k samples
  trained (goal <= 10), and rss_growth_mb_per_100k_second_half: the same over the second half of
  that span only. The allocators (glibc arenas, Mooncake's and Ray's clients) take a few thousand
  versions to reach their working set, so in a short run the first figure is mostly that warm-up and
  the second is the slope a week-long run keeps. `figures.rss_by_role` splits both by process role
  (the run's main process, mooncake_master, gcs_server, raylet, each Ray worker by actor and pid, ...);
  `--rss-trace FILE` writes every per-second sample;
* checkpoint seconds, first vs last, and the medians of the first and last ten (`checkpoints.jsonl`);
* the ledger: rows in its store, records ledger.json held (none beyond 1M samples).

`--trace-memory PREFIX` sets `BATON_TRACEMALLOC=PREFIX` for the run (`pipeline.runtime.memory`: on Ray the
learner's host, or the hosts `BATON_TRACEMALLOC_HOSTS` names, write PREFIX.<host>.jsonl after a warm-up)
and adds "memory_report": per host, its last record's growth since the warm-up (RSS, anonymous memory,
glibc heap in use and free, Python's traced allocations) and the allocation sites that grew most.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = 4096


def process_tree(root_pid: int) -> set[int]:
    """`root_pid` and its descendants (on Ray with a local cluster: gcs, raylet, every `ray::` worker)."""
    parents: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, grew = {root_pid}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def role_of(pid: int, root_pid: int) -> str:
    """What a process is, from its command line: "main" (the run's process), "mooncake_master",
    "gcs_server", "raylet", a Ray worker by its actor and pid ("ray::StageHost@1234": its title names
    the running method too, which changes), a Python helper by its script, else its program's name."""
    if pid == root_pid:
        return "main"
    try:
        argv = [a.decode(errors="replace") for a in (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")]
    except OSError:
        return "gone"
    if argv[0].startswith("ray::"):
        return f"{argv[0].split()[0].split('.')[0]}@{pid}"
    for name in ("mooncake_master", "gcs_server", "raylet", "mooncake_holder"):
        if any(name in arg for arg in argv[:3]):
            return name
    program = Path(argv[0].split()[0]).name if argv[0] else "?"
    if program.startswith("python") and len(argv) > 1:
        script = next((a for a in argv[1:] if a.endswith(".py") or a.startswith("ray.") or "." in a), argv[1])
        return f"python {Path(script).name}"
    return program


def rss_by_role(root_pid: int) -> dict[str, float]:
    """RSS in MB of `root_pid`'s process tree, summed per role (`role_of`); processes of one role
    (e.g. two engine workers) are added up."""
    roles: dict[str, float] = {}
    for pid in process_tree(root_pid):
        try:
            rss = int((Path("/proc") / str(pid) / "statm").read_text().split()[1]) * PAGE / 1e6
        except (OSError, ValueError, IndexError):
            continue
        role = role_of(pid, root_pid)
        roles[role] = roles.get(role, 0.0) + rss
    return roles


def latest_version(metrics: Path) -> int:
    """The version of metrics.jsonl's last complete line (reads only its end)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(0, 2)
            f.seek(max(f.tell() - 8192, 0))
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["version"])
        except (ValueError, KeyError):
            continue
    return 0


Sample = tuple[float, int, float, dict[str, float]]  # seconds, version, RSS MB of the tree, RSS MB per role


def run_sampled(cmd: list[str], root: Path, env: dict[str, str] | None = None) -> tuple[dict, list[Sample]]:
    """Run `cmd` (in `env`), sampling (seconds, version, RSS MB, RSS MB per role) every second; returns its
    summary and the samples."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    samples, t0 = [], time.monotonic()
    while proc.poll() is None:
        metrics = next(root.glob("*/metrics.jsonl"), None)
        version = latest_version(metrics) if metrics else 0
        roles = rss_by_role(proc.pid)
        samples.append((time.monotonic() - t0, version, sum(roles.values()), roles))
        time.sleep(1.0)
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"run failed (exit {proc.returncode}): {' '.join(cmd)}")
    return json.loads(out.strip().splitlines()[-1]), samples


def write_trace(path: Path, samples: list[Sample]) -> None:
    with open(path, "w") as f:
        for t, version, mb, roles in samples:
            per_role = {role: round(x, 1) for role, x in roles.items()}
            f.write(json.dumps({"s": round(t, 1), "version": version, "mb": round(mb, 1), "roles": per_role}) + "\n")


def growth_per_100k(a: Sample, b: Sample, per_version: int, role: str | None = None) -> float | None:
    """RSS growth from sample `a` to `b` (of `role`, or of the whole tree) per 100k samples trained."""
    grown = (b[1] - a[1]) * per_version
    mb = (b[3].get(role, 0.0) - a[3].get(role, 0.0)) if role else b[2] - a[2]
    return round(mb / grown * 1e5, 2) if grown > 0 else None


def growth_by_role(start: Sample, mid: Sample, end: Sample, per_version: int) -> dict[str, dict]:
    """Per role: RSS MB at `start`, `mid` and `end`, its growth per 100k samples trained from start to
    end and over the second half (mid to end: past the allocators' warm-up, the rate a long run keeps)."""
    roles = sorted(set(start[3]) | set(end[3]), key=lambda r: -(end[3].get(r, 0.0) - start[3].get(r, 0.0)))
    return {
        role: {
            "mb_start": round(start[3].get(role, 0.0), 1),
            "mb_mid": round(mid[3].get(role, 0.0), 1),
            "mb_end": round(end[3].get(role, 0.0), 1),
            "mb_per_100k_samples": growth_per_100k(start, end, per_version, role),
            "mb_per_100k_second_half": growth_per_100k(mid, end, per_version, role),
        }
        for role in roles
    }


def figures_of(summary: dict, samples: list[Sample], per_version: int) -> dict:
    run_dir = Path(summary["run_dir"])
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    version_s = [r["version_s"] for r in records]
    early = statistics.median(version_s[50:150])
    late = statistics.median(version_s[-max(len(version_s) // 10, 1):])
    start = next((s for s in samples if s[1] >= 150), samples[0])
    training = [s for s in samples if s[1] < len(records)] or samples
    end = training[-1]  # the last sample while it trained (not the report rendered at its end)
    mid = next(s for s in training if s[1] >= (start[1] + end[1]) // 2)
    grown = (end[1] - start[1]) * per_version
    checkpoints = [json.loads(x) for x in (run_dir / "checkpoints.jsonl").read_text().splitlines()]
    import sqlite3

    conn = sqlite3.connect(run_dir / "ledger.sqlite")
    rows = conn.execute("SELECT count(*) FROM settled").fetchone()[0]
    conn.close()
    return {
        "versions": len(records), "samples_trained": summary["samples"]["trained"], "wall_s": summary["wall_s"],
        "version_s_early": round(early, 5), "version_s_late": round(late, 5),
        "rss_mb_start": round(start[2], 1), "rss_mb_end": round(end[2], 1),
        "rss_mb_max": round(max(s[2] for s in samples), 1),
        "samples_between_rss": grown,
        "rss_growth_mb_per_100k_samples": growth_per_100k(start, end, per_version),
        "rss_mb_mid": round(mid[2], 1),
        "rss_growth_mb_per_100k_second_half": growth_per_100k(mid, end, per_version),
        "rss_by_role": growth_by_role(start, mid, end, per_version),
        "checkpoint_s_first": checkpoints[0]["seconds"] if checkpoints else None,
        "checkpoint_s_last": checkpoints[-1]["seconds"] if checkpoints else None,
        # medians of the first and last ten: one checkpoint's seconds are noisy (the consumer's fsyncs)
        "checkpoint_s_first10": statistics.median(c["seconds"] for c in checkpoints[:10]) if checkpoints else None,
        "checkpoint_s_last10": statistics.median(c["seconds"] for c in checkpoints[-10:]) if checkpoints else None,
        "checkpoint_run_bytes_first": checkpoints[0]["run_bytes"] if checkpoints else None,
        "checkpoint_run_bytes_last": checkpoints[-1]["run_bytes"] if checkpoints else None,
        "ledger_store_rows": rows, "ledger_json": (run_dir / "ledger.json").exists(),
        "ledger_balanced": summary["ledger_balanced"],
    }


def memory_report(prefix: str, top: int = 5) -> dict[str, dict]:
    """Per host that wrote `prefix.<host>.jsonl`: its records' count and span, the last one's growth
    since the warm-up and its `top` grown allocation sites."""
    hosts = {}
    for path in sorted(Path(prefix).parent.glob(Path(prefix).name + ".*.jsonl")):
        records = [r for r in map(json.loads, path.read_text().splitlines()) if "host" in r]
        if records:  # (not another file under that prefix, e.g. an --rss-trace)
            last = records[-1]
            hosts[last["host"]] = {"records": len(records), "seconds": round(last["t"] - records[0]["t"], 1),
                                   "since_warmup_mb": last["since_warmup_mb"], "grown": last["grown"][:top]}
    return hosts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "quickstart.toml"))
    p.add_argument("--runtime", choices=("local", "ray"), default="local")
    p.add_argument("--samples", type=int, default=200_000, help="samples to settle (sets the step count)")
    p.add_argument("--groups", type=int, default=4, help="learner.groups_per_step")
    p.add_argument("--group-size", type=int, default=2, help="rollout.group_size")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--rss-trace", help="also write every RSS sample here (JSON lines: seconds, version, MB per role)")
    p.add_argument("--trace-memory", metavar="PREFIX", help="BATON_TRACEMALLOC=PREFIX: hosts' memory reports")
    a = p.parse_args()
    per_version = a.groups * a.group_size
    steps = -(-a.samples // per_version)
    with tempfile.TemporaryDirectory(prefix="baton-long-") as tmp:
        sets = [f"steps={steps}", f"run_root='{tmp}'", "telemetry.progress=false", f"runtime='{a.runtime}'",
                f"learner.groups_per_step={a.groups}", f"rollout.group_size={a.group_size}",
                f"engine.batch_groups={a.groups}", f"model.path='{ROOT / 'runs' / 'models' / 'tiny-qwen2'}'",
                *a.overrides]
        cmd = [sys.executable, "-m", "baton.cli", "run", a.config, *[x for s in sets for x in ("--set", s)]]
        env = {**os.environ, "BATON_TRACEMALLOC": str(Path(a.trace_memory).resolve())} if a.trace_memory else None
        summary, samples = run_sampled(cmd, Path(tmp), env)
        if a.rss_trace:
            write_trace(Path(a.rss_trace), samples)
        figures = figures_of(summary, samples, per_version)
    ratios = {
        "late_vs_early_version_s": round(figures["version_s_late"] / figures["version_s_early"], 3),
        "rss_growth_mb_per_100k_samples": figures["rss_growth_mb_per_100k_samples"],
        "rss_growth_mb_per_100k_second_half": figures["rss_growth_mb_per_100k_second_half"],
        "checkpoint_s_last10_vs_first10": round(figures["checkpoint_s_last10"] / figures["checkpoint_s_first10"], 3)
        if figures["checkpoint_s_first10"] else None,
    }
    print(f"{a.runtime}: {figures['versions']} versions, {figures['samples_trained']} samples in "
          f"{figures['wall_s']} s; "
          f"version {figures['version_s_early']} s early, {figures['version_s_late']} s late "
          f"(x{ratios['late_vs_early_version_s']}); RSS {figures['rss_mb_start']} -> {figures['rss_mb_end']} MB "
          f"({ratios['rss_growth_mb_per_100k_samples']} MB per 100k samples); checkpoint "
          f"{figures['checkpoint_s_first']} s first, {figures['checkpoint_s_last']} s last")
    if a.trace_memory:
        figures["memory_report"] = memory_report(str(Path(a.trace_memory).resolve()))
    print(json.dumps({"runtime": a.runtime, "figures": figures, "ratios": ratios}))


if __name__ == "__main__":
    main()
