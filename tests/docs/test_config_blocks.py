"""Every TOML block of the docs and the README, and every file in configs/, passes `baton check`.

One that needs something made first (a model, data, GPUs, SGLang, your own package) says so: a block by a
`<!-- baton check: shape (why) -->` line right before it, a config by a `# needs: why` line. Those are
checked for shape: every table and key exists, every value has the key's type and bounds, without the
checks that look at files, import plug-ins or start servers."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import TypeAdapter, ValidationError

from baton import cli
from baton.schema import PluginSpec, RunConfig
from tests.docs.pages import PAGES, ROOT, blocks, section_models

CONFIGS = sorted((ROOT / "configs").glob("*.toml"))
NEEDS = re.compile(r"^# needs: (.+)$", re.M)


def shape_problems(data: dict[str, Any]) -> list[str]:
    """What is wrong with a config's shape: unknown tables or keys, values of the wrong type or bounds."""
    sections, problems = section_models(), []
    for key, value in data.items():
        if key not in RunConfig.model_fields:
            problems.append(f"unknown key {key!r}")
        elif key not in sections:
            problems += value_problems(RunConfig.model_fields[key], value, key)
        else:
            for table in value if isinstance(value, list) else [value]:
                problems += table_problems(sections[key], table, key)
    return problems


def table_problems(members: list[Any], table: dict[str, Any], section: str) -> list[str]:
    built_in = [m for m in members if m is not PluginSpec]
    if "kind" in built_in[0].model_fields and len(members) > 1:
        kind = table.get("kind", built_in[0].model_fields["kind"].default)
        if ":" in str(kind):
            return value_problems(PluginSpec.model_fields["kind"], kind, f"{section}.kind")
        built_in = [m for m in built_in if m.model_fields["kind"].default == kind]
        if not built_in:
            return [f"{section}.kind = {kind!r} is no built-in kind"]
    (model,) = built_in
    problems = []
    for key, value in table.items():
        field = model.model_fields.get(key)
        if field is None:
            if model.model_config.get("extra") != "allow":
                problems.append(f"unknown key {section}.{key}")
            continue
        problems += value_problems(field, value, f"{section}.{key}")
    return problems


def value_problems(field: Any, value: Any, name: str) -> list[str]:
    annotation = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    try:
        TypeAdapter(annotation).validate_python(value)
    except ValidationError as exc:
        return [f"{name} = {value!r}: {exc.errors()[0]['msg']}"]
    return []


def check(path: Path, capsys) -> tuple[int, str]:
    """`baton check PATH` in this process (the console script runs the same `main`), from the repo root."""
    code = cli.main(["check", str(path)])
    return code, capsys.readouterr().err


DOC_BLOCKS = [b for page in PAGES for b in blocks(page, "toml")]


@pytest.mark.parametrize("block", DOC_BLOCKS, ids=[b.where for b in DOC_BLOCKS])
def test_every_toml_block_of_the_docs_passes_baton_check(block, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    data = tomllib.loads(block.text)
    if block.shape_only:
        assert not shape_problems(data), f"{block.where} ({block.shape_only}): {shape_problems(data)}"
        return
    config = tmp_path / "block.toml"
    config.write_text(block.text)
    code, err = check(config, capsys)
    assert code == 0, f"{block.where} fails `baton check` (mark it shape-only if it needs something made):\n{err}"


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_passes_baton_check(config: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    needs = NEEDS.search(config.read_text())
    if needs:
        problems = shape_problems(tomllib.loads(config.read_text()))
        assert not problems, f"{config.name} (needs {needs.group(1)}): {problems}"
        return
    code, err = check(config, capsys)
    assert code == 0, f"configs/{config.name} fails `baton check` (say what it needs in a `# needs:` line):\n{err}"


def test_the_docs_have_toml_blocks_of_both_kinds() -> None:
    assert sum(b.shape_only is None for b in DOC_BLOCKS) >= 1
    assert sum(b.shape_only is not None for b in DOC_BLOCKS) >= 4


def test_the_shape_check_catches_what_baton_check_would() -> None:
    good = {"steps": 3, "task": {"kind": "dataset", "path": "nowhere.jsonl", "prompt_field": "q"},
            "engine": {"kind": "sglang", "python": "/no/python", "dtype": "bfloat16"},
            "store": {"kind": "mooncake", "global_segment_size": "2GiB"},
            "environment": {"kind": "my_pkg:Env", "anything": 1}, "faults": [{"kind": "engine.crash", "at": [2]}]}
    assert shape_problems(good) == []
    bad = {"stepz": 3, "learner": {"lrr": 1e-3, "lr": -1}, "engine": {"kind": "tgi"},
           "store": {"kind": "mooncake", "global_segment_size": "lots"}, "staleness": {"on_stale": "later"},
           "faults": [{"kind": "disk.full"}], "task": {"kind": "my.pkg:Task", "whatever": True}}
    assert [p.split(":")[0].split(" =")[0] for p in shape_problems(bad)] == [
        "unknown key 'stepz'", "unknown key learner.lrr", "learner.lr", "engine.kind", "store.global_segment_size",
        "staleness.on_stale", "faults.kind",
    ]
