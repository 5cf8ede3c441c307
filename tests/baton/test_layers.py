"""The architecture the suite enforces: the import-linter contracts in pyproject.toml (layers
`baton > stages > buffers > pipeline | policies`, no circles within a package) and short functions."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


MAX_STAGES_MODULE_LINES = 500
MAX_CLASS_METHODS = 20


def oversized(root: Path) -> list[str]:
    """`path: what` for every `stages/` module over MAX_STAGES_MODULE_LINES lines and every class of
    `stages/` with more than MAX_CLASS_METHODS methods (a class that large wants collaborators)."""
    found = []
    for package in PRODUCT:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            lines = len(text.splitlines())
            if package != "stages":
                continue
            if lines > MAX_STAGES_MODULE_LINES:
                found.append(f"{path.relative_to(root)}: {lines} lines")
            for node in ast.walk(ast.parse(text, filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                    if methods > MAX_CLASS_METHODS:
                        found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {methods} methods")
    return found


def test_no_stages_module_over_500_lines_and_no_class_over_20_methods():
    assert oversized(ROOT) == []


def test_the_size_check_sees_a_module_that_grew(tmp_path):
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "big.py").write_text("x = 1\n" * 501)
    body = "".join(f"    def m{i}(self):\n        pass\n" for i in range(21))
    (tmp_path / "stages" / "hub.py").write_text(f"class Hub:\n{body}")
    assert oversized(tmp_path) == ["stages/big.py: 501 lines", "stages/hub.py:1 Hub: 21 methods"]
