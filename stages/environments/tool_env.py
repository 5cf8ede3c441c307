"""`ToolEnvironment`: a base for environments whose model calls tools, dispatching each declared tool.

A subclass declares `tools` and, for each, a method `tool_<name>(**arguments)` (sync or async)
returning the result text; it writes `start` and `answer` (the model's final turn: one with no tool
call). `step` then runs a turn's calls in order and answers each with a `tool` message, and each call
the model wrote badly (`ModelTurn.malformed`) with an error message, both as observations:

    {"role": "tool", "name": <tool>, "tool_call_id": <id>, "content": <result or "error: ...">}

Invariants: a call with arguments its method cannot take, or whose method raises `ToolError`, is
answered "error: ..." and the episode goes on; any other exception from a tool is a bug and fails the
episode (the rollout counts it). The episode ends at the model's answer, or after `max_turns` model
turns (then with reward 0 and info "out_of_turns" = 1).
"""

from __future__ import annotations

import inspect
from typing import Any

from stages.data.tasks import Prompt
from stages.environments.base import Message, ModelTurn, Step, Tool, ToolCall


class ToolError(Exception):
    """A tool could not do what the call asked (bad input); its message is the model's observation."""


class ToolEnvironment:
    """Dispatches declared tools to `tool_<name>` methods (see the module docstring)."""

    tools: tuple[Tool, ...] = ()

    def __init__(self, max_turns: int = 4) -> None:
        if max_turns < 1:
            raise ValueError(f"environment max_turns must be >= 1, got {max_turns}")
        missing = [t.name for t in self.tools if not callable(getattr(self, f"tool_{t.name}", None))]
        if missing:
            raise TypeError(f"{type(self).__name__} declares tools {missing} without tool_<name> methods")
        self.max_turns = max_turns
        self.turns = 0

    async def start(self, sample: Prompt) -> list[Message]:
        raise NotImplementedError

    async def answer(self, turn: ModelTurn) -> Step:
        """The model's final turn (no tool call): score it; the returned step should be `done`."""
        raise NotImplementedError

    async def step(self, turn: ModelTurn) -> Step:
        self.turns += 1
        if not turn.tool_calls and not turn.malformed:
            return await self.answer(turn)
        if self.turns >= self.max_turns:
            return Step(done=True, info={"turns": float(self.turns), "out_of_turns": 1.0})
        results = [(call, *await self.run_tool(call)) for call in turn.tool_calls]
        messages = [tool_message(text if ok else f"error: {text}", call) for call, text, ok in results]
        messages += [tool_message(f"error: {reason}") for reason in turn.malformed]
        failed = len(turn.malformed) + sum(not ok for _, _, ok in results)
        return Step(messages=messages,
                    info={"tool_calls": float(len(messages)), "tool_errors": float(failed)})

    async def run_tool(self, call: ToolCall) -> tuple[str, bool]:
        """Run one call: (its result, True) or (why it failed, False)."""
        handler = getattr(self, f"tool_{call.name}", None) if call.name in {t.name for t in self.tools} else None
        if handler is None:
            return f"unknown tool {call.name!r}", False
        try:
            bound = inspect.signature(handler).bind(**call.arguments)
        except TypeError as exc:
            return f"bad arguments for {call.name}: {exc}", False
        try:
            result = handler(*bound.args, **bound.kwargs)
            if inspect.isawaitable(result):
                result = await result
        except ToolError as exc:
            return str(exc), False
        return str(result), True

    async def close(self) -> None:
        return None


def tool_message(content: str, call: ToolCall | None = None) -> dict[str, Any]:
    """A `tool` message answering `call` (or a call too malformed to name)."""
    message: dict[str, Any] = {"role": "tool", "content": content}
    if call is not None:
        message.update(name=call.name, tool_call_id=call.id)
    return message
