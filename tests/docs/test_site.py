"""The docs site builds in strict mode (a broken link or anchor fails it), the README's links land on pages
and anchors that exist, and the generated references are what the code makes of them today."""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.pages import DOCS, ROOT


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                            "-d", str(out)], capture_output=True, text=True, env=env, timeout=240)
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}\n{build.stderr}"
    return out


def test_site_builds_in_strict_mode(site: Path) -> None:
    for page in DOCS.rglob("*.md"):
        built = site / page.relative_to(DOCS).with_suffix("") / "index.html"
        if page.name == "index.md":
            built = site / page.relative_to(DOCS).parent / "index.html"
        assert built.exists(), f"{page.relative_to(ROOT)} was not built (is it in mkdocs.yml's nav?)"


def test_readme_links_land_on_pages_and_anchors_that_exist(site: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert len(links) > 10, "the README links into docs/ by use case"
    for target, anchor in links:
        page = ROOT / target
        assert page.exists(), f"README links to {target}, which does not exist"
        if anchor:
            stem = page.relative_to(DOCS).with_suffix("")
            built = site / (stem.parent if stem.name == "index" else stem) / "index.html"
            ids = set(re.findall(r'id="([^"]+)"', html.unescape(built.read_text())))
            assert anchor in ids, f"README links to {target}#{anchor}, but that page has no such anchor"


def test_generated_references_equal_what_the_code_makes() -> None:
    generator = load_generator()
    for path, text in generator.pages().items():
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} differs from what the code makes; run: python tools/gen_reference.py"
        )


def test_the_check_mode_names_a_stale_reference(tmp_path: Path, monkeypatch, capsys) -> None:
    generator = load_generator()
    stale = tmp_path / "config.md"
    stale.write_text(generator.render_config().replace("| `lr` |", "| `learning_rate` |"))
    monkeypatch.setattr(generator, "CONFIG_PAGE", stale)
    monkeypatch.setattr(generator, "ROOT", tmp_path)
    monkeypatch.setattr(generator, "CLI_PAGE", tmp_path / "cli.md")
    (tmp_path / "cli.md").write_text(generator.render_cli())
    assert generator.main(["--check"]) == 1
    assert "config.md differs from the code" in capsys.readouterr().err


def test_the_dsl_reference_renders_the_docstrings(site: Path) -> None:
    """mkdocstrings ran: the page shows each class's signature and docstring, no `:::` line left raw."""
    from stages.rollout.stage import Rollout

    page = html.unescape(re.sub(r"<[^>]+>", "", (site / "reference" / "dsl" / "index.html").read_text()))
    assert ":::" not in page
    assert "groups_per_step" in page and "on_stale" in page  # GRPOLearner's and MaxStaleness's arguments
    first_line = " ".join((Rollout.__doc__ or "").split("\n")[0].split())
    assert first_line and first_line.split(":")[0] in " ".join(page.split())
