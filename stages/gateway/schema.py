"""The OpenAI request bodies the gateway accepts, as msgspec structs: a body that does not decode into
one is a 400 naming the field. Fields the gateway does not act on (`model`, `seed`, `user`, ...) are
accepted and ignored, as OpenAI-compatible servers do; unknown fields are ignored too."""

from __future__ import annotations

from typing import Any

import msgspec


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str = "{}"


class ToolCallIn(msgspec.Struct):
    function: FunctionCall
    id: str = ""
    type: str = "function"


class Message(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(msgspec.Struct):
    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolDef(msgspec.Struct):
    function: FunctionDef
    type: str = "function"


class Sampling(msgspec.Struct, kw_only=True):
    """What chat and text completions share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    seed: int | None = None
    user: str | None = None


class ChatRequest(Sampling, kw_only=True):
    messages: list[Message]
    tools: list[ToolDef] | None = None
    tool_choice: Any = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(Sampling, kw_only=True):
    prompt: str | list[str | int | list[int]]  # one text, texts, one list of ids, lists of ids
    logprobs: int | None = None
    echo: bool = False


class RewardBody(msgspec.Struct):
    reward: float
