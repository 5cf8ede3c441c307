"""JudgeReward and its server's request logic against a small OpenAI-style server on 127.0.0.1 (a fake for
the logic of parse failures, timeouts and the concurrency cap; tests/stages/scorers/test_teacher_sglang.py
asks a real SGLang server): each failure is counted by reason, like a failing reward function."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
from aiohttp import web

from pipeline.events import EVENTS_FILE
from pipeline.net import free_port
from stages.data.rewards import Sample
from stages.scorers import JudgeReward
from stages.scorers.server import ScoringServer, ServerSettings

pytestmark = pytest.mark.anyio
TOKEN = "judge-secret"


class FakeJudge:
    """Answers by the completion it is shown: 'good' -> 8, 'bad' -> never a grade, 'flaky' -> no grade the first
    time then 5, 'slow' -> after 1.5 s, 'huge' -> 42 (out of range); counts requests in flight at once."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.in_flight = self.most_in_flight = 0
        self.authorized: list[bool] = []

    async def chat(self, request: web.Request) -> web.Response:
        self.authorized.append(request.headers.get("Authorization") == f"Bearer {TOKEN}")
        body = await request.json()
        completion = body["messages"][0]["content"].split("Response: ")[1].split("\n")[0]
        self.seen[completion] = self.seen.get(completion, 0) + 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await anyio.sleep(1.5 if completion == "slow" else 0.05)
        finally:
            self.in_flight -= 1
        text = {"good": "Grade: 8", "bad": "I cannot grade this.", "huge": "42",
                "flaky": "hmm" if self.seen[completion] == 1 else "5/10"}.get(completion, "3")
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": text}}]})


@pytest.fixture
async def judge_server():
    fake, app = FakeJudge(), web.Application()
    app.router.add_post("/v1/chat/completions", fake.chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port("127.0.0.1")
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield fake, f"http://127.0.0.1:{port}/v1"
    await runner.cleanup()


def samples(*completions: str) -> list[Sample]:
    return [Sample(prompt="12>", completion=c, tokens=[], answer="21") for c in completions]


async def test_parse_failures_and_timeouts_are_counted_by_reason(judge_server, tmp_path: Path) -> None:
    fake, url = judge_server
    (tmp_path / "token").write_text(TOKEN + "\n")
    judge = JudgeReward(ServerSettings(url=url, token_file=str(tmp_path / "token"), timeout_s=0.5),
                        model_name="grader", parse_retries=2)
    await judge.start(tmp_path)
    try:
        scores = await judge.score(samples("good", "bad", "slow", "flaky", "huge"))
    finally:
        await judge.stop()
    assert scores.rewards == pytest.approx([0.8, 0.0, 0.0, 0.5, 0.0])
    assert scores.failures == [None, "judge unparsed", "judge timeout", None, "judge unparsed"]
    assert fake.seen == {"good": 1, "bad": 3, "slow": 1, "flaky": 2, "huge": 3}  # asked again after no grade
    assert judge.stats["parse_failures"] == 3 + 1 + 3  # bad, flaky's first answer, huge
    assert judge.stats["failures"] == {"judge unparsed": 2, "judge timeout": 1}
    assert judge.stats["calls"] == 5
    events = [json.loads(line) for line in (tmp_path / EVENTS_FILE).read_text().splitlines()]
    assert [(e["kind"], e["count"]) for e in events] == [("judge.unparsed", 7)]
    assert all(fake.authorized), "the token file's token goes with every request"


async def test_a_users_parser_and_its_range(judge_server, tmp_path: Path) -> None:
    _, url = judge_server
    judge = JudgeReward(ServerSettings(url=url), model_name="grader",
                        parser=lambda text: 10.0 if "Grade" in text else None, parse_retries=0)
    await judge.start(tmp_path)
    try:
        scores = await judge.score(samples("good", "bad"))
    finally:
        await judge.stop()
    assert scores.rewards == [1.0, 0.0] and scores.failures == [None, "judge unparsed"]


async def test_the_concurrency_cap_holds_across_groups(judge_server, tmp_path: Path) -> None:
    fake, url = judge_server
    judge = JudgeReward(ServerSettings(url=url, concurrency=2), model_name="grader")
    await judge.start(tmp_path)
    try:
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(judge.score, samples("good", "good", "good"))
    finally:
        await judge.stop()
    assert fake.seen == {"good": 9} and fake.most_in_flight == 2


async def test_an_unreachable_server_fails_its_samples_after_the_retries(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    judge = JudgeReward(ServerSettings(url=url, retries=1), model_name="grader")
    await judge.start(tmp_path)
    try:
        scores = await judge.score(samples("good"))
    finally:
        await judge.stop()
    assert scores.failures == ["judge server unreachable"]


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model_name"):
        JudgeReward(ServerSettings(url="http://127.0.0.1:1"))
    with pytest.raises(ValueError, match="template"):
        JudgeReward(ServerSettings("m"), template="Grade {respone}")
    with pytest.raises(ValueError, match="token_file"):
        ScoringServer("judge", ServerSettings(url="http://127.0.0.1:1", token_file=str(tmp_path / "missing")))
