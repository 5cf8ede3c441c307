"""The metrics page lists every key the learner writes to metrics.jsonl and every run event the code reports.

Neither list is written here. The metric keys are read from the code's syntax tree (the dict the learner
passes to `log_metrics`, with the outcome and weight counters it nests) and from a real run's records (the
step's statistics, which several functions add). The event kinds are read from every `ctx.event(kind)` /
`report_event(folder, kind)` call, a kind built from a parameter or a loop resolved to the values its
callers pass."""

from __future__ import annotations

import ast
import importlib
import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from tests.docs.pages import DOCS, ROOT

PACKAGES = ("baton", "stages", "buffers", "pipeline", "policies")
PAGE = DOCS / "guides" / "metrics.md"
PATTERNS = (("events/", "events/<kind>"), ("episode/", "episode/<name>"))


@cache
def modules() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text())
            for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    yield from (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))


# -- metric keys ----------------------------------------------------------------------------------------


def key_text(node: ast.expr) -> str:
    """A dict key as the page writes it: a string, or an f-string with `<name>` for each placeholder."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else f"<{ast.unparse(v.value).split('.')[-1]}>"
                       for v in node.values)
    raise AssertionError(f"a metric key the test cannot read: {ast.unparse(node)}")


def defined(name: str) -> dict:
    """The module-level dict `name` of the one stages/ module that assigns it (BINS: the outcome histograms,
    STATS: the weight transports' counters), imported from wherever it lives."""
    def assigns(node: ast.stmt) -> list[str]:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        return [t.id for t in targets if isinstance(t, ast.Name)]

    paths = [path for path, tree in modules().items() if path.parts[len(ROOT.parts)] == "stages"
             for node in tree.body if name in assigns(node)]
    assert len(paths) == 1, f"expected one stages/ module defining {name}, found {paths}"
    module = ".".join(paths[0].relative_to(ROOT).with_suffix("").parts)
    return getattr(importlib.import_module(module), name)


def learner_record() -> ast.Dict:
    """The dict of the learner's one `log_metrics({...})` call."""
    calls = [node for path, tree in modules().items() if path.parts[len(ROOT.parts)] == "stages"
             for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "log_metrics"]
    assert len(calls) == 1, "the learner writes metrics.jsonl in one place"
    assert isinstance(calls[0].args[0], ast.Dict)
    return calls[0].args[0]


def record_keys() -> set[str]:
    """The keys the learner's record names itself (its spreads aside; the dict comprehension it spreads
    gives its key pattern, `events/<kind>`), nested ones as the sinks flatten them."""
    bins, stats = defined("BINS"), defined("STATS")
    record = learner_record()
    nested = {"outcomes": [f"outcomes/<outcome>/{k}" for k in ("n", *bins, *(f"{b}_mean" for b in bins))],
              "weights": [f"weights/{k}" for k in stats]}
    found = set()
    for key, value in zip(record.keys, record.values, strict=True):
        if key is not None:
            found.update(nested.get(key_text(key), [key_text(key)]))
        elif isinstance(value, ast.DictComp):
            found.add(key_text(value.key))
    return found


def written_keys(record: dict) -> set[str]:
    """The keys of one real metrics.jsonl record, as the page writes them."""
    found = set()
    for key, value in record.items():
        if key == "outcomes":
            found.update(f"outcomes/<outcome>/{k}" for entry in value.values() for k in entry)
        elif isinstance(value, dict):
            found.update(f"{key}/{k}" for k in value)
        else:
            found.add(next((pattern for prefix, pattern in PATTERNS if key.startswith(prefix)), key))
    return found


# -- event kinds ----------------------------------------------------------------------------------------


def parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def values_of(name: str, node: ast.AST, up: dict, tree: ast.Module) -> list[str]:
    """The strings `name` can hold at `node`: a literal loop over it, or a parameter of the function around
    it (its default and what every call in the module passes)."""
    scope = node
    while scope in up:
        scope = up[scope]
        if isinstance(scope, ast.For) and isinstance(scope.target, ast.Name) and scope.target.id == name:
            return [e.value for e in scope.iter.elts]
        if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
            return parameter_values(scope, name, tree)
    raise AssertionError(f"cannot tell what {name} holds")


def parameter_values(function: ast.FunctionDef, name: str, tree: ast.Module) -> list[str]:
    """`name`'s default and the constants calls of `function` pass for it, in any module (the same name in
    another module may be another function: a call there that passes no constant is not one of its)."""
    params = [a.arg for a in function.args.args]
    position = params.index(name) - (params[0] == "self")
    defaults = dict(zip(params[len(params) - len(function.args.defaults):], function.args.defaults, strict=True))
    values = [defaults[name].value] if name in defaults else []
    for module in modules().values():
        for call in ast.walk(module):
            if not (isinstance(call, ast.Call) and getattr(call.func, "attr", getattr(call.func, "id", None))
                    == function.name):
                continue
            given = {k.arg: k.value for k in call.keywords}
            value = call.args[position] if position < len(call.args) else given.get(name)
            if value is None:
                continue
            if isinstance(value, ast.Constant):
                values.append(value.value)
            else:
                assert module is not tree, f"{function.name}({name}=...) is called with {ast.unparse(value)}"
    return values


def evaluate(node: ast.expr, up: dict, tree: ast.Module) -> list[str]:
    if isinstance(node, ast.Constant):
        return [node.value]
    if isinstance(node, ast.Name):
        return values_of(node.id, node, up, tree)
    if isinstance(node, ast.JoinedStr):
        (part,) = [v for v in node.values if isinstance(v, ast.FormattedValue)]
        prefix = "".join(v.value for v in node.values[: node.values.index(part)])
        suffix = "".join(v.value for v in node.values[node.values.index(part) + 1:])
        return [prefix + v + suffix for v in values_of(part.value.id, node, up, tree)]
    if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "replace":
        old, new = (a.value for a in node.args)
        return [v.replace(old, new) for v in evaluate(node.func.value, up, tree)]
    raise AssertionError(f"an event kind the test cannot read: {ast.unparse(node)}")


@cache
def event_kinds() -> frozenset[str]:
    kinds = set()
    for tree in modules().values():
        up = parents(tree)
        for function in functions(tree):
            if function.name in ("event", "report_event"):
                continue  # they pass their caller's kind on
            for call in ast.walk(function):
                if not isinstance(call, ast.Call):
                    continue
                if isinstance(call.func, ast.Attribute) and call.func.attr == "event" and call.args:
                    kinds.update(evaluate(call.args[0], up, tree))
                elif isinstance(call.func, ast.Name) and call.func.id == "report_event":
                    kinds.update(evaluate(call.args[1], up, tree))
    return frozenset(kinds)


# -- the tests ------------------------------------------------------------------------------------------


def missing_from_page(names: set[str], form: str = "`{}`") -> list[str]:
    page = PAGE.read_text()
    return sorted(n for n in names if form.format(n) not in page)


def test_the_page_lists_every_key_the_learner_record_names() -> None:
    keys = record_keys()
    assert {"version", "staleness_mean", "weights/bytes", "events/<kind>", "outcomes/<outcome>/n"} <= keys
    missing = missing_from_page(keys)
    assert not missing, f"{PAGE.relative_to(ROOT)} does not list these metrics.jsonl keys: {missing}"


def correction_kinds() -> list[str]:
    from typing import get_args

    from baton.schema import CorrectionSpec

    return list(get_args(CorrectionSpec.model_fields["kind"].annotation))


@pytest.mark.slow
@pytest.mark.parametrize("correction", correction_kinds())
def test_the_page_lists_every_key_a_real_run_writes(correction: str, tmp_path: Path, monkeypatch) -> None:
    """The learner step's statistics come from several functions (the loss, each correction, the episodes):
    a real run of three versions per correction, multi-turn and with a KL penalty so that every optional key
    is written, says which keys they are."""
    from baton.builder import build_pipeline
    from baton.schema import load_run_config

    monkeypatch.chdir(ROOT)
    cfg = load_run_config(ROOT / "configs" / "agent-feedback.toml", [
        "steps=3", f"run_root={json.dumps(str(tmp_path))}", "telemetry.progress=false", "learner.kl_coef=0.01",
        f"correction.kind={json.dumps(correction)}", f"model.path={json.dumps(str(tmp_path / 'model'))}",
        "checkpoint.every=0",
    ])
    summary = build_pipeline(cfg).run()
    records = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*(written_keys(r) for r in records))
    assert {"loss", "kl_ref", "turns_mean", "episode/<name>", "weights/bytes"} <= keys
    missing = missing_from_page(keys)
    assert not missing, f"{PAGE.relative_to(ROOT)} does not list these metrics.jsonl keys: {missing}"


def test_the_page_lists_every_event_kind() -> None:
    kinds = event_kinds()
    assert {"groups.regenerated", "reward.failed", "eval.reward.failed", "weights.refused", "weights.unreachable",
            "checkpoint.skipped", "learner.entropy_collapse"} <= kinds, "the code reader broke"
    missing = missing_from_page(set(kinds), "| `{}` |")
    assert not missing, f"{PAGE.relative_to(ROOT)} does not list these run events: {missing}"
