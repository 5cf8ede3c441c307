"""A run's terminal and its run.log: routine events (a checkpoint written) go to the run's log only, unless the
level is "debug"; every other event to both; nothing reaches run.log outside its run. And `<run root>/latest`:
re-pointed atomically at each newer run, a `latest` of the user's own left alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog

from pipeline.logs import configure_logging, get_logger, run_log
from pipeline.telemetry import announce_run, link_latest


@pytest.fixture(autouse=True)
def _default_logging():
    yield
    configure_logging("console", "info")


def test_a_run_in_a_process_that_configured_no_logging_logs_to_stderr_and_its_run_log(tmp_path: Path, capsys) -> None:
    structlog.reset_defaults()  # as a fresh Python DSL process: structlog's own defaults print to stdout
    with run_log(tmp_path):
        get_logger("pipeline").info("run starting")
    captured = capsys.readouterr()
    assert "run starting" in captured.err and captured.out == ""
    assert "run starting" in (tmp_path / "run.log").read_text()


def log_a_run(folder: Path) -> None:
    log = get_logger("checkpoint")
    log.info("before the run")
    with run_log(folder):
        log.info("checkpoint written", version=20)
        log.info("resuming", version=20)
        log.warning("checkpoint written", version=21)  # a routine event's warning is no routine
    log.info("after the run")


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_routine_events_go_to_the_run_log_only_unless_debug(tmp_path: Path, capsys, fmt: str) -> None:
    configure_logging(fmt, "info")
    log_a_run(tmp_path)
    terminal, logged = capsys.readouterr().err, (tmp_path / "run.log").read_text()
    shown = [line for line in terminal.splitlines() if "checkpoint written" in line]
    assert len(shown) == 1 and "warning" in shown[0] and "21" in shown[0]
    assert "resuming" in terminal and "after the run" in terminal
    assert logged.count("checkpoint written") == 2 and "resuming" in logged
    assert "before the run" not in logged and "after the run" not in logged
    assert "\x1b[" not in logged, "the log file has no colour codes"
    if fmt == "json":
        assert [json.loads(line)["event"] for line in logged.splitlines()] == [
            "checkpoint written", "resuming", "checkpoint written"]

    configure_logging(fmt, "debug")
    log_a_run(tmp_path / "..")
    assert capsys.readouterr().err.count("checkpoint written") == 2


def test_latest_points_at_the_newest_run_and_leaves_a_users_own_alone(tmp_path: Path, capsys) -> None:
    first, second = tmp_path / "run-1", tmp_path / "run-2"
    first.mkdir(), second.mkdir()
    announce_run(first)
    assert (tmp_path / "latest").resolve() == first.resolve()
    assert capsys.readouterr().err.splitlines()[:2] == [
        f"baton: run folder {first} (also {tmp_path / 'latest'})",
        f"baton: follow it with: baton watch {first}  (its log: {first / 'run.log'})"]
    assert link_latest(second) == tmp_path / "latest" and (tmp_path / "latest").resolve() == second.resolve()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no temporary link is left"

    own = tmp_path / "own"
    (own / "latest").mkdir(parents=True)
    (own / "run").mkdir()
    assert link_latest(own / "run") is None and (own / "latest").is_dir() and not (own / "latest").is_symlink()
