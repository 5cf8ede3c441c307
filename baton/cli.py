"""`baton`: run or check a pipeline config.

    baton run CONFIG [--set key=value ...]     run; the last stdout line is the JSON summary
    baton run --resume RUN_DIR [--set k=v ...] continue a checkpointed run (its config.toml) to its steps
    baton check CONFIG [--set key=value ...]   validate and print the resolved config; start nothing
    baton mooncake-master [--port N]           run a mooncake_master on 127.0.0.1 ($BATON_HOST) until interrupted
    baton simulate CONFIG [--engines N] [--learners M] [--steps S] [--set k=v ...]
                   [--calibrate RUN_DIR] [--sweep engines=1,2,4,8 k=0,1,2,4]
                                               the pipeline in virtual time with cost models (baton.simulate):
                                               a table, a run folder with a plot, one JSON line
    baton faults CONFIG [--kinds a,b] [--seeds N] [--set k=v]
                                               the fault matrix: a table, then one JSON line of totals;
                                               exit 1 when any run breaks an invariant
    baton watch RUN_DIR                        follow a run's progress from its folder, then its summary
    baton ledger RUN_DIR [--export F] [--id ID] the ledger's totals and invariants (exit 1 on a broken one)
    baton scale RUN_DIR [--engines N] [--wait S] [--preempt]
                                               grow or shrink a running run's engines (rollout.max_engines);
                                               one JSON line: the fleet's status
    baton export RUN_DIR OUT [--version V] [--dtype D] [--max-shard-size S]
                                               a checkpoint's model as a Hugging Face folder (the latest
                                               checkpoint by default); one JSON line
    baton --version                            the installed version

exit codes (each command's --help lists its own):
  0   done
  1   the run failed (an actor raised; the message names it)
  2   bad config or usage
  130 interrupted by Ctrl-C or SIGTERM
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

from baton import export_command, ledger_command, scale_command, serve_command, watch_command
from baton.config import ConfigError
from buffers.mooncake_master import READ_LEASE_MS

INTERRUPTED = (130, "interrupted by Ctrl-C or SIGTERM")
EXIT_CODES: dict[str, tuple[tuple[int, str], ...]] = {  # each command's, listed by its --help
    "run": ((0, "done; the last stdout line is the JSON summary"),
            (1, "the run failed (an actor raised; the message names it)"), (2, "bad config or usage"),
            (130, "interrupted by Ctrl-C or SIGTERM; what the run started is stopped")),
    "check": ((0, "the config is valid (printed, resolved)"), (2, "bad config or usage"), INTERRUPTED),
    "faults": ((0, "every run kept every invariant"), (1, "a run broke one"), (2, "bad config or usage"),
               INTERRUPTED),
    "simulate": ((0, "done"), (2, "bad config or usage"), INTERRUPTED),
    "mooncake-master": ((0, "stopped by Ctrl-C or SIGTERM"), (1, "the master exited by itself"),
                        (2, "Mooncake is not installed, or bad usage")),
}


def exit_codes_epilog(codes: tuple[tuple[int, str], ...]) -> str:
    """A --help epilog listing `codes`, one per line."""
    return "exit codes:\n" + "\n".join(f"  {code:<4}{meaning}" for code, meaning in codes)


def version() -> str:
    """This source tree's version, `baton.__version__` (pyproject.toml reads the package's from it, so an
    editable install never prints a stale one)."""
    from baton import __version__

    return __version__


def add_overrides(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help_text)


def _command(sub: argparse._SubParsersAction, name: str, help_text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_text, epilog=exit_codes_epilog(EXIT_CODES[name]),
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _parser() -> argparse.ArgumentParser:
    synopsis = __doc__.split("\n\n", 1)[1]  # the command list and the exit codes
    parser = argparse.ArgumentParser(prog="baton", description="fully-asynchronous RL rollout pipeline",
                                     epilog=synopsis, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"baton {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("run", "run a pipeline config"), ("check", "validate a config, start nothing")):
        p = _command(sub, name, help_text)
        p.add_argument(
            "config", nargs="?" if name == "run" else None,
            help="path to a TOML config, e.g. configs/quickstart.toml (run --resume: default RUN_DIR/config.toml)",
        )
        if name == "run":
            p.add_argument(
                "--resume", metavar="RUN_DIR", default=None,
                help="continue the run in RUN_DIR from its latest checkpoint (needs checkpoint.every > 0)",
            )
        add_overrides(p, "override a config key, e.g. --set learner.lr=1e-3 (repeatable)")
    f = _command(sub, "faults", "run the fault matrix on a config; exit 1 if any invariant breaks")
    f.add_argument("config", help="path to a TOML config, e.g. configs/faults.toml")
    f.add_argument("--kinds", default=None, help="comma-separated fault kinds (default: all of them)")
    f.add_argument("--seeds", type=int, default=3, help="seeds per fault kind: 0 .. N-1 (default 3)")
    add_overrides(f, "override a config key for every run (repeatable)")
    _simulate_parser(_command(sub, "simulate", "predict throughput, staleness and idle time in virtual time"))
    watch_command.add_parser(sub)
    ledger_command.add_parser(sub)
    export_command.add_parser(sub)
    scale_command.add_parser(sub)
    serve_command.add_parser(sub)
    m = _command(sub, "mooncake-master", "run a mooncake_master on 127.0.0.1 or $BATON_HOST (prints its address)")
    m.add_argument("--port", type=int, default=None, help="RPC port (default: a free one)")
    m.add_argument("--lease-ttl-ms", type=int, default=READ_LEASE_MS, help="a read's lease: a read that "
                   "outlasts it is read again, a key read less than it ago cannot be removed")
    return parser


def _simulate_parser(s: argparse.ArgumentParser) -> None:
    s.add_argument("config", nargs="?", help="path to a TOML config (its [simulate] table declares costs); "
                   "default with --calibrate: RUN_DIR/config.toml")
    s.add_argument("--calibrate", metavar="RUN_DIR", default=None,
                   help="use the costs measured in a real run's folder instead of the declared ones")
    s.add_argument("--engines", type=int, default=None, help="engines to simulate (default: engine.count)")
    s.add_argument("--learners", type=int, default=None, help="learner ranks (default: learner.world_size)")
    s.add_argument("--steps", type=int, default=None, help="versions to simulate (default: simulate.steps or steps)")
    s.add_argument("--sweep", nargs="+", default=None, metavar="KEY=V1,V2",
                   help="simulate every combination, e.g. --sweep engines=1,2,4,8 k=0,1,2,4 (keys: engines, k, "
                   "learners)")
    s.add_argument("--engine-schedule", default=None, metavar="T:N,...",
                   help="the engine count over virtual time, e.g. 0:1,60:2,120:1 (simulate.engine_schedule; a joiner "
                   "pays simulate.engine_join_s, a leaver drains); figures come per phase too")
    s.add_argument("--learner-restarts", default=None, metavar="T,...",
                   help="times (s) at which the learner group restarts, each training nothing for "
                   "simulate.learner_restart_s (simulate.learner_restarts)")
    add_overrides(s, "override a config key, e.g. --set simulate.decode_tokens_per_s=3000 (repeatable)")


def run_mooncake_master(port: int | None, lease_ttl_ms: int) -> int:
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


def run_fault_matrix(config: str, kinds: str | None, seeds: int, overrides: list[str]) -> int:
    """`baton faults`: each fault kind x seed on `config`; the table, then one JSON line of totals."""
    from pipeline.process import prepare_process

    prepare_process()  # before torch loads: the fault matrix's runs are set up as `baton run`'s are
    from baton import fault_matrix
    from baton.schema import load_run_config
    from pipeline.telemetry import configure_logging

    try:
        cfg = load_run_config(config, overrides)  # the base config must be valid before any run starts
    except ConfigError as exc:
        print(f"baton: {exc}", file=sys.stderr)
        return 2
    configure_logging(cfg.telemetry.log_format, cfg.telemetry.log_level)
    return fault_matrix.main(config, kinds, seeds, overrides)


def run_simulate(args: argparse.Namespace) -> int:
    from baton import simulate

    for flag in ("engines", "learners", "steps"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            print(f"baton: --{flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    return simulate.main(args.config, args.calibrate, args.engines, args.learners, args.steps, args.overrides,
                         args.sweep, (args.engine_schedule, args.learner_restarts))


def main(argv: list[str] | None = None) -> int:
    """The `baton` command; its exit code (EXIT_CODES). Ctrl-C, and SIGTERM (which takes Ctrl-C's path),
    end every command with 130 but `mooncake-master`, for which they are the way to stop it (0)."""
    args = _parser().parse_args(argv)
    commands = {
        "mooncake-master": lambda: run_mooncake_master(args.port, args.lease_ttl_ms),
        "faults": lambda: run_fault_matrix(args.config, args.kinds, args.seeds, args.overrides),
        "simulate": lambda: run_simulate(args),
        "watch": lambda: watch_command.run(args),
        "ledger": lambda: ledger_command.run(args),
        "export": lambda: export_command.run(args),
        "scale": lambda: scale_command.run(args),
        "serve": lambda: serve_command.run(args),
    }
    if args.command not in ("run", "mooncake-master") and threading.current_thread() is threading.main_thread():
        _take_ctrl_c_back()
        signal.signal(signal.SIGTERM, _sigterm_as_ctrl_c)
    try:
        return commands[args.command]() if args.command in commands else run_or_check(args)
    except KeyboardInterrupt:
        print("baton: interrupted", file=sys.stderr)
        return 130


def run_or_check(args: argparse.Namespace) -> int:
    """`baton run` / `baton check`: validate the config, then (run) build the pipeline and run or resume it."""
    resume = getattr(args, "resume", None)
    if args.config is None and resume is None:
        print("baton: run needs a CONFIG, or --resume RUN_DIR", file=sys.stderr)
        return 2
    from baton.schema import load_run_config

    try:
        cfg = load_run_config(args.config or os.path.join(resume, "config.toml"), args.overrides)
    except ConfigError as exc:
        print(f"baton: {exc}", file=sys.stderr)
        return 2
    if args.command == "check":
        sys.stdout.write(cfg.resolved_toml())
        if (window := cfg.window_report()) is not None:  # what the staleness window holds, on stderr
            print(f"baton: {window}", file=sys.stderr)
        return 0

    from pipeline.process import prepare_process

    prepare_process()  # before torch loads; `Pipeline.run()` calls it again, as it does for the DSL
    from baton.builder import build_pipeline
    from pipeline.actor import ActorFailed
    from pipeline.checkpoint import CheckpointError
    from pipeline.telemetry import configure_logging, report_failure

    configure_logging(cfg.telemetry.log_format, cfg.telemetry.log_level)
    stop_on_sigterm()
    try:
        pipeline = build_pipeline(cfg)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"baton: {exc}", file=sys.stderr)
        return 2
    try:
        summary = pipeline.resume(resume) if resume is not None else pipeline.run()
    except CheckpointError as exc:
        print(f"baton: {exc}", file=sys.stderr)
        return 2
    except ActorFailed as exc:  # the cause and its fix in a few lines; the traceback in the run folder
        print(report_failure(exc, pipeline.run_dir), file=sys.stderr)
        _resume_hint(pipeline.run_dir)
        return 1
    except BaseException as exc:
        if not _interrupted(exc):
            raise
        print(f"baton: interrupted; the processes the run started are stopped (run folder {pipeline.run_dir})",
              file=sys.stderr)
        _resume_hint(pipeline.run_dir)
        return 130
    print(json.dumps(summary), flush=True)
    return 0


def _resume_hint(run_dir) -> None:
    """Say how to continue a run that stopped early, when its folder holds a checkpoint."""
    from pipeline.checkpoint import latest_checkpoint, read_state

    checkpoint = latest_checkpoint(run_dir) if run_dir is not None else None
    if checkpoint is not None:
        print(f"baton: {run_dir} holds a checkpoint of version {read_state(checkpoint).version}; "
              f"continue the run with: baton run --resume {run_dir}, or export its model with: "
              f"baton export {run_dir} OUT", file=sys.stderr)


SIGTERM_GRACE_S = 30.0  # a scheduler's usual grace before SIGKILL; a clean stop takes 2-9 s here
SIGTERM_REPEAT_S = 5.0  # then Ctrl-C again this often until the process is gone
_escalation: threading.Thread | None = None  # started by the first SIGTERM


def stop_on_sigterm() -> None:
    """`baton run`: a kill stops what the run started, as Ctrl-C does. SIGTERM takes Ctrl-C's path, so a
    process started with SIGINT ignored (a background job of a non-interactive shell, where the first
    kill then raised KeyboardInterrupt wherever it landed and the escalation's Ctrl-C went nowhere) gets
    Python's Ctrl-C handler back first; such a run now also stops on Ctrl-C at its terminal."""
    _take_ctrl_c_back()
    signal.signal(signal.SIGTERM, _on_sigterm)


def _take_ctrl_c_back() -> None:
    """Python's Ctrl-C handler where SIGINT was ignored at start (SIGTERM takes Ctrl-C's path)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _on_sigterm(signum: int, frame) -> None:
    """`baton run`'s SIGTERM handler: Ctrl-C's path now, and Ctrl-C again every `SIGTERM_REPEAT_S` from
    `SIGTERM_GRACE_S` on, should the orderly stop itself hang (seen once in a loaded benchmark: the
    interrupt's task cancellation never finished), so a kill always ends the run."""
    global _escalation
    if _escalation is None:
        _escalation = threading.Thread(target=_interrupt_again, name="sigterm-escalation", daemon=True)
        _escalation.start()
    _sigterm_as_ctrl_c(signum, frame)


def _interrupt_again() -> None:
    time.sleep(SIGTERM_GRACE_S)
    while True:
        print("baton: the run is still stopping after SIGTERM; interrupting again", file=sys.stderr)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(SIGTERM_REPEAT_S)


def _sigterm_as_ctrl_c(signum: int, frame) -> None:
    """SIGTERM takes Ctrl-C's path: the current SIGINT handler. While the run's event loop is up that is
    asyncio's runner, which cancels the run's main task so every stage unwinds and stops what it started.
    A KeyboardInterrupt raised from here instead lands wherever the main thread is, and where that is a
    weakref callback Python prints it and drops it: the run would go on."""
    handler = signal.getsignal(signal.SIGINT)
    if not callable(handler):
        raise KeyboardInterrupt
    handler(signal.SIGINT, frame)


def _interrupted(exc: BaseException) -> bool:
    """A KeyboardInterrupt (Ctrl-C, or SIGTERM in `baton run`), bare or in task groups' exception groups."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    return isinstance(exc, BaseExceptionGroup) and all(_interrupted(e) for e in exc.exceptions)


if __name__ == "__main__":
    sys.exit(main())
