"""The documentation as the tests read it: the pages, their code blocks and code spans, and the schema's
sections and keys that the docs may name."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS.rglob("*.md")])  # the site shows CHANGELOG.md
SHAPE_MARK = re.compile(r"<!-- baton check: shape \((?P<why>[^)]+)\) -->\s*$")
FENCE = re.compile(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Block:
    """A fenced code block: its page, language, text, line number, and the reason it is checked for shape
    only (a `<!-- baton check: shape (...) -->` line right before it), or None."""

    page: Path
    lang: str
    text: str
    line: int
    shape_only: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path, lang: str | None = None) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        if lang is not None and m.group("lang") != lang:
            continue
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = SHAPE_MARK.search(before)
        found.append(Block(page, m.group("lang"), m.group("body"), text.count("\n", 0, m.start()) + 1,
                           mark.group("why") if mark else None))
    return found


def prose(page: Path) -> str:
    """The page without its fenced code blocks."""
    return FENCE.sub("", page.read_text())


def code_spans(page: Path) -> list[str]:
    """Every inline `code span` outside fenced blocks."""
    return re.findall(r"`([^`\n]+)`", prose(page))


# -- the schema's sections and keys -------------------------------------------------------------------


def section_models() -> dict[str, list[Any]]:
    """RunConfig's tables by name, each with the section classes it may hold (several for a `kind`)."""
    from baton.config import section_classes
    from baton.schema import RunConfig

    fields = RunConfig.model_fields.items()
    return {name: found for name, field in fields if (found := section_classes(field.annotation))}


def key_exists(dotted: str) -> bool:
    """Does the config key `section.key` (or a top-level `key`) exist? A section that passes unknown keys
    on (a plug-in's, the environment's) takes any key."""
    from baton.schema import RunConfig

    parts = dotted.split(".")
    if len(parts) == 1:
        return parts[0] in RunConfig.model_fields
    if len(parts) != 2:
        return False
    section, key = parts
    members = section_models().get(section)
    if not members:
        return False
    return any(key in m.model_fields
               or m.model_config.get("extra") == "allow" and not m.__name__.endswith("PluginSpec")
               for m in members)
