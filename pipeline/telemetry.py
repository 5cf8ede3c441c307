"""Observability: a run folder, a one-line live status, the run's first lines (the structured logs:
`pipeline.logs`, re-exported here; the PNG report: `pipeline.report`).

Invariants:
- Nothing here writes to stdout (it is reserved for the caller's final JSON line): logs and the
  status line go to whatever `sys.stderr` is when they are written.
- `<run root>/latest` is a symlink to the newest run started (or resumed) under that root, replaced
  atomically (made beside it, then renamed over it), so it always names a whole run folder.
- A run folder is created fresh (never reused) and files in it are replaced atomically, so a reader
  sees either the old or the new content of a file, never a partial one. `metrics.jsonl` is append-
  only, one JSON object per line, flushed after each record.
- Files that grow cost the same per record whatever their size: appending is one write; reading the
  latest metric record reads the file's end only. Past `ROTATE_BYTES` (64 MiB) a JSONL file is
  rotated: `metrics.jsonl` becomes the part `metrics-00001.jsonl.gz` (gzip, compressed in a background
  thread) and a new `metrics.jsonl` starts; `read_metrics` reads the parts in order, then the current
  file. Files appended by several processes (`append_record`: generation.jsonl) rotate to plain
  `name-{ns}-{pid}.jsonl` parts (not compressed: a writer may still be finishing a line in the part).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import msgspec

from pipeline.logs import RUN_LOG_FILE, configure_logging, get_logger  # re-exported from here
from pipeline.report import Panel, render_report, sliding_rate  # the report's names, re-exported from here

__all__ = [
    "Panel",
    "Progress",
    "RunFolder",
    "announce_run",
    "configure_logging",
    "format_value",
    "report_failure",
    "get_logger",
    "render_report",
    "sliding_rate",
]

METRICS_FILE = "metrics.jsonl"
ROTATE_BYTES = 64 << 20  # a growing JSONL file is rotated past this size (see the module docstring)
TAIL_BYTES = 1 << 16  # `latest_metrics` reads at most this much of the file's end


def metric_parts(folder: Path) -> list[Path]:
    """The rotated parts of `folder`'s metrics.jsonl, oldest first (a part not yet compressed counts once)."""
    parts: dict[str, Path] = {}
    for path in folder.glob("metrics-[0-9]*.jsonl*"):
        stem = path.name.split(".", 1)[0]
        if path.name.endswith(".jsonl"):  # the plain part wins until its .gz is complete (then it is removed)
            parts[stem] = path
        elif path.name.endswith(".jsonl.gz"):
            parts.setdefault(stem, path)
    return [parts[stem] for stem in sorted(parts)]


def _compress(path: Path) -> None:
    """`path` -> `path`.gz (written whole, then renamed), then `path` removed."""
    tmp = path.with_name(path.name + ".gz.tmp")
    with open(path, "rb") as src, gzip.open(tmp, "wb", compresslevel=1) as dst:
        shutil.copyfileobj(src, dst)
    os.replace(tmp, path.with_name(path.name + ".gz"))
    path.unlink()


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, msgspec.Struct):
        return msgspec.to_builtins(obj)
    if isinstance(obj, Path):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if callable(getattr(obj, "tolist", None)):
        return obj.tolist()
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _json_dumps(obj: Any, **kwargs: Any) -> str:
    return json.dumps(obj, default=_jsonable, **kwargs)


# ----------------------------------------------------------------------------------------- run folder


def _atomic_write(path: Path, data: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class RunFolder:
    """One run's output folder: atomic text/JSON files and an append-only `metrics.jsonl`."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._metrics: IO[str] | None = None
        self._tail_offset = 0
        self._latest: dict[str, Any] | None = None

    @classmethod
    def create(cls, root: Path | str, name: str) -> RunFolder:
        """Make a new folder `root/<name>-<YYYYmmdd-HHMMSS>` (suffixed `-2`, `-3`, ... if taken)."""
        if not name or "/" in name or "\\" in name or name in {".", ".."}:
            raise ValueError(f"run name {name!r} must be non-empty and contain no path separator")
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        base = f"{name}-{datetime.now():%Y%m%d-%H%M%S}"
        for n in range(1, 10_000):
            path = root / (base if n == 1 else f"{base}-{n}")
            try:
                path.mkdir()
            except FileExistsError:
                continue
            return cls(path)
        raise RuntimeError(f"could not find a free run folder name for {base!r} in {root}")

    def _resolve(self, rel: str | Path) -> Path:
        path = (self.path / rel).resolve()
        if not path.is_relative_to(self.path.resolve()):
            raise ValueError(f"{rel!s} is outside the run folder {self.path}")
        return path

    def write_text(self, rel: str | Path, text: str) -> Path:
        """Atomically write `text` to `rel` inside the folder; returns the file's path."""
        path = self._resolve(rel)
        _atomic_write(path, text)
        return path

    def write_json(self, rel: str | Path, obj: Any) -> Path:
        """Atomically write `obj` as indented JSON (msgspec structs, paths and numpy values allowed)."""
        return self.write_text(rel, _json_dumps(obj, indent=2) + "\n")

    def log_metrics(self, record: Mapping[str, Any]) -> None:
        """Append `record` as one JSON line to `metrics.jsonl` and flush it."""
        if self._metrics is None:
            self._metrics = open(self.path / METRICS_FILE, "a", encoding="utf-8")
        self._metrics.write(_json_dumps(record) + "\n")
        self._metrics.flush()
        if self._metrics.tell() > ROTATE_BYTES:
            self._metrics.close()
            self._metrics = None
            part = self.path / f"metrics-{len(metric_parts(self.path)) + 1:05d}.jsonl"
            os.replace(self.path / METRICS_FILE, part)
            self._tail_offset = 0
            threading.Thread(target=_compress, args=(part,), name="compress-metrics", daemon=True).start()

    def append_record(self, rel: str | Path, record: Mapping[str, Any]) -> None:
        """Append `record` as one JSON line to the JSONL file `rel` (opened, written and closed each time:
        one short line per call, written with O_APPEND, so several processes may append to one file)."""
        path = self._resolve(rel)
        with open(path, "a", encoding="utf-8") as f:
            f.write(_json_dumps(record) + "\n")
            rotate = f.tell() > ROTATE_BYTES
        if rotate:
            try:
                os.replace(path, path.with_name(f"{path.stem}-{time.time_ns()}-{os.getpid()}{path.suffix}"))
            except FileNotFoundError:  # another process rotated it first
                pass

    def latest_metrics(self) -> dict[str, Any] | None:
        """The last complete record of metrics.jsonl (reads what was appended since the last call, and
        at most the file's last `TAIL_BYTES`: cheap to poll, even from a new RunFolder on a long run's
        file; it sees records other processes append to the same file)."""
        path = self.path / METRICS_FILE
        if not path.exists():
            return None
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < self._tail_offset:  # rotated: a new file
                self._tail_offset = 0
            start = max(self._tail_offset, size - TAIL_BYTES)
            f.seek(start)
            data = f.read()
        if start > self._tail_offset:  # skipped ahead: the first line may be a part of one
            cut = data.find(b"\n") + 1
            data, self._tail_offset = data[cut:], start + cut
        end = data.rfind(b"\n")
        if end >= 0:
            lines = data[: end + 1].splitlines()
            self._tail_offset += end + 1
            for line in reversed(lines):
                try:
                    self._latest = json.loads(line)
                    break
                except ValueError:
                    continue
        return self._latest

    def read_metrics(self) -> list[dict[str, Any]]:
        """All metric records, in order: the rotated parts', then `metrics.jsonl`'s; a torn last line
        (crash mid-write) is ignored."""
        records = []
        for part in metric_parts(self.path):
            opener = gzip.open if part.suffix == ".gz" else open
            with opener(part, "rt", encoding="utf-8") as f:
                records.extend(json.loads(line) for line in f if line.strip())
        path = self.path / METRICS_FILE
        if not path.exists():
            return records
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    break
                raise
        return records

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"


LATEST_LINK = "latest"


def link_latest(run_dir: Path) -> Path | None:
    """Point `run_dir`'s parent's `latest` at `run_dir` (a relative symlink, replaced atomically); returns
    the link, or None where this platform or file system makes no symlink, or `latest` is not one."""
    link = run_dir.parent / LATEST_LINK
    if link.exists() and not link.is_symlink():
        return None  # a folder or file of the user's own: left alone
    tmp = run_dir.parent / f".{LATEST_LINK}.{uuid.uuid4().hex}"
    try:
        os.symlink(run_dir.name, tmp, target_is_directory=True)
        os.replace(tmp, link)
    except (OSError, NotImplementedError):
        tmp.unlink(missing_ok=True)
        return None
    return link


def announce_run(run_dir: Path) -> None:
    """The run's first lines on stderr: its folder, how to follow it, where its log is; and `latest` set."""
    latest = link_latest(run_dir)
    print(f"baton: run folder {run_dir}" + (f" (also {latest})" if latest else ""), file=sys.stderr, flush=True)
    print(f"baton: follow it with: baton watch {run_dir}  (its log: {run_dir / RUN_LOG_FILE})", file=sys.stderr,
          flush=True)


# -------------------------------------------------------------------------------------------- failure

FAILURE_FILE = "failure.log"


def root_cause(exc: BaseException) -> BaseException:
    """The error a failure started from: down the `__cause__` chain and into exception groups of one."""
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        elif exc.__cause__ is not None:
            exc = exc.__cause__
        else:
            break
    return exc


def report_failure(exc: BaseException, folder: Path | str | None, *, exit_code: int = 1,
                   with_locals: bool | None = None) -> str:
    """A failed run, said in a few lines: the named cause (its message says what to change), where it
    happened (`actor`/`phase` of the error, when it has them), the exit code, and the file that holds the
    full traceback: `failure.log` in the run folder (written here; the same short message first). Local
    variables go into the traceback only when asked (`with_locals`, or BATON_TRACEBACK_LOCALS=1)."""
    import traceback

    cause = root_cause(exc)
    lines = [f"baton: the run failed: {type(cause).__name__}: {cause}"]
    actor, phase = getattr(exc, "actor", None), getattr(exc, "phase", None)
    if actor is not None:
        lines.append(f"  in actor {actor!r}" + (f", during {phase}()" if phase else ""))
    if with_locals is None:
        with_locals = os.environ.get("BATON_TRACEBACK_LOCALS", "") not in ("", "0")
    if folder is not None:
        trace = traceback.TracebackException.from_exception(exc, capture_locals=with_locals)
        path = Path(folder) / FAILURE_FILE
        lines.append(f"  full traceback: {path}")
        lines.append(f"  exit code {exit_code}")
        _atomic_write(path, "\n".join(lines) + "\n\n" + "".join(trace.format()))
    else:
        lines.append(f"  exit code {exit_code}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- progress


def format_value(value: Any) -> str:
    """Compact text for a status field: floats to ~3 significant digits, mappings as `k v k v`."""
    if isinstance(value, Mapping):
        return "  ".join(f"{k} {format_value(v)}" for k, v in value.items())
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


class Progress:
    """A one-line status on stderr: live (rich) on a terminal, else a plain line at most every
    `interval_s` seconds (plus the last state on exit if it was not printed). Disabled: prints nothing.

    `update(**fields)` merges into the current fields (in first-seen order; a value of None removes
    the field) and renders `title  key value  key value ...`.
    """

    def __init__(
        self,
        title: str,
        enabled: bool = True,
        *,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.title = title
        self.enabled = enabled
        self.interval_s = interval_s
        self._clock = clock
        self._fields: dict[str, Any] = {}
        self._live: Any = None
        self._last_print: float | None = None
        self._printed_current = True

    def line(self) -> str:
        parts = [self.title, *(f"{k} {format_value(v)}" for k, v in self._fields.items())]
        return "  ".join(parts)

    def __enter__(self) -> Progress:
        if self.enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.live import Live
            from rich.text import Text

            self._live = Live(
                Text(self.line()), console=Console(file=sys.stderr), refresh_per_second=4, transient=False
            )
            self._live.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        elif self.enabled and not self._printed_current:
            self._print()

    def update(self, **fields: Any) -> None:
        for key, value in fields.items():
            if value is None:
                self._fields.pop(key, None)
            else:
                self._fields[key] = value
        if not self.enabled:
            return
        if self._live is not None:
            from rich.text import Text

            self._live.update(Text(self.line()))
            return
        self._printed_current = False
        now = self._clock()
        if self._last_print is None or now - self._last_print >= self.interval_s:
            self._print(now)

    def _print(self, now: float | None = None) -> None:
        print(self.line(), file=sys.stderr, flush=True)
        self._last_print = self._clock() if now is None else now
        self._printed_current = True
