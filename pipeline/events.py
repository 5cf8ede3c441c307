"""Run events: what went wrong and was handled, said when it happens.

An engine restarted, groups generated again, a payload lost, a weight version refused or an engine
unreachable, a checkpoint skipped: each is a warning in the log at once and one line of the run
folder's `events.jsonl` (appended with O_APPEND, so any process of the run may report). The learner
puts the running counts into every metrics record (`events/<kind>`), and the summary holds the totals
(`events`), so a stall that had a cause shows it in the console, the metrics and the report alike.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

from pipeline.sinks import JsonlTail
from pipeline.telemetry import RunFolder, get_logger

EVENTS_FILE = "events.jsonl"


def report_event(folder: RunFolder | Path | str | None, kind: str, count: int = 1, **fields: Any) -> None:
    """Log `kind` as a warning and, given the run folder, append it to `events.jsonl`."""
    get_logger("events").warning(kind, count=count, **fields)
    if folder is None:
        return
    folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
    folder.append_record(EVENTS_FILE, {"t": round(time.time(), 3), "kind": kind, "count": count, **fields})


class EventCounts:
    """The running count of each event kind in a run folder, read incrementally (new lines only)."""

    def __init__(self, run_dir: Path | str) -> None:
        self._tail = JsonlTail(Path(run_dir) / EVENTS_FILE)
        self.counts: Counter[str] = Counter()

    def update(self) -> dict[str, int]:
        for event in self._tail.read():
            self.counts[event["kind"]] += int(event.get("count", 1))
        return dict(self.counts)


__all__ = ["EVENTS_FILE", "EventCounts", "report_event"]
