"""`baton watch RUN_DIR` follows a run from its folder: progress while it runs, the summary once it ended
(exit 0), the short failure message if it failed (exit 1)."""

from __future__ import annotations

import argparse
import io
import json
import threading
import time
from pathlib import Path

import pytest

from baton import watch_command
from baton.builder import build_pipeline
from baton.config import validate
from baton.schema import RunConfig
from baton.watch_command import watch
from pipeline.telemetry import FAILURE_FILE, report_failure


class Lines(io.StringIO):
    """Output that remembers, per line, whether the run had ended when it was printed."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__()
        self.run_dir = run_dir
        self.while_running: list[str] = []

    def write(self, text: str) -> int:
        if not (self.run_dir / "summary.json").exists():
            self.while_running += text.splitlines()
        return super().write(text)


def _finished_folder(tmp_path: Path) -> Path:
    run_dir = tmp_path / "quickstart-20260101-000000"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text('name = "quickstart"\nsteps = 3\n')
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"version": v, "t": v * 1.5, "reward": v / 10, "staleness_mean": 1.0, "samples_per_s": 100.0,
                    "eval/accuracy": 0.5}) + "\n" for v in (1, 2, 3)))
    (run_dir / "summary.json").write_text(json.dumps({
        "run_dir": str(run_dir), "version": 3, "reward_start": 0.1, "reward_end": 0.3, "wall_s": 5.0,
        "samples": {"trained": 96, "dropped": 0}, "ledger_balanced": True}))
    return run_dir


def test_watch_a_finished_run_prints_its_last_metrics_and_summary(tmp_path: Path) -> None:
    run_dir = _finished_folder(tmp_path)
    out = io.StringIO()
    assert watch(run_dir, out=out, sleep=lambda s: None) == 0
    lines = out.getvalue().splitlines()
    assert lines[0] == f"watching {run_dir} (3 steps)"
    assert lines[1] == "t 4.5 s  version 3/3  reward 0.3  staleness_mean 1  samples_per_s 100  eval/accuracy 0.5"
    assert lines[2].startswith("finished: version 3  reward_start 0.1  reward_end 0.3  samples trained 96  dropped 0")
    assert lines[3] == f"summary: {run_dir}/summary.json"


def test_watch_a_failed_run_prints_the_short_failure_and_exits_1(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    try:
        raise ValueError("the cause, and what to change")
    except ValueError as exc:
        message = report_failure(exc, run_dir)
    out = io.StringIO()
    assert watch(run_dir, out=out, sleep=lambda s: None) == 1
    assert out.getvalue().splitlines()[1:] == message.splitlines()
    assert "Traceback" in (run_dir / FAILURE_FILE).read_text() and "Traceback" not in out.getvalue()


def test_the_summary_says_per_fate_why_samples_were_not_trained_the_most_first() -> None:
    reasons = {f"episode failed: environment step raised KeyError: {i}": 20 - i for i in range(10)}
    lines = watch_command.summary_lines({"run_dir": "r", "version": 3, "samples": {"dropped": 155, "lost": 1},
                                         "reasons": {"dropped": reasons, "lost": {"CorruptPayload: bad": 1}}})
    assert lines[1] == "dropped 155 by reason: " + "; ".join(
        f"{20 - i} episode failed: environment step raised KeyError: {i}" for i in range(8)) + "; and 2 more reasons"
    assert lines[2] == "lost 1 by reason: 1 CorruptPayload: bad"
    assert lines[3] == "summary: r/summary.json"


def test_watch_cli_entry_refuses_a_missing_folder(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    watch_command.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["watch", str(tmp_path / "nope"), "--interval", "0.1"])
    assert args.interval == 0.1 and watch_command.run(args) == 2


@pytest.mark.slow
def test_watch_a_running_run_follows_it_to_its_summary(tmp_path: Path) -> None:
    cfg = validate(RunConfig, {
        "name": "watched", "steps": 40, "run_root": str(tmp_path), "model": {"path": str(tmp_path / "model")},
        "telemetry": {"progress": False, "log_level": "warning"},
        "learner": {"groups_per_step": 2}, "engine": {"batch_groups": 2}, "rollout": {"group_size": 4},
    })
    pipe = build_pipeline(cfg)
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(pipe.run()))
    runner.start()
    try:
        while pipe.run_dir is None and runner.is_alive():
            time.sleep(0.01)
        out = Lines(pipe.run_dir)
        code = watch(pipe.run_dir, interval_s=0.05, out=out)
    finally:
        runner.join()
    assert code == 0
    progress = [line for line in out.while_running if "version" in line]
    assert progress, out.getvalue()  # seen while the run went on
    versions = [int(line.split("version ")[1].split("/")[0]) for line in progress]
    assert versions == sorted(versions) and all(line.split("version ")[1].startswith(f"{v}/40") for v, line in
                                                zip(versions, progress, strict=True))
    lines = out.getvalue().splitlines()
    assert "version 40/40" in lines[-3] and lines[-2].startswith("finished: version 40")
    assert lines[-1] == f"summary: {result['run_dir']}/summary.json"
