"""The run-folder files the stages write, and their readers: the one place both halves meet on disk.

The producer writes them; the learner's report, `baton simulate --calibrate` and `baton watch` read
them. Neither half imports the other for a file name: both import this module, which imports nothing
of theirs. Each file is JSON lines, one record appended per event; a reader skips a torn last line
(the writer may be mid-append).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERATION_FILE = "generation.jsonl"  # one line per recorded batch of groups (stages.rollout.worker)
EVAL_FILE = "eval.jsonl"  # one line per evaluation (stages.rollout.evaluation)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every complete record of a JSON-lines file, oldest first (empty when the file does not exist)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:  # a torn last line
            continue
    return records


def read_evaluations(run_dir: str | Path | None) -> list[dict[str, Any]]:
    """The run folder's evaluations, oldest first (empty when the run evaluated nothing)."""
    return read_jsonl(Path(run_dir) / EVAL_FILE) if run_dir is not None else []


def read_generation(run_dir: str | Path | None) -> list[dict[str, Any]]:
    """The run folder's generation log (one record per batch of groups a rollout worker recorded)."""
    return read_jsonl(Path(run_dir) / GENERATION_FILE) if run_dir is not None else []
