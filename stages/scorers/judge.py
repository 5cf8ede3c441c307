"""`JudgeReward`: a generative model reads each sample against a rubric and answers with a score.

Each sample becomes one chat request to an OpenAI-compatible `/v1/chat/completions` (SGLang serves one;
so do vLLM and hosted APIs): the `template` filled with the sample's `prompt`, `completion` and `answer`
(`str.format` fields; write literal braces as `{{` and `}}`) as the user message. The answer's text goes
through the `parser` (`"number"`: the first number in it; or a `"pkg.module:function"` from text to a float,
or None when it finds none). A number is the reward divided by `max_score`; text the parser cannot read,
or a number outside [0, max_score], is a parse failure: counted (`stats["parse_failures"]`, the run event
`judge.unparsed`) and asked again, up to `parse_retries` times; then the sample fails ("judge unparsed")
and the reward's `on_error` decides. A request that times out or whose server stays unreachable fails the
sample at once ("judge timeout", "judge server unreachable"), counted the same way.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import anyio

from pipeline import plugins
from pipeline.events import report_event
from stages.data.rewards import Sample, Scores
from stages.scorers.base import ScorerError, record
from stages.scorers.server import ScoringServer, Served, ServerSettings

DEFAULT_TEMPLATE = (
    "Grade the response to the task below from 0 (wrong or useless) to 10 (fully right).\n\n"
    "Task: {prompt}\nReference answer: {answer}\nResponse: {completion}\n\n"
    "Reply with the grade only, a number from 0 to 10."
)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
CHAT_PATH = "/v1/chat/completions"


def first_number(text: str) -> float | None:
    """The `"number"` parser: the first number in `text` (None when there is none)."""
    found = NUMBER.search(text)
    return float(found.group()) if found else None


PARSERS = {"number": "stages.scorers.judge:first_number"}


@dataclass
class JudgeReward(Served):
    """`JudgeReward(ServerSettings("judge-folder"))` launches the folder on SGLang;
    `JudgeReward(ServerSettings(url=...), model_name=...)` uses any OpenAI-compatible server (with `token_file`:
    its bearer token)."""

    settings: ServerSettings
    model_name: str | None = None  # the request's "model"; default: the launched folder's path (SGLang's name)
    template: str = DEFAULT_TEMPLATE
    parser: str | Callable[[str], float | None] = "number"
    max_score: float = 10.0
    max_tokens: int = 16
    temperature: float = 0.0
    parse_retries: int = 2
    name: str = "judge"
    stats: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        model, url = self.settings.model, self.settings.url
        if url is None and model is None:
            raise ValueError("judge: give a model folder to launch on SGLang, or the url of an OpenAI-compatible "
                             "server")
        if self.model_name is None:
            if model is None:
                raise ValueError("judge: a judge given by url needs model_name (the model the server serves)")
            self.model_name = str(model)
        if self.max_score <= 0:
            raise ValueError(f"judge.max_score must be > 0, got {self.max_score}")
        if self.parse_retries < 0:
            raise ValueError(f"judge.parse_retries must be >= 0, got {self.parse_retries}")
        try:
            self.template.format(prompt="", completion="", answer="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"judge.template: {exc!r}; it may use {{prompt}}, {{completion}} and {{answer}} "
                             "(write literal braces as {{ and }})") from None
        if isinstance(self.parser, str):
            self.parser = plugins.resolve(self.parser, PARSERS, what="judge parser")
        url = url.removesuffix("/").removesuffix("/v1") if url else None
        self.server = ScoringServer(self.name, replace(self.settings, url=url), self.stats)
        self.stats.setdefault("parse_failures", 0)

    async def score(self, samples: Sequence[Sample]) -> Scores:
        """One group's scores, a request per sample at once (the server's cap bounds them); never raises."""
        values: list[float] = [0.0] * len(samples)
        failures: list[str | None] = [None] * len(samples)
        unparsed = [0]

        async def one(i: int) -> None:
            t0 = time.perf_counter()
            try:
                values[i] = await self._judge(samples[i], unparsed)
            except ScorerError as exc:
                failures[i] = f"judge {exc.reason}"
            record(self.stats, time.perf_counter() - t0, failures[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(samples)):
                tg.start_soon(one, i)
        if unparsed[0]:
            self.stats["parse_failures"] += unparsed[0]
            report_event(self.server.log_dir, "judge.unparsed", count=unparsed[0], scorer=self.name)
        return Scores(values, failures)

    async def _judge(self, sample: Sample, unparsed: list[int]) -> float:
        """The sample's reward; ScorerError("unparsed") after `parse_retries` unreadable answers."""
        content = self.template.format(prompt=sample.prompt, completion=sample.completion, answer=sample.answer)
        body = {"model": self.model_name, "messages": [{"role": "user", "content": content}],
                "max_tokens": self.max_tokens, "temperature": self.temperature}
        for _ in range(self.parse_retries + 1):
            answer = await self.server.post(CHAT_PATH, body)
            value = self.read(answer)
            if value is not None:
                return value / self.max_score
            unparsed[0] += 1
        raise ScorerError("unparsed", f"no grade in {self.parse_retries + 1} answers")

    def read(self, answer: object) -> float | None:
        """The grade in an OpenAI chat answer, or None when it holds none in [0, max_score]."""
        try:
            text = answer["choices"][0]["message"]["content"]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            return None
        try:
            value = self.parser(text or "")
        except Exception:  # noqa: BLE001 - a user's parser that raises has found no grade
            return None
        if value is None or not isinstance(value, int | float) or not math.isfinite(value):
            return None
        return float(value) if 0 <= value <= self.max_score else None
