"""`baton watch RUN_DIR`: a run's progress and latest metrics, read from its folder while it runs, for
runs started elsewhere (a Ray job, another terminal); its summary once it ended.

It only reads the folder: metrics.jsonl (followed, new bytes only), config.toml (for `steps`), and
summary.json or failure.log, whichever appears first, which ends the watch: exit 0 with the summary, 1
with the failure's short message. Lines go to stdout, at most one per `--interval` seconds (the latest
record then; records in between are in metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

SHOWN = ("reward", "staleness_mean", "samples_per_s", "version_s", "filtered_frac")  # when the record has them
SUMMARY_SHOWN = ("version", "reward_start", "reward_end", "max_staleness_trained", "samples", "ledger_balanced",
                 "wall_s", "samples_per_s")
REASONS_SHOWN = 8  # per fate, in the finished summary; summary.json has them all


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "watch", help="print a run's progress from its folder while it runs, and its summary when it ends",
        epilog="exit codes:\n  0   the run finished (its summary printed)\n  1   the run failed (failure.log's "
               "message printed)\n  2   RUN_DIR is not a folder, or bad usage\n  130 interrupted by Ctrl-C or SIGTERM",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder (runs/<name>-<timestamp>)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between lines (default 2)")
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        return watch(Path(args.run_dir), interval_s=args.interval)
    except KeyboardInterrupt:
        return 130


def _steps(run_dir: Path) -> int | None:
    try:
        return int(tomllib.loads((run_dir / "config.toml").read_text())["steps"])
    except (OSError, KeyError, ValueError, tomllib.TOMLDecodeError):
        return None


def progress_line(record: Mapping[str, Any], steps: int | None) -> str:
    """`t 12.3 s  version 10/240  reward 0.5  ...` from one metrics record."""
    from pipeline.telemetry import format_value

    parts = []
    if "t" in record:
        parts.append(f"t {format_value(float(record['t']))} s")
    if "version" in record:
        parts.append(f"version {record['version']}" + (f"/{steps}" if steps else ""))
    shown = [k for k in SHOWN if k in record] + sorted(k for k in record if k.startswith("eval"))
    parts += [f"{key} {format_value(record[key])}" for key in shown]
    return "  ".join(parts)


def summary_lines(summary: Mapping[str, Any]) -> list[str]:
    """The finished line, one line per fate with its samples by reason (the most first), and where the
    summary is."""
    from pipeline.telemetry import format_value

    lines = ["finished: " + "  ".join(f"{k} {format_value(summary[k])}" for k in SUMMARY_SHOWN if k in summary)]
    for fate, reasons in (summary.get("reasons") or {}).items():
        shown = list(reasons.items())[:REASONS_SHOWN]
        more = f"; and {len(reasons) - len(shown)} more reasons" if len(reasons) > len(shown) else ""
        lines.append(f"{fate} {sum(reasons.values())} by reason: " + "; ".join(f"{n} {r}" for r, n in shown) + more)
    lines.append(f"summary: {summary.get('run_dir', '')}/summary.json")
    return lines


def _ended(run_dir: Path) -> tuple[int, list[str]] | None:
    """(exit code, lines) once the run ended; None while it runs."""
    from pipeline.telemetry import FAILURE_FILE

    summary = run_dir / "summary.json"
    if summary.exists():
        try:
            return 0, summary_lines(json.loads(summary.read_text()))
        except ValueError:  # written atomically, so this is not a partial file: report it as it is
            return 1, [f"baton watch: {summary} is not JSON"]
    failure = run_dir / FAILURE_FILE
    if failure.exists():
        return 1, failure.read_text().split("\n\n", 1)[0].splitlines()
    return None


def watch(run_dir: Path, *, interval_s: float = 2.0, out: TextIO | None = None,
          sleep: Callable[[float], None] = time.sleep) -> int:
    """Follow `run_dir` until it holds summary.json (exit 0) or failure.log (exit 1); 2 if it is no run
    folder."""
    from pipeline.sinks import JsonlTail
    from pipeline.telemetry import METRICS_FILE

    out = out or sys.stdout
    if not run_dir.is_dir():
        print(f"baton watch: {run_dir} is not a folder", file=sys.stderr)
        return 2
    steps, tail = _steps(run_dir), JsonlTail(run_dir / METRICS_FILE)
    print(f"watching {run_dir}" + (f" ({steps} steps)" if steps else ""), file=out, flush=True)
    while True:
        ended = _ended(run_dir)  # looked at before the last read: records written before the end are shown
        records = tail.read()
        if records:
            print(progress_line(records[-1], steps), file=out, flush=True)
        if ended is not None:
            code, lines = ended
            print("\n".join(lines), file=out, flush=True)
            return code
        sleep(interval_s)
