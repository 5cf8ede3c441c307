"""Environments: what multi-turn episodes talk to (contract in `stages.environments.base`).

`make_environment(kind, **options)` builds one environment (one per episode): `kind` is a built-in
name (`ENVIRONMENTS`) or a user's `"pkg.module:Class"`, `options` its keyword arguments from config.
The pieces an episode is assembled from: `render` (messages to token ids and model tokens to a
parsed turn), `tokens` (the token-in token-out record), `tool_calls` (the Hermes tool-call format)
and `tool_env` (a base that dispatches declared tools).
"""

from __future__ import annotations

from typing import Any

from pipeline import plugins
from stages.environments.base import Environment

ENVIRONMENTS = {
    "feedback": "stages.environments.feedback:DigitFeedback",
    "calculator": "stages.environments.calculator:Calculator",
}


def environment_class(kind: str) -> type:
    """The class `kind` names (PluginError, a ValueError, naming the fix when it names none)."""
    cls = plugins.resolve(kind, ENVIRONMENTS, what="environment")
    if not callable(cls):
        raise plugins.PluginError(f"environment {kind!r} is not a class")
    return cls


def make_environment(kind: str, **options: Any) -> Environment:
    """A fresh environment of `kind` made with `options`; ValueError names the kind when the options do
    not fit its constructor or what it makes lacks start/step/close/tools."""
    cls = environment_class(kind)
    try:
        env = cls(**options)
    except TypeError as exc:
        raise ValueError(f"environment {kind!r}: {exc}") from None
    if not isinstance(env, Environment):
        raise ValueError(f"environment {kind!r} makes {type(env).__name__}, which lacks the Environment methods "
                         "(tools, async start(sample), step(turn), close())")
    return env


__all__ = ["ENVIRONMENTS", "Environment", "environment_class", "make_environment"]
