"""`baton ledger RUN_DIR [--export FILE] [--id ID] [--bound K]`: a run's ledger, read from its store.

Prints the totals (samples per fate, filtered, reused) and checks the invariants from the run folder's
`ledger.sqlite` (pipeline.ledger_store.check): no sample with two fates, none trained twice at one
version or more than `max_uses` times, none trained more than the staleness bound after its oldest
token, no sample lost uncounted (the run's counts match its records). The bound is `--bound`, else
the run's summary.json `staleness_bound`, else its config.toml `[staleness] k`; without any of them
it is not checked (said so). `--export FILE` writes one JSON record per sample (ledger.json's fields);
`--id ID` prints one sample's record and every row it has in the store. Works while the run is going
(it reads the last commit).

Exit codes: 0 every invariant holds, 1 one is broken (each printed), 2 no such run folder, store or id,
130 interrupted by Ctrl-C or SIGTERM.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

import msgspec


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `ledger` to a `baton` subparsers object."""
    p = subparsers.add_parser(
        "ledger", help="a run's ledger: totals, invariant checks, export, one sample",
        epilog="exit codes:\n  0   every invariant holds\n  1   one is broken (each printed)\n  2   no such run "
               "folder, store or id, or bad usage\n  130 interrupted by Ctrl-C or SIGTERM",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (holds ledger.sqlite)")
    p.add_argument("--export", metavar="FILE", default=None, help="write one JSON record per sample to FILE")
    p.add_argument("--id", dest="item_id", metavar="ID", default=None, help="show one sample's history")
    p.add_argument("--bound", type=int, default=None,
                   help="staleness bound to check (default: the run's summary.json, else its config.toml)")
    return p


def staleness_bound(run_dir: Path) -> int | None:
    """The run's staleness bound: summary.json's, else config.toml's `[staleness] k`; None if neither says."""
    try:
        return int(json.loads((run_dir / "summary.json").read_text())["staleness_bound"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        staleness = tomllib.loads((run_dir / "config.toml").read_text()).get("staleness", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return int(staleness["k"]) if "k" in staleness else None


def run(args: argparse.Namespace) -> int:
    from pipeline.ledger_store import open_run

    run_dir = Path(args.run_dir)
    try:
        conn = open_run(run_dir)
    except FileNotFoundError as exc:
        print(f"baton ledger: {exc}", file=sys.stderr)
        return 2
    try:
        if args.item_id is not None:
            return _show(conn, args.item_id)
        return _check(conn, run_dir, args)
    finally:
        conn.close()


def _show(conn: Any, item_id: str) -> int:
    from pipeline.ledger_store import history

    record = history(conn, item_id)
    if record is None:
        print(f"baton ledger: no sample {item_id!r} in this run's ledger", file=sys.stderr)
        return 2
    rows = conn.execute("SELECT seq, fate, reason, at, use FROM settled WHERE id = ? ORDER BY seq", (item_id,))
    for seq, fate, reason, at, use in rows:
        print(f"row {seq}: {fate}{f' at version {at}' if at is not None else ''}"
              f"{f' (reuse {use})' if use else ''}{f': {reason}' if reason else ''}")
    print(msgspec.json.encode(record).decode())
    return 0


def _check(conn: Any, run_dir: Path, args: argparse.Namespace) -> int:
    from pipeline.ledger_store import check, export_jsonl, meta, totals

    bound = args.bound if args.bound is not None else staleness_bound(run_dir)
    found = totals(conn)
    print("  ".join(f"{key} {value}" for key, value in found.items()))
    if bound is None:
        print("staleness bound unknown (no --bound, summary.json or config.toml): not checked")
    problems = check(conn, bound=bound)
    for problem in problems:
        print(f"BROKEN {problem.kind}: {problem.message}")
    exported = export_jsonl(conn, args.export) if args.export else None
    if exported is not None:
        print(f"exported {exported} records to {args.export}")
    print(json.dumps({
        "run_dir": str(run_dir), "totals": found, "max_uses": meta(conn).get("max_uses"), "bound": bound,
        "violations": [msgspec.to_builtins(p) for p in problems], "exported": exported,
    }))
    return 1 if problems else 0


__all__ = ["add_parser", "run", "staleness_bound"]
