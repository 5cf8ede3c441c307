"""`baton scale RUN_DIR --engines N [--wait S]`: grow or shrink a running run's engines.

It asks the run's control endpoint (`pipeline.control`: the address in the run folder's `control.json`,
the bearer token in `control.token`), which the run serves on 127.0.0.1 while it runs when it was started
with room to grow (`[rollout] max_engines`). A joining engine takes requests only once it holds the
run's current weights, proven by their checksum; a leaving one finishes what it has in flight first, or with
`--preempt` hands it to the others, which continue each request from the tokens it has
(docs/guides/elastic.md). Without `--engines` it prints the fleet's status.

Exit codes: 0 done (with --wait: the joins and leaves have settled), 1 the fleet did not settle within
--wait, 2 no control endpoint (the run is not running, or cannot grow), a refused target or bad usage,
130 interrupted by Ctrl-C or SIGTERM. The last stdout line is the fleet's status as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `scale` to a `baton` subparsers object."""
    p = subparsers.add_parser(
        "scale", help="grow or shrink a running run's engines (it must have been started with rollout.max_engines)",
        epilog="exit codes:\n  0   done\n  1   the fleet did not settle within --wait\n  2   no control endpoint "
               "(not running, or cannot grow), a refused target, or bad usage\n  130 interrupted by Ctrl-C or SIGTERM",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the folder of a running run")
    p.add_argument("--engines", type=int, default=None, metavar="N",
                   help="engines to have (1 .. the run's rollout.max_engines); omitted: print the fleet's status")
    p.add_argument("--preempt", action="store_true",
                   help="the leaving engines' requests in flight stop now and continue on the others from the tokens "
                        "they have (a node taken away), instead of finishing where they are")
    p.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for the joins and leaves to settle (default: return at once)")
    return p


def run(args: argparse.Namespace) -> int:
    from pipeline.control import ControlError, control_request, scale_run

    try:
        status = control_request(args.run_dir) if args.engines is None else \
            scale_run(args.run_dir, args.engines, args.wait, args.preempt)
    except ControlError as exc:
        print(f"baton scale: {exc}", file=sys.stderr)
        return 1 if "had not settled" in str(exc) else 2
    print(json.dumps(status))
    return 0
