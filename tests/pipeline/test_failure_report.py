"""A failure reads as one: the named cause, the fix its message gives, where, the exit code, in a few
lines; the full traceback in failure.log in the run folder, locals only when asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.actor import ActorFailed
from pipeline.telemetry import FAILURE_FILE, report_failure, root_cause
from policies.selection import NoSignalError

FIX = "every group's rewards were equal for 3 batches: raise the temperature or set drop_zero_signal = false"


def _failed_run() -> ActorFailed:
    def learner_step() -> None:
        secret_local = "a-local-value-7f3a"  # noqa: F841 - must not reach the log unless asked
        raise NoSignalError(FIX)

    try:
        try:
            learner_step()
        except NoSignalError as err:  # as the runtime does: a task group around the actor
            raise ActorFailed("learner", "run", ExceptionGroup("tasks", [err])) from ExceptionGroup("tasks", [err])
    except ActorFailed as failed:
        return failed
    raise AssertionError("unreachable")


def test_root_cause_goes_through_causes_and_groups_of_one() -> None:
    assert isinstance(root_cause(_failed_run()), NoSignalError)
    plain = ValueError("x")
    assert root_cause(plain) is plain


def test_a_named_failure_prints_cause_fix_and_exit_code_and_logs_the_traceback(tmp_path: Path) -> None:
    message = report_failure(_failed_run(), tmp_path)
    lines = message.splitlines()
    assert len(lines) <= 5
    assert lines[0] == f"baton: the run failed: NoSignalError: {FIX}"
    assert "in actor 'learner', during run()" in message
    assert f"full traceback: {tmp_path / FAILURE_FILE}" in message and lines[-1] == "  exit code 1"
    log = (tmp_path / FAILURE_FILE).read_text()
    assert log.startswith(message + "\n")
    assert "Traceback (most recent call last)" in log and "in learner_step" in log and "NoSignalError" in log
    assert "a-local-value-7f3a" not in log


@pytest.mark.parametrize("asked", ["argument", "environment"])
def test_locals_go_to_the_log_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asked: str) -> None:
    if asked == "environment":
        monkeypatch.setenv("BATON_TRACEBACK_LOCALS", "1")
    report_failure(_failed_run(), tmp_path, exit_code=3, with_locals=True if asked == "argument" else None)
    assert "a-local-value-7f3a" in (tmp_path / FAILURE_FILE).read_text()


def test_without_a_run_folder_there_is_no_log_to_name() -> None:
    message = report_failure(ValueError("bad"), None, exit_code=2)
    assert message.splitlines() == ["baton: the run failed: ValueError: bad", "  exit code 2"]
