"""The architecture the suite enforces: the import-linter contracts in pyproject.toml (layers
`baton > stages > buffers > pipeline | policies`, no circles within a package) and short functions."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("baton", "stages", "buffers", "pipeline", "policies")
MAX_FUNCTION_LINES = 60


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` (this interpreter's import-linter) on the packages and pyproject.toml under `root`."""
    command = "from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run(
        [sys.executable, "-c", command, "--no-cache", "--no-logo"], cwd=root, capture_output=True, text=True,
        timeout=120,
    )


def test_imports_keep_the_layer_contracts():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_upward_import_breaks_the_layer_contract(tmp_path):
    for package in PRODUCT:
        if (ROOT / package).is_dir():
            shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    before = lint_imports(tmp_path)
    assert "pipeline.versions -> stages" not in before.stdout

    with open(tmp_path / "pipeline" / "versions.py", "a") as module:
        module.write("\nimport stages\n")
    after = lint_imports(tmp_path)

    assert after.returncode != 0
    assert "pipeline is not allowed to import stages" in after.stdout, after.stdout + after.stderr
    assert "pipeline.versions -> stages" in after.stdout, after.stdout + after.stderr


def long_functions(root: Path) -> list[str]:
    """`path:line name (N lines)` for every function of the product longer than MAX_FUNCTION_LINES,
    counted from its `def` line to its last line."""
    found = []
    for package in PRODUCT:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_the_product_is_over_60_lines():
    assert long_functions(ROOT) == []
