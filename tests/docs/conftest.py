"""Every docs test fails on a DeprecationWarning from the project's own code (tests/docs/deprecations.py):
what the docs show must not use a path the next release removes. The documented commands, run as
subprocesses, are checked on their stderr (tests/docs/test_commands.py)."""

from __future__ import annotations

import pytest

from tests.docs.deprecations import project_deprecations, recording


@pytest.fixture(autouse=True)
def no_project_deprecations():
    with recording() as records:
        yield
    found = project_deprecations(records)
    assert not found, "the project's own code warned DeprecationWarning (a moved path?):\n" + "\n".join(found)
