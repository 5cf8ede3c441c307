"""Structured logs: the terminal (stderr) and, while a run is open, its run folder's `run.log`.

    configure_logging("console", "info")      # once per process (baton run, a Ray host)
    with run_log(run_dir):                    # the run's events also go to run_dir/run.log
        get_logger("checkpoint").info("checkpoint written", version=20)

Invariants:
- Nothing here writes to stdout (it is reserved for the caller's final JSON line).
- An event at the configured level or above goes to `run.log` of the open run, whole lines appended
  (O_APPEND, one write per line), so several processes may append and a reader never sees part of a line.
- On the terminal, routine events (`ROUTINE_EVENTS`: one per N versions, a checkpoint written, a model
  exported, where a process runs) are left out, unless the level is "debug"; every other event shows,
  warnings and errors always.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import structlog

__all__ = ["ROUTINE_EVENTS", "RUN_LOG_FILE", "attach_run_log", "configure_logging", "get_logger", "run_log"]

RUN_LOG_FILE = "run.log"
# the run log's only, but at "debug" (a Ray host placed and the addresses it serves on; a learner's rendezvous)
ROUTINE_EVENTS = frozenset({"checkpoint written", "model exported", "host placed", "rank rendezvous"})

_lock = threading.Lock()
_run_logs: list[int] = []  # file descriptors of the open runs' logs, the newest last (the one written)


def _append(line: str) -> None:
    with _lock:
        if _run_logs:
            os.write(_run_logs[-1], (line + "\n").encode())


class _Logger:
    """Writes a rendered event to the current `sys.stderr` (`terminal`) and the open run's log (`file`)."""

    def msg(self, terminal: str | None = None, file: str | None = None) -> None:
        if terminal is not None:
            print(terminal, file=sys.stderr, flush=True)
        if file is not None:
            _append(file)

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


def _logger_factory(*_args: Any) -> _Logger:
    return _Logger()


class _Route:
    """The last processor: renders an event for the terminal (colours on a tty) and for the run log (none),
    leaving a routine event off the terminal unless `show_routine`."""

    def __init__(self, fmt: str, show_routine: bool) -> None:
        self.show_routine = show_routine
        if fmt == "console":
            self.terminal = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
            self.file = structlog.dev.ConsoleRenderer(colors=False)
        else:
            self.terminal = self.file = structlog.processors.JSONRenderer()

    def __call__(self, logger: Any, method: str, event: dict[str, Any]) -> tuple[tuple, dict[str, str | None]]:
        routine = event.get("event") in ROUTINE_EVENTS and event.get("level") in ("debug", "info")
        file = self.file(logger, method, dict(event)) if _run_logs else None
        if routine and not self.show_routine:
            return (), {"terminal": None, "file": file}
        if file is not None and self.terminal is self.file:
            return (), {"terminal": file, "file": file}
        return (), {"terminal": self.terminal(logger, method, event), "file": file}


def configure_logging(fmt: Literal["console", "json"] = "console", level: str = "info") -> None:
    """Send structlog events at `level` or above to stderr and the open run's log (see the module
    docstring), timestamped, as console text or JSON lines; at "debug" routine events show on stderr too."""
    level_no = logging.getLevelNamesMapping().get(level.upper())
    if level_no is None:
        raise ValueError(f"unknown log level {level!r}")
    if fmt not in ("console", "json"):
        raise ValueError(f"unknown log format {fmt!r} (expected 'console' or 'json')")
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
        structlog.processors.StackInfoRenderer(),
    ]
    if fmt == "json":
        processors.append(structlog.processors.format_exc_info)
    processors.append(_Route(fmt, show_routine=level_no <= logging.DEBUG))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=_logger_factory,
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> Any:
    """A structlog logger whose events carry `logger=name`; follows later `configure_logging` calls."""
    return structlog.get_logger().bind(logger=name)


def attach_run_log(folder: Path | str) -> int:
    """From now on this process's events also go to `folder/run.log` (appended); returns its descriptor,
    for `detach_run_log`. A process that serves one run (a Ray host) attaches once and never detaches."""
    fd = os.open(Path(folder) / RUN_LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    with _lock:
        _run_logs.append(fd)
    return fd


def detach_run_log(fd: int) -> None:
    with _lock:
        if fd in _run_logs:
            _run_logs.remove(fd)
    os.close(fd)


@contextmanager
def run_log(folder: Path | str) -> Iterator[Path]:
    """Events also go to `folder/run.log` inside the block (two runs at once in one process: the newer's).
    A process whose logging nothing configured yet (a Python DSL run) gets `configure_logging`'s defaults
    first: structlog's own would print to stdout, and not to the run's log."""
    if not structlog.is_configured():
        configure_logging()
    fd = attach_run_log(folder)
    try:
        yield Path(folder) / RUN_LOG_FILE
    finally:
        detach_run_log(fd)
