"""What an episode's current segment has seen, to decide whether a new request extends it.

A chat transcript is the conversation as the gateway recorded it: the messages of each request it
served, then the assistant message it returned. A request extends the transcript when its messages
start with exactly the recorded ones (assistant turns compared by content and tool calls, tool-call
arguments compared as JSON values, so an agent that re-serializes them still matches) and add at
least one message; only the added messages are then rendered (`reply_ids`). Anything else (an edited
or truncated history, other tools, a resent request) is not an extension: the gateway starts a new
segment instead of re-tokenizing. A text transcript (`/v1/completions`) is the prompt text (or ids)
and the completion returned; a prompt extends it when it starts with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from stages.gateway.schema import Message, ToolDef

Normalized = tuple  # a message reduced to what makes two messages the same


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text", "")) for part in content if part.get("type", "text") == "text")


def _json_value(arguments: str) -> Any:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except ValueError:
        return arguments


def normalize(message: Message) -> Normalized:
    calls = tuple((c.id, c.function.name, _json_value(c.function.arguments)) for c in message.tool_calls or ())
    return (message.role, _text(message.content), message.name or "", calls, message.tool_call_id or "")


def as_dict(message: Message) -> dict[str, Any]:
    """The message as the chat renderer takes it (`content` a string; tool-call arguments as objects;
    OpenAI's newer "developer" role as "system")."""
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": _text(message.content)}
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c)}}
            for c in message.tool_calls
        ]
    return out


def _arguments(call) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


def tool_key(tools: list[ToolDef] | None) -> str:
    return json.dumps([[t.function.name, t.function.description, t.function.parameters] for t in tools or ()],
                      sort_keys=True)


@dataclass
class ChatTranscript:
    tools: str
    messages: list[Normalized] = field(default_factory=list)

    def added(self, messages: list[Message], tools: str) -> list[Message] | None:
        """The messages a request adds to this transcript, or None when it does not extend it."""
        seen = len(self.messages)
        if tools != self.tools or len(messages) <= seen:
            return None
        if [normalize(m) for m in messages[:seen]] != self.messages:
            return None
        return messages[seen:]

    def record(self, messages: list[Message], reply: Message) -> None:
        self.messages = [normalize(m) for m in messages] + [normalize(reply)]


@dataclass
class TextTranscript:
    prompt: str | list[int]

    def added(self, prompt: str | list[int]) -> str | list[int] | None:
        if type(prompt) is not type(self.prompt) or len(prompt) <= len(self.prompt):
            return None
        if prompt[: len(self.prompt)] != self.prompt:
            return None
        return prompt[len(self.prompt):]
