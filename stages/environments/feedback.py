"""`DigitFeedback`: the digit-reversal task with feedback after each attempt, for the tiny demo model.

The sample is a `stages.data.tasks.ReverseDigits` prompt (`"1234>"`, answer `"4321"`); its plain text is the
first turn (the tiny model has no chat template: use `PlainRenderer`). After a wrong attempt the
environment replies with one character per answer position, then `>`: the right digit where the
attempt was wrong or missing, `right` (default "=") where it was right. With answer 4321, attempt
4391 gets `==2=>`. A later turn can fix its mistakes by copying, position by position, its own last
attempt or the feedback. That is easy for attention, unlike the first turn's reversal: with turns of
`digits` tokens (cut by length, so each reply starts with the stop token), the digit the model writes
next sits a fixed distance back in both, `digits` tokens in the feedback and `2 * digits + 1` in the
last attempt, whatever its index. Every character is in `stages.data.model.ALPHABET`.

With `show="answer"` the reply is the whole answer instead (`4321>`): a later turn copies it.

The episode ends at a right attempt or after `max_turns` (default 3). Its reward is the last
attempt's score (positional credit, in [0, 1]) times `turn_discount` per turn after the first, so
getting it right early pays most. `info` holds each turn's score as "turn_score/<n>" (turn n is
played only when turns before it were wrong), "turn_gain/<n>" (n > 1) its score minus the turn before's in
the same episode (how much a later turn fixed), and at the end "score" and "turns".
"""

from __future__ import annotations

from stages.data.tasks import Prompt, positional_credit
from stages.environments.base import Message, ModelTurn, Step, Tool


def feedback(answer: str, attempt: str, right: str = "=") -> str:
    """Per answer position: `right` where `attempt` has the answer's character, else that character;
    then `>`, the task's cue to answer."""
    marks = (right if i < len(attempt) and attempt[i] == ch else ch for i, ch in enumerate(answer))
    return "".join(marks) + ">"


class DigitFeedback:
    """Reverse the digits, with feedback after each wrong attempt (see the module docstring)."""

    tools: tuple[Tool, ...] = ()

    def __init__(self, max_turns: int = 3, turn_discount: float = 0.8, right: str = "=",
                 show: str = "mistakes") -> None:
        if max_turns < 1:
            raise ValueError(f"environment max_turns must be >= 1, got {max_turns}")
        if not 0.0 < turn_discount <= 1.0:
            raise ValueError(f"environment turn_discount must be in (0, 1], got {turn_discount}")
        if len(right) != 1 or right.isdigit():
            raise ValueError(f"environment right must be one character that is not a digit, got {right!r}")
        if show not in ("mistakes", "answer"):
            raise ValueError(f"environment show must be 'mistakes' or 'answer', got {show!r}")
        self.max_turns, self.turn_discount, self.right, self.show = max_turns, turn_discount, right, show
        self.answer: str | None = None
        self.turns = 0
        self.last_score = 0.0

    async def start(self, sample: Prompt) -> list[Message]:
        if not sample.answer:
            raise ValueError("DigitFeedback needs samples with an answer (a reverse-digits task)")
        self.answer, self.turns, self.last_score = sample.answer, 0, 0.0
        return [{"role": "user", "content": sample.text}]

    async def step(self, turn: ModelTurn) -> Step:
        if self.answer is None:
            raise RuntimeError("DigitFeedback.step before start")
        self.turns += 1
        score = positional_credit(self.answer, turn.text)
        info = {f"turn_score/{self.turns}": score}
        if self.turns > 1:
            info[f"turn_gain/{self.turns}"] = score - self.last_score
        self.last_score = score
        if score == 1.0 or self.turns >= self.max_turns:
            info.update(score=score, turns=float(self.turns))
            return Step(reward=score * self.turn_discount ** (self.turns - 1), done=True, info=info)
        return Step(messages=[{"role": "user", "content": self._feedback(turn.text)}], info=info)

    def _feedback(self, attempt: str) -> str:
        return feedback(self.answer, attempt if self.show == "mistakes" else "", self.right)

    async def close(self) -> None:
        return None
