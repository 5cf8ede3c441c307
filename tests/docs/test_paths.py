"""Every repository path that the docs, the README, and the docstrings and comments of the code cite exists.

Where: the pages (README.md, CHANGELOG.md, docs/**/*.md: prose, code spans and code blocks alike); the docstrings and
`#` comments of every Python file in the product (baton, stages, buffers, pipeline, policies), benchmarks/,
tools/, examples/ and tests/ (a string in code is data, not a citation); the `#` comments of configs/,
the shell tools, .ci/run, pyproject.toml and mkdocs.yml.

What is a cited path (strict, and no false positives):

- a token that starts, at a word's start, with one of the repository's top-level folders (as git tracks
  them) and a `/`: `stages/engines/sglang.py`, `docs/guides/learner.md`, `configs/quickstart.toml`, a
  folder such as `stages/rollout/`; or a top-level file: `pyproject.toml`, `mkdocs.yml`, `README.md`;
- the target of a relative Markdown link, resolved against the page's own folder
  (`[the metrics page](guides/metrics.md)` in docs/ is docs/guides/metrics.md).

Not a cited path: a URL; a path inside another (`<run>/metrics.jsonl`, `/work/x/stages/y.py`,
`runs/quickstart/...`, `envs/sandbox.py` or `my_rewards.py` in a user's project: none starts with a
top-level name at a word's start); a glob or a placeholder (`configs/*.toml`, `docs/<page>.md`, `{x}`,
`stages/...`); a dotted module name (`stages.learner.losses`). A path cited on purpose that does not exist
(what a section says went away) goes in CITED_ON_PURPOSE, with the reason.

It reads files and runs no code, in well under a second: `python -m pytest -n 0 -q tests/docs/test_paths.py`.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "CHANGELOG.md", "docs")
CODE = ("baton", "stages", "buffers", "pipeline", "policies", "benchmarks", "tools", "examples", "tests")
HASH_COMMENTED = ("configs/*.toml", "tools/**/*.sh", ".ci/run", "pyproject.toml", "mkdocs.yml")
HASH_COMMENT = re.compile(r"(?:^|\s)#(.*)$", re.M)

# (file relative to the root, path cited): why the path is cited although it does not exist
CITED_ON_PURPOSE: dict[tuple[str, str], str] = {}

# one name of a path; a path continued by `<`, `{`, `*`, `$` or `[` is a placeholder or a glob
# (`docs/<page>.md`, `configs/*.toml`, `stages/{a,b}.py`), not a citation
SEGMENT = r"[A-Za-z0-9_][A-Za-z0-9_.\-]*"
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@dataclass(frozen=True)
class Citation:
    """A path as cited: the file that cites it, the line, and the path (relative to the root, or resolved
    against the citing page for a relative link)."""

    source: str
    line: int
    path: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.path}"


def top_level(root: Path) -> tuple[set[str], set[str]]:
    """The repository's top-level folders and files, as git tracks them (a folder an untracked build makes,
    `site/` or `runs/`, is not one)."""
    listed = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout
    folders, files = set(), set()
    for name in listed.splitlines():
        head, sep, _ = name.partition("/")
        (folders if sep else files).add(head)
    return folders, files


def path_pattern(folders: set[str], files: set[str]) -> re.Pattern[str]:
    """A token that starts, at a word's start (or after a word-starting `./`), with a top-level folder and a
    `/`, or is a top-level file."""
    heads = "|".join(re.escape(f) for f in sorted(folders, key=len, reverse=True))
    tops = "|".join(re.escape(f) for f in sorted(files, key=len, reverse=True))
    return re.compile(
        r"(?:(?<![\w./\-~>}@:])|(?<=[\s`(\[\"']\./))"  # not inside a longer path
        rf"(?:(?:{heads})/(?:{SEGMENT}/)*(?:{SEGMENT})?|(?:{tops})(?![\w\-]))"
        r"(?P<tail>[<>{}*$\[]?)"  # a placeholder or a glob goes on
    )


def paths_in(text: str, pattern: re.Pattern[str]) -> list[tuple[int, str]]:
    """(offset, path) for every cited path in `text`, without a trailing `.` and without the placeholders
    and globs."""
    found = []
    for m in pattern.finditer(text):
        if m.group("tail") or text[m.end():m.end() + 3] == "...":
            continue
        path = m.group(0).rstrip(".")
        if path.endswith("/..") or "/../" in path:
            continue
        found.append((m.start(), path))
    return found


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def page_citations(page: Path, root: Path, pattern: re.Pattern[str]) -> list[Citation]:
    """The repository paths a Markdown page names, and its relative links resolved against its folder."""
    text, name = page.read_text(), page.relative_to(root).as_posix()
    cited = [Citation(name, line_of(text, at), path) for at, path in paths_in(text, pattern)]
    for m in LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if not target or re.match(r"[a-z][a-z0-9+.\-]*:", target) or target.startswith("/"):
            continue
        resolved = os.path.relpath((page.parent / target).resolve(), root.resolve())
        cited.append(Citation(name, line_of(text, m.start()), Path(resolved).as_posix()))
    return cited


# a Python comment or string literal (in Python 3.11 an f-string cannot hold its own quote, so this is exact)
COMMENT_OR_STRING = re.compile(r"""
    (?P<comment>\#[^\n]*)
  | (?P<string>[rRbBuUfF]{0,2}
      (?: \"\"\"(?:\\[\s\S]|[^\\])*?\"\"\"
        | '''(?:\\[\s\S]|[^\\])*?'''
        | "(?:\\.|[^"\\\n])*"
        | '(?:\\.|[^'\\\n])*' ))
""", re.X)


def comments_and_docstrings(text: str) -> list[tuple[int, str]]:
    """(offset, text) of every comment and docstring in Python source: a docstring is a string that is a
    statement of its own (a module's, class's or function's docstring, or an attribute's below it), that is
    first on its line, outside any bracket, and followed only by the line's end or a comment. A regex and a
    bracket count find what the tokenizer would, three times faster."""
    found, depth, end = [], 0, 0
    for m in COMMENT_OR_STRING.finditer(text):
        code = text[end:m.start()]
        depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
        first_on_line = not text[text.rfind("\n", 0, m.start()) + 1:m.start()].strip()
        end = m.end()
        if m.group("comment"):
            found.append((m.start(), m.group(0)))
        elif depth == 0 and first_on_line and re.match(r"[ \t]*(?:#|\n|$)", text[end:end + 200]):
            found.append((m.start(), m.group(0)))
    return found


def code_citations(source: Path, root: Path, pattern: re.Pattern[str]) -> list[Citation]:
    """The repository paths a Python file names in its comments and its docstrings."""
    text, name = source.read_text(), source.relative_to(root).as_posix()
    if not pattern.search(text):
        return []
    return [Citation(name, line_of(text, start + at), path)
            for start, token in comments_and_docstrings(text) for at, path in paths_in(token, pattern)]


def comment_citations(source: Path, root: Path, pattern: re.Pattern[str]) -> list[Citation]:
    """The repository paths a config or script names in its `#` comments."""
    text, name = source.read_text(), source.relative_to(root).as_posix()
    return [Citation(name, line_of(text, m.start(1)), path)
            for m in HASH_COMMENT.finditer(text) for _, path in paths_in(m.group(1), pattern)]


def citations(root: Path) -> list[Citation]:
    folders, files = top_level(root)
    pattern = path_pattern(folders, files)
    pages = [p for name in PAGES for p in ([root / name] if name.endswith(".md") else (root / name).rglob("*.md"))
             if p.exists()]
    code = [p for name in CODE if (root / name).is_dir() for p in (root / name).rglob("*.py")]
    commented = sorted({p for glob in HASH_COMMENTED for p in root.glob(glob) if p.is_file()})
    return ([c for page in sorted(pages) for c in page_citations(page, root, pattern)]
            + [c for source in sorted(code) for c in code_citations(source, root, pattern)]
            + [c for source in commented for c in comment_citations(source, root, pattern)])


def dead(root: Path) -> list[Citation]:
    """The citations whose path does not exist in the repository (a file or a folder; a link out of the
    repository, `../x`, is dead too), less the ones cited on purpose."""
    return [c for c in citations(root) if (c.path.startswith("../") or not (root / c.path).exists())
            and (c.source, c.path) not in CITED_ON_PURPOSE]


def test_every_cited_path_exists() -> None:
    missing = dead(ROOT)
    assert not missing, "paths cited that do not exist (file:line: path):\n" + "\n".join(map(str, missing))


def test_a_dead_path_is_named_with_its_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "stages").mkdir()
    (tmp_path / "docs" / "guides").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text("# the layers: stages/good.py\n")
    (tmp_path / "stages" / "good.py").write_text(
        '"""Read with stages/good.py, written by stages/gone.py."""\n\n'
        'PATH = "stages/not_a_citation.py"  # a string in code is not a citation; this comment is: stages/gone/\n')
    (tmp_path / "docs" / "index.md").write_text("# Home\n")
    (tmp_path / "docs" / "guides" / "page.md").write_text(
        "Good: `stages/good.py`, [home](../index.md), [good](../../stages/good.py#L1), `stages/`.\n"
        "Not cited: `<run>/metrics.jsonl`, `stages/<name>.py`, `stages/*.py`, `docs/{page}.md`, `runs/x/stages/a.py`,\n"
        "`envs/sandbox.py`, `my_rewards.py`, https://example.com/stages/none.py, `stages.gone`, `/abs/stages/no.py`.\n"
        "Dead: `docs/guides/missing.md`, [a link](other.md), [out of the repository](../../../pyproject.toml).\n")
    (tmp_path / "README.md").write_text("See [the guide](docs/guides/page.md), stages/gone.py, `./stages/`\n"
                                        "and `./docs/gone.md`.\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "."], cwd=tmp_path, check=True)

    assert [str(c) for c in dead(tmp_path)] == [
        "README.md:1: stages/gone.py",
        "README.md:2: docs/gone.md",
        "docs/guides/page.md:4: docs/guides/missing.md",
        "docs/guides/page.md:4: docs/guides/other.md",
        "docs/guides/page.md:4: ../pyproject.toml",
        "stages/good.py:1: stages/gone.py",
        "stages/good.py:3: stages/gone/",
    ]
