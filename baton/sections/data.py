"""Where prompts come from and what is trained: [model], [task] (its kinds) and [eval]."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from baton.config import ConfigError
from baton.sections.base import BuildContext, Section, declared_defaults, kinds, same_as
from stages.data.tasks import Addition, ReverseDigits

if TYPE_CHECKING:
    from stages.data.datasets import DatasetTask
    from stages.rollout.evaluation import Evaluation

DTYPES = same_as("stages.data.model:DTYPES", ("float32", "bfloat16"))

TINY_MODEL = declared_defaults("stages.data.model:make_tiny_model")
TINY_MOE_MODEL = declared_defaults("stages.data.model:make_tiny_moe_model")
REVERSE_DIGITS = declared_defaults("stages.data.tasks:ReverseDigits")
DATASET_TASK = declared_defaults("stages.data.datasets:DatasetTask")
EVALUATION = declared_defaults("stages.rollout.evaluation:Evaluation")


class ModelSpec(Section):
    path: str = Field("runs/models/tiny-qwen2",
        description="a Hugging Face causal-LM folder, shared by the engines and the learner (with `create`, the tiny"
                    " model is made there); nothing is downloaded")
    create: bool = Field(True, description="make a random-init tiny model there if it is missing")
    hidden_size: int = Field(TINY_MODEL("hidden_size", 64), ge=8,
        description="with `create`: the tiny model's hidden size (a folder made with other shape values is an error,"
                    " not replaced)")
    layers: int = Field(TINY_MODEL("layers", 2), ge=1,
        description="with `create`: the tiny model's decoder layers")
    heads: int = Field(TINY_MODEL("heads", 8), ge=1,
        description="with `create`: the tiny model's attention (query) heads")
    kv_heads: int = Field(TINY_MODEL("kv_heads", 4), ge=1,
        description="with `create`: the tiny model's key/value heads (heads / kv_heads query heads share one)")
    seed: int = Field(TINY_MODEL("seed", 0), description="seed of the random init (independent of "
                      "the run's seed)")
    experts: int = Field(0, ge=0, description="with `create`: 0 makes a dense Qwen2; more makes a Qwen3-MoE whose "
                         "every decoder layer routes each token to `top_k` of this many experts")
    top_k: int = Field(TINY_MOE_MODEL("top_k", 2), ge=1, description="with `create` and `experts`: "
                       "experts per token")
    dtype: Literal[tuple(DTYPES)] = Field("float32", description="the engines' weights (the learner trains in "  # type: ignore[valid-type]
                                          "float32)")

    def make(self) -> Path:
        """The model folder: a tiny random-init model made there when `create` (reused when present)."""
        from stages.data.model import make_tiny_model, make_tiny_moe_model

        if not self.create:
            return Path(self.path)
        if self.experts:
            return make_tiny_moe_model(self.path, hidden_size=self.hidden_size, layers=self.layers, heads=self.heads,
                                       kv_heads=self.kv_heads, experts=self.experts, top_k=self.top_k, seed=self.seed)
        return make_tiny_model(self.path, hidden_size=self.hidden_size, layers=self.layers, heads=self.heads,
                               kv_heads=self.kv_heads, seed=self.seed)


class ReverseDigitsSpec(Section):
    kind: Literal["reverse-digits"] = Field("reverse-digits",
        description="reverse a string of digits: `1234>` -> `4321`; reward: the fraction of positions right")
    digits: int = Field(REVERSE_DIGITS("digits", 2), ge=1, le=16, description="digits per prompt")

    @property
    def max_new_tokens(self) -> int:
        return ReverseDigits(digits=self.digits).max_new_tokens

    def make(self, ctx: BuildContext) -> ReverseDigits:
        return ReverseDigits(digits=self.digits)


class AdditionSpec(Section):
    kind: Literal["addition"] = Field("addition",
        description="single-digit addition: `3+5=` -> `08` (two digits, zero-padded); reward: the fraction of "
                    "positions right")

    @property
    def max_new_tokens(self) -> int:
        return Addition().max_new_tokens

    def make(self, ctx: BuildContext) -> Addition:
        return Addition()


class DatasetTaskSpec(Section):
    """Prompts from a local JSONL/JSON/Parquet/CSV file or a `save_to_disk` folder (stages.data.datasets)."""

    kind: Literal["dataset"] = Field("dataset",
        description="prompts and answers from rows of a local dataset file or folder")
    path: str = Field(description="the train split: a file or a save_to_disk folder")
    eval_path: str | None = Field(None, description="the eval split, read like `path` ([eval] generates it)")
    split: str | None = Field(None, description="which split of a save_to_disk DatasetDict")
    prompt_field: str | None = Field(None, description="text prompts (a user message when `chat`)")
    messages_field: str | None = Field(None, description="chat prompts: [{role, content}, ...]")
    answer_field: str = Field(DATASET_TASK("answer_field", "answer"),
        description="the row field holding the answer the reward checks")
    metadata_fields: list[str] = Field(default_factory=list, description="row fields passed to the reward")
    system_prompt: str | None = Field(None,
        description="a system message put first in every prompt (needs chat prompts: `chat` or `messages_field`)")
    chat: bool = Field(DATASET_TASK("chat", True), description="prompt_field text goes through the chat "
                       "template")
    max_new_tokens: int = Field(DATASET_TASK("max_new_tokens", 32), ge=1,
        description="most tokens the model generates per completion")
    shuffle: bool = Field(DATASET_TASK("shuffle", True),
        description="shuffle the rows of each epoch, seeded by the run's seed; false: file order")
    epochs: int | None = Field(DATASET_TASK("epochs", None), ge=1, description="unset: cycle forever")

    @model_validator(mode="after")
    def _check(self) -> DatasetTaskSpec:
        if (self.prompt_field is None) == (self.messages_field is None):
            raise ValueError("give exactly one of task.prompt_field (text) and task.messages_field (chat messages)")
        for key in ("path", "eval_path"):
            value = getattr(self, key)
            if value is not None and not Path(value).exists():
                raise ValueError(f"task.{key} = {value!r} does not exist")
        return self

    @property
    def uses_chat(self) -> bool:
        return self.messages_field is not None or self.chat

    def make(self, ctx: BuildContext) -> DatasetTask:
        """Reads (and checks) every row now, before anything starts; the run's seed orders the epochs."""
        from stages.data.datasets import DatasetTask

        try:
            return DatasetTask(**self.model_dump(exclude={"kind", "metadata_fields"}),
                               metadata_fields=tuple(self.metadata_fields), seed=ctx.seed)
        except ValueError as exc:
            raise ConfigError(f"task: {exc}") from None


BUILT_IN_TASKS = (ReverseDigitsSpec, AdditionSpec, DatasetTaskSpec)  # tasks whose sizes the schema knows
TaskSection = kinds(*BUILT_IN_TASKS)  # the task kinds


class EvalSpec(Section):
    """Evaluation during training ([eval], stages.rollout.evaluation): off unless `every` is set."""

    every: int = Field(0, ge=0, description="generate the eval split every this many versions; 0: never")
    samples: int = Field(EVALUATION("samples", 1), ge=1, description="completions per eval prompt")
    temperature: float = Field(EVALUATION("temperature", 0.0), ge=0, description="0: greedy")
    sample_prompts: int = Field(EVALUATION("sample_prompts", 64), ge=1, description="prompts drawn from "
                                "a built-in task (a dataset task evaluates its eval_path)")
    pass_reward: float = Field(EVALUATION("pass_reward", 1.0), description="eval/pass_rate counts samples "
                               "whose reward reaches this")

    def make(self, ctx: BuildContext, task: Any) -> Evaluation | None:
        """A dataset task's eval split, or seeded samples of a built-in task; None when `every` = 0."""
        from stages.data.datasets import DatasetTask
        from stages.rollout.evaluation import Evaluation

        if not self.every:
            return None
        eval_task = task.eval_task() if isinstance(task, DatasetTask) else task
        return Evaluation(eval_task, seed=ctx.seed, **self.model_dump())
