"""The generated references read as the code says: no text swallowed as an HTML tag, and every table the
schema nests in a section (`[reward.classifier]`, `[reward.judge]`, `[learner.lora]`) listed key by key
with its type, default and description, not as a Python class name."""

from __future__ import annotations

import re

from pydantic import BaseModel

from baton.config import section_classes
from baton.schema import RunConfig
from tests.docs.pages import DOCS, FENCE
from tests.docs.test_site import load_generator

CONFIG, CLI = DOCS / "reference" / "config.md", DOCS / "reference" / "cli.md"
RAW_TAG = re.compile(r"<[A-Za-z/!?][^>\n]*>")  # what Markdown passes through as HTML, and a browser hides


def raw_tags(markdown: str) -> list[str]:
    """The HTML tags a page's prose and tables hold, outside code (fenced blocks, code spans) and the
    generator's own notice comment."""
    text = FENCE.sub("", markdown).replace(load_generator().NOTICE, "")
    return RAW_TAG.findall(re.sub(r"`[^`\n]*`", "", text))


def test_the_references_hold_no_raw_html() -> None:
    for page in (CONFIG, CLI):
        assert raw_tags(page.read_text()) == [], f"{page.name} shows text a browser reads as HTML"


def test_the_raw_html_check_sees_an_unescaped_placeholder() -> None:
    generator = load_generator()
    assert raw_tags("| `name` | the run folder (run_root/<name>-<timestamp>) |") == ["<name>", "<timestamp>"]
    escaped = generator.cell("the run folder (run_root/<name>-<timestamp>), `<kept in code>`, k < 2, k <= 3")
    assert raw_tags(escaped) == [] and "`<kept in code>`" in escaped and "k < 2, k <= 3" in escaped


def nested_tables(model: type[BaseModel], path: str) -> list[tuple[str, type[BaseModel]]]:
    """Every table the schema nests inside a section, by its dotted path (the kinds of a `kind` section
    each searched)."""
    found = []
    for name, field in model.model_fields.items():
        classes = section_classes(field.annotation)
        if path and len(classes) == 1 and not isinstance(field.default, list):
            found.append((f"{path}.{name}", classes[0]))
        for cls in classes:
            found += nested_tables(cls, f"{path}.{name}" if path else name)
    return found


def rows_under(page: str, heading: str) -> dict[str, list[str]]:
    """The key table that follows `heading` (up to the next heading): key -> its cells."""
    start = page.index(heading)
    end = page.find("\n#", start + len(heading))
    rows = re.findall(r"^\| `(\w+)` \| (.*) \|$", page[start:end if end != -1 else None], re.M)
    return {key: cells.split(" | ") for key, cells in rows}


def test_every_nested_table_of_the_schema_is_listed_key_by_key() -> None:
    page, cell = CONFIG.read_text(), load_generator().cell
    tables = dict(nested_tables(RunConfig, ""))
    assert {"reward.classifier", "reward.judge", "learner.lora"} <= set(tables)
    for path, cls in tables.items():
        heading = f"`[{path}]`\n"
        assert heading in page, f"config.md has no heading for [{path}]"
        rows = rows_under(page, heading)
        for key, field in cls.model_fields.items():
            assert key in rows, f"config.md lists no {path}.{key}"
            kind, default, description = rows[key]
            assert description == cell(field.description or "") != ""
            assert default and kind and cls.__name__ not in kind


def test_no_key_has_a_class_name_for_a_type() -> None:
    class_names = {cls.__name__ for _, cls in nested_tables(RunConfig, "")}
    types = re.findall(r"^\| `\w+` \| ([^|]+) \|", CONFIG.read_text(), re.M)
    assert types and not [t for t in types if t.strip() in class_names or t.strip().endswith(("Spec", "Section"))]
