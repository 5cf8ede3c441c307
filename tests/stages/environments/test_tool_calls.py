"""Tool calls in the Qwen/Hermes format: parsing valid, malformed and unknown calls out of a model's
text (never raising), and writing calls back exactly as the parser reads them."""

from __future__ import annotations

import json

import pytest

from stages.environments.base import Tool, ToolCall
from stages.environments.tool_calls import (
    openai_tool_calls,
    parse_tool_calls,
    render_tool_calls,
    render_turn,
    tools_prompt,
)

CALC = Tool("calculator", "Evaluate arithmetic.",
            {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})
LOOKUP = Tool("lookup", "Look a word up.")


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_valid_calls_are_parsed_in_order_and_removed_from_the_content():
    text = ("Let me compute.\n" + block('{"name": "calculator", "arguments": {"expression": "3 + 4"}}')
            + "\nand " + block('{"name": "lookup", "arguments": {}}'))
    content, calls, malformed = parse_tool_calls(text, [CALC, LOOKUP])
    assert content == "Let me compute.\n\nand"
    assert calls == (ToolCall("calculator", {"expression": "3 + 4"}, "call_0"), ToolCall("lookup", {}, "call_1"))
    assert malformed == ()


def test_text_without_calls_is_all_content():
    assert parse_tool_calls("  The answer is 7. ", [CALC]) == ("The answer is 7.", (), ())


def test_missing_arguments_mean_no_arguments_and_tool_names_may_be_strings():
    _, calls, malformed = parse_tool_calls(block('{"name": "lookup"}'), ["lookup"])
    assert calls == (ToolCall("lookup", {}, "call_0"),) and malformed == ()


def test_no_declared_tools_check_accepts_any_name():
    _, calls, _ = parse_tool_calls(block('{"name": "anything", "arguments": {"x": 1}}'))
    assert [c.name for c in calls] == ["anything"]


@pytest.mark.parametrize(("body", "reason"), [
    ('{"name": "calculator", "arguments": {"expression": "3+4"}', "not valid JSON"),
    ('["calculator"]', "not a JSON object"),
    ('{"arguments": {"expression": "1"}}', 'no "name"'),
    ('{"name": 7, "arguments": {}}', 'no "name"'),
    ('{"name": "calculator", "arguments": "3+4"}', '"arguments" must be a JSON object'),
    ('{"name": "calculator", "arguments": [1]}', '"arguments" must be a JSON object'),
    ('{"name": "search", "arguments": {}}', "unknown tool 'search'"),
])
def test_malformed_calls_are_reported_not_raised(body, reason):
    content, calls, malformed = parse_tool_calls("before " + block(body) + " after", [CALC, LOOKUP])
    assert calls == ()
    assert len(malformed) == 1 and reason in malformed[0]
    assert content == "before  after"


def test_unknown_tool_error_names_the_declared_tools():
    _, _, malformed = parse_tool_calls(block('{"name": "search", "arguments": {}}'), [CALC, LOOKUP])
    assert "calculator, lookup" in malformed[0]


def test_an_unclosed_tag_is_an_error_and_its_text_is_not_content():
    text = "I will call <tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expre"
    content, calls, malformed = parse_tool_calls(text, [CALC])
    assert content == "I will call" and calls == ()
    assert malformed == ("a <tool_call> that is never closed with </tool_call>",)


def test_a_good_call_after_an_unclosed_tag_is_still_parsed():
    good = block('{"name": "lookup", "arguments": {"word": "cat"}}')
    content, calls, malformed = parse_tool_calls("<tool_call> oops " + good + " done", [LOOKUP])
    assert calls == (ToolCall("lookup", {"word": "cat"}, "call_0"),)
    assert len(malformed) == 1 and "never closed" in malformed[0]
    assert content == "done"


def test_a_stray_closing_tag_is_an_error():
    content, calls, malformed = parse_tool_calls("answer 3 </tool_call>", [CALC])
    assert content == "answer 3" and calls == ()
    assert malformed == ("a </tool_call> without a <tool_call> before it",)


def test_good_and_bad_calls_in_one_turn():
    text = block('{"name": "calculator", "arguments": {"expression": "2*3"}}') + block("not json")
    _, calls, malformed = parse_tool_calls(text, [CALC])
    assert [c.arguments for c in calls] == [{"expression": "2*3"}]
    assert len(malformed) == 1 and "not valid JSON" in malformed[0]


def test_rendered_calls_parse_back_to_the_same_calls():
    calls = (ToolCall("calculator", {"expression": "12 / (3 - 1)"}, "call_0"),
             ToolCall("lookup", {"word": "ünïcode \"quoted\"", "n": [1, 2]}, "call_1"))
    text = render_turn("Thinking.", calls)
    assert text.startswith("Thinking.\n<tool_call>\n{")
    assert parse_tool_calls(text, [CALC, LOOKUP]) == ("Thinking.", calls, ())
    assert render_turn("", calls) == render_tool_calls(calls)
    assert render_turn("just text", ()) == "just text"


def test_openai_form_carries_arguments_as_a_json_string():
    (form,) = openai_tool_calls([ToolCall("calculator", {"expression": "1+1"}, "call_0")])
    assert form["id"] == "call_0" and form["type"] == "function"
    assert form["function"]["name"] == "calculator"
    assert json.loads(form["function"]["arguments"]) == {"expression": "1+1"}


def test_tools_prompt_lists_every_tool_schema_and_the_call_format():
    text = tools_prompt([CALC, LOOKUP])
    listed = text.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == [CALC.schema(), LOOKUP.schema()]
    assert "<tool_call>" in text and '"arguments"' in text
