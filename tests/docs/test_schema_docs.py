"""Every config key has a description, and every key the docs name exists: a key renamed or removed in the
schema fails here until the docs follow."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

from pydantic import BaseModel

import baton.schema
import baton.sections
from tests.docs.pages import PAGES, ROOT, blocks, code_spans, key_exists, section_models
from tests.docs.test_metrics_page import event_kinds

FILE_SUFFIXES = ("jsonl", "json", "toml", "png", "py", "txt", "sqlite", "db", "md", "sh", "token")
PLACEHOLDERS = {"key", "KEY", "k", "section.key"}  # how the docs write "a key" in general (`--set k=v`)


def schema_models() -> list[type[BaseModel]]:
    modules = [baton.schema, *(importlib.import_module(f"baton.sections.{m.name}")
                               for m in pkgutil.iter_modules(baton.sections.__path__))]
    return list({cls for module in modules for cls in vars(module).values() if inspect.isclass(cls)
                 and issubclass(cls, BaseModel) and cls.__module__.startswith(("baton.schema", "baton.sections"))})


def test_every_schema_field_has_a_description() -> None:
    missing = [f"{cls.__name__}.{name}" for cls in schema_models() for name, field in cls.model_fields.items()
               if not (field.description or "").strip()]
    assert len(schema_models()) > 20
    assert not missing, f"schema fields without a description (Field(..., description=...)): {missing}"


def named_keys(text_spans: list[str], code: list[str], not_keys: set[str]) -> set[str]:
    """The config keys a page names: `[section] key` and `section.key` code spans (a section being one of
    RunConfig's tables), and every `--set key=value`."""
    sections = set(section_models())
    found = set()
    for span in text_spans:
        if m := re.match(r"^\[(\w+)\]\s+(\w+)\b", span):
            found.add(f"{m.group(1)}.{m.group(2)}")
        elif (m := re.match(r"^(\w+)\.(\w+)(\s*=.*)?$", span)) and m.group(1) in sections:
            dotted = f"{m.group(1)}.{m.group(2)}"
            if m.group(2) not in FILE_SUFFIXES and dotted not in not_keys:
                found.add(dotted)
    for text in [*text_spans, *code]:  # a block showing `baton` refuse a key on purpose says "unknown key"
        found.update(k for k in re.findall(r"--set\s+'?([\w.]+)=", text) if f"unknown key '{k}'" not in text)
    return found - PLACEHOLDERS


def test_every_key_the_docs_name_exists() -> None:
    not_keys = set(event_kinds()) | set(baton.schema.FAULT_KINDS)
    unknown = []
    for page in PAGES:
        keys = named_keys(code_spans(page), [b.text for b in blocks(page)], not_keys)
        unknown += [f"{page.relative_to(ROOT)}: {key}" for key in sorted(keys) if not key_exists(key)]
    assert not unknown, f"the docs name config keys the schema does not have: {unknown}"


def test_the_key_check_catches_a_key_that_does_not_exist() -> None:
    spans = ["[rollout] max_regenerations", "learner.lrr", "rollout.group_size", "eval.jsonl", "engine.crash",
             "stages.rollout"]
    refused = "$ baton check x.toml --set staleness.kkk=1\n  unknown key 'staleness.kkk'"  # shown refused
    keys = named_keys(spans, ["baton run x.toml --set staleness.kk=3", refused], {"engine.crash"})
    assert keys == {"rollout.max_regenerations", "learner.lrr", "rollout.group_size", "staleness.kk"}
    assert [k for k in sorted(keys) if not key_exists(k)] == ["learner.lrr", "rollout.max_regenerations",
                                                              "staleness.kk"]
    assert key_exists("environment.show")  # the environment's own options pass through
    assert not key_exists("engine.show")  # a plug-in kind takes any key, a built-in one does not
