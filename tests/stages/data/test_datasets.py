"""DatasetTask: every file format and field mapping, seeded epochs, shards, a position that survives a
checkpoint (through the rollout worker's stream state), the eval split, and an error naming the file,
the row and the field for each bad input."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from random import Random

import pytest

from stages.data.datasets import DatasetError, DatasetExhausted, DatasetTask
from stages.data.tasks import Prompt
from stages.rollout.prompts import PromptStream, decode_prompt, encode_prompt

ROWS = [{"question": f"What is {i} plus 1?", "answer": i + 1, "level": i % 3} for i in range(10)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "train.jsonl", ROWS)


def all_prompts(task: DatasetTask, n: int) -> list[Prompt]:
    return [task.sample(Random(0)) for _ in range(n)]


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "disk", "disk-dict", "object"])
def test_every_format_reads_the_same_rows(tmp_path: Path, fmt: str) -> None:
    import datasets

    data = datasets.Dataset.from_list(ROWS)
    path: object = {
        "jsonl": lambda: write_jsonl(tmp_path / "d.jsonl", ROWS),
        "json": lambda: (tmp_path / "d.json").write_text(json.dumps(ROWS)) and tmp_path / "d.json",
        "parquet": lambda: data.to_parquet(str(tmp_path / "d.parquet")) and tmp_path / "d.parquet",
        "csv": lambda: data.to_csv(str(tmp_path / "d.csv"), index=False) and tmp_path / "d.csv",
        "disk": lambda: data.save_to_disk(str(tmp_path / "d")) or tmp_path / "d",
        "disk-dict": lambda: datasets.DatasetDict({"train": data}).save_to_disk(str(tmp_path / "dd"))
        or tmp_path / "dd",
        "object": lambda: data,
    }[fmt]()
    task = DatasetTask(path, prompt_field="question", metadata_fields=("level",), shuffle=False,
                       split="train" if fmt == "disk-dict" else None)
    prompts = all_prompts(task, 10)
    assert [p.text for p in prompts] == [r["question"] for r in ROWS]
    assert [p.answer for p in prompts] == [str(r["answer"]) for r in ROWS]
    assert prompts[4].metadata == {"level": 1}
    assert prompts[0].messages == [{"role": "user", "content": "What is 0 plus 1?"}]


def test_field_mappings(tmp_path: Path, jsonl: Path) -> None:
    plain = DatasetTask(jsonl, prompt_field="question", chat=False, shuffle=False, metadata_fields=("level",))
    assert plain.sample(Random(0)) == Prompt("What is 0 plus 1?", "1", metadata={"level": 0})
    assert not plain.uses_chat and decode_prompt(encode_prompt(plain.sample(Random(0)))).metadata == {"level": 1}
    system = DatasetTask(jsonl, prompt_field="question", system_prompt="Be brief.", shuffle=False)
    assert system.sample(Random(0)).messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 0 plus 1?"}
    ]
    chats = [{"conv": [{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi"}], "gold": "x"},
             {"conv": [{"role": "user", "content": "Yo"}], "gold": "y"}]
    chat = DatasetTask(write_jsonl(tmp_path / "c.jsonl", chats), messages_field="conv", answer_field="gold",
                       system_prompt="Default.", shuffle=False)
    first, second = all_prompts(chat, 2)
    assert decode_prompt(encode_prompt(first)) == first, "a chat prompt goes through the ledger (redo) unchanged"
    assert first.messages[0]["content"] == "Own." and first.text == "Hi" and first.answer == "x"
    assert second.messages == [{"role": "system", "content": "Default."}, {"role": "user", "content": "Yo"}]


def test_seeded_shuffle_epochs_and_exhaustion(jsonl: Path) -> None:
    task = DatasetTask(jsonl, prompt_field="question", seed=3, epochs=2)
    first, second = all_prompts(task, 10), all_prompts(task, 10)
    assert sorted(p.text for p in first) == sorted(r["question"] for r in ROWS), "an epoch is every row once"
    assert [p.text for p in first] != [r["question"] for r in ROWS], "shuffled"
    assert [p.text for p in first] != [p.text for p in second], "each epoch has its own order"
    again = DatasetTask(jsonl, prompt_field="question", seed=3)
    assert all_prompts(again, 10) == first, "the same seed gives the same order"
    with pytest.raises(DatasetExhausted, match="2 epochs"):
        task.sample(Random(0))


def test_shards_split_each_epoch(jsonl: Path) -> None:
    task = DatasetTask(jsonl, prompt_field="question", seed=1)
    shards = [task.shard(i, 3) for i in range(3)]
    seen = [p.text for s in shards for p in all_prompts(s, len(s._order(0)))]
    assert sorted(seen) == sorted(r["question"] for r in ROWS)
    with pytest.raises(ValueError):
        task.shard(3, 3)
    with pytest.raises(DatasetError, match="fewer than the 11 rollout workers"):
        task.shard(0, 11)


def test_position_survives_a_checkpoint_through_the_worker_stream(jsonl: Path) -> None:
    """The rollout worker's checkpointed stream state carries the dataset position: a resumed worker
    continues the epoch, so no prompt of it is seen twice and none skipped."""
    task = DatasetTask(jsonl, prompt_field="question", seed=5)
    worker = PromptStream(task.shard(0, 1), ctx=None, rng=Random(0), stats={})
    before = [worker.task.sample(worker.rng) for _ in range(4)]
    state = worker.state()
    resumed = PromptStream(task.shard(0, 1), ctx=None, rng=Random(0), stats={})
    resumed.restore(state)
    after = [resumed.task.sample(resumed.rng) for _ in range(6)]
    assert sorted(p.text for p in before + after) == sorted(r["question"] for r in ROWS)
    assert resumed.rng.getstate() == worker.rng.getstate()
    task.restore((1, 2))
    assert task.state() == (1, 2)
    with pytest.raises(DatasetError):
        task.restore((-1, 0))


def test_eval_split_and_other_processes(tmp_path: Path, jsonl: Path) -> None:
    eval_path = write_jsonl(tmp_path / "eval.jsonl", ROWS[:3])
    task = DatasetTask(jsonl, prompt_field="question", eval_path=eval_path)
    evaluation = task.eval_task()
    assert [p.text for p in all_prompts(evaluation, 3)] == [r["question"] for r in ROWS[:3]]
    with pytest.raises(DatasetExhausted):
        evaluation.sample(Random(0))
    copy = pickle.loads(pickle.dumps(task))  # what a Ray process gets: the mapping; it reads the file again
    assert copy._prompts == task._prompts
    with pytest.raises(DatasetError, match="no eval_path"):
        copy.eval_task().eval_task()


@pytest.mark.parametrize(("rows", "kw", "message"), [
    ([{"question": "a", "answer": 1}, {"question": "b"}], {}, r"row 2: field 'answer' is missing"),
    ([{"question": "a", "answer": 1}, {"question": "b", "answer": None}], {}, r"row 2: field 'answer'"),
    ([{"question": 3, "answer": 1}], {}, r"row 1: field 'question' is not text"),
    ([{"question": "a", "answer": 1}], {"metadata_fields": ("level",)}, r"row 1: field 'level' is missing"),
    ([{"conv": "hi", "answer": 1}], {"messages_field": "conv", "prompt_field": None}, r"row 1: field 'conv' is not"),
    ([{"conv": [{"role": "bot", "content": "x"}], "answer": 1}], {"messages_field": "conv", "prompt_field": None},
     r"row 1: field 'conv': message 0"),
])
def test_a_bad_row_names_file_row_and_field(tmp_path: Path, rows, kw, message) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError, match=message) as info:
        DatasetTask(path, **({"prompt_field": "question"} | kw))
    assert "bad.jsonl" in str(info.value)


def test_bad_files_and_settings(tmp_path: Path, jsonl: Path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "a", "answer": 1}\n{"question": \n')
    with pytest.raises(DatasetError, match=r"broken.jsonl.*row 2 is not JSON"):
        DatasetTask(broken, prompt_field="question")
    with pytest.raises(DatasetError, match="does not exist"):
        DatasetTask(tmp_path / "none.jsonl", prompt_field="question")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DatasetError, match="use a .jsonl"):
        DatasetTask(tmp_path / "d.txt", prompt_field="question")
    with pytest.raises(DatasetError, match="exactly one"):
        DatasetTask(jsonl)
    with pytest.raises(DatasetError, match="system_prompt needs chat"):
        DatasetTask(jsonl, prompt_field="question", chat=False, system_prompt="x")
    with pytest.raises(DatasetError, match="epochs"):
        DatasetTask(jsonl, prompt_field="question", epochs=0)
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"holds splits \['train'\]"):
        DatasetTask(tmp_path / "dd", prompt_field="question")
