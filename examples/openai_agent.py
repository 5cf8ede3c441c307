"""An agent written only against the `openai` package (no baton import), trained through baton's gateway.

It solves arithmetic word problems with a calculator tool: it sends the problem with the tool's schema,
runs every tool call the model makes itself (a safe evaluator over the expression's syntax tree), sends
the results back as `tool` messages, and stops at the first answer without a tool call (or after
`MAX_TURNS`). Its reward is 1.0 when that answer's last number equals the sample's answer, else 0.0.

Two ways to run it:
- baton calls `agent(sample, base_url, api_key)` once per episode (`agent = "examples.openai_agent:agent"`):
  the base_url is the episode's own, every request on it is recorded for training, and the returned
  float is the episode's reward.
- standalone, as a separate process that opens episodes itself:

      python examples/openai_agent.py --base-url http://127.0.0.1:PORT/v1 --key-file RUN/gateway.token

  For each episode it POSTs {base-url}/episodes (waiting while the run is over its staleness budget),
  runs `agent` on the episode's base_url and sample, then POSTs the reward to
  {base-url}/episodes/{id}/reward, or closes the episode if the agent failed.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
import os
import re
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

MAX_TURNS = 4
MAX_TOKENS = 64
SYSTEM = "Use the calculator tool for arithmetic. When you know the answer, reply with the number alone."
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The exact value of an integer expression with + - * / and parentheses, or "error: ..."."""

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 10**12:
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return OPERATORS[type(node.op)](left, right)
        raise ValueError("only integers, + - * / and parentheses are allowed")

    try:
        result = value(ast.parse(str(expression).strip()[:200], mode="eval").body)
    except (SyntaxError, ValueError) as exc:
        return f"error: {exc}"
    return str(result.numerator) if result.denominator == 1 else f"{float(result):.10g}"


def _field(sample: Any, name: str) -> Any:
    return sample.get(name) if isinstance(sample, dict) else getattr(sample, name, None)


def score(answer: str | None, expected: Any) -> float:
    """1.0 when the answer's last number equals the expected one."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer or "")
    try:
        return float(bool(numbers) and Fraction(numbers[-1]) == Fraction(str(expected).strip()))
    except ValueError:
        return 0.0


def _run_calls(calls) -> list[dict[str, Any]]:
    results = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments or "{}")
            content = calculate(arguments["expression"]) if call.function.name == "calculator" else \
                f"error: unknown tool {call.function.name!r}"
        except (ValueError, KeyError, TypeError) as exc:
            content = f"error: bad arguments ({exc})"
        results.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return results


async def agent(sample: Any, base_url: str, api_key: str) -> float:
    """Solve one problem through `base_url` with the calculator tool; return the reward (see the module doc)."""
    messages = [dict(m) for m in _field(sample, "messages") or [{"role": "user", "content": _field(sample, "prompt")
                                                                  or _field(sample, "text")}]]
    if messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": SYSTEM})
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=2) as client:
        for _ in range(MAX_TURNS):
            response = await client.chat.completions.create(
                model="baton", messages=messages, tools=[CALCULATOR], max_tokens=MAX_TOKENS, temperature=1.0)
            message = response.choices[0].message
            if not message.tool_calls:
                return score(message.content, _field(sample, "answer"))
            messages.append(message.model_dump(exclude_none=True))
            messages += _run_calls(message.tool_calls)
    return 0.0


async def episode(control: AsyncOpenAI, api_key: str) -> float | None:
    """Open one episode, run the agent on it, post its reward (or close it when the agent failed)."""
    opened = await control.post("/episodes", cast_to=object, body={})
    try:
        reward = await agent(opened["sample"], opened["base_url"], api_key)
    except Exception as exc:  # the agent failed: end the episode so the run counts it as dropped
        print(f"episode {opened['id']}: agent failed: {exc}", file=sys.stderr)
        await control.post(f"/episodes/{opened['id']}/close", cast_to=object, body={})
        return None
    await control.post(f"/episodes/{opened['id']}/reward", cast_to=object, body={"reward": reward})
    return reward


async def serve(base_url: str, api_key: str, episodes: int, concurrency: int) -> list[float | None]:
    """Run `episodes` episodes, `concurrency` at a time; their rewards (None: the agent failed).
    Episode control goes through the openai client's plain `post` (opening waits for budget: no timeout)."""
    rewards: list[float | None] = []
    left = iter(range(episodes))
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=None) as control:

        async def worker() -> None:
            for _ in left:
                rewards.append(await episode(control, api_key))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return rewards


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True, help="the gateway's base URL, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--key", help="the gateway's bearer token (default: --key-file, or $OPENAI_API_KEY)")
    parser.add_argument("--key-file", help="a file holding the token (the run writes one)")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args(argv)
    key = args.key or (Path(args.key_file).read_text().strip() if args.key_file else os.environ.get("OPENAI_API_KEY"))
    if not key:
        parser.error("give --key, --key-file or OPENAI_API_KEY")
    rewards = asyncio.run(serve(args.base_url, key, args.episodes, args.concurrency))
    scored = [r for r in rewards if r is not None]
    print(json.dumps({"episodes": len(rewards), "failed": len(rewards) - len(scored),
                      "mean_reward": sum(scored) / len(scored) if scored else None}))


if __name__ == "__main__":
    main()
