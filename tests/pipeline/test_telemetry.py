"""Telemetry: run folders, atomic files, metrics round trip, reports, stderr-only logs, quiet progress."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import numpy as np
import pytest
import structlog

from pipeline.telemetry import (
    Panel,
    Progress,
    RunFolder,
    configure_logging,
    format_value,
    get_logger,
    render_report,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _reset_structlog():
    yield
    structlog.reset_defaults()


def test_run_folder_name_and_uniqueness(tmp_path: Path) -> None:
    folders = [RunFolder.create(tmp_path / "runs", "quick") for _ in range(3)]
    names = [f.path.name for f in folders]
    assert re.fullmatch(r"quick-\d{8}-\d{6}", names[0])
    assert len(set(names)) == 3
    assert all(f.path.is_dir() and f.path.parent == tmp_path / "runs" for f in folders)
    stamp = names[0]
    if names[1].startswith(stamp):
        assert names[1:] == [f"{stamp}-2", f"{stamp}-3"]


def test_run_folder_rejects_bad_names_and_escapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        RunFolder.create(tmp_path, "a/b")
    run = RunFolder.create(tmp_path, "x")
    with pytest.raises(ValueError, match="outside"):
        run.write_text("../evil.txt", "no")


def test_write_json_is_atomic_and_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Summary(msgspec.Struct):
        version: int

    run = RunFolder.create(tmp_path, "r")
    obj = {"a": 1, "nested": {"b": [1.5, None]}, "s": Summary(3), "p": Path("x/y"), "n": np.float32(0.5)}
    path = run.write_json("out/summary.json", obj)
    assert path == run.path / "out" / "summary.json"
    assert json.loads(path.read_text()) == {
        "a": 1,
        "nested": {"b": [1.5, None]},
        "s": {"version": 3},
        "p": "x/y",
        "n": 0.5,
    }

    def crash(*_args: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr("pipeline.telemetry.os.replace", crash)
    with pytest.raises(OSError):
        run.write_json("out/summary.json", {"a": 2})
    assert json.loads(path.read_text())["a"] == 1
    assert [p.name for p in path.parent.iterdir()] == ["summary.json"]


def test_write_text(tmp_path: Path) -> None:
    run = RunFolder.create(tmp_path, "r")
    run.write_text("notes.txt", "hello\n")
    run.write_text("notes.txt", "again\n")
    assert (run.path / "notes.txt").read_text() == "again\n"


def test_metrics_jsonl_round_trip(tmp_path: Path) -> None:
    run = RunFolder.create(tmp_path, "r")
    assert run.read_metrics() == []
    records = [{"version": i, "value": i / 3, "tag": "x"} for i in range(5)]
    for record in records:
        run.log_metrics(record)
        assert run.read_metrics()[-1] == record
    run.close()
    assert run.read_metrics() == records
    lines = (run.path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == records
    with open(run.path / "metrics.jsonl", "a") as f:
        f.write('{"version": 5, "val')
    assert RunFolder(run.path).read_metrics() == records


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 1000


def test_render_report_line_hist_bar(tmp_path: Path) -> None:
    records = [{"version": i, "t": i * 0.1, "a": i**0.5, "b": 1 - i / 10} for i in range(20)]
    records.append({"version": 20, "note": "a record without the plotted keys"})
    panels = [
        Panel("a and b", "line", x="version", y=["a", "b"]),
        Panel("a over time", "line", x="t", y=["a"]),
        Panel("distribution", "hist", values=list(np.random.default_rng(0).normal(size=500)), bins=20),
        Panel("b histogram", "hist", y=["b"]),
        Panel("last", "bar", y=["a", "b"]),
        Panel("per version", "bar", x="version", y=["a"]),
    ]
    out = tmp_path / "report" / "report.png"
    render_report(out, records, panels)
    _assert_png(out)
    assert list(out.parent.iterdir()) == [out]


@pytest.mark.parametrize(
    "records, panels",
    [
        ([], [Panel("empty", "line", x="version", y=["a"])]),
        ([{"other": 1}], [Panel("missing keys", "line", x="version", y=["a"]), Panel("h", "hist", y=["a"])]),
        ([], [Panel("no values", "hist", values=[])]),
        ([], []),
    ],
)
def test_render_report_never_fails_on_empty_data(
    tmp_path: Path, records: list[dict], panels: list[Panel]
) -> None:
    out = tmp_path / "empty.png"
    render_report(out, records, panels)
    _assert_png(out)


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_logging_goes_to_stderr_not_stdout(capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    configure_logging(fmt, level="info")
    log = get_logger("unit")
    log.info("hello", answer=42)
    log.debug("hidden")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "hello" in captured.err and "hidden" not in captured.err
    if fmt == "json":
        event = json.loads(captured.err.strip().splitlines()[-1])
        assert event["event"] == "hello" and event["answer"] == 42
        assert event["logger"] == "unit" and event["level"] == "info" and "timestamp" in event


def test_configure_logging_rejects_unknown_options() -> None:
    with pytest.raises(ValueError):
        configure_logging("console", level="loud")
    with pytest.raises(ValueError):
        configure_logging("xml")  # type: ignore[arg-type]


def test_format_value() -> None:
    assert [format_value(v) for v in (0.41, 1.2, 830.2, 12.345, 0.0, 3, "12/60", True)] == [
        "0.41",
        "1.2",
        "830",
        "12.3",
        "0",
        "3",
        "12/60",
        "True",
    ]
    assert format_value({"rollouts": "3/16", "train": "1/8"}) == "rollouts 3/16  train 1/8"


def test_progress_non_tty_prints_at_most_once_per_interval(capsys: pytest.CaptureFixture[str]) -> None:
    now = [0.0]
    with Progress("quickstart", interval_s=5.0, clock=lambda: now[0]) as progress:
        for step in range(100):
            now[0] = step * 0.5
            progress.update(version=f"{step}/100", reward=step / 7, channels={"items": "3/16"})
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 11
    assert lines[0] == "quickstart  version 0/100  reward 0  channels items 3/16"
    assert lines[1].startswith("quickstart  version 10/100  reward 1.43")
    assert lines[-1].startswith("quickstart  version 99/100")


def test_progress_fields_merge_and_disabled_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress("t", enabled=False) as progress:
        progress.update(a=1, b=2.5)
        progress.update(a=None, c="x")
        assert progress.line() == "t  b 2.5  c x"
    assert capsys.readouterr().err == ""


def test_growing_metrics_rotate_into_compressed_parts_and_read_back_whole(tmp_path, monkeypatch) -> None:
    import time as _time

    from pipeline import telemetry

    monkeypatch.setattr(telemetry, "ROTATE_BYTES", 2000)
    folder = RunFolder(tmp_path)
    for version in range(1, 201):
        folder.log_metrics({"version": version, "pad": "x" * 40})
        if version % 50 == 0:
            folder.append_record("generation.jsonl", {"version": version, "pad": "y" * 1000})
    deadline = _time.monotonic() + 10
    while list(tmp_path.glob("metrics-*.jsonl")) and _time.monotonic() < deadline:  # compressed in a thread
        _time.sleep(0.01)
    parts = telemetry.metric_parts(tmp_path)
    assert len(parts) >= 4 and all(p.name.endswith(".jsonl.gz") for p in parts)
    assert (tmp_path / "metrics.jsonl").stat().st_size <= 2000 + 100
    assert [r["version"] for r in folder.read_metrics()] == list(range(1, 201)), "every record, in order"
    assert folder.latest_metrics()["version"] == 200
    assert RunFolder(tmp_path).latest_metrics()["version"] == 200, "a new reader reads only the file's end"
    generation = sorted(tmp_path.glob("generation*.jsonl"))
    assert len(generation) >= 2 and sum(len(p.read_text().splitlines()) for p in generation) == 4


def test_latest_metrics_reads_only_the_end_of_a_long_file(tmp_path, monkeypatch) -> None:
    from pipeline import telemetry

    monkeypatch.setattr(telemetry, "TAIL_BYTES", 300)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for version in range(1, 1001):
            f.write(json.dumps({"version": version, "pad": "z" * 50}) + "\n")
    folder = RunFolder(tmp_path)
    assert folder.latest_metrics()["version"] == 1000
    assert folder._tail_offset > (tmp_path / "metrics.jsonl").stat().st_size - 300, "it skipped the history"
    folder.log_metrics({"version": 1001})
    assert folder.latest_metrics()["version"] == 1001
