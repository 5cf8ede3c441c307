"""The environment contract: what every environment (`stages.environments.base.Environment`) does,
checked on the built-in ones and the ones the configs and benchmarks plug in, each made by its kind
the way a run makes it (`make_environment`) and driven the way the rollout drives it.

A new environment passes by adding an `EnvironmentCase` to `ENVIRONMENTS`: how to make one (with
the options its config gives), a sample of the task it serves, a turn that does not end an episode
by itself, the turn limit its options set, and a turn that answers (by default the sample's answer).

The contract:
- `start(sample)` returns the episode's first messages: a non-empty list of well-formed messages
  (a known role, text content); `tools` is a tuple of `Tool`s;
- `step(turn)` returns a `Step`: well-formed messages (some, unless the episode is `done`), a finite
  float reward, a bool `done`, `info` of finite numbers; the episode ends within its turn limit, and
  at a turn that answers the sample, with more reward than an episode that never does;
- `close()` may be called before `start`, after any step, and twice;
- instances share no state: an episode's steps are the same whether or not another runs beside it;
- a tool call the model wrote badly (unknown tool, arguments the tool cannot take, malformed) is
  answered with an error message to the model, never an exception.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from stages.data.datasets import DatasetTask
from stages.data.tasks import Prompt, ReverseDigits
from stages.environments import Environment, make_environment
from stages.environments.base import ModelTurn, Step, Tool, ToolCall

pytestmark = pytest.mark.anyio

ROLES = {"system", "user", "assistant", "tool"}


def said(text: str) -> ModelTurn:
    return ModelTurn(text=text, content=text)


def calls(*made: ToolCall, malformed: tuple[str, ...] = ()) -> ModelTurn:
    return ModelTurn(text="", content="", tool_calls=made, malformed=malformed)


def reverse_digits(rng: random.Random, folder: Path) -> Prompt:
    return ReverseDigits(digits=4).sample(rng)  # configs/agent-feedback.toml's task


def math_rows(rng: random.Random, folder: Path) -> Prompt:
    """A row of the math example's data (configs/agent-tools.toml's task)."""
    from tools.make_math_example import make_math_data

    train = folder / "train.jsonl"
    if not train.exists():
        make_math_data(folder, train=20, eval=2)
    return DatasetTask(train, prompt_field="question", answer_field="answer").sample(rng)


@dataclass(frozen=True)
class EnvironmentCase:
    name: str
    kind: str  # what a config's [environment] kind names
    options: dict[str, Any]  # the rest of its [environment] table
    sample: Callable[[random.Random, Path], Prompt]  # a sample of the task it serves (may write data under Path)
    keep_going: Callable[[Prompt], ModelTurn]  # a turn that does not end the episode by itself
    max_turns: int  # the turn limit its options set
    finish: Callable[[Prompt], ModelTurn] = lambda s: said(s.answer)  # a turn that ends it, scored best

    def make(self) -> Environment:
        return make_environment(self.kind, **self.options)


ENVIRONMENTS = [
    EnvironmentCase("feedback (configs/agent-feedback.toml)", "feedback",
                    {"max_turns": 3, "turn_discount": 0.8, "show": "answer"},
                    reverse_digits, lambda s: said("x" * len(s.answer)), max_turns=3),
    EnvironmentCase("feedback, mistakes shown", "feedback", {"max_turns": 2},
                    reverse_digits, lambda s: said(s.answer[:-1]), max_turns=2),
    EnvironmentCase("calculator (configs/agent-tools.toml)", "calculator",
                    {"max_turns": 3, "reward": "math_verify"},
                    math_rows, lambda s: calls(ToolCall("calculator", {"expression": "(12 + 3) * 4"}, "call_0")),
                    max_turns=3),
    EnvironmentCase("long tail (benchmarks/long_tail.py)", "benchmarks._long_tail_env:LongTailFeedback",
                    {"seed": 1, "min_turns": 3, "max_turns": 3, "latency_min_s": 0.001, "latency_max_s": 0.002},
                    reverse_digits, lambda s: said("x" * len(s.answer)), max_turns=3),
]
CASES = [pytest.param(case, id=case.name) for case in ENVIRONMENTS]
WITH_TOOLS = [pytest.param(case, id=case.name) for case in ENVIRONMENTS if case.make().tools]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("environment-contract")


def assert_messages(messages: Any) -> None:
    assert isinstance(messages, list)
    for message in messages:
        assert isinstance(message, dict) and message.get("role") in ROLES, message
        assert isinstance(message.get("content"), str), message


def assert_step(step: Any) -> None:
    assert isinstance(step, Step)
    assert isinstance(step.reward, float) and math.isfinite(step.reward), step.reward
    assert isinstance(step.done, bool)
    assert_messages(step.messages)
    assert step.done or step.messages, "an episode that goes on answers the model"
    assert all(isinstance(k, str) and isinstance(v, int | float) and math.isfinite(v) for k, v in step.info.items())


async def episode(case: EnvironmentCase, env: Environment, sample: Prompt) -> list[Step]:
    """Drive `env` with `case.keep_going` turns until it is done (at most one turn past its limit)."""
    steps = []
    for _ in range(case.max_turns + 1):
        steps.append(await env.step(case.keep_going(sample)))
        if steps[-1].done:
            break
    return steps


@pytest.mark.parametrize("case", CASES)
async def test_start_gives_the_first_messages(case: EnvironmentCase, data: Path) -> None:
    env = case.make()
    assert isinstance(env, Environment)
    assert isinstance(env.tools, tuple) and all(isinstance(t, Tool) for t in env.tools)
    messages = await env.start(case.sample(random.Random(0), data))
    assert_messages(messages)
    assert messages and messages[-1]["role"] == "user"
    await env.close()


@pytest.mark.parametrize("case", CASES)
async def test_each_step_is_well_formed_and_the_episode_ends_within_its_turns(case: EnvironmentCase,
                                                                               data: Path) -> None:
    for seed in range(3):
        env, sample = case.make(), case.sample(random.Random(seed), data)
        await env.start(sample)
        steps = await episode(case, env, sample)
        for step in steps:
            assert_step(step)
        assert steps[-1].done and len(steps) <= case.max_turns
        await env.close()


@pytest.mark.parametrize("case", CASES)
async def test_an_episode_ends_at_its_answer_scored_above_giving_up(case: EnvironmentCase, data: Path) -> None:
    sample = case.sample(random.Random(3), data)
    env = case.make()
    await env.start(sample)
    given_up = sum(step.reward for step in await episode(case, env, sample))
    for turns_before in range(case.max_turns):
        env = case.make()
        await env.start(sample)
        steps = [await env.step(case.keep_going(sample)) for _ in range(turns_before)]
        steps.append(await env.step(case.finish(sample)))
        for step in steps:
            assert_step(step)
        assert [step.done for step in steps] == [False] * turns_before + [True]
        assert sum(step.reward for step in steps) > given_up
        await env.close()


@pytest.mark.parametrize("case", CASES)
async def test_close_may_come_at_any_point_and_twice(case: EnvironmentCase, data: Path) -> None:
    sample = case.sample(random.Random(0), data)
    await case.make().close()  # its start failed: the rollout still closes it
    for taken in range(case.max_turns + 1):
        env = case.make()
        await env.start(sample)
        for _ in range(taken):
            if (await env.step(case.keep_going(sample))).done:
                break
        await env.close()
        await env.close()


@pytest.mark.parametrize("case", CASES)
async def test_instances_share_no_state(case: EnvironmentCase, data: Path) -> None:
    one, other = case.sample(random.Random(1), data), case.sample(random.Random(2), data)
    alone = case.make()
    first = await alone.start(one)
    expected = await episode(case, alone, one)
    a, b = case.make(), case.make()
    assert await a.start(one) == first
    await b.start(other)
    got = []
    for _ in expected:  # turn by turn, another episode between each two
        got.append(await a.step(case.keep_going(one)))
        await b.step(case.keep_going(other))
    assert got == expected
    for env in (alone, a, b):
        await env.close()


@pytest.mark.parametrize("case", WITH_TOOLS)
async def test_a_badly_written_tool_call_is_answered_with_an_error(case: EnvironmentCase, data: Path) -> None:
    env = case.make()
    await env.start(case.sample(random.Random(0), data))
    bad = [ToolCall(tool.name, {"no_such_argument": 1}, f"call_{i}") for i, tool in enumerate(env.tools)]
    step = await env.step(calls(*bad, ToolCall("no_such_tool", {}, "call_x"), malformed=("not valid JSON",)))
    assert_step(step)
    assert not step.done and len(step.messages) == len(bad) + 2
    assert all(m["role"] == "tool" and m["content"].startswith("error") for m in step.messages), step.messages
    await env.close()
