"""The README's two commands and its Python quickstart are what the project really does, and it stays a
README: everything else lives in docs/ (tests/docs checks the site and the README's links into it)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_commands_are_what_ci_runs() -> None:
    commands = re.search(r"```bash\n(.*?)```", README, re.S).group(1).splitlines()
    install_and_run, tests = (c.split("#")[0].strip() for c in commands[:2])
    ci = (ROOT / ".ci" / "run").read_text()
    assert install_and_run in ci and "baton run configs/quickstart.toml" in install_and_run
    assert tests in ci and "pytest" in tests


def test_readme_stays_short() -> None:
    assert len(README.splitlines()) <= 250, "the README is the front page; move detail into docs/"


@pytest.mark.slow
def test_readme_python_quickstart_runs(tmp_path: Path, monkeypatch) -> None:
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    assert len(code.strip().splitlines()) <= 25, "the quickstart must stay on one screen"
    short = code.replace("steps=500", "steps=3, progress=False")
    assert short != code
    script = tmp_path / "quickstart.py"
    script.write_text(short)
    monkeypatch.chdir(tmp_path)  # runs/ and the model folder land in tmp_path
    scope = runpy.run_path(str(script))
    summary = scope["summary"]
    assert summary["version"] == 3
    assert summary["samples"]["trained"] == 3 * 16 * 8
    assert summary["ledger_balanced"]
    assert (tmp_path / "runs" / "models" / "tiny-qwen2" / "config.json").exists()
