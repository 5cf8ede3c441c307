"""The README's first screen (up to its first `##` heading) says what its install line assumes, and
leaves the test and CI detail to the development page."""

from __future__ import annotations

from tests.docs.pages import DOCS, ROOT

FIRST_SCREEN = (ROOT / "README.md").read_text().split("\n## ", 1)[0]


def test_the_install_line_says_what_it_assumes() -> None:
    for assumption in ("clone", "Python 3.11", "venv", "root", "sudo"):
        assert assumption in FIRST_SCREEN, f"the README's first screen does not say it assumes {assumption!r}"


def test_the_test_and_ci_detail_is_on_the_development_page() -> None:
    detail = ("-m long", "-m nightly", ".ci/run", "workers", "-n 0")
    assert [d for d in detail if d in FIRST_SCREEN] == [], "test and CI detail belongs in docs/development.md"
    development = (DOCS / "development.md").read_text()
    assert all(d in development for d in detail)
    assert "(docs/development.md#the-readmes-two-commands)" in FIRST_SCREEN
