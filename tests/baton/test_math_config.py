"""configs/math.toml: the TOML form of the math example (task.kind = "dataset", [reward], [eval],
model.dtype) builds the same parts as examples/math_dsl.py, and each bad input is named by its key
before anything starts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from baton.builder import build_pipeline
from baton.config import ConfigError, load_toml, validate
from baton.schema import RunConfig
from stages.data.datasets import DatasetTask
from tools.make_math_example import make_math_data, make_qwen_like_model

ROOT = Path(__file__).resolve().parents[2]
MATH = ROOT / "configs" / "math.toml"


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("math-example")
    make_qwen_like_model(out / "model", hidden_size=32, layers=1)
    make_math_data(out / "data", train=40, eval=8)
    return out


def config(example: Path, *overrides: str) -> RunConfig:
    paths = (f"model.path='{example / 'model'}'", f"task.path='{example / 'data' / 'train.jsonl'}'",
             f"task.eval_path='{example / 'data' / 'eval.jsonl'}'", f"run_root='{example / 'runs'}'")
    return validate(RunConfig, load_toml(MATH, [*paths, *overrides]), source=str(MATH))


def test_math_toml_builds_the_dsl_parts(example: Path) -> None:
    pipe = build_pipeline(config(example))
    rollout = pipe.producer
    assert isinstance(rollout.task, DatasetTask) and rollout.task.uses_chat
    assert rollout.task.system_prompt == "Answer with a number." and rollout.task.max_new_tokens == 2
    assert "math_verify" in rollout.reward.fn.__qualname__ and rollout.reward.timeout_s == 5
    assert rollout.evaluation.every == 50 and len(rollout.evaluation.prompt_list()) == 8
    assert rollout.engines[0].dtype == "float32"
    assert rollout.stop_token_ids == (rollout.tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                      rollout.tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    bf16 = build_pipeline(config(example, "model.dtype='bfloat16'", "reward={function='exact_match'}"))
    assert bf16.producer.engines[0].dtype == "bfloat16" and bf16.producer.reward.fn.__name__ == "exact_match"


def test_a_user_reward_by_dotted_path(example: Path) -> None:
    pipe = build_pipeline(config(example, "reward={function='stages.data.rewards:exact_match', on_error='drop'}"))
    assert pipe.producer.reward.on_error == "drop"


@pytest.mark.parametrize(("override", "expected"), [
    ("model.dtype='float16'", "model.dtype"),
    ("reward={function='no_such.module:f'}", "reward: reward 'no_such.module:f': cannot import"),
    ("reward={function='exact_match', weights={math_verify=1.0}}", "exactly one of reward.function and"),
    ("reward={function='exact_match', on_error='retry'}", "reward.on_error"),
    ("task.messages_field='conv'", "exactly one of task.prompt_field"),
    ("task.path='/nowhere/train.jsonl'", "task.path = '/nowhere/train.jsonl' does not exist"),
    ("task.eval_path='/nowhere/eval.jsonl'", "task.eval_path = '/nowhere/eval.jsonl' does not exist"),
    ("eval.every=-1", "eval.every"),
])
def test_bad_values_are_named(example: Path, override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        config(example, override)
    assert expected in str(info.value), str(info.value)


def test_eval_needs_an_eval_split(example: Path) -> None:
    data = load_toml(MATH, [f"model.path='{example / 'model'}'", f"task.path='{example / 'data' / 'train.jsonl'}'"])
    del data["task"]["eval_path"]
    with pytest.raises(ConfigError, match="eval.every is set, but the dataset task has no task.eval_path"):
        validate(RunConfig, data)
    data["eval"]["every"] = 0
    assert build_pipeline(validate(RunConfig, data)).producer.evaluation is None


def test_own_model_folder_problems_name_model_path(example: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.path"):
        config(example, f"model.path='{tmp_path}'")
    base = tmp_path / "base"
    shutil.copytree(example / "model", base)
    (base / "chat_template.jinja").unlink()
    with pytest.raises(ConfigError, match="model.path: the tokenizer .* has no chat template"):
        config(example, f"model.path='{base}'")


def test_a_bad_row_fails_the_build_naming_file_row_and_field(example: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "a", "answer": 1}) + "\n" + json.dumps({"question": "b"}) + "\n")
    with pytest.raises(ConfigError, match=r"task: dataset '.*bad.jsonl', row 2: field 'answer' is missing"):
        build_pipeline(config(example, f"task.path='{bad}'"))


@pytest.mark.slow
@pytest.mark.long  # CI time: in the long suite
def test_baton_run_math_toml(example: Path) -> None:
    """The CLI runs the math example end to end: chat prompts, the reward, evaluations tagged with versions."""
    paths = (f"model.path='{example / 'model'}'", f"task.path='{example / 'data' / 'train.jsonl'}'",
             f"task.eval_path='{example / 'data' / 'eval.jsonl'}'", f"run_root='{example / 'runs'}'",
             "steps=6", "eval.every=3")
    proc = subprocess.run(
        [sys.executable, "-m", "baton.cli", "run", str(MATH), *[x for p in paths for x in ("--set", p)]],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["version"] == 6 and summary["ledger_balanced"]
    evals = [json.loads(line) for line in (Path(summary["run_dir"]) / "eval.jsonl").read_text().splitlines()]
    assert evals[0]["version"] == 0 and all(e["eval/n"] == 8 for e in evals)
    assert all(e["version"] >= 3 * i and e["version_max"] >= e["version"] for i, e in enumerate(evals))
