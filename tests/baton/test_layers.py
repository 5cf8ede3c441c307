"""The architecture the suite enforces: the import-linter contracts in pyproject.toml (layers
`baton > stages > buffers > pipeline | policies`, no circles within a package) and the size budgets of
functions, modules and classes."""

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


MAX_MODULE_LINES = 500
MAX_CLASS_METHODS = 20
# What exceeds a budget today, by name (a module's path, or `path::Class`), with its size then (lines, or
# methods). An entry may only shrink: the check fails when a listed one grows past its size here, and when
# it is within budget (then its entry goes). Nothing else may exceed a budget.
OVER_BUDGET: dict[str, int] = {}  # empty since baton/schema.py (1,357 lines) became baton/sections/


def _measured(root: Path) -> dict[str, tuple[int, str]]:
    """`name -> (size, what)` for every module of the product over MAX_MODULE_LINES lines (name: its
    path) and every class with more than MAX_CLASS_METHODS methods (name: `path::Class`; a class that
    large wants collaborators)."""
    found = {}
    for package in PRODUCT:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            lines = len(text.splitlines())
            rel = path.relative_to(root).as_posix()
            if lines > MAX_MODULE_LINES:
                found[rel] = (lines, f"{rel}: {lines} lines")
            for node in ast.walk(ast.parse(text, filename=str(path))):
                if isinstance(node, ast.ClassDef):
                    methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                    if methods > MAX_CLASS_METHODS:
                        found[f"{rel}::{node.name}"] = (methods, f"{rel}:{node.lineno} {node.name}: {methods} methods")
    return found


def oversized(root: Path) -> list[str]:
    """`path: what` for every module and class of the product over its budget."""
    return [what for _, what in _measured(root).values()]


def budget_breaches(root: Path, allowed: dict[str, int]) -> list[str]:
    """What breaks the budgets given the allow-list `allowed`: an oversized module or class not on it,
    a listed one that grew past its listed size, and a listed one now within budget (drop its entry)."""
    measured = _measured(root)
    breaches = []
    for name, (size, what) in measured.items():
        if name not in allowed:
            breaches.append(f"{what}: over budget and not on OVER_BUDGET")
        elif size > allowed[name]:
            breaches.append(f"{what}: grew past its allowed {allowed[name]}")
    breaches += [f"{name}: within budget now, drop it from OVER_BUDGET" for name in allowed if name not in measured]
    return breaches


def test_no_module_over_500_lines_and_no_class_over_20_methods_beyond_the_allow_list():
    assert budget_breaches(ROOT, OVER_BUDGET) == []


def test_the_size_check_sees_a_module_that_grew(tmp_path):
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "big.py").write_text("x = 1\n" * 501)
    body = "".join(f"    def m{i}(self):\n        pass\n" for i in range(21))
    (tmp_path / "stages" / "hub.py").write_text(f"class Hub:\n{body}")
    assert oversized(tmp_path) == ["stages/big.py: 501 lines", "stages/hub.py:1 Hub: 21 methods"]
    assert budget_breaches(tmp_path, {}) == [
        "stages/big.py: 501 lines: over budget and not on OVER_BUDGET",
        "stages/hub.py:1 Hub: 21 methods: over budget and not on OVER_BUDGET",
    ]


def test_a_listed_module_or_class_may_only_shrink(tmp_path):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "big.py").write_text("x = 1\n" * 601)
    body = "".join(f"    def m{i}(self):\n        pass\n" for i in range(23))
    (tmp_path / "pipeline" / "hub.py").write_text(f"class Hub:\n{body}")
    (tmp_path / "pipeline" / "small.py").write_text("x = 1\n")
    listed = {"pipeline/big.py": 601, "pipeline/hub.py::Hub": 23}
    assert budget_breaches(tmp_path, listed) == []

    grown = {"pipeline/big.py": 600, "pipeline/hub.py::Hub": 22}
    assert budget_breaches(tmp_path, grown) == [
        "pipeline/big.py: 601 lines: grew past its allowed 600",
        "pipeline/hub.py:1 Hub: 23 methods: grew past its allowed 22",
    ]
    shrunk = dict(listed, **{"pipeline/small.py": 700})
    assert budget_breaches(tmp_path, shrunk) == ["pipeline/small.py: within budget now, drop it from OVER_BUDGET"]
