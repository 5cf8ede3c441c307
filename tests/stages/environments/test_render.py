"""Renderers: the first prompt, environment replies tokenized alone, and model turns read back, with
the math example's byte-level BPE ChatML tokenizer (`ChatRenderer`) and the tiny digit model's
character tokenizer (`PlainRenderer`)."""

from __future__ import annotations

import numpy as np
import pytest

from stages.data.model import load_tokenizer, make_tiny_model, prompt_token_ids
from stages.environments.base import Tool, ToolCall
from stages.environments.render import ChatRenderer, PlainRenderer, Renderer, renderer_for, with_tools_message
from stages.environments.tool_calls import render_turn, tools_prompt
from tools.make_math_example import make_tokenizer

PLAIN_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DEFAULT_SYSTEM = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant."
                  "<|im_end|>\n{% endif %}" + PLAIN_CHATML)
CALC = Tool("calculator", "Evaluate arithmetic.",
            {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})
CONVERSATION = [{"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": "Ann has 3 apples and gets 4 more. How many apples does Ann have now?"}]


@pytest.fixture(scope="session")
def bpe():
    return make_tokenizer()


@pytest.fixture(scope="session")
def stops(bpe):
    return (bpe.convert_tokens_to_ids("<|im_end|>"), bpe.convert_tokens_to_ids("<|endoftext|>"))


@pytest.fixture
def chat(bpe, stops):
    return ChatRenderer(bpe, stops)


def with_template(template: str):
    tok = make_tokenizer()
    tok.chat_template = template
    return tok


def test_the_first_prompt_is_the_chat_template_with_the_generation_prompt(chat, bpe):
    assert chat.prompt_ids(CONVERSATION) == prompt_token_ids(bpe, messages=CONVERSATION)
    assert bpe.decode(chat.prompt_ids(CONVERSATION)).endswith("<|im_start|>assistant\n")


def test_the_math_template_renders_conversations_without_tools_as_plain_chatml(bpe):
    tool_free = [*CONVERSATION, {"role": "assistant", "content": "7"}, {"role": "user", "content": "Sure?"}]
    for add in (True, False):
        ours = bpe.apply_chat_template(tool_free, tokenize=False, add_generation_prompt=add)
        assert ours == bpe.apply_chat_template(tool_free, tokenize=False, add_generation_prompt=add,
                                               chat_template=PLAIN_CHATML)


def test_tools_reach_the_model_through_the_template_or_a_system_message(chat, stops):
    plain = ChatRenderer(with_template(PLAIN_CHATML), stops)
    assert chat.shows_tools and not plain.shows_tools
    shown = chat.prompt_ids(CONVERSATION, [CALC])
    assert shown == plain.prompt_ids(CONVERSATION, [CALC])  # the math template writes the fallback's text
    text = chat.tokenizer.decode(shown)
    assert text.startswith("<|im_start|>system\nAnswer with a number.\n\n" + tools_prompt([CALC]) + "<|im_end|>\n")
    assert shown != chat.prompt_ids(CONVERSATION)


def test_the_fallback_adds_a_system_message_when_none_leads():
    messages = with_tools_message([{"role": "user", "content": "hi"}], [CALC])
    assert messages == [{"role": "system", "content": tools_prompt([CALC])}, {"role": "user", "content": "hi"}]


def test_a_reply_is_the_new_messages_and_the_next_generation_prompt(chat, bpe):
    ids = chat.reply_ids([{"role": "user", "content": "Are you sure?"}], after_stop=True)
    assert bpe.decode(ids) == "\n<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n"
    assert ids == list(bpe.encode(bpe.decode(ids), add_special_tokens=False))


def test_tool_results_render_as_tool_responses_in_one_user_turn(chat, bpe):
    replies = [{"role": "tool", "name": "calculator", "content": "7"}, {"role": "tool", "content": "error: x"}]
    assert bpe.decode(chat.reply_ids(replies, after_stop=True)) == (
        "\n<|im_start|>user\n<tool_response>\n7\n</tool_response>\n<tool_response>\nerror: x\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")


def test_a_turn_cut_by_length_gets_the_stop_token_first(chat, stops):
    assert chat.ended_on_stop([5, stops[1]]) and chat.ended_on_stop(np.array([5, stops[0]]))
    assert not chat.ended_on_stop([stops[0], 5]) and not chat.ended_on_stop([])
    reply = [{"role": "user", "content": "Go on."}]
    assert chat.reply_ids(reply, after_stop=False) == [stops[0], *chat.reply_ids(reply, after_stop=True)]


def test_a_default_system_prompt_stays_out_of_the_reply(chat, stops):
    templated = ChatRenderer(with_template(DEFAULT_SYSTEM), stops)
    assert "You are a helpful assistant." in templated.tokenizer.decode(templated.prompt_ids(CONVERSATION[1:]))
    reply = [{"role": "user", "content": "Again."}]
    assert templated.reply_ids(reply, True) == chat.reply_ids(reply, True)


def test_appended_ids_equal_the_whole_conversation_rendered_when_the_model_writes_canonical_ids(chat, bpe, stops):
    """The reply rule is exact: prompt + model turn + reply == the template over the whole conversation
    (for a completion whose ids are the canonical encoding of its text)."""
    answer = render_turn("Let me check.", [ToolCall("calculator", {"expression": "3 + 4"})])
    model = [*bpe.encode(answer, add_special_tokens=False), stops[0]]
    reply = [{"role": "tool", "content": "7"}]
    appended = chat.prompt_ids(CONVERSATION, [CALC]) + model + chat.reply_ids(reply, after_stop=True)
    assistant = {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3 + 4"}}}]}
    assert appended == chat.prompt_ids([*CONVERSATION, assistant, *reply], [CALC])


def test_a_template_without_a_stop_token_after_the_assistant_cannot_split_replies(stops):
    no_end = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="none of the stop tokens"):
        ChatRenderer(with_template(no_end), stops).reply_ids([{"role": "user", "content": "x"}], True)


def test_a_template_that_drops_a_message_is_refused(stops):
    user_only = ("{% for m in messages %}{% if m['role'] != 'tool' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="did not render"):
        ChatRenderer(with_template(user_only), stops).reply_ids([{"role": "tool", "content": "42"}], True)


def test_a_chat_renderer_needs_a_template(stops):
    with pytest.raises(ValueError, match="chat template"):
        ChatRenderer(with_template(None), stops)


def test_a_turn_is_decoded_without_special_tokens_and_its_calls_parsed(chat, bpe, stops):
    text = render_turn("Checking.", [ToolCall("calculator", {"expression": "2*3"})])
    ids = [*bpe.encode(text, add_special_tokens=False), stops[0]]
    turn = chat.turn(ids, "stop", [CALC])
    assert turn.text == text and turn.content == "Checking." and turn.finish_reason == "stop"
    assert turn.tool_calls == (ToolCall("calculator", {"expression": "2*3"}, "call_0"),) and turn.malformed == ()
    unknown = chat.turn(ids, "length", [Tool("other", "")])
    assert unknown.tool_calls == () and "unknown tool" in unknown.malformed[0]
    no_tools = chat.turn(ids, "stop")
    assert no_tools.content == text and no_tools.tool_calls == () and no_tools.malformed == ()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return load_tokenizer(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def test_plain_prompts_are_tokenized_as_the_rollout_does_with_bos(tiny):
    plain = PlainRenderer(tiny)
    assert plain.stop_ids == (tiny.eos_token_id,)
    ids = plain.prompt_ids([{"role": "user", "content": "12>"}])
    assert ids == prompt_token_ids(tiny, "12>") and ids[0] == tiny.bos_token_id
    assert plain.reply_ids([{"role": "user", "content": "=1>"}], after_stop=True) == tiny.encode(
        "=1>", add_special_tokens=False)
    assert plain.reply_ids([{"role": "user", "content": "=1>"}], after_stop=False)[0] == tiny.eos_token_id
    assert plain.turn([*tiny.encode("21", add_special_tokens=False), tiny.eos_token_id], "stop").text == "21"
    with pytest.raises(ValueError, match="cannot show tools"):
        plain.prompt_ids([{"role": "user", "content": "1>"}], [CALC])


def test_renderer_for_picks_by_whether_prompts_are_chat(bpe, tiny):
    assert isinstance(renderer_for(bpe, chat=True), ChatRenderer)
    assert isinstance(renderer_for(tiny, chat=False), PlainRenderer)
    assert isinstance(renderer_for(tiny, chat=False), Renderer)


def test_decode_many_equals_the_tokenizers_own_decode(bpe, tmp_path) -> None:
    """The fast path (one Rust call) gives exactly what `tokenizer.decode` gives, special tokens skipped
    or kept, on the byte-level BPE chat tokenizer and the tiny char-level one."""
    from stages.data.model import decode_many

    make_tiny_model(tmp_path / "tiny")
    for tok in (bpe, load_tokenizer(tmp_path / "tiny")):
        rng = np.random.default_rng(0)
        seqs = [rng.integers(0, len(tok), size=n).tolist() for n in (0, 1, 7, 40)]
        for skip in (True, False):
            assert decode_many(tok, seqs, skip) == [tok.decode(s, skip_special_tokens=skip) for s in seqs]
