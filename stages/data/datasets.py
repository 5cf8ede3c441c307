"""Prompts from a local dataset file: `DatasetTask`, usable wherever a Task is.

Reads JSONL, JSON, Parquet, CSV, or a folder written by `datasets`' `save_to_disk`, with the
`datasets` library (nothing is downloaded), and maps fields: `prompt_field` (text; sent as a user
message through the tokenizer's chat template when `chat`, else as plain text) or `messages_field`
(chat messages, `[{"role", "content"}, ...]`), `answer_field` (the ground truth) and `metadata_fields`
(passed to the reward). `system_prompt` is put first in chat prompts that have none.

Order: each epoch is a permutation of the rows seeded by (`seed`, epoch) (`shuffle = False`: file
order). A rollout worker takes its own shard (`shard(index, count)`: every count-th prompt of the
epoch from its index), so workers in separate processes never repeat each other's prompts. `state()`
is (epoch, position) within the shard and `restore(state)` continues from it, so a run that
checkpoints and resumes sees every prompt of an epoch once. With `epochs` set, asking past the last
epoch raises `DatasetExhausted`. Every row is checked when the file is loaded: a bad one raises
`DatasetError` naming the file, the row (1-based) and the field.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from stages.data.rewards import RewardFunction, Sample, accepted_keywords
from stages.data.tasks import Prompt

ROLES = ("system", "user", "assistant", "tool")
READERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DatasetError(ValueError):
    """A dataset file cannot be read, or one of its rows lacks or misshapes a mapped field."""


class DatasetExhausted(RuntimeError):
    """Every epoch the task was given has been used."""


def read_rows(path: str | Path, split: str | None = None) -> list[dict[str, Any]]:
    """The rows of a JSONL/JSON/Parquet/CSV file or a `save_to_disk` folder, as dicts."""
    import datasets

    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset {str(path)!r} does not exist")
    datasets.disable_progress_bars()
    try:
        if path.is_dir():
            data = datasets.load_from_disk(str(path))
            if isinstance(data, datasets.DatasetDict):
                if split not in data:
                    raise DatasetError(f"dataset {str(path)!r} holds splits {sorted(data)}; name one as `split`")
                data = data[split]
        elif path.suffix in READERS:
            reader = getattr(datasets.Dataset, f"from_{READERS[path.suffix]}")
            data = reader(str(path), keep_in_memory=True)
        else:
            raise DatasetError(f"dataset {str(path)!r}: use a .jsonl, .json, .parquet or .csv file or a "
                               "save_to_disk folder")
    except DatasetError:
        raise
    except Exception as exc:  # noqa: BLE001 - arrow/json errors of every kind: name the file (and line)
        raise DatasetError(f"dataset {str(path)!r} cannot be read: {_bad_json_line(path) or exc}") from None
    return data.to_list()


def _bad_json_line(path: Path) -> str | None:
    if path.suffix != ".jsonl":
        return None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            if line.strip():
                json.loads(line)
        except json.JSONDecodeError as exc:
            return f"row {number} is not JSON ({exc})"
    return None


@dataclass
class DatasetTask:
    """A Task over a dataset file (see the module docstring)."""

    path: Any  # a file or folder path, or a `datasets.Dataset`
    prompt_field: str | None = None
    messages_field: str | None = None
    answer_field: str = "answer"
    metadata_fields: tuple[str, ...] = ()
    system_prompt: str | None = None
    chat: bool = True  # prompt_field text goes through the chat template as a user message
    max_new_tokens: int = 32
    seed: int = 0
    shuffle: bool = True
    epochs: int | None = None  # None: cycle forever
    reward_function: Any = "exact_match"  # a RewardFunction, a callable, or a "pkg.module:function" path / built-in
    eval_path: Any = None  # the eval split: a file or folder (or Dataset), read like `path`
    split: str | None = None  # which split of a save_to_disk DatasetDict
    name: str = "dataset"
    shard_index: int = 0
    shard_count: int = 1
    _prompts: list[Prompt] = field(default_factory=list, repr=False)
    _cursor: tuple[int, int] = (0, 0)  # (epoch, position within this shard's part of the epoch)

    def __post_init__(self) -> None:
        if (self.prompt_field is None) == (self.messages_field is None):
            raise DatasetError("a dataset task needs exactly one of prompt_field (text) and messages_field (chat)")
        if self.system_prompt is not None and not self.uses_chat:
            raise DatasetError("system_prompt needs chat prompts (chat = true or a messages_field)")
        if self.epochs is not None and self.epochs < 1:
            raise DatasetError(f"epochs must be >= 1 (or unset: forever), got {self.epochs}")
        if not isinstance(self.reward_function, RewardFunction):
            self.reward_function = RewardFunction(self.reward_function)
        if not self._prompts:
            self._prompts = self.load(self.path)
        if not self._prompts:
            raise DatasetError(f"dataset {self.path!r} has no rows")

    @property
    def uses_chat(self) -> bool:
        """Its prompts are chat messages (the tokenizer must have a chat template)."""
        return self.messages_field is not None or self.chat

    def load(self, source: Any) -> list[Prompt]:
        """Every row of `source` as a Prompt (raises DatasetError at the first bad row)."""
        label = str(source) if isinstance(source, str | Path) else "<Dataset>"
        rows = read_rows(source, self.split) if isinstance(source, str | Path) else source.to_list()
        return [self._prompt(row, label, number) for number, row in enumerate(rows, 1)]

    def _prompt(self, row: dict[str, Any], label: str, number: int) -> Prompt:
        def need(name: str) -> Any:
            if name not in row or row[name] is None:
                raise DatasetError(f"dataset {label!r}, row {number}: field {name!r} is missing "
                                   f"(the row has {sorted(row)})")
            return row[name]

        answer = need(self.answer_field)
        metadata = {name: need(name) for name in self.metadata_fields}
        if self.messages_field is not None:
            messages = _checked_messages(need(self.messages_field), label, number, self.messages_field)
            text = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
        else:
            text = need(self.prompt_field)
            if not isinstance(text, str):
                raise DatasetError(f"dataset {label!r}, row {number}: field {self.prompt_field!r} is not text")
            messages = [{"role": "user", "content": text}] if self.chat else None
        if messages is not None and self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return Prompt(text=text, answer=str(answer), messages=messages, metadata=metadata or None)

    @property
    def prompts(self) -> list[Prompt]:
        """Every row as a Prompt, in file order (what an evaluation of this split generates)."""
        return list(self._prompts)

    # -- the Task protocol ------------------------------------------------------------------------

    def sample(self, rng: random.Random) -> Prompt:
        """The next prompt of this shard's order (`rng` is not used: the order is seeded by `seed`)."""
        epoch, position = self._cursor
        order = self._order(epoch)
        if position >= len(order):
            epoch, position = epoch + 1, 0
            order = self._order(epoch)
        if self.epochs is not None and epoch >= self.epochs:
            raise DatasetExhausted(f"dataset {self.path!r}: all {self.epochs} epochs of its "
                                   f"{len(self._prompts)} rows are used; raise task.epochs or train fewer steps")
        self._cursor = (epoch, position + 1)
        return self._prompts[order[position]]

    def reward(self, prompt: Prompt, completion: str) -> float:
        """A sync per-sample reward function called directly (no timeout; the rollout calls
        `reward_function.score`, which also takes async and batched functions)."""
        sample = Sample(prompt.text, completion, (), prompt.answer, prompt.metadata or {}, prompt.messages, prompt)
        fn = self.reward_function.fn
        return float(fn(**accepted_keywords(fn)(sample.keywords())))

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self._prompts)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order[self.shard_index :: self.shard_count]

    # -- position, shards and splits ----------------------------------------------------------------

    def state(self) -> tuple[int, int]:
        """(epoch, position in this shard's part of it): where `sample` goes on from."""
        return self._cursor

    def restore(self, state: tuple[int, int]) -> None:
        epoch, position = (int(v) for v in state)
        if epoch < 0 or position < 0:
            raise DatasetError(f"dataset position {state!r} is not (epoch >= 0, position >= 0)")
        self._cursor = (epoch, position)

    def shard(self, index: int, count: int) -> DatasetTask:
        """The part of each epoch rollout worker `index` of `count` takes (the rows are shared)."""
        if not 0 <= index < count:
            raise ValueError(f"shard {index} of {count} does not exist")
        if count > len(self._prompts):
            raise DatasetError(f"dataset {self.path!r} has {len(self._prompts)} rows, fewer than the {count} "
                               "rollout workers sharing it")
        return replace(self, shard_index=index, shard_count=count, _prompts=self._prompts, _cursor=(0, 0))

    def eval_task(self) -> DatasetTask:
        """The eval split as a task: file order, one epoch, the same mapping and reward."""
        if self.eval_path is None:
            raise DatasetError("this dataset task has no eval_path")
        return replace(self, path=self.eval_path, eval_path=None, shuffle=False, epochs=1, shard_index=0,
                       shard_count=1, _prompts=[], _cursor=(0, 0))

    def __getstate__(self) -> dict[str, Any]:
        """What another process needs: the mapping, not the loaded rows (it reads the file again)."""
        state = dict(self.__dict__)
        if isinstance(self.path, str | Path):
            state["_prompts"] = []
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if not self._prompts:
            self._prompts = self.load(self.path)


def _checked_messages(value: Any, label: str, number: int, name: str) -> list[dict[str, str]]:
    where = f"dataset {label!r}, row {number}: field {name!r}"
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where} is not a non-empty list of messages")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise DatasetError(f"{where}: message {i} is not {{'role': one of {ROLES}, 'content': text}}")
        messages.append({"role": m["role"], "content": m["content"]})
    return messages
