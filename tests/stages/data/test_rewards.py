"""Reward functions: sync, async and batched; resolved by dotted path; the built-ins; and a reward that
raises or times out is counted by reason and never ends the rollout (scored 0, or its group dropped
with its reason in the ledger)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from random import Random

import anyio
import pytest

from buffers.codec import decode
from buffers.memory import MemoryStore
from stages.data.datasets import DatasetTask
from stages.data.model import make_tiny_model
from stages.data.rewards import (
    RewardFunction,
    Sample,
    batched,
    exact_match,
    format_number,
    math_verify,
    regex_reward,
    weighted_sum,
)
from stages.engines.torch import TorchEngine
from stages.rollout import Rollout
from tests.helpers.workers import Recorder, worker_for


def samples(*completions: str, answer: str = "7") -> list[Sample]:
    return [Sample(prompt="q", completion=c, tokens=[1, 2], answer=answer, metadata={"k": 2}) for c in completions]


def score(fn, items, **kw):
    return anyio.run(RewardFunction(fn, **kw).score, items)


def test_builtins() -> None:
    assert exact_match(" 7 ", "7") == 1.0 and exact_match("7.0", "7") == 0.0
    assert math_verify("The answer is 7", "7") == 1.0
    assert math_verify("$\\frac{14}{2}$", "7") == 1.0
    assert math_verify("8", "7") == 0.0 and math_verify("no number", "7") == 0.0
    assert format_number("42") == 1.0 and format_number("42 apples") == 0.0
    assert regex_reward(r"<a>.*</a>")("<a>x</a>") == 1.0


def test_sync_async_and_keywords() -> None:
    seen = {}

    def by_metadata(completion, metadata, tokens):
        seen.update(metadata=metadata, tokens=tokens)
        return len(completion) * metadata["k"]

    async def slow_async(completion: str, answer: str) -> float:
        await anyio.sleep(0.01)
        return float(completion == answer)

    assert score(by_metadata, samples("ab", "c")).rewards == [4.0, 2.0]
    assert seen == {"metadata": {"k": 2}, "tokens": [1, 2]}
    assert score(slow_async, samples("7", "8")).rewards == [1.0, 0.0]
    assert score(lambda **kw: float(kw["answer"]), samples("x")).rewards == [7.0]


def test_batched() -> None:
    calls = []

    @batched
    def group_rank(completion: list[str], answer: list[str]) -> list[float]:
        calls.append(len(completion))
        return [float(c == a) for c, a in zip(completion, answer, strict=True)]

    assert score(group_rank, samples("7", "1", "7")).rewards == [1.0, 0.0, 1.0]
    assert calls == [3], "one call per group"

    async def short(completion: list[str]) -> list[float]:
        return [1.0]

    result = score(short, samples("a", "b"), batched=True)
    assert result.rewards == [0.0, 0.0] and result.failures == ["wrong count", "wrong count"]


def test_failures_are_reasons_not_errors() -> None:
    def boom(completion: str) -> float:
        if completion == "bad":
            raise KeyError("x")
        return 1.0

    def hangs(completion: str) -> float:
        time.sleep(0.5 if completion == "slow" else 0)
        return 1.0

    async def hangs_async(completion: str) -> float:
        await anyio.sleep(10 if completion == "slow" else 0)
        return 1.0

    r = score(boom, samples("ok", "bad"))
    assert r.rewards == [1.0, 0.0] and r.failures == [None, "raised KeyError"]
    r = score(hangs, samples("ok", "slow"), timeout_s=0.1)
    assert r.rewards == [1.0, 0.0] and r.failures == [None, "timeout"]
    r = score(hangs_async, samples("slow", "ok"), timeout_s=0.1)
    assert r.failures == ["timeout", None]
    assert score(lambda completion: "x", samples("a")).failures == ["not a number"]
    assert score(lambda completion: float("nan"), samples("a")).failures == ["not finite"]


def test_resolution_weighted_sum_and_bad_settings() -> None:
    assert RewardFunction("math_verify").fn is math_verify
    assert RewardFunction("stages.data.rewards:exact_match").fn is exact_match
    with pytest.raises(ValueError, match="no 'nope'"):
        RewardFunction("stages.data.rewards:nope")
    with pytest.raises(ValueError, match="cannot import"):
        RewardFunction("no_such_package.rewards:f")
    with pytest.raises(ValueError, match="use one of"):
        RewardFunction("exactmatch")
    with pytest.raises(ValueError, match="on_error"):
        RewardFunction(exact_match, on_error="retry")
    with pytest.raises(ValueError, match="timeout_s"):
        RewardFunction(exact_match, timeout_s=0)
    with pytest.raises(ValueError, match="asks for \\['gold'\\]"):
        RewardFunction(lambda gold: 1.0)

    async def half(completion: str) -> float:
        return 0.5

    combined = weighted_sum(("math_verify", 0.8), ("format_number", 0.2), (half, 1.0))
    assert score(combined, samples("7", "x = 7", "3")).rewards == pytest.approx([1.5, 1.3, 0.7])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def flaky(completion: str, tokens: list[int]) -> float:
    """Raises on completions whose first token id is a multiple of 4: some samples of some groups fail."""
    if tokens and tokens[0] % 4 == 0:
        raise RuntimeError("flaky reward")
    return 1.0


@pytest.mark.anyio
@pytest.mark.parametrize("on_error", ["zero", "drop"])
async def test_a_failing_reward_never_ends_the_rollout(tiny: Path, tmp_path: Path, on_error: str) -> None:
    rows = [{"q": f"{i}{i}>", "a": f"{i}{i}"} for i in range(10)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = DatasetTask(tmp_path / "d.jsonl", prompt_field="q", answer_field="a", chat=False, max_new_tokens=2)
    engine = TorchEngine(tiny, seed=1)
    await engine.start()
    rollout = Rollout(task, [engine], tokenizer=tiny, group_size=4, batch_groups=4,
                      reward=RewardFunction(flaky, on_error=on_error))
    store, recorder = MemoryStore(), Recorder()
    await worker_for(rollout, engine, store, recorder, tmp_path).produce([task.sample(Random(0)) for _ in range(6)])
    failed = rollout.stats["reward_failed"]["raised RuntimeError"]
    assert failed > 0
    assert sum(n for kind, n in recorder.events if kind == "reward.failed") == failed, "each failure is a run event"
    assert len(recorder.produced) == 6, "every group is recorded in the ledger"
    if on_error == "zero":
        assert len(recorder.sent) == 6 and not recorder.finished
        zeros = 0
        for ref in recorder.sent:
            rewards = decode(await store.get(ref.key)).row_fields["rewards"].tolist()
            zeros += rewards.count(0.0)
        assert zeros == failed
        assert sum(sum(r.values.get("reward_failed", [])) for r in recorder.produced) == failed
    else:
        dropped = [f for f in recorder.finished if f[0] == "dropped"]
        assert dropped and all(reason == "reward failed" for _, _, reason in dropped)
        assert len(recorder.sent) + len(dropped) == 6 and recorder.discarded == len(dropped)
        assert recorder.sent, "groups whose rewards all worked are sent"
        for ref in recorder.sent:
            assert decode(await store.get(ref.key)).rows == 4
    await engine.stop()
