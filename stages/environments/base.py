"""The environment contract: what a multi-turn episode talks to.

An episode is one conversation between the model and an environment. The rollout stage makes one
environment object per episode (from config: `environment = "pkg.module:Class"` plus options) and
drives it:

    messages = await env.start(sample)          # the first messages (system/user), from a task sample
    while not done:                             # model turn, then the environment's reply
        turn = <the model's tokens, decoded and parsed into a ModelTurn>
        step = await env.step(turn)             # new messages, a reward, done?
    await env.close()                           # always called, also after a failure or timeout

Invariants the rollout keeps for every environment:
- The environment sees text and parsed tool calls, never token ids; the rollout appends the tokens
  of `step.messages` rendered alone (token-in token-out), so nothing the model emitted is re-encoded.
- An environment that raises or outlives its step timeout fails its episode (counted, with the
  reason); it never ends the run.
- The episode's reward is the sum of its steps' rewards.
- A tool call the model wrote badly reaches the environment as `ModelTurn.malformed`, an
  observation to answer like any other; it is never an exception.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from stages.data.tasks import Prompt

Message = dict[str, Any]  # an OpenAI/chat-template message: {"role": ..., "content": ..., ...}


@dataclass(frozen=True)
class Tool:
    """A tool an environment offers: its name, what it does, and its JSON-schema parameters
    (rendered into the prompt by the chat template's `tools`)."""

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool form that chat templates and the gateway take."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call parsed from the model's text: a tool name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]
    id: str = ""


@dataclass(frozen=True)
class ModelTurn:
    """What the model said in one turn: its text with tool-call markup removed (`content`), the raw
    decoded text (`text`), the calls parsed from it, one error string per call that could not be
    parsed (`malformed`), and why the turn ended ("stop" or "length")."""

    text: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    malformed: tuple[str, ...] = ()
    finish_reason: str = "stop"


@dataclass
class Step:
    """The environment's answer to a model turn: messages to append (a `tool` or `user` reply; may be
    empty when `done`), the reward this step earns, whether the episode is over, and anything to
    record (`info`, e.g. {"score": 0.5} per turn; numbers are averaged into the run's metrics)."""

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (a fresh object per episode). `tools` may be empty."""

    tools: tuple[Tool, ...]

    async def start(self, sample: Prompt) -> list[Message]: ...

    async def step(self, turn: ModelTurn) -> Step: ...

    async def close(self) -> None: ...
