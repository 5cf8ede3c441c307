"""Reward functions: a user's scoring code, called safely by the rollout stage.

A reward function is any callable, named in a config as `"pkg.module:function"` (or a built-in's
name: `exact_match`, `math_verify`, `format_number`). It is called with the keywords it declares out
of `prompt` (the prompt text), `messages` (chat messages or None), `completion` (the decoded text),
`tokens` (the completion's token ids), `answer` (the ground truth), `metadata` (the row's extra
fields) and `source` (the whole `stages.data.tasks.Prompt`), and returns a float. It may be `async`. A
*batched* function (`@batched`, or `RewardFunction(batched=True)`) takes the same keywords as lists,
one entry per sample of a group, and returns a list of floats.

Invariant: scoring never raises. A call that raises, outlives `timeout_s` or returns something that
is not a finite number fails its samples (a batched call fails the whole group); `score` reports the
reason per sample and `on_error` says what the rollout does with them: "zero" scores them 0, "drop"
drops their group. A sync function runs in a worker thread; one that times out is abandoned there
(Python cannot stop a thread), so a reward that can hang should be async or bound its own work.
"""

from __future__ import annotations

import inspect
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio

from pipeline import plugins

ON_ERROR = ("zero", "drop")
KEYWORDS = ("prompt", "messages", "completion", "tokens", "answer", "metadata", "source")


@dataclass(frozen=True)
class Sample:
    """One completion to score, with everything a reward function may ask for."""

    prompt: str
    completion: str
    tokens: Sequence[int]
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] | None = None
    source: Any = None  # the stages.data.tasks.Prompt these came from

    def keywords(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in KEYWORDS}


@dataclass(frozen=True)
class Scores:
    """Per sample: its reward, and why it failed (None: it did not); failed samples score 0."""

    rewards: list[float]
    failures: list[str | None]


def resolve(target: str) -> Callable:
    """A built-in reward's name (`BUILT_IN`) or `"pkg.module:function"` -> the function."""
    return plugins.resolve(target, BUILT_IN, what="reward")


def batched(fn: Callable) -> Callable:
    """Mark `fn` as taking a whole group at once (each keyword a list) and returning a list of floats."""
    fn.batched = True
    return fn


@dataclass(frozen=True)
class KeywordPicker:
    """The keywords a reward function declares, picked from all of them (picklable: a RewardFunction
    travels to other processes with its task)."""

    names: tuple[str, ...] | None  # None: all (the function takes **kwargs)

    def __call__(self, keywords: dict[str, Any]) -> dict[str, Any]:
        return keywords if self.names is None else {n: keywords[n] for n in self.names}


def accepted_keywords(fn: Callable) -> KeywordPicker:
    """Which of the keywords `fn` declares (all of them when it takes **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return KeywordPicker(None)
    unknown = [n for n, p in params.items() if n not in KEYWORDS and p.default is p.empty
               and p.kind not in (p.VAR_POSITIONAL,)]
    if unknown:
        raise ValueError(f"reward function {_name(fn)} asks for {unknown}; it may take only {list(KEYWORDS)}")
    return KeywordPicker(tuple(n for n in params if n in KEYWORDS))


def _name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


async def call(fn: Callable, keywords: dict[str, Any], pick: KeywordPicker | None = None) -> Any:
    """Call `fn` with the keywords it declares (`pick`: `accepted_keywords(fn)`, if the caller keeps it):
    awaited if async, else in a worker thread."""
    picked = (pick or accepted_keywords(fn))(keywords)
    if inspect.iscoroutinefunction(fn):
        return await fn(**picked)
    result = await anyio.to_thread.run_sync(partial(fn, **picked), abandon_on_cancel=True)
    return await result if inspect.isawaitable(result) else result


@dataclass
class RewardFunction:
    """A reward callable (or its `"pkg.module:function"` path / built-in name) with how to call it."""

    fn: Callable | str
    timeout_s: float | None = 10.0  # per call (a batched call: per group); None: no limit
    on_error: str = "zero"  # what a failed sample's group gets: "zero" (scored 0) or "drop" (dropped)
    batched: bool | None = None  # None: as the function is marked (`@batched`)

    def __post_init__(self) -> None:
        if isinstance(self.fn, str):
            self.fn = resolve(self.fn)
        if not callable(self.fn):
            raise ValueError(f"reward {self.fn!r} is not callable")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"reward.on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0 (or unset), got {self.timeout_s}")
        if self.batched is None:
            self.batched = bool(getattr(self.fn, "batched", False))
        self._pick = accepted_keywords(self.fn)  # a function asking for an unknown keyword fails here, not mid-run

    async def score(self, samples: Sequence[Sample]) -> Scores:
        """Score one group (never raises; see the module docstring)."""
        if self.batched:
            keywords = {k: [getattr(s, k) for s in samples] for k in KEYWORDS}
            value, failure = await self._guarded(keywords, len(samples))
            values = value if failure is None else [0.0] * len(samples)
            return Scores(list(values), [failure] * len(samples))
        results: list[tuple[Any, str | None]] = [(0.0, None)] * len(samples)

        async def one(i: int) -> None:
            results[i] = await self._guarded(samples[i].keywords(), None)

        async with anyio.create_task_group() as tg:
            for i in range(len(samples)):
                tg.start_soon(one, i)
        return Scores([r if f is None else 0.0 for r, f in results], [f for _, f in results])

    async def _guarded(self, keywords: dict[str, Any], count: int | None) -> tuple[Any, str | None]:
        """(value, None), or (0.0, reason) when the call raised, timed out or returned no number."""
        try:
            if self.timeout_s is None:  # no cancel scope: it costs more than a quick reward
                value = await call(self.fn, keywords, self._pick)
            else:
                with anyio.fail_after(self.timeout_s):
                    value = await call(self.fn, keywords, self._pick)
        except TimeoutError:
            return 0.0, "timeout"
        except Exception as exc:  # noqa: BLE001 - a user's reward must not end the run
            return 0.0, f"raised {type(exc).__name__}"
        try:
            checked = [float(v) for v in value] if count is not None else float(value)
        except (TypeError, ValueError):
            return 0.0, "not a number"
        if count is not None and len(checked) != count:
            return 0.0, "wrong count"
        if not all(math.isfinite(v) for v in (checked if count is not None else [checked])):
            return 0.0, "not finite"
        return checked, None


def task_reward(task: Any) -> RewardFunction:
    """A built-in task's own `reward(prompt, completion)` as a RewardFunction: one call per group, in the
    event loop (it is quick and ours), no timeout."""

    async def reward(source: list[Any], completion: list[str]) -> list[float]:
        return [task.reward(s, c) for s, c in zip(source, completion, strict=True)]

    reward.__qualname__ = f"{type(task).__name__}.reward"
    return RewardFunction(reward, timeout_s=None, batched=True)


# -- built-in rewards ---------------------------------------------------------------------------------


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion, stripped, is the answer, stripped; else 0.0."""
    return float(completion.strip() == str(answer).strip())


def math_verify(completion: str, answer: str) -> float:
    """1.0 when `math-verify` finds the completion's answer mathematically equal to the ground truth
    (numbers, fractions, LaTeX, \\boxed{...}); else 0.0. Its own signal-based timeouts are off (they only
    work in the main thread); `RewardFunction.timeout_s` bounds the call instead."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold = parse(str(answer), parsing_timeout=None)
    found = parse(completion, parsing_timeout=None)
    if not gold or not found:
        return 0.0
    return float(verify(gold, found, timeout_seconds=None))


def regex_reward(pattern: str, flags: int = 0) -> Callable[..., float]:
    """A format reward: 1.0 when `pattern` matches the whole completion (stripped), else 0.0."""
    compiled = re.compile(pattern, flags)

    def format_reward(completion: str) -> float:
        return float(compiled.fullmatch(completion.strip()) is not None)

    format_reward.__qualname__ = f"regex_reward({pattern!r})"
    return format_reward


format_number = regex_reward(r"-?\d+(\.\d+)?")


def weighted_sum(*parts: tuple[Callable | str, float]) -> Callable[..., Any]:
    """One per-sample reward: the sum of `weight * part(...)` over `(part, weight)` pairs; a part is a
    callable or a `"pkg.module:function"` path / built-in name, sync or async."""
    resolved = [(resolve(p) if isinstance(p, str) else p, float(w)) for p, w in parts]
    for fn, _ in resolved:
        accepted_keywords(fn)

    async def weighted(**keywords: Any) -> float:
        return sum([w * float(await call(fn, keywords)) for fn, w in resolved])

    weighted.__qualname__ = "weighted_sum(" + ", ".join(f"{_name(f)}*{w:g}" for f, w in resolved) + ")"
    return weighted


BUILT_IN = {
    "exact_match": "stages.data.rewards:exact_match",
    "math_verify": "stages.data.rewards:math_verify",
    "format_number": "stages.data.rewards:format_number",
}
