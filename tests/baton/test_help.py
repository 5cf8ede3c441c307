"""`baton --help` shows the synopsis of every command and the exit codes, each command's --help its own
exit codes, `baton --version` the version; and a command interrupted by Ctrl-C or SIGTERM exits 130,
as the help says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import baton
from baton import cli
from tests import ROOT

COMMANDS = ("run", "check", "faults", "simulate", "watch", "ledger", "export", "mooncake-master")


def help_text(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*args, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_the_help_shows_the_synopsis_and_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    out = help_text(capsys)
    for line in ("baton run CONFIG [--set key=value ...]", "baton run --resume RUN_DIR", "baton check CONFIG",
                 "baton simulate CONFIG", "baton faults CONFIG", "baton watch RUN_DIR", "baton ledger RUN_DIR",
                 "baton export RUN_DIR OUT",
                 "baton mooncake-master", "baton --version"):
        assert line in out, line
    codes = out[out.index("exit codes"):]
    for line in ("0   done", "1   the run failed", "2   bad config or usage", "130 interrupted by Ctrl-C or SIGTERM"):
        assert line in codes, codes


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_lists_its_exit_codes(capsys: pytest.CaptureFixture[str], command: str) -> None:
    out = help_text(capsys, command)
    codes = out[out.index("exit codes:"):].splitlines()[1:]
    assert [line.split()[0] for line in codes][:1] == ["0"], out
    assert any(line.split()[0] == "2" for line in codes), out
    interrupted = [line for line in codes if line.split()[0] == "130"]
    if command == "mooncake-master":  # Ctrl-C is how it is stopped
        assert not interrupted and "0   stopped by Ctrl-C or SIGTERM" in out
    else:
        assert interrupted and "Ctrl-C or SIGTERM" in interrupted[0], out


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"baton {baton.__version__}\n"


def test_the_version_is_written_in_one_place() -> None:
    """pyproject.toml reads the package's version from `baton.__version__` and writes none of its own, so
    the distribution, `baton --version` and the docs (tests/docs/test_version.py) cannot disagree."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "baton.__version__"}
    assert cli.version() == baton.__version__


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_command_exits_130(tmp_path: Path, sig: signal.Signals) -> None:
    """`baton watch` on a folder that never ends, stopped by Ctrl-C or by a kill."""
    proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "watch", str(tmp_path), "--interval", "0.1"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("watching")
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 130, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
