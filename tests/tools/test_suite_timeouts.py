"""The suite's own timeout rule (tests/conftest.py): an async test that hangs fails alone, and the rest of
the suite goes on, instead of leaving its module's async fixtures waiting forever."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

HANGING = '''
import anyio, pytest
pytestmark = pytest.mark.anyio

@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"

@pytest.fixture(scope="module")
async def held():
    yield 1
    await anyio.sleep(0.01)

async def test_hangs(held):
    while True:
        await anyio.sleep(0.01)

async def test_after_it(held):
    assert held == 1
'''


def test_a_hanging_async_test_fails_and_the_suite_goes_on(tmp_path: Path) -> None:
    shutil.copy(Path(__file__).parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_hanging.py").write_text(HANGING)
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    assert True\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts =\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "1", "--timeout=3"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,  # signal method: the next test fails, or no end
    )
    tail = done.stdout[-2000:]
    assert done.returncode == 1, tail
    assert "FAILED test_hanging.py::test_hangs" in tail and "1 failed, 2 passed" in tail, tail
