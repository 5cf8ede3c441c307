"""Renderers: messages to token ids and model tokens to a parsed turn, for token-in token-out episodes.

An episode's ids are built by appending, never by re-rendering the conversation (see
`stages.environments.tokens`): the first prompt (`prompt_ids`), then each model turn as the engine
emitted it, then each environment reply tokenized alone (`reply_ids`), and so on. A renderer makes
the two kinds of appended ids and reads the model's turns (`turn`):

- `ChatRenderer`: the tokenizer's chat template. A reply is found by a rule that needs no
  per-template code: render a fixed user/assistant exchange followed by the new messages, with the
  generation prompt; the reply is the text after the end-of-turn (stop) token that closes the
  fixed assistant message, tokenized with add_special_tokens=False. So the reply holds exactly the
  new messages' markup and the next generation prompt, nothing the template puts before the
  conversation (such as a default system prompt).
- `PlainRenderer`: a tokenizer without a chat template (the tiny digit model): message contents
  concatenated, the first prompt tokenized as `stages.data.model.prompt_token_ids` does (its BOS
  included), replies without special tokens.

Both keep one invariant at a turn boundary: the history always holds a stop token after a model
turn. The engine's stop token is part of the model's ids when the turn ended on it
(`after_stop=True`, which `ended_on_stop(ids)` tells); otherwise (cut by length, or an engine that
leaves the stop token out) the reply starts with the stop token.
A turn's text is decoded without special tokens, and its tool calls parsed when tools are declared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from stages.data.model import decode_many, stop_token_ids
from stages.environments.base import Message, ModelTurn, Tool
from stages.environments.tool_calls import parse_tool_calls, tools_prompt

_MARK = "baton-renderer-probe"  # content of the fixed conversation's messages; never in real replies
_BASE = [{"role": "user", "content": _MARK}, {"role": "assistant", "content": _MARK}]
_PROBE_TOOL = Tool(_MARK, _MARK)


@runtime_checkable
class Renderer(Protocol):
    """Messages to appended token ids, and a model turn's ids to a `ModelTurn` (module docstring)."""

    stop_ids: tuple[int, ...]

    def prompt_ids(self, messages: list[Message], tools: Sequence[Tool] = ()) -> list[int]: ...

    def reply_ids(self, messages: list[Message], after_stop: bool) -> list[int]: ...

    def turn(self, token_ids: Sequence[int], finish_reason: str, tools: Sequence[Tool] = ()) -> ModelTurn: ...

    def ended_on_stop(self, token_ids: Sequence[int]) -> bool: ...


class _Turns:
    """What both renderers share: the tokenizer, its stop ids and reading a model turn."""

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = tuple(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer)
        if not self.stop_ids:
            raise ValueError("a renderer needs a stop token: the tokenizer has no EOS and none was given")

    def turn(self, token_ids: Sequence[int], finish_reason: str, tools: Sequence[Tool] = ()) -> ModelTurn:
        """The model's tokens decoded (special tokens skipped); tool calls parsed when `tools` are declared."""
        (text,) = decode_many(self.tokenizer, [list(token_ids)])
        if not tools:
            return ModelTurn(text=text, content=text, finish_reason=finish_reason)
        content, calls, malformed = parse_tool_calls(text, tools)
        return ModelTurn(text=text, content=content, tool_calls=calls, malformed=malformed,
                         finish_reason=finish_reason)

    def ended_on_stop(self, token_ids: Sequence[int]) -> bool:
        """The model's turn ends with a stop token: the `after_stop` its reply is rendered with."""
        return len(token_ids) > 0 and int(token_ids[-1]) in self.stop_ids

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


class PlainRenderer(_Turns):
    """A tokenizer without a chat template: contents concatenated (no roles, no tools)."""

    def prompt_ids(self, messages: list[Message], tools: Sequence[Tool] = ()) -> list[int]:
        """The contents as one plain prompt, with the special tokens the tokenizer adds (its BOS)."""
        if tools:
            raise ValueError("a plain-text prompt cannot show tools; use a tokenizer with a chat template")
        return list(self.tokenizer.encode(_joined(messages), add_special_tokens=True))

    def reply_ids(self, messages: list[Message], after_stop: bool) -> list[int]:
        """The contents without special tokens, after a stop token when the model's turn had none."""
        return ([] if after_stop else [self.stop_ids[0]]) + self._encode(_joined(messages))


class ChatRenderer(_Turns):
    """The tokenizer's chat template (module docstring). `shows_tools`: the template renders `tools`;
    when it does not, tools are listed in a Hermes-style system message instead."""

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int] | None = None) -> None:
        super().__init__(tokenizer, stop_ids)
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("ChatRenderer needs a tokenizer with a chat template; use PlainRenderer")
        self.shows_tools = self._render(_BASE[:1], [_PROBE_TOOL]) != self._render(_BASE[:1], [])

    def prompt_ids(self, messages: list[Message], tools: Sequence[Tool] = ()) -> list[int]:
        """The first prompt: `messages` rendered with the generation prompt and `tools` shown."""
        if tools and not self.shows_tools:
            messages, tools = with_tools_message(messages, tools), ()
        return self._encode(self._render(messages, tools))

    def reply_ids(self, messages: list[Message], after_stop: bool) -> list[int]:
        """`messages` rendered alone, then the next generation prompt (the rule in the module docstring).

        Raises ValueError when the template closes an assistant message with no stop token, or leaves a
        new message's content out of the reply (then replies cannot be tokenized alone)."""
        full = self._render([*_BASE, *messages], ())
        start = full.find(_MARK, full.find(_MARK) + len(_MARK)) + len(_MARK)  # after the assistant's content
        ends = [(full.find(text, start), stop, text) for stop, text in self._stop_texts()]
        ends = [end for end in ends if end[0] >= 0]
        if not ends:
            raise ValueError("the chat template ends an assistant message with none of the stop tokens "
                             f"{list(self.stop_ids)}; an environment reply cannot be split from it")
        at, stop, text = min(ends)
        reply = full[at + len(text):]
        missing = [m["content"] for m in messages if isinstance(m.get("content"), str)
                   and m["content"].strip() not in reply]
        if missing:
            raise ValueError(f"the chat template did not render {missing[0]!r} after the assistant's turn")
        return ([] if after_stop else [stop]) + self._encode(reply)

    def _stop_texts(self) -> list[tuple[int, str]]:
        return [(stop, self.tokenizer.decode([stop])) for stop in self.stop_ids]

    def _render(self, messages: list[Message], tools: Sequence[Tool]) -> str:
        schemas = [t.schema() for t in tools] or None
        return self.tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)


def with_tools_message(messages: list[Message], tools: Sequence[Tool]) -> list[Message]:
    """`messages` with the tools listed at the end of the system message (one is added when none leads)."""
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{tools_prompt(tools)}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": tools_prompt(tools)}, *messages]


def renderer_for(tokenizer: Any, chat: bool, stop_ids: Sequence[int] | None = None) -> Renderer:
    """The renderer a task's prompts need: chat messages (`chat`) -> ChatRenderer, else PlainRenderer."""
    return ChatRenderer(tokenizer, stop_ids) if chat else PlainRenderer(tokenizer, stop_ids)


def _joined(messages: list[Message]) -> str:
    return "".join(str(m.get("content") or "") for m in messages)
