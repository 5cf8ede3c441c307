"""`baton`: run or check a pipeline config.

    baton run CONFIG [--set key=value ...]     run; the last stdout line is the JSON summary
    baton check CONFIG [--set key=value ...]   validate and print the resolved config; start nothing
    baton mooncake-master [--port N]           run a mooncake_master on 127.0.0.1 until interrupted

Exit codes: 0 done, 1 the run failed (an actor raised; the message names it), 2 bad config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from pipeline.config import ConfigError, load_toml, validate


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description="fully-asynchronous RL rollout pipeline")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("run", "run a pipeline config"), ("check", "validate a config, start nothing")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", help="path to a TOML config, e.g. configs/quickstart.toml")
        p.add_argument(
            "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
            help="override a config key, e.g. --set learner.lr=1e-3 (repeatable)",
        )
    m = sub.add_parser("mooncake-master", help="run a mooncake_master on 127.0.0.1 (prints its address)")
    m.add_argument("--port", type=int, default=None, help="RPC port (default: a free one)")
    m.add_argument("--lease-ttl-ms", type=int, default=500, help="read lease before a key can be removed")
    return parser


def run_mooncake_master(port: int | None, lease_ttl_ms: int) -> int:
    import signal
    import threading

    from buffers.mooncake_master import MooncakeMaster, MooncakeUnavailable

    try:
        master = MooncakeMaster(port, lease_ttl_ms=lease_ttl_ms).start()
    except MooncakeUnavailable as exc:
        print(f"baton: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"master": master.address, "pid": master.pid}), flush=True)
    print(f"mooncake_master on {master.address} (pid {master.pid}); Ctrl-C stops it", file=sys.stderr)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(0.5):
        if not master.running():
            print("baton: mooncake_master exited", file=sys.stderr)
            return 1
    master.stop()
    return 0


def load_config(path: str, overrides: list[str]):
    from stages.config import RunConfig

    return validate(RunConfig, load_toml(path, overrides), source=path)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "mooncake-master":
        return run_mooncake_master(args.port, args.lease_ttl_ms)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"baton: {exc}", file=sys.stderr)
        return 2
    if args.command == "check":
        sys.stdout.write(cfg.resolved_toml())
        return 0

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from pipeline.actor import ActorFailed
    from pipeline.telemetry import configure_logging, get_logger
    from stages.config import build_pipeline

    configure_logging(cfg.telemetry.log_format, cfg.telemetry.log_level)
    try:
        pipeline = build_pipeline(cfg)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"baton: {exc}", file=sys.stderr)
        return 2
    try:
        summary = pipeline.run()
    except ActorFailed as exc:
        get_logger("baton").error("run failed", error=str(exc), exc_info=exc)
        return 1
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
