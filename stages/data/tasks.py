"""Tasks with verifiable rewards.

A task makes prompts and scores completions; it never sees a model. Rewards are in [0, 1].
The built-in tasks' prompts are plain text in the tiny tokenizer's alphabet (digits and a few
symbols); the rollout stage tokenizes them (with BOS where the tokenizer adds one). Tasks over
dataset files are in `stages.data.datasets`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Prompt:
    """What a task asks: `text` (plain prompt; for a chat prompt, its user text), the ground truth,
    and optionally chat `messages` (the tokenizer's chat template renders them instead of `text`)
    and `metadata` for the reward function."""

    text: str
    answer: str
    messages: list[dict[str, str]] | None = None
    metadata: dict[str, Any] | None = None


@runtime_checkable
class Task(Protocol):
    name: str
    max_new_tokens: int

    def sample(self, rng: random.Random) -> Prompt: ...

    def reward(self, prompt: Prompt, completion: str) -> float: ...


@runtime_checkable
class DataTask(Task, Protocol):
    """A task over rows of data (`stages.data.datasets.DatasetTask`): its prompts may be chat messages, it
    brings its own reward function, each rollout worker samples its own shard, and its position is
    kept by checkpoints (`state()` / `restore(state)`: two ints)."""

    uses_chat: bool
    reward_function: Any

    def shard(self, index: int, count: int) -> DataTask: ...

    def state(self) -> tuple[int, int]: ...

    def restore(self, state: tuple[int, int]) -> None: ...


def positional_credit(answer: str, completion: str) -> float:
    """Fraction of answer positions the completion gets right (dense partial credit)."""
    return sum(a == c for a, c in zip(answer, completion, strict=False)) / len(answer)


@dataclass(frozen=True)
class ReverseDigits:
    """`1234>` -> `4321`; reward = fraction of positions right.

    Measured here (README "Learning defaults"): the quickstart's tiny 2-layer Qwen2 learns 2 digits from
    random init in 115-143 GRPO versions, 3 digits in 260-691 and 4 in 328-477 (trailing reward 0.8).
    A middle answer position is the hard one: a model whose circuit for it forms late locks it onto a
    wrong rule (`tools/answer_positions.py`, README "Findings").
    """

    digits: int = 2
    name: str = "reverse-digits"

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 16:
            raise ValueError(f"task.digits must be in 1..16, got {self.digits}")

    @property
    def max_new_tokens(self) -> int:
        return self.digits

    def sample(self, rng: random.Random) -> Prompt:
        digits = "".join(rng.choice("0123456789") for _ in range(self.digits))
        return Prompt(text=f"{digits}>", answer=digits[::-1])

    def reward(self, prompt: Prompt, completion: str) -> float:
        return positional_credit(prompt.answer, completion)


@dataclass(frozen=True)
class Addition:
    """`3+5=` -> `08`: single-digit addition, two-digit zero-padded answer, positional credit."""

    name: str = "addition"

    @property
    def max_new_tokens(self) -> int:
        return 2

    def sample(self, rng: random.Random) -> Prompt:
        a, b = rng.randrange(10), rng.randrange(10)
        return Prompt(text=f"{a}+{b}=", answer=f"{a + b:02d}")

    def reward(self, prompt: Prompt, completion: str) -> float:
        return positional_credit(prompt.answer, completion)


TASKS: dict[str, type] = {"reverse-digits": ReverseDigits, "addition": Addition}
