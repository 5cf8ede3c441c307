"""Run events (pipeline.events): said when they happen, counted in the metrics and the summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from baton.builder import build_pipeline
from baton.config import validate
from baton.schema import RunConfig
from pipeline.events import EVENTS_FILE, EventCounts, report_event
from pipeline.telemetry import RunFolder, configure_logging


def test_an_event_is_a_warning_and_a_line_counted_incrementally(tmp_path: Path, capsys) -> None:
    configure_logging("console", "info")
    folder = RunFolder(tmp_path)
    counts = EventCounts(tmp_path)
    assert counts.update() == {}
    report_event(folder, "engine.restarted", engine="sglang-0", restart=1)
    report_event(tmp_path, "groups.regenerated", count=4, cause="EngineCrashed")
    assert "engine.restarted" in capsys.readouterr().err
    assert counts.update() == {"engine.restarted": 1, "groups.regenerated": 4}
    report_event(folder, "groups.regenerated", count=2)
    assert counts.update() == {"engine.restarted": 1, "groups.regenerated": 6}, "only new lines are added"
    lines = [json.loads(line) for line in (tmp_path / EVENTS_FILE).read_text().splitlines()]
    assert [e["kind"] for e in lines] == ["engine.restarted", "groups.regenerated", "groups.regenerated"]
    report_event(None, "checkpoint.skipped")  # no folder: the warning alone
    assert "checkpoint.skipped" in capsys.readouterr().err


@pytest.mark.slow
def test_a_crashed_engine_shows_in_the_metrics_and_the_summary(tmp_path: Path) -> None:
    cfg = validate(RunConfig, {
        "name": "events", "steps": 12, "run_root": str(tmp_path), "model": {"path": str(tmp_path / "model")},
        "telemetry": {"progress": False, "log_level": "warning"}, "checkpoint": {"every": 0},
        "learner": {"groups_per_step": 4}, "engine": {"batch_groups": 4}, "rollout": {"group_size": 4},
        "faults": [{"kind": "engine.crash", "at": [3]}],
    })
    summary = build_pipeline(cfg).run()
    regenerated = summary["events"]["groups.regenerated"]
    assert regenerated >= 1
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    counts = [r.get("events/groups.regenerated", 0) for r in records]
    assert counts == sorted(counts) and 0 < counts[-1] <= regenerated, "running counts, as they happened"
