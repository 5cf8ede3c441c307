"""`Calculator`: a tool environment over arithmetic word problems.

The sample is a task's prompt (chat messages or text) with its ground-truth answer, such as a row of
the math example's data (tools/make_math_example.py). The model may call
`calculator(expression)` any number of times; each result comes back as a `tool` message (a bad
expression or a malformed call as "error: ..."). The episode ends when the model answers without a
tool call, scored by `reward` (a built-in reward's name or "pkg.module:function", as in
`stages.data.rewards`; default math_verify) on the answer's text without markup, or after `max_turns`.

The expression is evaluated from its syntax tree, never with eval: integers, + - * /, unary signs and
parentheses only, exact (fractions), every intermediate value at most `MAX_MAGNITUDE` in size.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

from stages.data.rewards import RewardFunction, Sample
from stages.data.tasks import Prompt
from stages.environments.base import Message, ModelTurn, Step, Tool
from stages.environments.tool_env import ToolEnvironment, ToolError

MAX_EXPRESSION = 200  # characters
MAX_MAGNITUDE = 10**15  # largest |numerator| and denominator of any value along the way
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}

CALCULATOR = Tool(
    "calculator",
    "Evaluate an arithmetic expression of integers with + - * / and parentheses.",
    {"type": "object", "properties": {"expression": {"type": "string", "description": "for example (12 + 3) * 4"}},
     "required": ["expression"]},
)
SYSTEM_PROMPT = "Use the calculator tool for arithmetic. When you know the answer, reply with the number alone."


def evaluate(expression: str) -> Fraction:
    """The exact value of `expression`; ToolError (a message for the model) when it is not allowed."""
    if not isinstance(expression, str):
        raise ToolError(f"expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION:
        raise ToolError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r} as arithmetic") from None
    return _value(tree.body)


def _value(node: ast.expr) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in SIGNS:
        value = SIGNS[type(node.op)](_value(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ToolError("division by zero")
        value = OPERATORS[type(node.op)](left, right)
    else:
        raise ToolError(f"only integers, + - * / and parentheses are allowed, not {ast.unparse(node)!r}")
    if abs(value.numerator) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
        raise ToolError(f"numbers beyond {MAX_MAGNITUDE:.0e} are not supported")
    return value


def format_number(value: Fraction) -> str:
    """An integer as itself, anything else as a decimal of up to 10 significant digits."""
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.10g}"


class Calculator(ToolEnvironment):
    """Word problems with a calculator tool (see the module docstring). Options: `max_turns` (model
    turns, default 4), `reward` (default "math_verify"), `system_prompt` (put first unless the
    sample's messages start with a system message; "" for none)."""

    tools = (CALCULATOR,)

    def __init__(self, max_turns: int = 4, reward: str = "math_verify", system_prompt: str = SYSTEM_PROMPT) -> None:
        super().__init__(max_turns)
        self.reward = RewardFunction(reward)
        self.system_prompt = system_prompt
        self.sample: Prompt | None = None

    async def start(self, sample: Prompt) -> list[Message]:
        self.sample = sample
        messages = [dict(m) for m in sample.messages] if sample.messages else [{"role": "user", "content": sample.text}]
        if self.system_prompt and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def tool_calculator(self, expression: str) -> str:
        return format_number(evaluate(expression))

    async def answer(self, turn: ModelTurn) -> Step:
        """The final answer, scored by the reward function (a failed reward scores 0, counted in info)."""
        if self.sample is None:
            raise RuntimeError("Calculator.step before start")
        s = self.sample
        scores = await self.reward.score([Sample(s.text, turn.content, (), s.answer, s.metadata or {}, s.messages, s)])
        info = {"correct": scores.rewards[0], "turns": float(self.turns)}
        if scores.failures[0] is not None:
            info["reward_failed"] = 1.0
        return Step(reward=scores.rewards[0], done=True, info=info)
