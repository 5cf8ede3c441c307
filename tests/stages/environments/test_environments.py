"""Environments: the registry (built-in names and dotted paths), the digit-feedback environment for the
tiny model, the calculator tool environment and its safe evaluator, the tool-dispatching base; and
whole episodes driven through a renderer and the token record, as the rollout drives them."""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pytest

from pipeline.plugins import PluginError
from stages.data.datasets import DatasetTask
from stages.data.model import ALPHABET, load_tokenizer, make_tiny_model
from stages.data.tasks import Prompt
from stages.environments import ENVIRONMENTS, Environment, environment_class, make_environment
from stages.environments.base import ModelTurn, Step, Tool, ToolCall
from stages.environments.calculator import CALCULATOR, SYSTEM_PROMPT, Calculator, evaluate, format_number
from stages.environments.feedback import DigitFeedback, feedback
from stages.environments.render import ChatRenderer, PlainRenderer
from stages.environments.tokens import EpisodeTokens
from stages.environments.tool_calls import render_turn
from stages.environments.tool_env import ToolEnvironment, ToolError
from tools.make_math_example import make_math_data, make_tokenizer

pytestmark = pytest.mark.anyio


def said(text: str, finish_reason: str = "stop") -> ModelTurn:
    return ModelTurn(text=text, content=text, finish_reason=finish_reason)


def calls(*pairs: tuple[str, dict], malformed: tuple[str, ...] = ()) -> ModelTurn:
    made = tuple(ToolCall(name, args, f"call_{i}") for i, (name, args) in enumerate(pairs))
    return ModelTurn(text="", content="", tool_calls=made, malformed=malformed)


# -- the registry -------------------------------------------------------------------------------------


class NotAnEnvironment:
    def __init__(self, size: int = 1) -> None:
        self.size = size


def test_built_in_kinds_and_dotted_paths_make_environments():
    env = make_environment("feedback", max_turns=2)
    assert isinstance(env, DigitFeedback) and isinstance(env, Environment) and env.max_turns == 2
    assert isinstance(make_environment("calculator"), Calculator)
    assert environment_class("stages.environments.calculator:Calculator") is Calculator
    assert set(ENVIRONMENTS) == {"feedback", "calculator"}


def test_registry_errors_name_the_kind_and_the_fix():
    with pytest.raises(PluginError, match="unknown environment 'sandbox'.*calculator, feedback"):
        make_environment("sandbox")
    with pytest.raises(ValueError, match="environment 'feedback'.*turns"):
        make_environment("feedback", turns=3)
    with pytest.raises(ValueError, match="lacks the Environment methods"):
        make_environment("tests.stages.environments.test_environments:NotAnEnvironment")


# -- digit feedback -----------------------------------------------------------------------------------


def test_feedback_marks_right_positions_and_gives_the_right_digit_elsewhere():
    assert feedback("4321", "4391") == "==2=>"
    assert feedback("4321", "43") == "==21>"
    assert feedback("4321", "") == "4321>"
    assert feedback("4321", "1234x9", right="+") == "4321>"
    assert set(feedback("0987654321", "5")) <= set(ALPHABET)


async def test_a_wrong_then_right_episode_is_discounted_and_scores_each_turn():
    env = DigitFeedback(max_turns=3, turn_discount=0.8)
    assert await env.start(Prompt(text="12>", answer="21")) == [{"role": "user", "content": "12>"}]
    first = await env.step(said("11"))
    assert first == Step(messages=[{"role": "user", "content": "2=>"}], reward=0.0, done=False,
                         info={"turn_score/1": 0.5})
    last = await env.step(said("21"))
    assert last.done and last.messages == [] and last.reward == pytest.approx(0.8)
    assert last.info == {"turn_score/2": 1.0, "turn_gain/2": 0.5, "score": 1.0, "turns": 2.0}


async def test_show_answer_feedback_gives_the_whole_answer():
    env = DigitFeedback(show="answer")
    await env.start(Prompt(text="123>", answer="321"))
    assert (await env.step(said("391"))).messages == [{"role": "user", "content": "321>"}]
    with pytest.raises(ValueError, match="show"):
        DigitFeedback(show="hints")


async def test_right_at_once_pays_most_and_max_turns_ends_the_episode():
    env = DigitFeedback(max_turns=2)
    await env.start(Prompt(text="34>", answer="43"))
    assert (await env.step(said("43"))).reward == 1.0
    await env.start(Prompt(text="34>", answer="43"))
    await env.step(said("00"))
    final = await env.step(said("03"))
    assert final.done and final.reward == pytest.approx(0.5 * 0.8) and final.info["turns"] == 2.0


def test_feedback_options_are_checked():
    for bad in ({"max_turns": 0}, {"turn_discount": 0.0}, {"right": "7"}, {"right": "=="}):
        with pytest.raises(ValueError):
            DigitFeedback(**bad)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return load_tokenizer(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@dataclass
class Completion:  # the fields of stages.engines.base.Completion that EpisodeTokens reads
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray


def emitted(ids: list[int], version: int) -> Completion:
    return Completion(np.array(ids, np.int32), np.full(len(ids), -0.5, np.float32), np.full(len(ids), version))


def uses_feedback(last_attempt: str, reply: str) -> str:
    """A model that uses the feedback: each position from its last attempt (marked right) or the reply."""
    return "".join(a if m == "=" else m for a, m in zip(last_attempt, reply[:-1], strict=True))


async def test_a_feedback_episode_through_the_plain_renderer_keeps_its_tokens_aligned(tiny):
    """Driven as the rollout does: prompt ids, model ids as emitted, feedback ids tokenized alone; a
    model that copies from the feedback is right on its second turn."""
    renderer, env = PlainRenderer(tiny), DigitFeedback()
    sample = Prompt(text="385>", answer="583")
    episode = EpisodeTokens(renderer.prompt_ids(await env.start(sample)))
    attempt, attempts, scores = "593", [], []
    for version in range(env.max_turns):
        ids = tiny.encode(attempt, add_special_tokens=False)  # cut by length: no stop token
        episode.add_model(emitted(ids, version))
        attempts.append(attempt)
        step = await env.step(renderer.turn(ids, "length"))
        scores.append(step.info[f"turn_score/{version + 1}"])
        if step.done:
            break
        episode.add_env(renderer.reply_ids(step.messages, after_stop=False))
        attempt = uses_feedback(attempt, step.messages[0]["content"])
    assert attempts == ["593", "583"] and scores == [pytest.approx(2 / 3), 1.0]
    assert step.done and step.reward == pytest.approx(0.8)
    assert tiny.decode(episode.ids()) == "<|im_start|>385>593<|im_end|>=8=>583"
    row = episode.row()
    assert tiny.decode(row["tokens"][row["loss_mask"] == 1]) == "593583"
    assert row["token_versions"][row["loss_mask"] == 1].tolist() == [0, 0, 0, 1, 1, 1]
    assert episode.version_span() == (0, 1)



@dataclass
class RoutedCompletion(Completion):  # an MoE engine's: each token's routed experts too
    routed_experts: np.ndarray | None = None


def routed(ids: list[int], version: int, first_expert: int) -> RoutedCompletion:
    experts = (first_expert + np.arange(len(ids) * 2 * 2)).reshape(len(ids), 2, 2).astype(np.uint8)
    return RoutedCompletion(*vars(emitted(ids, version)).values(), experts)


def test_routed_experts_ride_along_for_model_tokens_only():
    """Prompt and environment tokens carry zero experts, model tokens theirs, in one [ids, layers, k] column;
    a dense episode has no such column."""
    episode = EpisodeTokens([1, 2, 3])
    first, second = routed([4, 5], 0, 1), routed([8], 1, 100)
    episode.add_model(first)
    episode.add_env([6, 7])
    episode.add_model(second)
    row = episode.row()
    experts = row["routed_experts"]
    assert experts.shape == (8, 2, 2) and experts.dtype == np.uint8
    mask = row["loss_mask"].astype(bool)
    assert np.array_equal(experts[mask], np.concatenate([first.routed_experts, second.routed_experts]))
    assert not experts[~mask].any()
    dense = EpisodeTokens([1, 2, 3])
    dense.add_model(emitted([4, 5], 0))
    assert list(dense.row()) == ["tokens", "logprobs", "loss_mask", "token_versions"]


def test_routed_experts_must_fit_their_turn_and_episode():
    episode = EpisodeTokens([1])
    with pytest.raises(ValueError, match="routed experts: 2 tokens"):
        episode.add_model(RoutedCompletion(*vars(emitted([4, 5], 0)).values(), np.zeros((1, 2, 2), np.uint8)))
    episode.add_model(routed([4, 5], 0, 0))
    with pytest.raises(ValueError, match="without routed experts"):
        episode.add_model(emitted([6], 0))
    with pytest.raises(ValueError, match="after"):
        episode.add_model(RoutedCompletion(*vars(emitted([6], 0)).values(), np.zeros((1, 3, 2), np.uint8)))
    dense = EpisodeTokens([1])
    dense.add_model(emitted([4], 0))
    with pytest.raises(ValueError, match="other turns have none"):
        dense.add_model(routed([5], 0, 0))


# -- the calculator -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("expression", "value"), [
    ("3 + 4", 7), ("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("-5 + +2", -3), ("7 / 2", Fraction(7, 2)),
    ("10 - 2 - 3", 5), (" 12 ", 12), ("1 / 3 * 3", 1),
])
def test_the_evaluator_computes_exactly(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(("expression", "reason"), [
    ("__import__('os')", "only integers"), ("2 ** 10", "only integers"), ("3.5 + 1", "only integers"),
    ("True + 1", "only integers"), ("x + 1", "only integers"), ("5 / (2 - 2)", "division by zero"),
    ("3 +", "cannot parse"), ("1" * 20, "beyond"), ("100000000 * 100000000", "beyond"),
    ("1 + " * 60 + "1", "longer than"), ("abs(-3)", "only integers"),
])
def test_the_evaluator_refuses_what_is_not_plain_arithmetic(expression, reason):
    with pytest.raises(ToolError, match=reason):
        evaluate(expression)


def test_results_are_integers_or_short_decimals():
    assert format_number(Fraction(14)) == "14"
    assert format_number(Fraction(-7, 2)) == "-3.5"
    assert format_number(Fraction(1, 3)) == "0.3333333333"


SAMPLE = Prompt(text="Ann has 3 apples and gets 4 more. How many apples does Ann have now?", answer="7")


async def test_calculator_episode_answers_calls_and_scores_the_final_answer():
    env = Calculator(max_turns=4, reward="exact_match")
    assert env.tools == (CALCULATOR,)
    first = await env.start(SAMPLE)
    assert first == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": SAMPLE.text}]
    step = await env.step(calls(("calculator", {"expression": "3 + 4"}), ("calculator", {"expression": "1/0"})))
    assert not step.done and step.reward == 0.0
    assert step.messages == [
        {"role": "tool", "content": "7", "name": "calculator", "tool_call_id": "call_0"},
        {"role": "tool", "content": "error: division by zero", "name": "calculator", "tool_call_id": "call_1"},
    ]
    assert step.info == {"tool_calls": 2.0, "tool_errors": 1.0}
    done = await env.step(said("7"))
    assert done.done and done.reward == 1.0 and done.info == {"correct": 1.0, "turns": 2.0}


async def test_malformed_calls_and_bad_arguments_are_observations():
    env = Calculator(reward="exact_match")
    await env.start(SAMPLE)
    step = await env.step(calls(("calculator", {"expr": "1"}), malformed=("tool call is not valid JSON (...)",)))
    assert [m["content"] for m in step.messages] == [
        "error: bad arguments for calculator: missing a required argument: 'expression'",
        "error: tool call is not valid JSON (...)"]
    assert "name" not in step.messages[1] and step.info["tool_errors"] == 2.0
    assert (await env.step(said("8"))).reward == 0.0


async def test_calculator_ends_at_max_turns_and_keeps_a_samples_system_prompt():
    env = Calculator(max_turns=2)
    chat = Prompt(text="q", answer="1", messages=[{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "q"}])
    assert (await env.start(chat))[0] == {"role": "system", "content": "Be brief."}
    await env.step(calls(("calculator", {"expression": "1"})))
    last = await env.step(calls(("calculator", {"expression": "1"})))
    assert last.done and last.reward == 0.0 and last.messages == [] and last.info["out_of_turns"] == 1.0


async def test_math_verify_is_the_default_reward():
    env = Calculator()
    await env.start(SAMPLE)
    assert (await env.step(said("The answer is 7."))).reward == 1.0


async def test_a_calculator_episode_through_the_chat_renderer():
    """Token-in token-out with the BPE ChatML model: the tool result reaches the model's context as a
    <tool_response>, model tokens alone are masked in, and the final answer is scored."""
    bpe = make_tokenizer()
    stop = bpe.convert_tokens_to_ids("<|im_end|>")
    renderer, env = ChatRenderer(bpe, (stop,)), Calculator(reward="exact_match")
    episode = EpisodeTokens(renderer.prompt_ids(await env.start(SAMPLE), env.tools))
    written = [render_turn("", [ToolCall("calculator", {"expression": "3 + 4"})]), "7"]
    step = Step()
    for version, text in enumerate(written):
        ids = [*bpe.encode(text, add_special_tokens=False), stop]
        episode.add_model(emitted(ids, version + 3))
        step = await env.step(renderer.turn(ids, "stop", env.tools))
        if step.done:
            break
        episode.add_env(renderer.reply_ids(step.messages, after_stop=True))
    assert step.done and step.reward == 1.0
    text = bpe.decode(episode.ids())
    assert '"name": "calculator"' in text.split("<|im_start|>user")[1]  # the tools are in the system prompt
    assert text.endswith("<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n7<|im_end|>")
    row = episode.row()
    assert bpe.decode(row["tokens"][row["loss_mask"] == 1]) == written[0] + "<|im_end|>7<|im_end|>"
    assert episode.version_span() == (3, 4) and episode.turns == 2


# -- the tool-dispatching base ------------------------------------------------------------------------


class Lookup(ToolEnvironment):
    tools = (Tool("lookup", "Look a word up."), Tool("fail", "Always breaks."))

    async def tool_lookup(self, word: str) -> str:
        if word not in {"cat": "a small animal"}:
            raise ToolError(f"no entry for {word!r}")
        return "a small animal"

    def tool_fail(self) -> str:
        raise RuntimeError("a bug in the tool")

    async def start(self, sample: Prompt) -> list[dict]:
        return [{"role": "user", "content": sample.text}]

    async def answer(self, turn: ModelTurn) -> Step:
        return Step(reward=float(turn.content == "yes"), done=True)


async def test_the_base_dispatches_async_tools_and_reports_tool_errors():
    env = Lookup()
    step = await env.step(calls(("lookup", {"word": "cat"}), ("lookup", {"word": "dog"}), ("other", {})))
    assert [m["content"] for m in step.messages] == ["a small animal", "error: no entry for 'dog'",
                                                     "error: unknown tool 'other'"]
    assert (await env.step(said("yes"))).reward == 1.0


async def test_a_tool_that_raises_anything_else_fails_the_episode():
    with pytest.raises(RuntimeError, match="a bug in the tool"):
        await Lookup().step(calls(("fail", {})))


def test_a_declared_tool_needs_its_method():
    class Broken(ToolEnvironment):
        tools = (Tool("missing", ""),)

    with pytest.raises(TypeError, match=r"\['missing'\] without tool_<name> methods"):
        Broken()
    with pytest.raises(ValueError, match="max_turns"):
        Lookup(max_turns=0)


async def test_calculator_takes_the_math_examples_rows(tmp_path):
    train, _ = make_math_data(tmp_path, train=20, eval=2)
    task = DatasetTask(train, prompt_field="question", answer_field="answer", reward_function="math_verify")
    sample = task.sample(random.Random(0))
    env = Calculator(reward="math_verify")
    messages = await env.start(sample)
    assert [m["role"] for m in messages] == ["system", "user"] and messages[1]["content"] == sample.text
    assert (await env.step(said(f"It is {sample.answer}."))).reward == 1.0
