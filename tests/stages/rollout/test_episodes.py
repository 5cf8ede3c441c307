"""Multi-turn episodes through the real rollout and torch engine: token-in token-out rows, masks and
logprobs aligned with what the engine emitted, environment failures and engine crashes counted and
survived, staleness across turns, and a learning run on the feedback environment."""

from __future__ import annotations

import json
from pathlib import Path
from random import Random

import anyio
import numpy as np
import pytest

from buffers.codec import decode
from buffers.memory import MemoryStore
from pipeline.faults import FaultPlan, FaultSpec
from policies.staleness import MaxStaleness
from stages.data.model import load_tokenizer, make_tiny_model
from stages.data.tasks import ReverseDigits
from stages.engines.faulty import with_engine_faults
from stages.engines.torch import TorchEngine
from stages.environments.base import ModelTurn, Step
from stages.environments.feedback import DigitFeedback, feedback
from stages.environments.tokens import EpisodeTokens
from stages.rollout import Rollout
from stages.rollout.episode import EpisodeLimits, EpisodeStale, _check_fresh
from tests.helpers.ledger_checks import check_ledger
from tests.helpers.runs import baton_run
from tests.helpers.workers import Recorder, worker_for


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


class Recording:
    """The real engine, with every (prompt ids, completion) it answered kept for the assertions."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine, self.calls = engine, []
        self.name = engine.name

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, prompts, params):
        completions = await self.engine.generate(prompts, params)
        self.calls += list(zip((tuple(p) for p in prompts), completions, strict=True))
        return completions

    def __getattr__(self, name):
        return getattr(self.engine, name)


def spans(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in `mask`."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


@pytest.mark.anyio
async def test_rows_are_the_engines_ids_then_the_environments_replies(tiny: Path, tmp_path: Path) -> None:
    engine = TorchEngine(tiny, seed=2)
    await engine.start()
    recording = Recording(engine)
    task = ReverseDigits(digits=3)
    rollout = Rollout(task, [engine], tokenizer=tiny, group_size=4, environment="feedback",
                      environment_options={"max_turns": 3}, limits=EpisodeLimits(max_turns=3))
    store, recorder = MemoryStore(), Recorder()
    await worker_for(rollout, recording, store, recorder, tmp_path).produce([task.sample(Random(s)) for s in range(3)])
    tok = load_tokenizer(tiny)
    answered: dict[tuple, list] = {}
    for prompt, completion in recording.calls:
        answered.setdefault(prompt, []).append(completion)
    turns_seen = 0
    for ref in recorder.sent:
        batch = decode(await store.get(ref.key))
        for row in range(batch.rows):
            fields = batch.row(row)
            ids, mask, logprobs, versions = (fields[k] for k in ("tokens", "loss_mask", "logprobs", "token_versions"))
            answer = batch.meta["answer"]
            model_spans = spans(mask)
            assert model_spans and model_spans[0][0] == batch.row_fields["prompt_lens"][row]
            for n, (start, end) in enumerate(model_spans):
                # token-in: the engine was asked exactly this prefix; token-out: the row holds its ids unchanged
                turn = ids[start:end].tolist()
                same = [c for c in answered[tuple(ids[:start].tolist())] if c.tokens.tolist() == turn]
                assert same, "the row's model turn is not what the engine answered for its prefix"
                completion = same[0]
                assert np.array_equal(logprobs[start:end], completion.logprobs)
                assert np.array_equal(versions[start:end], completion.versions)
                if n + 1 < len(model_spans):  # between turns: the environment's reply, tokenized alone
                    reply = ids[end:model_spans[n + 1][0]]
                    attempt = tok.decode(completion.tokens, skip_special_tokens=True)
                    assert tok.decode(reply, skip_special_tokens=True) == feedback(answer, attempt)
                    assert not logprobs[end:model_spans[n + 1][0]].any()
                    assert (versions[end:model_spans[n + 1][0]] == -1).all()
            assert batch.row_fields["turns"][row] == len(model_spans)
            turns_seen = max(turns_seen, len(model_spans))
    assert turns_seen >= 2, "a random model gets some reversal wrong: some episodes took more turns"
    assert len(recorder.produced) == 3 and not recorder.finished
    await engine.stop()


class Breaks(DigitFeedback):
    """The feedback environment, except that it raises on a given turn or hangs past the step timeout."""

    calls = 0

    async def step(self, turn: ModelTurn) -> Step:
        Breaks.calls += 1
        if Breaks.calls % 4 == 1:
            raise RuntimeError("environment bug")
        if Breaks.calls % 4 == 2:
            await anyio.sleep(30)
        return await super().step(turn)


@pytest.mark.anyio
async def test_environment_failures_are_counted_and_the_group_goes_on(tiny: Path, tmp_path: Path) -> None:
    engine = TorchEngine(tiny, seed=3)
    await engine.start()
    task = ReverseDigits(digits=2)
    rollout = Rollout(task, [engine], tokenizer=tiny, group_size=4, environment=Breaks,
                      limits=EpisodeLimits(max_turns=2, step_timeout_s=0.5))
    store, recorder = MemoryStore(), Recorder()
    await worker_for(rollout, engine, store, recorder, tmp_path).produce([task.sample(Random(s)) for s in range(2)])
    failed = rollout.stats["episodes_failed"]
    assert failed["environment step 1 raised RuntimeError: environment bug"] >= 1
    assert sum(n for reason, n in failed.items() if "timed out after 0.5 s" in reason) >= 1
    dropped = [ids for fate, ids, reason in recorder.finished if fate == "dropped" and "episode failed" in reason]
    stored = sum(ref.rows for ref in recorder.sent)
    assert sum(map(len, dropped)) == sum(failed.values()), "each failed episode is recorded as dropped"
    assert stored + sum(failed.values()) == 2 * 4, "every episode is either stored or counted"
    produced_ids = [i for record in recorder.produced for i in record.ids]
    assert len(produced_ids) == len(set(produced_ids)) == 8, "each episode is in the ledger once"
    await engine.stop()


@pytest.mark.anyio
async def test_an_engine_crash_mid_episode_starts_it_again(tiny: Path, tmp_path: Path) -> None:
    engine = TorchEngine(tiny, seed=4)
    await engine.start()
    plan = FaultPlan([FaultSpec("engine.crash", at=(3, 7))])
    task = ReverseDigits(digits=2)
    rollout = Rollout(task, [engine], tokenizer=tiny, group_size=4, environment="feedback",
                      environment_options={"max_turns": 3}, limits=EpisodeLimits(max_turns=3))
    store, recorder = MemoryStore(), Recorder()
    worker = worker_for(rollout, with_engine_faults(engine, plan), store, recorder, tmp_path)
    await worker.produce([task.sample(Random(s)) for s in range(2)])
    assert rollout.stats["episodes_restarted"]["EngineCrashed"] == 2
    assert sum(n for kind, n in recorder.events if kind == "episodes.restarted") == 2
    assert sum(ref.rows for ref in recorder.sent) == 8, "the restarted episodes finished, nothing lost"
    assert not recorder.finished
    for ref in recorder.sent:  # a restarted episode's row holds its last attempt only, starting at its prompt
        batch = decode(await store.get(ref.key))
        for row in range(batch.rows):
            plen = batch.row_fields["prompt_lens"][row]
            assert spans(batch.row(row)["loss_mask"])[0][0] == plen
    await engine.stop()


def test_an_episode_too_old_for_the_engines_weights_restarts_between_turns() -> None:
    tokens = EpisodeTokens([1, 2, 3])
    completion = type("C", (), {"tokens": np.array([5], np.int32), "logprobs": np.zeros(1, np.float32),
                                "versions": np.array([4], np.int32)})()
    tokens.add_model(completion)
    engine = type("E", (), {"version": 6})()
    _check_fresh(engine, tokens, MaxStaleness(k=2))  # 6 - 4 = 2: may go on
    engine.version = 7
    with pytest.raises(EpisodeStale):
        _check_fresh(engine, tokens, MaxStaleness(k=2))
    _check_fresh(engine, tokens, None)  # no policy: never interrupted


@pytest.mark.slow
@pytest.mark.long  # CI time: in the long suite
def test_multi_turn_staleness_holds_across_turns(tmp_path: Path) -> None:
    s = baton_run(tmp_path, "agent-feedback.toml", "steps=30", "staleness.k=1")
    assert s["max_staleness_trained"] <= 1 and s["ledger_balanced"]
    check_ledger(Path(s["run_dir"]), bound=1)


def _feedback_run_learned(metrics: list[dict]) -> str | None:
    """None when a feedback run learned and its later turns fix the first attempt's mistakes, else why not."""
    early, late = metrics[:20], metrics[-20:]
    mean = lambda rs, key: float(np.mean([r[key] for r in rs if key in r]))  # noqa: E731
    rise = mean(late, "reward") - mean(early, "reward")
    # turn 2 is played only after a wrong turn 1, so a turn's mean score is over harder samples than the
    # turn before's; what the later turns fixed is measured within each episode: its last attempt's
    # score ("score") against its first
    fixed = mean(late, "episode/score") - mean(late, "episode/turn_score/1")
    if rise < 0.2 or fixed < 0.2:
        return f"reward rose {rise:.3f}, later turns fixed {fixed:.3f} (each should be >= 0.2)"
    return None


@pytest.mark.nightly
@pytest.mark.timeout(900)  # up to three runs of ~2 minutes each
def test_the_feedback_environment_learns_and_later_turns_fix_mistakes(tmp_path: Path) -> None:
    """The tiny model learns this in 5 of 6 runs of 400 versions (README, "feedback environment"; a run
    that learns nothing by then is the sixth): the test asks one of up to three seeds to, and every
    run to keep its ledger within the staleness bound."""
    failures = []
    for seed in range(3):
        s = baton_run(tmp_path / f"seed{seed}", "agent-feedback.toml", f"seed={seed}")
        check_ledger(Path(s["run_dir"]), bound=2)
        metrics = [json.loads(line) for line in (Path(s["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        assert len(metrics) == 400
        failure = _feedback_run_learned(metrics)
        if failure is None:
            return
        failures.append(f"seed {seed}: {failure}")
    pytest.fail("; ".join(failures))


class Slow(DigitFeedback):
    """Each step takes 0.3 s: two of them outlive an episode limit of 0.5 s."""

    async def step(self, turn: ModelTurn) -> Step:
        await anyio.sleep(0.3)
        return Step([{"role": "user", "content": "0>"}], reward=0.0, done=False)


@pytest.mark.anyio
async def test_an_episode_past_its_time_limit_fails_counted(tiny: Path, tmp_path: Path) -> None:
    engine = TorchEngine(tiny, seed=5)
    await engine.start()
    task = ReverseDigits(digits=2)
    rollout = Rollout(task, [engine], tokenizer=tiny, group_size=2, environment=Slow,
                      limits=EpisodeLimits(max_turns=5, timeout_s=0.5))
    store, recorder = MemoryStore(), Recorder()
    await worker_for(rollout, engine, store, recorder, tmp_path).produce([task.sample(Random(0))])
    assert rollout.stats["episodes_failed"] == {"episode timed out after 0.5 s": 2}
    (dropped,) = recorder.finished
    assert dropped[0] == "dropped" and dropped[2] == "episode failed: episode timed out after 0.5 s"
    assert not recorder.sent and recorder.discarded == 1, "a group with nothing left frees its slot"
    await engine.stop()


class AlwaysBreaks(DigitFeedback):
    async def step(self, turn: ModelTurn) -> Step:
        raise RuntimeError("environment bug")


@pytest.mark.anyio
async def test_a_run_whose_episodes_all_fail_ends_naming_their_reason(tiny: Path, tmp_path: Path) -> None:
    """`max_failed_in_a_row` episodes failed with none kept: the run ends (EpisodesFailing) naming the reason and
    the key; one episode kept in between starts the count again."""
    from stages.rollout.groups import EpisodesFailing

    engine = TorchEngine(tiny, seed=6)
    await engine.start()
    task = ReverseDigits(digits=2)
    rollout = Rollout(task, [engine], tokenizer=tiny, group_size=2, environment=AlwaysBreaks,
                      limits=EpisodeLimits(max_turns=2), max_failed_in_a_row=4)
    store, recorder = MemoryStore(), Recorder()
    worker = worker_for(rollout, engine, store, recorder, tmp_path)
    with pytest.raises(BaseException) as caught:  # the worker's groups run at once: each may raise it
        await worker.produce([task.sample(Random(s)) for s in range(3)])
    failing = caught.value.subgroup(EpisodesFailing) if isinstance(caught.value, BaseExceptionGroup) else caught.value
    message = str(failing.exceptions[0] if isinstance(failing, BaseExceptionGroup) else failing)
    assert "episodes in a row failed" in message and "environment bug" in message
    assert "rollout.max_failed_in_a_row" in message
    assert sum(rollout.stats["episodes_failed"].values()) >= 4 and not recorder.sent
    maker = worker.maker
    maker.failed_in_a_row = 3
    maker._count_failures([], kept=2)
    assert not maker.failing, "a kept episode starts the count again"
    await engine.stop()
