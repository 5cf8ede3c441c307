"""One version, from one place: `baton.__version__` (pyproject.toml reads it). The README, the docs' home
page, `baton --version` and the changelog's newest release say the same; the LICENSE the README names is
there, and the site shows the changelog."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import baton
from tests.docs.pages import DOCS, ROOT

STATED = re.compile(r"baton is at (\d+\.\d+\.\d+)\b")


def test_readme_and_docs_home_state_the_package_version() -> None:
    for page in (ROOT / "README.md", DOCS / "index.md"):
        stated = STATED.findall(page.read_text())
        assert stated == [baton.__version__], (
            f"{page.relative_to(ROOT)} says baton is at {stated}, the package is {baton.__version__} "
            "(baton/__init__.py's __version__ is the one place it is written)"
        )


def test_baton_version_prints_it() -> None:
    program = shutil.which("baton")
    assert program, "the `baton` console script is not installed (pip install -e .)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's code, not the installed one
    done = subprocess.run([program, "--version"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                          check=True)
    assert done.stdout == f"baton {baton.__version__}\n"


def test_the_changelog_names_the_version_and_the_site_shows_it() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## (\S+)", changelog, re.M)
    assert releases[:2] == ["Unreleased", baton.__version__], f"CHANGELOG.md's releases, newest first: {releases}"
    assert '--8<-- "CHANGELOG.md"' in (DOCS / "changelog.md").read_text()


def test_the_license_the_readme_names_is_there() -> None:
    assert "Apache-2.0" in (ROOT / "README.md").read_text()
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
