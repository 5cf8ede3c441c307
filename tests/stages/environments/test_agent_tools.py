"""The calculator tool environment end to end on the math example's model, warm-started to write tool
calls (tools/make_math_example.py --tool-warmup): on the real TorchEngine (and SGLang when it is
installed), every stored row is the prompt's ids, then each model turn exactly as the engine emitted it,
then each tool reply rendered alone, whose content is the calculator's value of the parsed expression
(or "error: ..."); the loss mask is 1 exactly on the engine's ids, with their logprobs and versions.
configs/agent-tools.toml passes `baton check` and a short `baton run` leaves a balanced ledger."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from buffers.codec import decode
from buffers.memory import MemoryStore
from stages.data.datasets import DatasetTask
from stages.data.model import load_tokenizer
from stages.environments.base import ModelTurn
from stages.environments.calculator import CALCULATOR, SYSTEM_PROMPT, Calculator, evaluate, format_number
from stages.environments.render import ChatRenderer
from stages.environments.tool_env import ToolError, tool_message
from stages.rollout import Rollout
from stages.rollout.episode import EpisodeLimits
from tests.helpers.engines import VLLM_MISSING
from tests.helpers.ledger_checks import check_ledger
from tests.helpers.workers import Recorder, worker_for
from tools.make_math_example import make_math_data, make_qwen_like_model, tool_warmup

ROOT = Path(__file__).resolve().parents[3]
TOOLS = ROOT / "configs" / "agent-tools.toml"
LIMITS = EpisodeLimits(max_turns=3, max_tokens=1280, step_timeout_s=30, timeout_s=600)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("math-tools")
    tool_warmup(make_qwen_like_model(out / "model"))
    make_math_data(out / "data", train=32, eval=4)
    return out


class RecordingEngine:
    """An engine with every `generate` answer recorded as (prompt ids, completion); nothing else changes."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls: list[tuple[list[int], object]] = []

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def generate(self, prompts, params):
        completions = await self.engine.generate(prompts, params)
        self.calls += [([int(t) for t in p], c) for p, c in zip(prompts, completions, strict=True)]
        return completions


async def expected_replies(turn: ModelTurn) -> list[dict]:
    """The tool messages a model turn should get: the calculator's value of each parsed expression (or
    "error: ..."), then "error: <why>" per malformed call."""
    messages = []
    for call in turn.tool_calls:
        if set(call.arguments) == {"expression"}:
            try:
                content = format_number(evaluate(call.arguments["expression"]))
            except ToolError as exc:
                content = f"error: {exc}"
        else:  # arguments the tool does not take: the environment's own wording of the error
            text, ok = await Calculator().run_tool(call)
            assert not ok and text.startswith("bad arguments for calculator")
            content = f"error: {text}"
        messages.append(tool_message(content, call))
    return messages + [tool_message(f"error: {reason}") for reason in turn.malformed]


async def run_tool_groups(engine, model: Path, train: Path, tmp_path: Path, groups: int = 2) -> dict:
    """Produce `groups` calculator groups through a rollout worker on `engine` (recorded) and check every
    stored row against what the engine emitted and the calculator answered; returns counts."""
    task = DatasetTask(train, prompt_field="question", max_new_tokens=96)
    recording = RecordingEngine(engine)
    rollout = Rollout(task, [recording], tokenizer=model, group_size=4, batch_groups=groups,
                      environment="calculator", environment_options={"max_turns": 3}, limits=LIMITS)
    store, recorder = MemoryStore(), Recorder()
    prompts = [task.sample(None) for _ in range(groups)]
    await worker_for(rollout, recording, store, recorder, tmp_path).produce(prompts)
    assert len(recorder.sent) == groups and not recorder.finished and "episodes_failed" not in rollout.stats
    renderer = ChatRenderer(load_tokenizer(model))
    counts = {"episodes": 0, "turns": 0, "valid_calls": 0, "first_turn_valid_calls": 0, "two_turns_after_a_call": 0}
    used: set[int] = set()
    batches = [decode(await store.get(ref.key)) for ref in recorder.sent]  # in the order groups finished
    assert sorted(b.meta["prompt"] for b in batches) == sorted(p.text for p in prompts)
    for batch in batches:
        first = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": batch.meta["prompt"]}]
        prompt_ids = renderer.prompt_ids(first, [CALCULATOR])  # the calculator's system prompt, the tool shown
        for i in range(batch.rows):
            row = batch.row(i)
            assert int(row["prompt_lens"]) == len(prompt_ids)
            turns = await check_row(row, prompt_ids, renderer, recording.calls, used)
            assert int(row["turns"]) == len(turns)
            counts["episodes"] += 1
            counts["turns"] += len(turns)
            counts["valid_calls"] += sum(bool(t.tool_calls) and not t.malformed for t in turns)
            counts["first_turn_valid_calls"] += bool(turns[0].tool_calls) and not turns[0].malformed
            counts["two_turns_after_a_call"] += len(turns) >= 2 and bool(turns[0].tool_calls)
    assert used == set(range(len(recording.calls))), "every engine answer is in exactly one stored row"
    return counts


async def check_row(row: dict, prompt_ids: list[int], renderer: ChatRenderer, calls: list, used: set[int]):
    """Walk one stored row: the prompt, then per turn the engine's ids (one of the recorded answers to
    exactly the row's history so far) and the tool reply rendered alone. Every position is checked once,
    so the loss mask is 1 exactly on the engine's ids. Returns the row's parsed model turns."""
    tokens, mask, logprobs, versions = (row["tokens"].tolist(), row["loss_mask"], row["logprobs"],
                                        row["token_versions"])
    assert len(mask) == len(tokens) == len(logprobs) == len(versions)
    pos, turns = len(prompt_ids), []
    assert tokens[:pos] == prompt_ids and not mask[:pos].any() and (versions[:pos] == -1).all()
    while pos < len(tokens):
        found = [k for k, (history, c) in enumerate(calls) if k not in used and history == tokens[:pos]
                 and c.tokens.tolist() == tokens[pos : pos + len(c.tokens)]]
        assert found, f"the row's ids from {pos} on are no engine answer to the row's history"
        used.add(found[0])
        completion = calls[found[0]][1]
        end = pos + len(completion.tokens)
        assert mask[pos:end].all()
        np.testing.assert_array_equal(logprobs[pos:end], completion.logprobs)
        np.testing.assert_array_equal(versions[pos:end], completion.versions)
        turns.append(renderer.turn(completion.tokens, completion.finish_reason, [CALCULATOR]))
        if end == len(tokens):
            break
        replies = await expected_replies(turns[-1])
        reply = renderer.reply_ids(replies, after_stop=renderer.ended_on_stop(completion.tokens))
        pos, end = end, end + len(reply)
        assert tokens[pos:end] == reply, "the environment's reply is its tool messages rendered alone"
        assert not mask[pos:end].any() and not logprobs[pos:end].any() and (versions[pos:end] == -1).all()
        pos = end
    return turns


@pytest.mark.anyio
async def test_tool_episodes_on_the_torch_engine(example: Path, tmp_path: Path) -> None:
    from stages.engines.torch import TorchEngine

    engine = TorchEngine(example / "model", seed=1)
    await engine.start()
    try:
        counts = await run_tool_groups(engine, example / "model", example / "data" / "train.jsonl", tmp_path)
    finally:
        await engine.stop()
    print("torch tool episodes:", counts)
    assert counts["episodes"] == 8
    assert counts["two_turns_after_a_call"] >= 1, "some episode called the calculator and went on"
    assert counts["valid_calls"] >= 1


@pytest.mark.long  # a slow integration run: in the long suite
@pytest.mark.anyio
@pytest.mark.sglang
@pytest.mark.slow
async def test_tool_episodes_on_sglang(example: Path, tmp_path: Path) -> None:
    from stages.engines.sglang import SGLangEngine
    from stages.engines.sglang_server import SGLangUnavailable, sglang_python

    try:
        sglang_python()
    except SGLangUnavailable as exc:
        pytest.skip(str(exc))
    engine = SGLangEngine(example / "model", name="sglang-tools", log_dir=tmp_path)
    await engine.start()
    try:
        counts = await run_tool_groups(engine, example / "model", example / "data" / "train.jsonl", tmp_path)
    finally:
        await engine.stop()
    print("sglang tool episodes:", counts)
    assert counts["episodes"] == 8
    assert counts["two_turns_after_a_call"] >= 1, "some episode called the calculator and went on"


def paths(example: Path) -> list[str]:
    sets = (f"model.path='{example / 'model'}'", f"task.path='{example / 'data' / 'train.jsonl'}'",
            f"run_root='{example / 'runs'}'")
    return [x for s in sets for x in ("--set", s)]


def baton(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baton.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


@pytest.mark.long  # CI time: in the long suite
def test_baton_check_accepts_agent_tools_toml(example: Path) -> None:
    proc = baton("check", str(TOOLS), *paths(example))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'kind = "calculator"' in proc.stdout and "max_tokens = 1280" in proc.stdout


@pytest.fixture(scope="module")
def vllm_example(tmp_path_factory) -> Path:
    """The example shaped for vLLM's CPU attention: 3 heads over hidden size 96 (head size 32)."""
    out = tmp_path_factory.mktemp("math-tools-vllm")
    tool_warmup(make_qwen_like_model(out / "model", heads=3, kv_heads=1))
    make_math_data(out / "data", train=32, eval=4)
    return out


@pytest.mark.long  # a real vLLM server: ~1-3 min to start on 2 shared cores
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING)
def test_baton_run_agent_tools_toml_on_vllm(vllm_example: Path) -> None:
    """The config with `--set engine.kind='vllm'`: multi-turn tool episodes on a vLLM server, a clean ledger."""
    proc = baton("run", str(TOOLS), *paths(vllm_example), "--set", "steps=3", "--set", "engine.kind='vllm'")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["version"] == 3 and summary["ledger_balanced"]
    check_ledger(Path(summary["run_dir"]), bound=2)
    metrics = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    print("vllm tool runs:", [(m.get("turns_mean"), m.get("episode/tool_calls")) for m in metrics])
    assert max(m["turns_mean"] for m in metrics) > 1, "episodes went on after a tool reply"


@pytest.mark.long  # a slow integration run: in the long suite
@pytest.mark.slow
def test_baton_run_agent_tools_toml(example: Path) -> None:
    """A short run of the config on the local runtime finishes with a balanced ledger."""
    proc = baton("run", str(TOOLS), *paths(example), "--set", "steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["version"] == 2 and summary["ledger_balanced"]
    check_ledger(Path(summary["run_dir"]), bound=2)
