"""Where a long-running host process's memory goes: an opt-in report (`watch_memory`).

With `BATON_TRACEMALLOC=PATH` set (in the environment the run starts from), each Ray stage host named
in `BATON_TRACEMALLOC_HOSTS` (default `consumer-0`, the learner; `*` for all) starts a daemon thread
that waits `BATON_TRACEMALLOC_WARMUP_S` (default 90) seconds, past the allocators' warm-up, then every
`BATON_TRACEMALLOC_EVERY_S` (default 30) seconds, and once more when the host stops, appends one JSON
line to `PATH.<host>.jsonl`:

* `rss_mb` and `smaps_mb`: the process's resident memory as /proc/self/smaps_rollup splits it
  (anonymous: heaps and private mappings; file and shmem: mapped files, Ray's plasma, segments);
* `heap_mb`: glibc's heap as `mallinfo2` counts it over every arena: bytes `in_use`, bytes `free` but
  still held (fragmentation, handed back only by `malloc_trim`), `mmapped` large chunks;
* `traced_mb`: what Python allocated, as tracemalloc traces it (started after the warm-up, with
  `BATON_TRACEMALLOC_FRAMES` frames, default 6; 0 leaves tracemalloc off), and `grown`: the
  allocation sites (tracebacks) that grew most since the warm-up;
* `since_warmup_mb`: the growth of each of these since the first record.

Reading it: growth that `traced_mb` shows is Python objects (see `grown` for their holder); growth of
`heap_mb.in_use` beyond it is native (Ray's core worker, Mooncake, torch); growth of `heap_mb.free` is
fragmentation. Without the variable nothing is started: the hook costs one environment lookup.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "BATON_TRACEMALLOC"
MB = 1e6


@dataclass(frozen=True)
class MemorySettings:
    path: str  # each host writes PATH.<host>.jsonl
    hosts: tuple[str, ...] = ("consumer-0",)  # "*": every host
    warmup_s: float = 90.0
    every_s: float = 30.0
    frames: int = 6  # traceback depth of an allocation site; 0: tracemalloc stays off
    top: int = 15  # allocation sites per record

    @classmethod
    def from_env(cls, env: Any = os.environ) -> MemorySettings | None:
        """The settings `BATON_TRACEMALLOC*` give; None when `BATON_TRACEMALLOC` is unset or empty."""
        path = env.get(ENV)
        if not path:
            return None
        return cls(
            path=path,
            hosts=tuple(h.strip() for h in env.get(f"{ENV}_HOSTS", "consumer-0").split(",") if h.strip()),
            warmup_s=float(env.get(f"{ENV}_WARMUP_S", 90.0)),
            every_s=float(env.get(f"{ENV}_EVERY_S", 30.0)),
            frames=int(env.get(f"{ENV}_FRAMES", 6)),
        )

    def watches(self, host: str) -> bool:
        return "*" in self.hosts or host in self.hosts

    def env(self) -> dict[str, str]:
        """These settings as the environment variables that give them (for a Ray worker's runtime_env)."""
        return {ENV: self.path, f"{ENV}_HOSTS": ",".join(self.hosts), f"{ENV}_WARMUP_S": str(self.warmup_s),
                f"{ENV}_EVERY_S": str(self.every_s), f"{ENV}_FRAMES": str(self.frames)}


def watch_memory(host: str, env: Any = os.environ) -> MemoryReport | None:
    """A started `MemoryReport` for `host` when the environment asks for one, else None."""
    settings = MemorySettings.from_env(env)
    if settings is None or not settings.watches(host):
        return None
    report = MemoryReport(settings, host)
    report.start()
    return report


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
    )]


def heap_mb() -> dict[str, float]:
    """glibc's heap over every arena (`mallinfo2`): in use, free but held, mmapped; {} off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return {}
    info = libc.mallinfo2()
    return {"in_use": round(info.uordblks / MB, 2), "free": round(info.fordblks / MB, 2),
            "mmapped": round(info.hblkhd / MB, 2)}


def smaps_mb() -> dict[str, float]:
    """/proc/self/smaps_rollup's resident split (Rss, Anonymous, Shared_*, Private_*), in MB."""
    fields = {}
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
            name, _, rest = line.partition(":")
            if name in ("Rss", "Anonymous", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty"):
                fields[name] = round(int(rest.split()[0]) * 1024 / MB, 2)
    except (OSError, ValueError, IndexError):
        pass
    return fields


class MemoryReport:
    """The thread that writes `PATH.<host>.jsonl` (see the module docstring). Records are appended whole,
    one line each; `close()` writes the last one and stops tracemalloc if this report started it."""

    def __init__(self, settings: MemorySettings, host: str) -> None:
        self.settings, self.host = settings, host
        self.path = Path(f"{settings.path}.{host}.jsonl")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._baseline: tracemalloc.Snapshot | None = None
        self._first: dict[str, float] | None = None
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name=f"memory-report-{host}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        if self._stop.wait(self.settings.warmup_s):
            return
        self.write()
        while not self._stop.wait(self.settings.every_s):
            self.write()

    def close(self) -> None:
        """Stop the thread; write a last record if the warm-up was over."""
        self._stop.set()
        if self._first is not None:
            self.write()
        if self._baseline is not None and tracemalloc.is_tracing():
            tracemalloc.stop()

    def write(self) -> dict[str, Any]:
        """Append one record (the first one, after the warm-up, also starts tracemalloc); returns it."""
        with self._lock:
            if self._first is None and self.settings.frames and not tracemalloc.is_tracing():
                tracemalloc.start(self.settings.frames)
                self._baseline = self._snapshot()
            record = self._record()
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            return record

    def _record(self) -> dict[str, Any]:
        smaps, heap = smaps_mb(), heap_mb()
        traced = tracemalloc.get_traced_memory()[0] / MB if tracemalloc.is_tracing() else 0.0
        now = {"rss": smaps.get("Rss", 0.0), "anonymous": smaps.get("Anonymous", 0.0),
               "heap_in_use": heap.get("in_use", 0.0), "heap_free": heap.get("free", 0.0), "traced": traced}
        if self._first is None:
            self._first = now
        return {
            "host": self.host, "pid": os.getpid(), "t": round(time.monotonic() - self._t0, 1),
            "rss_mb": now["rss"], "smaps_mb": smaps, "heap_mb": heap, "traced_mb": round(traced, 2),
            "tracemalloc_own_mb": round(tracemalloc.get_tracemalloc_memory() / MB, 2),
            "since_warmup_mb": {k: round(v - self._first[k], 2) for k, v in now.items()},
            "grown": self._grown(),
        }

    def _snapshot(self) -> tracemalloc.Snapshot:
        return tracemalloc.take_snapshot().filter_traces((
            tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, __file__),
        ))

    def _grown(self) -> list[dict[str, Any]]:
        """The allocation sites that grew most since the warm-up's snapshot, by traceback."""
        if self._baseline is None or not tracemalloc.is_tracing():
            return []
        diffs = self._snapshot().compare_to(self._baseline, "traceback")
        diffs.sort(key=lambda d: d.size_diff, reverse=True)
        return [
            {"kb": round(d.size_diff / 1e3, 1), "count": d.count_diff, "kb_now": round(d.size / 1e3, 1),
             "at": [f"{'/'.join(Path(f.filename).parts[-3:])}:{f.lineno}" for f in d.traceback]}
            for d in diffs[: self.settings.top] if d.size_diff > 0
        ]


__all__ = ["MemoryReport", "MemorySettings", "heap_mb", "smaps_mb", "watch_memory"]
