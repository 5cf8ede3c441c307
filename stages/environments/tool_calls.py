"""Tool calls in the Qwen/Hermes format, parsed out of a model turn's text and written back.

A model calls a tool by writing, anywhere in its turn,

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3 + 4"}}
    </tool_call>

`parse_tool_calls(text, tools)` returns the turn's `content` (the text with every tool-call block
removed, stripped), the well-formed calls in order, and one error string per block that could not be
used: JSON that does not parse or is not an object, a missing or non-text "name", "arguments" that
are not an object, a tool the environment did not declare, a tag never closed, a stray closing tag.
Parsing never raises: a badly written call is an observation for the environment (see `base`).

`render_tool_calls` writes calls exactly as the parser reads them (and as Qwen 2.5's chat template
renders an assistant's calls); `tools_prompt` is the Hermes-style system text that shows a model
its tools, for tokenizers whose chat template ignores `tools`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any, NamedTuple

from stages.environments.base import Tool, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_TAG = re.compile(f"({re.escape(OPEN)}|{re.escape(CLOSE)})")


class ParsedTurn(NamedTuple):
    """What `parse_tool_calls` found: text without markup, the well-formed calls, the errors."""

    content: str
    calls: tuple[ToolCall, ...]
    malformed: tuple[str, ...]


def parse_tool_calls(text: str, tools: Iterable[Tool | str] | None = None) -> ParsedTurn:
    """Split `text` into content, well-formed calls and errors (see the module docstring).

    `tools` (Tool objects or names) are the declared tools; None accepts any name. Call ids are
    "call_<i>" by position among the turn's blocks, so an error and a call never share an id."""
    known = None if tools is None else {t.name if isinstance(t, Tool) else t for t in tools}
    content: list[str] = []
    calls: list[ToolCall] = []
    malformed: list[str] = []
    pieces = _TAG.split(text)  # text, tag, text, tag, ...: the tags sit at the odd indices
    i, block = 0, 0
    while i < len(pieces):
        piece = pieces[i]
        if piece == CLOSE:
            malformed.append(f"a {CLOSE} without a {OPEN} before it")
        elif piece == OPEN and pieces[i + 2 : i + 3] == [CLOSE]:
            call, error = _one_call(pieces[i + 1], f"call_{block}", known)
            calls += [call] if call else []
            malformed += [error] if error else []
            block, i = block + 1, i + 2
        elif piece == OPEN:  # unclosed: what follows up to the next tag is the unfinished call
            malformed.append(f"a {OPEN} that is never closed with {CLOSE}")
            i += 1
        else:
            content.append(piece)
        i += 1
    return ParsedTurn("".join(content).strip(), tuple(calls), tuple(malformed))


def _one_call(body: str, call_id: str, known: set[str] | None) -> tuple[ToolCall | None, str | None]:
    """One block's JSON as a call, or the reason it is not one."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"tool call is not valid JSON ({exc.msg} at character {exc.pos}): {body.strip()[:200]}"
    if not isinstance(value, dict):
        return None, f'tool call is not a JSON object with "name" and "arguments": {body.strip()[:200]}'
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None, f'tool call has no "name": {body.strip()[:200]}'
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None, f'tool call to {name!r}: "arguments" must be a JSON object, got {json.dumps(arguments)[:200]}'
    if known is not None and name not in known:
        offered = ", ".join(sorted(known)) or "none"
        return None, f"unknown tool {name!r} (tools: {offered})"
    return ToolCall(name=name, arguments=arguments, id=call_id), None


def render_tool_calls(calls: Iterable[ToolCall]) -> str:
    """The calls as the model writes them: one block per call, joined by newlines."""
    return "\n".join(f"{OPEN}\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n{CLOSE}" for c in calls)


def render_turn(content: str, calls: Iterable[ToolCall]) -> str:
    """A whole assistant turn: its content, then its calls on the next line (either may be empty)."""
    written = render_tool_calls(calls)
    return "\n".join(part for part in (content, written) if part)


def openai_tool_calls(calls: Iterable[ToolCall]) -> list[dict[str, Any]]:
    """The calls in the OpenAI message form (`arguments` as a JSON string), for the gateway."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in calls]


def tools_prompt(tools: Iterable[Tool]) -> str:
    """The Hermes-style system text listing `tools` and how to call them. The math example's chat
    template (tools/make_math_example.py) writes the same text, so both paths show a model the same."""
    listed = "\n".join(json.dumps(t.schema()) for t in tools)
    return (
        "# Tools\n\nYou may call the tools below to help with the task. Their signatures, one JSON object "
        f"per line, are inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
        "To call a tool, write a JSON object with its name and arguments inside tool-call tags:\n"
        f'{OPEN}\n{{"name": <tool name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}'
    )
