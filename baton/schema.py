"""The run config: a TOML file that maps one to one onto the Python DSL. One Section class per table
([model], [task], [engine], ... [simulate]), RunConfig for the whole file; the README's "Config
reference" lists every key. A `kind` key picks a built-in class or a "pkg.mod:Class" plug-in.

Unknown keys and bad values fail validation, naming the key, the value and what is allowed. So does a
config whose shape can break its own staleness bound (`policies.bounds`: queues that let groups age
past k, PPO epochs that compound staleness, a reuse count k cannot reach), before anything starts.

A default is defined once, in the part's own class (`default_of`); a section that mirrors a class reads
it from there. `baton.builder` turns a validated RunConfig into the Pipeline.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from baton.config import load_toml, to_toml, validate
from buffers import MemoryStore, RefBuffer
from buffers.mooncake import MooncakeSettings
from pipeline.dsl import Pipeline
from pipeline.faults import FAULT_KINDS, FaultSpec
from pipeline.watchdog import WatchdogSettings
from policies.correction import KIND_OF_SETTING, KINDS, Correction, auto_kind
from policies.selection import Selection
from policies.staleness import MaxStaleness, reuse_lead
from stages.data.datasets import DatasetTask
from stages.data.model import DTYPES, check_model_folder, linear_module_names, make_tiny_model
from stages.data.rewards import ON_ERROR, RewardFunction, resolve
from stages.data.tasks import Addition, ReverseDigits
from stages.engines.sglang import SGLangEngine
from stages.environments import make_environment
from stages.learner import GRPOLearner
from stages.learner.lora import LoraSpec, check_targets
from stages.learner.losses import (
    AGGREGATIONS,
    DISTILL_MODES,
    ENTROPY_SCOPES,
    LR_DECAYS,
    auto_entropy_cap,
    staleness_lr_factor,
)
from stages.rollout import Rollout
from stages.rollout.episode import EpisodeLimits
from stages.rollout.evaluation import Evaluation
from stages.rollout.gateway_worker import GatewaySettings, as_agent
from stages.scorers import ClassifierReward, Distillation, JudgeReward
from stages.scorers.server import ServerSettings
from stages.scorers.teacher import TEACHER_TIMEOUT_S
from stages.weights import TRANSPORTS, transport_class
from stages.weights.mooncake_p2p import MooncakeP2PTransport


def default_of(part: Any, name: str) -> Any:
    """The default of keyword `name` in the part's own class (or function): the one place it is defined."""
    if dataclasses.is_dataclass(part):
        return next(f.default for f in dataclasses.fields(part) if f.name == name)
    return inspect.signature(part).parameters[name].default


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PluginSpec(BaseModel):
    """`kind = "package.module:Class"`; every other key is passed to the class as a keyword (baton.builder)."""

    model_config = ConfigDict(extra="allow")
    kind: Annotated[str, Field(pattern=r"^[\w.]+:\w+$")] = Field(
        description="your own class as 'package.module:Class'; every other key of the table is passed to it as a "
        "keyword argument"
    )


def kinds(*members: type[BaseModel]) -> Any:
    """A discriminated union on `kind` (the first member is the default when `kind` is omitted),
    plus the `pkg.mod:Class` plug-in form."""
    default = members[0].model_fields["kind"].default

    def tag(value: Any) -> str:
        kind = value.get("kind", default) if isinstance(value, dict) else getattr(value, "kind", default)
        return "plugin" if isinstance(kind, str) and ":" in kind else kind

    union: Any = Annotated[PluginSpec, Tag("plugin")]
    for member in members:
        union = union | Annotated[member, Tag(member.model_fields["kind"].default)]
    return Annotated[union, Discriminator(tag)]


class ModelSpec(Section):
    path: str = Field("runs/models/tiny-qwen2",
        description="a Hugging Face causal-LM folder, shared by the engines and the learner (with `create`, the tiny"
                    " model is made there); nothing is downloaded")
    create: bool = Field(True, description="make a random-init tiny model there if it is missing")
    hidden_size: int = Field(default_of(make_tiny_model, "hidden_size"), ge=8,
        description="with `create`: the tiny model's hidden size (a folder made with other shape values is an error,"
                    " not replaced)")
    layers: int = Field(default_of(make_tiny_model, "layers"), ge=1,
        description="with `create`: the tiny model's decoder layers")
    heads: int = Field(default_of(make_tiny_model, "heads"), ge=1,
        description="with `create`: the tiny model's attention (query) heads")
    kv_heads: int = Field(default_of(make_tiny_model, "kv_heads"), ge=1,
        description="with `create`: the tiny model's key/value heads (heads / kv_heads query heads share one)")
    seed: int = Field(default_of(make_tiny_model, "seed"), description="seed of the random init (independent of "
                      "the run's seed)")
    dtype: Literal[tuple(DTYPES)] = Field("float32", description="the engines' weights (the learner trains in "  # type: ignore[valid-type]
                                          "float32)")


class ReverseDigitsSpec(Section):
    kind: Literal["reverse-digits"] = Field("reverse-digits",
        description="reverse a string of digits: `1234>` -> `4321`; reward: the fraction of positions right")
    digits: int = Field(default_of(ReverseDigits, "digits"), ge=1, le=16, description="digits per prompt")

    @property
    def max_new_tokens(self) -> int:
        return ReverseDigits(digits=self.digits).max_new_tokens


class AdditionSpec(Section):
    kind: Literal["addition"] = Field("addition",
        description="single-digit addition: `3+5=` -> `08` (two digits, zero-padded); reward: the fraction of "
                    "positions right")

    @property
    def max_new_tokens(self) -> int:
        return Addition().max_new_tokens


class DatasetTaskSpec(Section):
    """Prompts from a local JSONL/JSON/Parquet/CSV file or a `save_to_disk` folder (stages.data.datasets)."""

    kind: Literal["dataset"] = Field("dataset",
        description="prompts and answers from rows of a local dataset file or folder")
    path: str = Field(description="the train split: a file or a save_to_disk folder")
    eval_path: str | None = Field(None, description="the eval split, read like `path` ([eval] generates it)")
    split: str | None = Field(None, description="which split of a save_to_disk DatasetDict")
    prompt_field: str | None = Field(None, description="text prompts (a user message when `chat`)")
    messages_field: str | None = Field(None, description="chat prompts: [{role, content}, ...]")
    answer_field: str = Field(default_of(DatasetTask, "answer_field"),
        description="the row field holding the answer the reward checks")
    metadata_fields: list[str] = Field(default_factory=list, description="row fields passed to the reward")
    system_prompt: str | None = Field(None,
        description="a system message put first in every prompt (needs chat prompts: `chat` or `messages_field`)")
    chat: bool = Field(default_of(DatasetTask, "chat"), description="prompt_field text goes through the chat "
                       "template")
    max_new_tokens: int = Field(default_of(DatasetTask, "max_new_tokens"), ge=1,
        description="most tokens the model generates per completion")
    shuffle: bool = Field(default_of(DatasetTask, "shuffle"),
        description="shuffle the rows of each epoch, seeded by the run's seed; false: file order")
    epochs: int | None = Field(default_of(DatasetTask, "epochs"), ge=1, description="unset: cycle forever")

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


BUILT_IN_TASKS = (ReverseDigitsSpec, AdditionSpec, DatasetTaskSpec)  # tasks whose sizes the schema knows


URL = r"^https?://[\w.-]+(:\d+)?(/[\w./-]*)?$"


class ScorerSpec(Section):
    """What every model scorer's server takes (stages.scorers.server.ServerSettings)."""

    url: Annotated[str, Field(pattern=URL)] | None = Field(None, description="use this running server instead of "
                                                        "launching one from the model folder")
    token_file: str | None = Field(None, description="with url: a file holding the server's API token (sent as a "
                                   "bearer token; the token itself never goes in the config)")
    concurrency: int = Field(default_of(ServerSettings, "concurrency"), ge=1, description="requests of this scorer "
                             "in flight at once, over all groups of a producer process")
    timeout_s: float = Field(default_of(ServerSettings, "timeout_s"), gt=0, description="one request; past it the "
                             "samples fail ('<scorer> timeout'), counted like a failing reward function")
    retries: int = Field(default_of(ServerSettings, "retries"), ge=0, description="re-sends of a request after a "
                         "transport error (refused, reset)")
    max_restarts: int = Field(default_of(ServerSettings, "max_restarts"), ge=0, description="restarts of a launched "
                              "server that died, over the run (event scorer.restarted); then its samples fail")
    python: str | None = Field(None, description="interpreter with sglang for a launched server (default: "
                               "$BATON_SGLANG_PYTHON, then .venv-sglang)")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(default_of(ServerSettings, "dtype"),
        description="a launched server's weights (auto: the checkpoint's)")
    device: Literal["auto", "cpu", "cuda"] = Field(default_of(ServerSettings, "device"), description="a launched "
                                                   "server's device; auto: cuda when a GPU is visible, else cpu")

    def server_keys(self) -> dict[str, Any]:
        """The keys every model scorer passes to its server (stages.scorers.server.ServerSettings)."""
        return self.model_dump(include={"url", "token_file", "concurrency", "timeout_s", "retries", "max_restarts",
                                        "python", "dtype", "device"})

    @model_validator(mode="after")
    def _token_needs_url(self) -> ScorerSpec:
        if self.token_file is not None and self.url is None:
            raise ValueError("token_file is set without url: a server baton launches needs no token; set url or "
                             "remove token_file")
        return self


class ClassifierSpec(ScorerSpec):
    """[reward.classifier]: a sequence-classification reward model on SGLang (stages.scorers.classifier)."""

    model: str = Field(description="the reward model's Hugging Face folder (e.g. a Qwen2ForSequenceClassification): "
                       "its tokenizer and chat template render each sample; baton serves it with SGLang "
                       "--is-embedding unless url is set")
    label: int = Field(default_of(ClassifierReward, "label"), ge=0, description="which output of the model's head "
                       "is the score")

    def make(self) -> ClassifierReward:
        """The scorer (reads the folder's config and tokenizer: `RunConfig` checks it before a run)."""
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model = {self.model!r} holds no model (no config.json); point it at a Hugging Face "
                             "folder")
        return ClassifierReward(ServerSettings(self.model, **self.server_keys()), label=self.label)


class JudgeSpec(ScorerSpec):
    """[reward.judge]: a generative model grades each sample against a rubric (stages.scorers.judge)."""

    model: str | None = Field(None, description="a judge model folder baton serves with SGLang; or set url to use "
                              "any OpenAI-compatible server")
    model_name: str | None = Field(None, description="the request's model name (needed with url; default: the "
                                   "launched folder's path, as SGLang names it)")
    template: str = Field(default_of(JudgeReward, "template"), description="the user message: a str.format "
                          "template with {prompt}, {completion} and {answer}")
    parser: str = Field(default_of(JudgeReward, "parser"), description="'number' (the first number in the answer) or "
                        "'pkg.module:function' from the answer's text to a float, or None when it finds no grade")
    max_score: float = Field(default_of(JudgeReward, "max_score"), gt=0, description="the reward is the grade / "
                             "this; a grade outside [0, max_score] is a parse failure")
    max_tokens: int = Field(default_of(JudgeReward, "max_tokens"), ge=1, description="most tokens of the judge's "
                            "answer")
    temperature: float = Field(default_of(JudgeReward, "temperature"), ge=0, description="the judge's sampling "
                               "temperature (0: greedy)")
    parse_retries: int = Field(default_of(JudgeReward, "parse_retries"), ge=0, description="asks again after an "
                               "answer with no grade (each counted: event judge.unparsed); then the sample fails")

    @model_validator(mode="after")
    def _one_server(self) -> JudgeSpec:
        if self.model is None and self.url is None:
            raise ValueError("give model (a folder baton serves with SGLang) or url (an OpenAI-compatible server)")
        if self.model is None and self.model_name is None:
            raise ValueError("a judge given by url needs model_name (the model the server serves)")
        try:
            self.template.format(prompt="", completion="", answer="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"template: {exc!r}; it may use {{prompt}}, {{completion}} and {{answer}} (write "
                             "literal braces as {{ and }})") from None
        return self

    def make(self) -> JudgeReward:
        """The scorer (resolves a plug-in parser, reads the token file: `RunConfig` checks it before a run)."""
        return JudgeReward(ServerSettings(self.model, **self.server_keys()), **self.model_dump(include={
            "model_name", "template", "parser", "max_score", "max_tokens", "temperature", "parse_retries"}))


MODEL_REWARDS = ("classifier", "judge")  # names in [reward] weights that are the [reward.<name>] tables


class RewardSpec(Section):
    """The reward function ([reward]): `function`, or `weights` (a weighted sum of several, rule rewards and the
    model rewards of [reward.classifier] and [reward.judge])."""

    function: str | None = Field(None, description="a built-in (exact_match, math_verify, format_number) or "
                                 "'pkg.module:function'")
    weights: dict[str, float] = Field(default_factory=dict, description="function -> weight: their weighted sum; "
                                      "'classifier' and 'judge' name the model rewards of their tables")
    timeout_s: float | None = Field(default_of(RewardFunction, "timeout_s"), gt=0, description="per call")
    on_error: Literal[ON_ERROR] = Field(default_of(RewardFunction, "on_error"), description="what a sample "  # type: ignore[valid-type]
                                        "whose reward raised or timed out gets: 'zero' (scored 0) or 'drop' "
                                        "(its group dropped)")
    batched: bool = Field(False, description="the function takes a whole group at once")
    classifier: ClassifierSpec | None = Field(None, description="[reward.classifier]: a reward model's score, "
                                              "weighted by weights.classifier")
    judge: JudgeSpec | None = Field(None, description="[reward.judge]: an LLM judge's grade, weighted by "
                                    "weights.judge")

    @model_validator(mode="after")
    def _check(self) -> RewardSpec:
        if (self.function is None) == (not self.weights):
            raise ValueError("give exactly one of reward.function and reward.weights")
        for name in MODEL_REWARDS:
            table, weighted = getattr(self, name) is not None, name in self.weights
            if weighted and not table:
                raise ValueError(f"reward.weights names {name!r}, but there is no [reward.{name}] table; add it "
                                 f"(e.g. [reward.{name}] model = \"path/to/model\")")
            if table and not weighted:
                raise ValueError(f"[reward.{name}] is set, but reward.weights has no {name!r}; add {name} = 1.0 to "
                                 "reward.weights (reward.function cannot compose with a model reward)")
        for name in [self.function] if self.function else [n for n in self.weights if n not in MODEL_REWARDS]:
            try:
                resolve(name)
            except ValueError as exc:
                raise ValueError(f"reward: {exc}") from None
        return self


class DistillSpec(Section):
    """[distill]: on-policy distillation (stages.scorers.teacher; the learner's term: stages.learner.losses)."""

    teacher: str | dict[str, str] = Field(description="the teacher: a model folder, or the url of an SGLang "
                                          "server; several: {name = folder or url}, picked per sample by teacher_key")
    teacher_key: str | None = Field(None, description="with several teachers: the sample's metadata field "
                                    "(task.metadata_fields) whose value names its teacher")
    coef: float = Field(1.0, gt=0, description="the teacher term's weight: each model token's advantage gets "
                        "-coef x (student logprob - teacher logprob)")
    mode: Literal[DISTILL_MODES] = Field(default_of(GRPOLearner, "distill_mode"),  # type: ignore[valid-type]
        description="'advantage': the teacher's term is added to GRPO's advantage; 'loss': it is the whole "
                    "advantage (pure distillation: rewards are scored and reported but train nothing)")
    baseline: bool = Field(default_of(GRPOLearner, "distill_baseline"), description="subtract from each token's "
                           "teacher term the mean of the term at that position over the group's other samples (a "
                           "leave-one-out baseline: unbiased, lower variance; a random-init student distills "
                           "reverse-2 to reward 0.8 in ~120 versions with it, and is at 0.3 after 150 without)")
    backend: Literal["torch", "sglang"] = Field("torch", description="how a teacher folder is served: in the "
                                                "producer's process with torch, or on an SGLang server baton launches")
    on_error: Literal[ON_ERROR] = Field(default_of(Distillation, "on_error"),  # type: ignore[valid-type]
        description="a group its teacher failed to score: 'zero' (no teacher term: it trains on its reward) or "
                    "'drop' (dropped, counted)")
    token_file: str | None = Field(None, description="for teachers given by url: a file holding their API token")
    concurrency: int = Field(default_of(ServerSettings, "concurrency"), ge=1, description="sglang: requests per "
                             "teacher server in flight at once")
    timeout_s: float = Field(TEACHER_TIMEOUT_S, gt=0, description="sglang: one request")
    retries: int = Field(default_of(ServerSettings, "retries"), ge=0, description="sglang: re-sends after a "
                         "transport error")
    max_restarts: int = Field(default_of(ServerSettings, "max_restarts"), ge=0, description="sglang: restarts of a "
                              "launched teacher server that died (event scorer.restarted)")
    python: str | None = Field(None, description="sglang: interpreter with sglang (default: $BATON_SGLANG_PYTHON, "
                               "then .venv-sglang)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="the teacher's weights")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="sglang: a launched server's device")

    @model_validator(mode="after")
    def _teachers(self) -> DistillSpec:
        teachers = self.teachers()
        if len(teachers) > 1 and self.teacher_key is None:
            raise ValueError(f"distill.teacher names {len(teachers)} teachers; set distill.teacher_key, the sample "
                             "field that names each sample's teacher")
        if isinstance(self.teacher, str) and self.teacher_key is not None:
            raise ValueError("distill.teacher_key picks among several teachers, but distill.teacher is one; give "
                             "distill.teacher as {name = folder, ...} or remove teacher_key")
        for name, where in teachers.items():
            if not is_url(where) and not (Path(where) / "config.json").is_file():
                raise ValueError(f"distill.teacher {name!r} = {where!r} is neither a model folder (no config.json) "
                                 "nor an http(s) url; export a trained run with `baton export RUN_DIR OUT`")
        return self

    def teachers(self) -> dict[str, str]:
        """name -> folder or url (one teacher: named "teacher")."""
        return {"teacher": self.teacher} if isinstance(self.teacher, str) else dict(self.teacher)


def is_url(where: str) -> bool:
    return where.startswith(("http://", "https://"))


def check_shared_tokenizer(teacher: str, student: str | None, key: str = "distill.teacher") -> None:
    """Refuse a teacher folder whose tokenizer maps any token to another id than the student's (`student`:
    the student's folder; None: the tiny model's tokenizer, made on first use): the teacher scores the
    student's token ids, which mean the same text only under the same vocabulary."""
    from stages.data.model import load_tokenizer, tiny_tokenizer

    mine = (load_tokenizer(student) if student else tiny_tokenizer()).get_vocab()
    theirs = load_tokenizer(teacher).get_vocab()
    if mine == theirs:
        return
    differ = sorted(t for t in mine.keys() | theirs.keys() if mine.get(t) != theirs.get(t))
    example = differ[0]
    raise ValueError(
        f"{key} = {teacher!r}: its tokenizer differs from the student's ({len(theirs)} vs {len(mine)} tokens, "
        f"{len(differ)} differ, e.g. {example!r} is {theirs.get(example)} there and {mine.get(example)} here); the "
        "teacher scores the student's token ids, so both must share one tokenizer: use a teacher of the student's "
        "family, or export one from a run on this model with `baton export RUN_DIR OUT`"
    )


class EvalSpec(Section):
    """Evaluation during training ([eval], stages.rollout.evaluation): off unless `every` is set."""

    every: int = Field(0, ge=0, description="generate the eval split every this many versions; 0: never")
    samples: int = Field(default_of(Evaluation, "samples"), ge=1, description="completions per eval prompt")
    temperature: float = Field(default_of(Evaluation, "temperature"), ge=0, description="0: greedy")
    sample_prompts: int = Field(default_of(Evaluation, "sample_prompts"), ge=1, description="prompts drawn from "
                                "a built-in task (a dataset task evaluates its eval_path)")
    pass_reward: float = Field(default_of(Evaluation, "pass_reward"), description="eval/pass_rate counts samples "
                               "whose reward reaches this")


class TorchEngineSpec(Section):
    kind: Literal["torch"] = Field("torch",
        description="the in-process torch engine (continuous batching between decode steps)")
    count: int = Field(1, ge=1, le=16, description="engine workers (each its own producer actor)")
    batch_groups: int = Field(default_of(Rollout, "batch_groups"), ge=1, description="groups generated per engine call")
    temperature: float = Field(default_of(Rollout, "temperature"), gt=0,
        description="sampling temperature; the learner computes its logprobs at the same temperature")
    top_p: float = Field(default_of(Rollout, "top_p"), gt=0, le=1,
        description="nucleus sampling: draw from the smallest set of tokens whose probability reaches this; 1: all")


class SGLangEngineSpec(Section):
    """SGLang servers: launched on 127.0.0.1 (CPU flags when no GPU), or attached by `urls`."""

    kind: Literal["sglang"] = Field("sglang",
        description="SGLang HTTP servers (launched per engine, or attached by `urls`)")
    count: int = Field(1, ge=1, le=64, description="servers (each its own producer actor)")
    urls: list[Annotated[str, Field(pattern=r"^https?://[\w.-]+:\d+/?$")]] = Field(
        default_factory=list, description="attach to running servers instead of launching (one per engine)"
    )
    python: str | None = Field(
        None, description="interpreter with sglang (default: $BATON_SGLANG_PYTHON, then .venv-sglang)"
    )
    batch_groups: int = Field(default_of(Rollout, "batch_groups"), ge=1, description="groups generated per engine call")
    temperature: float = Field(default_of(Rollout, "temperature"), gt=0,
        description="sampling temperature; the learner computes its logprobs at the same temperature")
    top_p: float = Field(default_of(Rollout, "top_p"), gt=0, le=1,
        description="nucleus sampling: draw from the smallest set of tokens whose probability reaches this; 1: all")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(default_of(SGLangEngine, "dtype"),
        description="the server's weights; when this key is not set, model.dtype is used (auto: the checkpoint's)")
    device: Literal["auto", "cpu", "cuda"] = Field(default_of(SGLangEngine, "device"),
        description="auto: cuda when a GPU is visible, else cpu (the server then gets the CPU flags)")
    threads: int = Field(default_of(SGLangEngine, "threads"), ge=1, description="torch threads per server process "
                         "on CPU")
    max_total_tokens: int = Field(default_of(SGLangEngine, "max_total_tokens"), ge=256, description="KV-cache "
                                  "tokens per server")
    extra_args: list[str] = Field(default_factory=list, description="more sglang.launch_server flags, verbatim")
    update: Literal["tensor", "distributed", "disk"] = Field(
        default_of(SGLangEngine, "update"),
        description="how weights enter the server: update_weights_from_{tensor,distributed,disk}",
    )
    pause_mode: Literal["in_place", "retract"] = Field(
        default_of(SGLangEngine, "pause_mode"),
        description="how in-flight requests pause for a weight update (keep or recompute their KV)",
    )
    max_restarts: int = Field(default_of(SGLangEngine, "max_restarts"), ge=0, description="restarts of a dead server "
                              "before the run fails")
    base_gpu_id: int = Field(0, ge=0, description="device = 'cuda': engine i runs on GPU base_gpu_id + i")
    max_lora_rank: int | None = Field(None, ge=1, description="with learner.lora: the server's --max-lora-rank "
                                      "(default: learner.lora.rank); it refuses adapters of a larger rank")
    max_loaded_loras: int | None = Field(None, ge=2, description="with learner.lora: adapters a server holds at once "
                                         "(default and least: staleness.k + 2, the versions a live request may "
                                         "still use plus the one loading)")

    def lora_rank_limit(self) -> int | None:
        """The largest adapter rank the server takes: `max_lora_rank`, or a --max-lora-rank in `extra_args`."""
        if self.max_lora_rank is not None:
            return self.max_lora_rank
        args = list(self.extra_args)
        if "--max-lora-rank" in args and args.index("--max-lora-rank") + 1 < len(args):
            return int(args[args.index("--max-lora-rank") + 1])
        return None

    @model_validator(mode="after")
    def _check(self) -> SGLangEngineSpec:
        if self.urls and len(self.urls) != self.count:
            if "count" in self.model_fields_set:
                raise ValueError(f"engine.urls has {len(self.urls)} entries but engine.count = {self.count}; "
                                 "give one url per engine or drop engine.count")
            self.count = len(self.urls)
        return self

    @field_validator("python")
    @classmethod
    def _server_environment(cls, python: str | None, info: ValidationInfo) -> str | None:
        """Launching needs an interpreter with sglang; say how to make one before anything starts."""
        if not info.data.get("urls"):
            from stages.engines.sglang_server import SGLangUnavailable, sglang_python

            try:
                sglang_python(python)
            except SGLangUnavailable as exc:
                raise ValueError(f"cannot launch an SGLang server: {exc}") from None
        return python


BUILT_IN_ENGINES = (TorchEngineSpec, SGLangEngineSpec)  # engines whose sections the schema knows


class RolloutSpec(Section):
    group_size: int = Field(default_of(Rollout, "group_size"), ge=2,
        description="completions per prompt: one GRPO group, whose rewards are compared with their mean")
    request_timeout_s: float | None = Field(
        default_of(Rollout, "request_timeout_s"), gt=0,
        description="an engine call not answered within this is an error and its groups are generated "
        "again; unset: wait (required by the engine.hang fault)"
    )


class EpisodeSpec(Section):
    """Per-episode limits ([episode], stages.rollout.episode.EpisodeLimits); unset: no limit."""

    max_turns: int = Field(default_of(EpisodeLimits, "max_turns"), ge=1, description="model turns per episode "
                           "(an episode without an environment has one)")
    max_tokens: int | None = Field(default_of(EpisodeLimits, "max_tokens"), ge=1, description="tokens per "
                                   "episode: prompt, model turns and environment replies")
    step_timeout_s: float | None = Field(default_of(EpisodeLimits, "step_timeout_s"), gt=0, description="one "
                                         "environment call; past it the episode fails (counted)")
    timeout_s: float | None = Field(default_of(EpisodeLimits, "timeout_s"), gt=0, description="the whole episode; "
                                    "past it the episode fails (counted)")


class EnvironmentSpec(BaseModel):
    """[environment]: `kind` is a built-in environment's name or 'pkg.module:Class'; every other key is
    passed to it (stages.environments). Unset: single-turn episodes scored by the reward function."""

    model_config = ConfigDict(extra="allow")
    kind: str = Field(description="a built-in environment (stages.environments.ENVIRONMENTS) or 'pkg.module:Class'")

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _makes_one(self) -> EnvironmentSpec:
        try:
            make_environment(self.kind, **self.options())
        except (ValueError, TypeError) as exc:
            raise ValueError(f"environment: {exc}") from None
        return self


class GatewaySpec(Section):
    """[gateway] (stages.rollout.gateway_worker.GatewaySettings): the OpenAI API in front of the run's engines;
    episodes come from agents through it instead of the rollout's own loop."""

    port: int = Field(default_of(GatewaySettings, "port"), ge=0, le=65535, description="0: a free port")
    bind: str = Field(default_of(GatewaySettings, "bind"), description="the address to listen on; anything "
                      "but 127.0.0.1 lets other machines in (they still need the run's token)")
    agent: str | None = Field(None, description="'pkg.module:function' called per episode with (sample, "
                              "base_url, api_key), returning its reward; unset: agents open episodes themselves")
    agents: int | None = Field(None, ge=1, description="agent calls at once (default: engine.batch_groups * "
                               "rollout.group_size)")
    max_tokens: int = Field(default_of(GatewaySettings, "max_tokens"), ge=1, description="per request")
    max_episode_tokens: int = Field(default_of(GatewaySettings, "max_episode_tokens"), ge=1,
        description="all tokens of one episode; generation stops there")
    max_episode_s: float = Field(default_of(GatewaySettings, "max_episode_s"), gt=0,
        description="an episode open longer than this is dropped ('episode time limit')")
    reward_timeout_s: float = Field(default_of(GatewaySettings, "reward_timeout_s"), gt=0, description="an "
                                    "episode whose reward has not come this long after its last request is dropped")

    @model_validator(mode="after")
    def _agent_resolves(self) -> GatewaySpec:
        if self.agent is not None:
            try:
                as_agent(self.agent)
            except ValueError as exc:
                raise ValueError(f"gateway.agent: {exc}") from None
        return self


class FaultConfig(Section):
    """One `[[faults]]` entry (pipeline.faults): a named injection point and when it fires."""

    kind: Literal[FAULT_KINDS] = Field(description="the injection point, e.g. 'store.get_fail'")  # type: ignore[valid-type]
    at: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list, description="occurrences (1-based) at which it fires; learner.crash: learner versions"
    )
    probability: float = Field(default_of(FaultSpec, "probability"), ge=0, le=1,
                               description="instead of `at`: the chance it fires at each occurrence")
    seed: int = Field(default_of(FaultSpec, "seed"), description="seeds the `probability` draws")
    delay_s: float = Field(default_of(FaultSpec, "delay_s"), gt=0, description="engine.hang / channel.stall: how "
                           "long it lasts")

    @model_validator(mode="after")
    def _one_schedule(self) -> FaultConfig:
        if bool(self.at) == bool(self.probability):
            both = "both `at` and" if self.at else "neither `at` nor"
            raise ValueError(
                f"fault {self.kind!r} has {both} `probability`: give exactly one, e.g. at = [3] "
                "(fire at the 3rd occurrence) or probability = 0.01"
            )
        return self


class MemoryStoreSpec(Section):
    kind: Literal["memory"] = Field("memory", description="an in-process store: the local runtime only")
    capacity: ByteSize | None = Field(default_of(MemoryStore, "capacity_bytes"),
        description="most payload bytes held at once (a put beyond it is refused with StoreFull); unset: no bound")


class MooncakeStoreSpec(Section):
    """Mirrors Miles's `--mooncake-store-init-kwargs`; MOONCAKE_* environment variables give defaults."""

    kind: Literal["mooncake"] = Field("mooncake",
        description="Mooncake Store: the buffer's process mounts a segment, a mooncake_master coordinates")
    master: str = Field(
        default_factory=lambda: os.environ.get("MOONCAKE_MASTER_ADDR", "auto"),
        pattern=r"^(auto|[\w.-]+:\d+)$",
        description='"auto" starts a master on 127.0.0.1 for the run; "host:port" attaches',
    )
    protocol: str = Field(default_factory=lambda: os.environ.get("MOONCAKE_PROTOCOL", "tcp"),
        description='TransferEngine protocol, "tcp" or "rdma" (default: $MOONCAKE_PROTOCOL, else "tcp")')
    device: str = Field(default_factory=lambda: os.environ.get("MOONCAKE_DEVICE", ""),
        description="RDMA device names for protocol = 'rdma' (default: $MOONCAKE_DEVICE, else empty)")
    global_segment_size: ByteSize = Field(ByteSize(1 << 30),
        description="memory the buffer stage's process mounts into the store; must hold the buffer's byte bounds x "
                    "replicas below the master's 90 % eviction watermark (checked before the run)")
    local_buffer_size: ByteSize = Field(ByteSize(default_of(MooncakeSettings, "local_buffer_size")),
        description="each client's local transfer buffer registered with Mooncake")
    chunk_bytes: ByteSize = Field(ByteSize(default_of(MooncakeSettings, "chunk_bytes")),
        description="objects larger than this are stored as parts and reassembled on get (at least 1 MiB)")
    replicas: int = Field(default_of(MooncakeSettings, "replicas"), ge=1,
        description="copies of each object on distinct segments; 2 survives one holder's death but needs two "
                    "processes holding segments")


class RayStoreSpec(Section):
    """Ray's object store (Miles's `--object-store-backend ray`): one numpy object per batch."""

    kind: Literal["ray"] = Field("ray",
        description="Ray's object store: one numpy object per batch, owned by the store's index actor")
    capacity: ByteSize | None = Field(None,
        description="most payload bytes held at once (a put beyond it is refused); unset: bounded by Ray's object "
                    "store only")


class BufferSpec(Section):
    max_refs: int = Field(default_of(RefBuffer, "max_refs"), ge=1,
        description="refs the buffer stage holds at once; when full it stops receiving (backpressure)")
    max_bytes: ByteSize = Field(ByteSize(default_of(RefBuffer, "max_bytes")),
        description="payload bytes the refs the buffer holds may point at")
    produced_channel: int = Field(64, ge=1, description="refs in flight producer -> buffer")
    produced_bytes: ByteSize = Field(ByteSize(64 << 20), description="payload bytes in flight producer -> buffer")
    ready_channel: int = Field(16, ge=1, description="refs in flight buffer -> learner")
    ready_bytes: ByteSize = Field(ByteSize(64 << 20), description="payload bytes in flight buffer -> learner")

    @property
    def bytes_in_flight(self) -> int:
        """The most payload bytes the pipeline lets exist at once (channels + replay index)."""
        return int(self.produced_bytes) + int(self.max_bytes) + int(self.ready_bytes)


class LoraSection(Section):
    """[learner] lora: train LoRA adapters on a frozen base and publish only them (stages.learner.lora)."""

    rank: int = Field(default_of(LoraSpec, "rank"), ge=1, description="the adapters' rank")
    alpha: float = Field(default_of(LoraSpec, "alpha"), gt=0, description="the adapters' output is scaled by "
                         "alpha / rank")
    dropout: float = Field(default_of(LoraSpec, "dropout"), ge=0, lt=1, description="dropout on the adapters' "
                           "input, in training only")
    target_modules: list[str] = Field(default_factory=lambda: list(default_of(LoraSpec, "target_modules")),
                                      min_length=1, description="decoder linear modules to adapt, by the last part "
                                      "of their names (checked against the model)")
    check_every: int = Field(default_of(LoraSpec, "check_every"), ge=0, description="versions between checks "
                             "that each engine's logprobs of a fixed sequence equal the learner's (refused "
                             "otherwise); 0: never")
    check_tolerance: float = Field(default_of(LoraSpec, "check_tolerance"), gt=0, description="most a checked "
                                   "logprob may differ, relative beyond 1 in size (bfloat16 engines: about 0.05)")

    def spec(self) -> LoraSpec:
        return LoraSpec(**{**self.model_dump(), "target_modules": tuple(self.target_modules)})


class GRPOSpec(Section):
    kind: Literal["grpo"] = Field("grpo",
        description="GRPO: group-normalised advantages and a PPO-clip loss (the built-in learner)")
    lr: float = Field(default_of(GRPOLearner, "lr"), gt=0,
        description="AdamW learning rate, before warmup, decay and the staleness factor")
    groups_per_step: int = Field(default_of(GRPOLearner, "groups_per_step"), ge=1,
        description="new groups trained per learner step; each step makes one new version")
    clip_eps: float = Field(default_of(GRPOLearner, "clip_eps"), gt=0, description="PPO clip: ratio >= 1 - clip_eps "
                            "(and <= 1 + clip_eps unless clip_eps_high is set)")
    clip_eps_high: float | None = Field(default_of(GRPOLearner, "clip_eps_high"), gt=0, description="PPO clip, high "
                                        "side: ratio <= 1 + clip_eps_high (DAPO clip-higher); unset: clip_eps")
    loss_agg_mode: Literal[AGGREGATIONS] = Field(  # type: ignore[valid-type]
        default_of(GRPOLearner, "loss_agg_mode"), description="token-mean (DAPO), seq-mean-token-mean (GRPO) or "
        "seq-mean-token-sum-norm (Dr. GRPO: token sums / loss_max_tokens)")
    loss_max_tokens: int | None = Field(default_of(GRPOLearner, "loss_max_tokens"), ge=1, description="Dr. GRPO's "
                                        "constant divisor; unset: the batch's padded width")
    norm_adv_by_std: bool = Field(default_of(GRPOLearner, "norm_adv_by_std"), description="false: advantages are "
                                  "r - group mean, not divided by the group's std (Dr. GRPO)")
    entropy_coef: float = Field(default_of(GRPOLearner, "entropy_coef"), ge=0, description="entropy bonus")
    entropy_scope: Literal[ENTROPY_SCOPES] = Field(  # type: ignore[valid-type]
        default_of(GRPOLearner, "entropy_scope"), description='"all" rows, or "zero-variance": only the rows of '
        "groups whose rewards are all equal (no signal)")
    entropy_cap: Annotated[float, Field(gt=0)] | Literal["auto", "off", "initial"] = Field("auto", description=
        "each token's entropy counts in the bonus only up to this (nats): a token above it gets no push, so the "
        'bonus cannot drive the policy towards uniform where rewards are flat; "initial": the policy\'s mean '
        'token entropy on its first step (kept in checkpoints); "off": uncapped; "auto" (the default): off up '
        'to staleness.k = 2, "initial" above (resolved when the config loads)')
    kl_coef: float = Field(default_of(GRPOLearner, "kl_coef"), ge=0, description="k3 KL penalty to the initial "
                           "weights (0: off, and no reference model is kept)")
    lr_warmup_steps: int = Field(default_of(GRPOLearner, "lr_warmup_steps"), ge=0, description="versions of linear "
                                 "warmup")
    lr_decay: Literal[LR_DECAYS] = Field(default_of(GRPOLearner, "lr_decay"),  # type: ignore[valid-type]
                                         description="after warmup: constant, or linear / cosine decay to "
                                         "min_lr_ratio x lr at the last version")
    min_lr_ratio: float = Field(default_of(GRPOLearner, "min_lr_ratio"), ge=0, le=1,
        description="the decay's floor: lr_decay ends at this x lr")
    lr_tuned_staleness: float = Field(default_of(GRPOLearner, "lr_tuned_staleness"), ge=0, description="the "
                                      "staleness lr was chosen at: a staler step trains at lr x ((this + 1) / (its "
                                      "mean staleness + 1)) ** lr_staleness_power")
    lr_staleness_power: float = Field(default_of(GRPOLearner, "lr_staleness_power"), ge=0, description="0: the "
                                      "same lr at every staleness")
    lr_staleness_floor: float = Field(default_of(GRPOLearner, "lr_staleness_floor"), ge=0, le=1, description="the "
                                      "cut never takes a step's lr below this x lr (0: no floor)")
    warn_entropy_below: float = Field(default_of(GRPOLearner, "warn_entropy_below"), ge=0, description="a "
                                      "learner.entropy_collapse event when the entropy falls below this ...")
    warn_reward_below: float = Field(default_of(GRPOLearner, "warn_reward_below"), description="... while the "
                                     "trailing mean reward is below this")
    warn_window: int = Field(default_of(GRPOLearner, "warn_window"), ge=1, description="versions in that trailing "
                             "mean")
    max_grad_norm: float = Field(default_of(GRPOLearner, "max_grad_norm"), gt=0,
        description="gradients are clipped to this global norm before each optimizer step")
    weight_decay: float = Field(default_of(GRPOLearner, "weight_decay"), ge=0, description="AdamW weight decay")
    adam_betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        default_of(GRPOLearner, "adam_betas"), description="AdamW's decay rates of its gradient mean (momentum) "
        "and of its squared gradient, each in [0, 1)")
    epochs: int = Field(default_of(GRPOLearner, "epochs"), ge=1, description="optimizer passes over each step's "
                        "batch (PPO epochs)")
    device: str = Field(default_of(GRPOLearner, "device"), pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description='"auto": cuda when a GPU is visible')
    world_size: int = Field(default_of(GRPOLearner, "world_size"), ge=1, description="learner ranks: processes, "
                            "one device each (a GPU each on CUDA), the model sharded over them with FSDP2; 1: one "
                            "process, the whole model")
    micro_batch_tokens: int | None = Field(default_of(GRPOLearner, "micro_batch_tokens"), ge=1, description="padded "
                                           "tokens per forward/backward pass: each rank's rows are cut into micro-"
                                           "batches within it and their gradients accumulated; unset: one pass")
    activation_checkpointing: bool = Field(default_of(GRPOLearner, "activation_checkpointing"), description="recompute "
                                           "activations in backward: less memory, about a third more compute")
    rank_timeout_s: float = Field(default_of(GRPOLearner, "rank_timeout_s"), gt=0, description="a collective of "
                                  "the learner's ranks not answered in this long fails the run")
    lora: LoraSection | None = Field(None, description="[learner] lora = { rank, alpha, dropout, target_modules }: "
                                     "LoRA adapters on a frozen base, each version publishing the adapter alone; "
                                     "unset: full fine-tuning")


class MaxStalenessSpec(Section):
    kind: Literal["max-staleness"] = Field("max-staleness",
        description="the built-in staleness policy: a bound k on how many versions old a trained token may be")
    k: int | None = Field(None, ge=0, description="default: MaxStaleness's k in async mode, 0 in sync mode")
    on_stale: Literal["drop", "requeue"] = Field(default_of(MaxStaleness, "on_stale"),
        description="a group older than k at the learner: 'drop' it, or 'requeue' its prompt to be generated again")
    max_span: int | None = Field(
        default_of(MaxStaleness, "max_span"), ge=1,
        description="most weight versions one sample may span; longer ones restart on the new weights",
    )
    admission: Literal["pace", "eager"] = Field(
        default_of(MaxStaleness, "admission"),
        description='"pace": producers wait rather than start work that would be too stale to train; '
        '"eager": they start work as fast as the channels take it, and what turns too stale is refused',
    )
    lead: int | None = Field(
        default_of(MaxStaleness, "lead"), ge=0,
        description="with admission = 'pace': most versions producers run ahead of the learner (0..k); "
        "unset: k, or k - (replay.max_reuse - 1) with replays, so a group arrives with room to be trained again",
    )


class CorrectionSpec(Section):
    """Off-policy correction in the learner's loss (policies.correction): which objective, and its settings."""

    kind: Literal[("auto", *KINDS)] = Field(  # type: ignore[valid-type]
        "auto",
        description="auto (the default): none up to staleness.k = 2, m2po above (resolved when the config loads; "
        "docs/results/learning.md says why); none: PPO-clip on behaviour logprobs; the others clip against "
        "the learner's logprobs at the step's start and weight tokens by pi_prox / pi_behav: tis truncates "
        "the weight, decoupled keeps it (left out above decoupled_cap), m2po leaves out the tokens whose "
        "squared log-weight lifts the batch's second moment over m2_threshold, mis-token / mis-seq leave out "
        "tokens / rows whose weight lies outside their bounds, gspo uses a sequence-level ratio and clip"
    )
    tis_cap: float = Field(default_of(Correction, "tis_cap"), ge=1, description="tis: importance weights above "
                           "this are truncated to it")
    decoupled_cap: float | None = Field(
        default_of(Correction, "decoupled_cap"), ge=1,
        description="decoupled: tokens whose importance weight exceeds this are left out; unset: none are"
    )
    m2_threshold: float = Field(
        default_of(Correction, "m2_threshold"), gt=0,
        description="m2po: the most mean squared log(pi_prox / pi_behav) of the kept tokens (the batch's second "
        "moment); the largest are left out until it holds (the M2PO paper's 0.04, chosen on long reasoning traces, "
        "leaves out the tokens the learner is moving on short answers)"
    )
    m2_positive: Literal["weighted", "on_policy"] = Field(
        default_of(Correction, "m2_positive"),
        description="m2po: on_policy (the default): a positive-advantage token trains at weight 1 and is never "
        "left out (the bound acts on the others), so a good sample the learner has since moved away from is "
        "not shrunk away; weighted (the M2PO paper's): it is weighted and bounded like any"
    )
    mis_token_low: float = Field(default_of(Correction, "mis_token_low"), ge=0, le=1,
                                 description="mis-token: tokens whose weight is below this are left out")
    mis_token_high: float = Field(default_of(Correction, "mis_token_high"), ge=1,
                                  description="mis-token: tokens whose weight is above this are left out")
    mis_seq_low: float = Field(
        default_of(Correction, "mis_seq_low"), ge=0, le=1,
        description="mis-seq: rows whose geometric-mean weight (per token, so tighter than a token's bounds) is "
        "below this are left out"
    )
    mis_seq_high: float = Field(default_of(Correction, "mis_seq_high"), ge=1,
                                description="mis-seq: rows whose geometric-mean weight is above this are left out")
    gspo_clip_low: float = Field(
        default_of(Correction, "gspo_clip_low"), gt=0, lt=1,
        description="gspo: the sequence ratio is clipped at 1 - this (replaces learner.clip_eps; 3e-4 in the "
        "GSPO paper)"
    )
    gspo_clip_high: float = Field(
        default_of(Correction, "gspo_clip_high"), gt=0,
        description="gspo: the sequence ratio is clipped at 1 + this (replaces learner.clip_eps_high; 4e-4 in "
        "the GSPO paper)"
    )

    @model_validator(mode="after")
    def _settings_match_kind(self) -> CorrectionSpec:
        """A setting only one kind reads, given a value other than its default under another kind, is a mistake."""
        if self.kind != "auto":  # auto: checked once RunConfig has resolved it from staleness.k
            self.check_settings(f"correction.kind = {self.kind!r}")
        return self

    def check_settings(self, kind_said: str) -> None:
        """Raise when a setting of another kind than `self.kind` is set; `kind_said` names the kind in the error."""
        for key, kind in KIND_OF_SETTING.items():
            value = getattr(self, key)
            if self.kind != kind and value != default_of(Correction, key):
                raise ValueError(
                    f"correction.{key} = {value} applies only to correction.kind = {kind!r}, but {kind_said}; "
                    f"remove correction.{key} or set correction.kind = {kind!r}"
                )

    def resolve_auto(self, k: int) -> None:
        """`auto` becomes the kind `policies.correction.auto_kind` picks for bound k; its settings are checked."""
        if self.kind == "auto":
            self.kind = auto_kind(k)
            self.check_settings(f"correction.kind = 'auto' is {self.kind!r} at staleness.k = {k}")

    @model_validator(mode="after")
    def _bounds_keep_on_policy_tokens(self) -> CorrectionSpec:
        for level in ("mis_token", "mis_seq"):
            low, high = getattr(self, f"{level}_low"), getattr(self, f"{level}_high")
            if low == high:
                raise ValueError(
                    f"correction.{level}_low = {low} equals correction.{level}_high: only weights of exactly 1 "
                    f"would be kept; widen them, e.g. {level}_low = {default_of(Correction, level + '_low')}, "
                    f"{level}_high = {default_of(Correction, level + '_high')}"
                )
        return self


class ReplaySpec(Section):
    """Which groups each learner step trains on, and how often one may be (policies.selection)."""

    max_reuse: int = Field(default_of(Selection, "max_reuse"), ge=1, description="most learner steps one group is "
                           "trained in (only while within k)")
    selection: Literal["fifo", "freshest", "uniform"] = Field(
        default_of(GRPOLearner, "selection").kind,
        description="fifo: in arrival order; freshest: newest version first; uniform: at random (seeded)"
    )
    ride_along: bool = Field(
        default_of(GRPOLearner, "replays_ride_along"),
        description="with max_reuse > 1: a step trains groups_per_step new groups plus its replays (true), or "
        "replays take new groups' places (false); true keeps the staleness check's bound as without reuse"
    )
    drop_zero_signal: bool = Field(
        default_of(Selection, "drop_zero_signal"),
        description="filter groups whose rewards are all equal before they cost a step (DAPO dynamic sampling)"
    )
    max_filtered_batches: int = Field(
        default_of(Selection, "max_filtered_batches"), ge=1,
        description="a step that filters more than this many times groups_per_step groups fails the run"
    )


class WeightsSpec(Section):
    """How each new version reaches the engines; independent of `store` (rollout data)."""

    transport: str = Field(default_of(GRPOLearner, "weights"), description="how new versions reach the engines, "
                           f"independent of the store: {', '.join(TRANSPORTS)} (which needs runtime = 'ray'), or "
                           "a plug-in's 'pkg.module:Class' (stages.weights)")
    protocol: str = Field(default_of(MooncakeP2PTransport, "protocol"),
                          description='mooncake_p2p: TransferEngine protocol, "tcp" or "rdma"')
    device: str = Field(default_of(MooncakeP2PTransport, "device"),
                        description="mooncake_p2p: RDMA device names (empty for tcp)")
    bucket_bytes: ByteSize | None = Field(None, description="bytes per checksummed bucket (mooncake_p2p, delta); "
                                          "default: the transport's own")
    pace: ByteSize | None = Field(default_of(MooncakeP2PTransport, "pace_bytes_per_s"),
                                  description="mooncake_p2p: push at most this many bytes per second")
    retries: int | None = Field(None, ge=0, description="re-sends of a refused version before the run fails "
                                "(mooncake_p2p, disk, delta, broadcast); default: the transport's own")
    root: str | None = Field(None, description="disk: folder every engine can read (default: a temporary one)")
    sparse: bool = Field(default_of(MooncakeP2PTransport, "sparse"), description="mooncake_p2p: send each version "
                         "as element-level deltas against what the engine holds (transport = 'delta' always does)")
    snapshot_every: int = Field(
        default_of(GRPOLearner, "snapshot_every"), ge=0,
        description="keep every n-th version in the store for engines that (re)start; 0: never",
    )

    @field_validator("transport")
    @classmethod
    def _transport_resolves(cls, transport: str) -> str:
        transport_class(transport)  # a built-in's name or an importable plug-in (ValueError naming the known)
        return transport

    @property
    def kind(self) -> str:
        """The registry key of this part (baton.builder): one factory makes every transport."""
        return "transport"


class CheckpointSpec(Section):
    """Checkpoints into the run folder, for `baton run --resume RUN_DIR` (pipeline.checkpoint)."""

    every: int = Field(20, ge=0, description="write a checkpoint every this many versions; 0: never")
    keep: int = Field(default_of(Pipeline, "checkpoint_keep"), ge=1,
                      description="complete checkpoints kept in the run folder (older ones are removed)")
    export_every: int = Field(default_of(GRPOLearner, "export_every"), ge=0, description="export every this many "
                              "versions' checkpoint as a Hugging Face folder, RUN_DIR/exports/v{version:08d}/ "
                              "(`baton export`), while the run goes on; a multiple of every; 0: never")

    @model_validator(mode="after")
    def _exports_checkpoints(self) -> CheckpointSpec:
        if self.export_every and (not self.every or self.export_every % self.every):
            fix = (f"set checkpoint.export_every to a multiple of {self.every}" if self.every else
                   "set checkpoint.every (e.g. to checkpoint.export_every)")
            raise ValueError(
                f"checkpoint.export_every = {self.export_every} exports checkpoints, but checkpoint.every = "
                f"{self.every} writes none at those versions; {fix}, or checkpoint.export_every = 0"
            )
        return self


class WatchdogSpec(Section):
    """Hang diagnosis (pipeline.watchdog): progress is the version or the ledger moving."""

    warn_after_s: float = Field(default_of(WatchdogSettings, "warn_after_s"), ge=0,
                                description="log where every stage waits after this long without "
                                "progress (and again each time as long again passes); 0: never")
    fail_after_s: float = Field(default_of(WatchdogSettings, "fail_after_s"), ge=0,
                                description="fail the run with PipelineHung after this long without progress; 0: never")
    poll_s: float = Field(default_of(WatchdogSettings, "poll_s"), gt=0, description="how often the watchdog looks")

    @model_validator(mode="after")
    def _warn_before_failing(self) -> WatchdogSpec:
        if self.fail_after_s and self.warn_after_s and self.warn_after_s >= self.fail_after_s:
            raise ValueError(
                f"watchdog.warn_after_s = {self.warn_after_s:g} must be below watchdog.fail_after_s = "
                f"{self.fail_after_s:g} (or 0), so a hang is reported before the run fails; lower warn_after_s"
            )
        return self


class RaySpec(Section):
    address: str | None = Field(None, description="attach to this Ray cluster (\"auto\" inside `ray job submit`: the "
                                "cluster the job runs on); default: start one on 127.0.0.1")
    placement_timeout_s: float = Field(120.0, gt=0, description="an actor (or a learner's other ranks) the cluster "
                                       "has not placed by then fails the run, naming what it asked for")


class TelemetrySpec(Section):
    log_format: Literal["console", "json"] = Field("console",
        description="console: readable lines; json: one JSON object per line")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="the lowest level logged")
    progress: bool = Field(default_of(Pipeline, "progress"),
        description="the progress line on stderr (version, reward, staleness, samples/s, channel depths)")
    sinks: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["jsonl"], description="where metrics go: metrics.jsonl always, plus tensorboard, "
        "wandb (offline in the run folder unless WANDB_MODE=online), mlflow (the run folder, or MLFLOW_TRACKING_URI)",
    )


class SimulateSpec(Section):
    """The `[simulate]` table: cluster shape and declared costs (ignored by `baton run`).

    Declared generation cost of one engine call of n groups (group_size samples each, response lengths
    drawn from a lognormal with the given mean and shape, capped at max_response_tokens):
    `engine_call_overhead_s + max(response tokens / decode_tokens_per_s, longest response /
    sequence_tokens_per_s)`: throughput-bound for big batches, bound by the longest sample otherwise.
    Training on N learner ranks: `step_overhead_s + tokens / (train_tokens_per_s * N)` per step (prompt +
    response tokens), plus, when N > 1, FSDP's traffic: each rank gathers the parameters it lacks twice
    (forward, backward) and scatters the gradients once, `3 * weight_bytes * (N - 1) / N /
    shard_bytes_per_s`. Weights: `push_latency_s + weight_bytes * copies / push_bytes_per_s` (copies: the
    engine count with `push_per_engine`, else 1); from N ranks with `mooncake_p2p` every rank writes its
    own 1/N at once (the time / N), with another transport rank 0 first gathers the other ranks' parts
    (`+ weight_bytes * (N - 1) / N / shard_bytes_per_s`). Store put/get per group:
    `store_latency_s + bytes / store_bytes_per_s`.
    """

    engines: int | None = Field(None, ge=1, description="engines (producers); default: engine.count")
    learners: int | None = Field(None, ge=1, description="learner ranks (FSDP: step time / learners, plus the "
                                 "sharding traffic); default: learner.world_size")
    shard_bytes_per_s: float = Field(100e9, gt=0, description="one learner rank's collective bandwidth (NVLink-class "
                                     "by default): FSDP's gathers and scatters, and gathers before a push")
    steps: int | None = Field(None, ge=1, description="versions to simulate; default: steps")
    warmup: int = Field(10, ge=0, description="versions left out of the steady-state figures")
    seed: int = Field(0, description="seeds the simulated response lengths and cost draws")
    prompt_tokens: int = Field(16, ge=1, description="tokens per prompt")
    response_tokens_mean: float = Field(8.0, gt=0, description="mean response length in tokens")
    response_tokens_sigma: float = Field(0.5, ge=0, description="lognormal shape of response lengths")
    max_response_tokens: int = Field(16, ge=1, description="responses are capped at this many tokens")
    decode_tokens_per_s: float = Field(5_000.0, gt=0, description="one engine's decode throughput at batch")
    sequence_tokens_per_s: float = Field(500.0, gt=0, description="one sequence's decode speed")
    engine_call_overhead_s: float = Field(0.0, ge=0, description="fixed cost of one engine call")
    engine_load_s: float = Field(0.0, ge=0, description="an engine's pause to load a new version")
    train_tokens_per_s: float = Field(20_000.0, gt=0, description="one learner replica's training throughput")
    step_overhead_s: float = Field(0.0, ge=0, description="fixed cost of one learner step")
    learner_overhead_s: float = Field(0.0, ge=0, description="per-version bookkeeping besides the step")
    weight_bytes: ByteSize = Field(ByteSize(1 << 20), description="bytes of one version of the weights")
    push_bytes_per_s: float | None = Field(None, gt=0, description="learner egress; default: by weights.transport")
    push_per_engine: bool = Field(False, description="each engine gets its own copy from the learner (P2P "
                                  "without relays): push time grows with engines; false: one broadcast")
    push_latency_s: float = Field(0.0, ge=0, description="fixed cost of one weight push")
    store_bytes_per_s: float = Field(1e9, gt=0, description="store put/get throughput")
    store_latency_s: float = Field(1e-4, ge=0, description="fixed cost of one store put or get")
    hop_s: float | None = Field(None, ge=0, description="per cross-process channel call; default 1 ms on ray")
    zero_signal_fraction: float = Field(0.0, ge=0, lt=1, description="groups whose rewards are all equal")

    @model_validator(mode="after")
    def _lengths_fit(self) -> SimulateSpec:
        if self.response_tokens_mean > self.max_response_tokens:
            raise ValueError(
                f"simulate.response_tokens_mean = {self.response_tokens_mean:g} is above simulate.max_response_tokens"
                f" = {self.max_response_tokens}; lower the mean or raise max_response_tokens"
            )
        return self


class RunConfig(Section):
    name: str = Field("baton", pattern=r"^[A-Za-z0-9_.-]+$",
        description="the run's name: the run folder's prefix (run_root/<name>-<timestamp>) and the first part of "
                    "every store key")
    seed: int = Field(default_of(Pipeline, "seed"),
        description="seeds torch, prompt sampling, engine sampling and the dataset's shuffle (the tiny model's init "
                    "has model.seed)")
    steps: int = Field(default_of(Pipeline, "steps"), ge=1, description="learner versions to train")
    mode: Literal["async", "sync"] = Field("async",
        description="sync: staleness.k = 0 through the same code path (on-policy); async: the staleness policy's k")
    runtime: Literal["local", "ray"] = Field(default_of(Pipeline, "runtime"),
        description="local: every actor a task in one event loop; ray: every actor a Ray actor in its own process")
    run_root: str = Field(default_of(Pipeline, "run_root"), description="where run folders are made")
    model: ModelSpec = Field(ModelSpec(), description="[model]: the model folder engines and learner load")
    task: kinds(ReverseDigitsSpec, AdditionSpec, DatasetTaskSpec) = Field(ReverseDigitsSpec(),  # type: ignore[valid-type]
        description="[task]: where prompts and answers come from")
    reward: RewardSpec | None = Field(None, description="[reward]: the reward function; unset: the task's own "
                                      "(a dataset task: exact_match)")
    distill: DistillSpec | None = Field(None, description="[distill]: on-policy distillation from a teacher model; "
                                        "unset: none")
    eval: EvalSpec = Field(EvalSpec(), description="[eval]: evaluation during training; off unless eval.every is set")
    engine: kinds(TorchEngineSpec, SGLangEngineSpec) = Field(TorchEngineSpec(),  # type: ignore[valid-type]
        description="[engine]: the inference engines the producer generates on")
    rollout: RolloutSpec = Field(RolloutSpec(),
        description="[rollout]: the producer's group size and engine-call timeout")
    environment: EnvironmentSpec | None = Field(None, description="[environment]: multi-turn episodes; unset: "
                                                "single-turn")
    episode: EpisodeSpec = Field(EpisodeSpec(), description="[episode]: per-episode limits, whatever the environment")
    gateway: GatewaySpec | None = Field(None, description="[gateway]: train agents that speak the OpenAI API")
    store: kinds(MemoryStoreSpec, MooncakeStoreSpec, RayStoreSpec) = Field(MemoryStoreSpec(),  # type: ignore[valid-type]
        description="[store]: where rollout payloads live (refs travel through the channels)")
    buffer: BufferSpec = Field(BufferSpec(),
        description="[buffer]: the bounds of the buffer stage and of the channels around it")
    learner: kinds(GRPOSpec) = Field(GRPOSpec(),  # type: ignore[valid-type]
        description="[learner]: the consumer: loss, optimizer and device")
    staleness: kinds(MaxStalenessSpec) = Field(MaxStalenessSpec(),  # type: ignore[valid-type]
        description="[staleness]: what may be generated and trained, from weight versions")
    correction: CorrectionSpec = Field(CorrectionSpec(), description="[correction]: off-policy correction in the loss")
    replay: ReplaySpec = Field(ReplaySpec(),
        description="[replay]: which groups each step trains on, and how often one may be")
    weights: WeightsSpec = Field(WeightsSpec(), description="[weights]: how each new version reaches the engines")
    telemetry: TelemetrySpec = Field(TelemetrySpec(),
        description="[telemetry]: logs, the progress line and metric sinks")
    ray: RaySpec = Field(RaySpec(), description="[ray]: which Ray cluster runtime = 'ray' uses")
    checkpoint: CheckpointSpec = Field(CheckpointSpec(),
        description="[checkpoint]: checkpoints for `baton run --resume`")
    watchdog: WatchdogSpec = Field(WatchdogSpec(), description="[watchdog]: hang diagnosis")
    faults: list[FaultConfig] = Field(default_factory=list, description="[[faults]]: injected faults (pipeline.faults)")
    simulate: SimulateSpec | None = Field(None, description="[simulate]: cluster shape and declared costs for "
                                          "`baton simulate` (baton.simulate); `baton run` ignores it")

    @model_validator(mode="after")
    def _mode_sets_k(self) -> RunConfig:
        if isinstance(self.staleness, MaxStalenessSpec):
            if self.mode == "sync" and self.staleness.k not in (None, 0):
                raise ValueError(
                    f"mode = 'sync' means staleness.k = 0, but staleness.k = {self.staleness.k}; "
                    "remove staleness.k or set mode = 'async'"
                )
            if self.staleness.k is None:
                self.staleness.k = 0 if self.mode == "sync" else default_of(MaxStaleness, "k")
            self._set_lead(self.staleness)
        # a plug-in staleness policy names no k: its auto is k = 2's
        bound = self.staleness.k if isinstance(self.staleness, MaxStalenessSpec) else default_of(MaxStaleness, "k")
        self.correction.resolve_auto(bound)
        if isinstance(self.learner, GRPOSpec) and self.learner.entropy_cap == "auto":
            self.learner.entropy_cap = auto_entropy_cap(bound) or "off"
        if isinstance(self.store, MooncakeStoreSpec):
            self._check_mooncake_capacity(self.store)
        if self.weights.transport == "broadcast" and self.runtime == "local":
            raise ValueError(
                "weights.transport = 'broadcast' sends to engine processes, but runtime = 'local' keeps the "
                "engines in the learner's process; use weights.transport = 'inproc' or runtime = 'ray'"
            )
        if self.runtime == "ray" and isinstance(self.store, MemoryStoreSpec):
            raise ValueError(
                "runtime = 'ray' puts every stage in its own process, but store.kind = 'memory' lives in one; "
                "use store.kind = 'mooncake' or 'ray'"
            )
        if not self.model.create and not (Path(self.model.path) / "config.json").exists():
            raise ValueError(
                f"model.path = {self.model.path!r} holds no model (no config.json) and model.create = false; "
                "set model.create = true to make a tiny one there, or point model.path at an HF checkpoint"
            )
        return self

    @model_validator(mode="after")
    def _learner_ranks_fit(self) -> RunConfig:
        """On the local runtime every learner rank is a process on this machine, each with its own device:
        a GPU each on CUDA, a core each on CPU."""
        if not isinstance(self.learner, GRPOSpec) or self.learner.world_size == 1 or self.runtime != "local":
            return self
        import torch

        cuda = self.learner.device.startswith("cuda") or (self.learner.device == "auto" and torch.cuda.is_available())
        have, what = (torch.cuda.device_count(), "GPUs") if cuda else (os.cpu_count() or 1, "CPU cores")
        if self.learner.world_size > have:
            raise ValueError(
                f"learner.world_size = {self.learner.world_size}, but this machine has {have} {what} and every "
                f"learner rank needs one of its own; set learner.world_size to at most {have}, or use runtime = "
                "'ray' on a cluster that has them"
            )
        return self

    @model_validator(mode="after")
    def _lora_fits(self) -> RunConfig:
        """LoRA's settings fit the model and the engine, before anything starts: target modules the model
        has, a rank the SGLang server takes, room for the staleness window's adapters, a way in for them."""
        lora = self.learner.lora if isinstance(self.learner, GRPOSpec) else None
        if lora is None:
            return self
        check_targets(lora.target_modules, linear_module_names(self.model.path))
        if not isinstance(self.engine, SGLangEngineSpec):
            return self
        engine, k = self.engine, self.staleness.k if isinstance(self.staleness, MaxStalenessSpec) else None
        limit = engine.lora_rank_limit()
        if limit is not None and lora.rank > limit:
            raise ValueError(f"learner.lora.rank = {lora.rank} is above the SGLang server's --max-lora-rank {limit} "
                             "(engine.max_lora_rank or engine.extra_args): it would refuse every adapter; lower "
                             "learner.lora.rank or raise engine.max_lora_rank")
        if k is not None and engine.max_loaded_loras is not None and engine.max_loaded_loras < k + 2:
            raise ValueError(f"engine.max_loaded_loras = {engine.max_loaded_loras}, but staleness.k = {k} keeps up "
                             f"to k + 1 adapters in use plus the one loading; set it to at least {k + 2} (or unset)")
        if engine.update == "distributed":
            raise ValueError("engine.update = 'distributed' moves full weights only; SGLang loads LoRA adapters from "
                             "tensors or a folder: with learner.lora set engine.update = 'tensor' (same host) or "
                             "'disk' (a folder the server reads)")
        return self

    @model_validator(mode="after")
    def _episodes_from_one_place(self) -> RunConfig:
        """Episodes come from the rollout's environment or from the gateway's agents, not both."""
        if self.gateway is None:
            return self
        if self.environment is not None:
            raise ValueError("[gateway] and [environment] are both set: with a gateway the agents run the episodes; "
                             "remove [environment] (an agent may call its own tools) or [gateway]")
        if self.runtime == "ray":
            raise ValueError("[gateway] runs with runtime = 'local' for now (one gateway in front of the run's "
                             "engines); set runtime = 'local' or remove [gateway]")
        return self

    @model_validator(mode="after")
    def _own_model_fits(self) -> RunConfig:
        """A model folder of one's own loads, with a chat template when the task gives chat prompts; a
        reward or eval split needs a task that has answers to check (a dataset's)."""
        if not self.model.create:
            try:
                check_model_folder(self.model.path, needs_chat_template=isinstance(self.task, DatasetTaskSpec)
                                   and self.task.uses_chat)
            except ValueError as exc:
                raise ValueError(f"model.path: {exc}") from None
        if self.eval.every and isinstance(self.task, DatasetTaskSpec) and self.task.eval_path is None:
            raise ValueError("eval.every is set, but the dataset task has no task.eval_path to evaluate")
        return self

    @model_validator(mode="after")
    def _model_rewards_load(self) -> RunConfig:
        """Each model reward's folder, tokenizer, template, labels, parser and token file, before anything starts."""
        for name in MODEL_REWARDS:
            spec = getattr(self.reward, name, None)
            if spec is not None:
                try:
                    spec.make()
                except ValueError as exc:
                    raise ValueError(f"reward.{name}: {exc}") from None
        return self

    @model_validator(mode="after")
    def _distillation_fits(self) -> RunConfig:
        """Teachers share the student's tokenizer; groups with equal rewards are not filtered (the teacher's
        term is their signal)."""
        if self.distill is None:
            return self
        student = None if self.model.create and not (Path(self.model.path) / "tokenizer.json").exists() \
            else self.model.path
        for name, where in self.distill.teachers().items():
            if not is_url(where):
                key = "distill.teacher" if isinstance(self.distill.teacher, str) else f"distill.teacher.{name}"
                check_shared_tokenizer(where, student, key)
        if self.replay.drop_zero_signal:
            raise ValueError("replay.drop_zero_signal filters groups whose rewards are all equal, but with [distill] "
                             "the teacher's term gives them signal; set replay.drop_zero_signal = false")
        return self

    @model_validator(mode="after")
    def _faults_fit(self) -> RunConfig:
        """Each planned fault has what its recovery needs; say which key to set before anything starts."""
        kinds = [f.kind for f in self.faults]
        twice = sorted({k for k in kinds if kinds.count(k) > 1})
        if twice:
            raise ValueError(f"faults: {', '.join(twice)} planned more than once; merge their `at` lists into one")
        if "engine.hang" in kinds and self.rollout.request_timeout_s is None:
            raise ValueError(
                "fault engine.hang needs rollout.request_timeout_s, which turns a hang into an error and the groups "
                "into regenerated ones; set rollout.request_timeout_s (e.g. 10)"
            )
        for kind in ("store.master_restart", "store.holder_crash"):
            if kind in kinds and not isinstance(self.store, MooncakeStoreSpec):
                raise ValueError(f"fault {kind} acts on Mooncake processes, but store.kind = {self.store.kind!r}; "
                                 "set store.kind = 'mooncake' or remove the fault")
        if "store.master_restart" in kinds and self.runtime == "ray" and self.store.master == "auto":
            raise ValueError(
                "fault store.master_restart with runtime = 'ray' needs a master the faults runner owns: run it with "
                "`baton faults CONFIG`, or use runtime = 'local' (which restarts its own store.master = 'auto')"
            )
        if "store.holder_crash" in kinds and self.store.replicas < 2:
            raise ValueError(
                f"fault store.holder_crash is survived with store.replicas = 2, but store.replicas = "
                f"{self.store.replicas}; set store.replicas = 2 (`baton faults` does, and starts the second holder)"
            )
        return self

    @model_validator(mode="after")
    def _staleness_holds(self) -> RunConfig:
        """The static check of `policies.bounds`: refuse a shape that can break the staleness bound. Runs after
        _mode_sets_k (validators run in the order defined), so staleness.k is set."""
        from policies.bounds import check

        shape = self.pipeline_shape()
        if shape is None:
            return self  # plug-ins: their numbers mean what their authors say
        problems = check(shape)
        if problems:
            raise ValueError("the staleness bound does not hold: " + " | ".join(problems))
        return self

    @property
    def engine_count(self) -> int:
        """Engine workers: the built-in engines' `count`; a plug-in engine section is one worker."""
        return self.engine.count if isinstance(self.engine, BUILT_IN_ENGINES) else 1

    def engine_sampling(self) -> dict[str, Any]:
        """The rollout's sampling keys the engine section sets (batch_groups, temperature, top_p); none for
        a plug-in engine (the rollout's defaults apply)."""
        if not isinstance(self.engine, BUILT_IN_ENGINES):
            return {}
        return {"batch_groups": self.engine.batch_groups, "temperature": self.engine.temperature,
                "top_p": self.engine.top_p}

    @property
    def learner_ranks(self) -> int:
        """The learner's world size (a plug-in learner: one)."""
        return self.learner.world_size if isinstance(self.learner, GRPOSpec) else 1

    def pipeline_shape(self) -> Any:
        """The numbers that decide staleness (a `policies.bounds.PipelineShape`); None for plug-in parts."""
        from policies.bounds import PipelineShape

        if not isinstance(self.staleness, MaxStalenessSpec) or not isinstance(self.learner, GRPOSpec):
            return None
        return PipelineShape(
            k=self.staleness.k, groups_per_step=self.learner.groups_per_step, engines=self.engine_count,
            batch_groups=self.engine_sampling().get("batch_groups", 1), produced_channel=self.buffer.produced_channel,
            buffer_refs=self.buffer.max_refs, ready_channel=self.buffer.ready_channel,
            admission=self.staleness.admission, max_reuse=self.replay.max_reuse, epochs=self.learner.epochs,
            replays_ride_along=self.replay.ride_along,
            corrected=self.correction.kind != "none", lead=self.staleness.lead,
        )

    def window_report(self) -> str | None:
        """What the staleness window holds at most, in groups, samples and store bytes (`baton check`)."""
        from policies.bounds import live_groups
        from stages.environments.tokens import EpisodeTokens

        shape = self.pipeline_shape()
        if shape is None:
            return None
        groups = live_groups(shape)
        samples = groups * self.rollout.group_size
        new_tokens = self.task.max_new_tokens if isinstance(self.task, BUILT_IN_TASKS) else None
        per_token = samples * EpisodeTokens.ROW_BYTES_PER_TOKEN
        line = (f"staleness window (k = {shape.k}, {shape.admission} admission): up to {groups} groups, {samples} "
                f"samples, live at once; in the store that is {per_token / 2**10:,.1f} KiB per token of a sample")
        if new_tokens:
            line += f", {per_token * new_tokens / 2**20:,.2f} MiB for completions of {new_tokens} tokens plus prompts"
        learner = self.learner
        if isinstance(learner, GRPOSpec) and shape.k > 0:
            factor = staleness_lr_factor(shape.k, learner.lr_tuned_staleness, learner.lr_staleness_power,
                                         learner.lr_staleness_floor)
            line += (f"; a step on groups {shape.k} versions old trains at {factor:.2f} x lr "
                     "(learner.lr_tuned_staleness, lr_staleness_power, lr_staleness_floor)")
        return line

    def _set_lead(self, staleness: MaxStalenessSpec) -> None:
        """Check staleness.lead against k, or derive it from replay.max_reuse when unset: groups that
        arrive k versions old could never be trained again, so reuse would silently never happen."""
        k = staleness.k
        assert k is not None
        if staleness.lead is not None and staleness.lead > k:
            raise ValueError(
                f"staleness.lead = {staleness.lead} is more than staleness.k = {k}: producers may run at most k "
                f"versions ahead; set staleness.lead to at most {k}, or remove it"
            )
        if staleness.lead is None and self.replay.max_reuse > 1:
            staleness.lead = reuse_lead(k, self.replay.max_reuse)

    def _check_mooncake_capacity(self, store: MooncakeStoreSpec) -> None:
        """Miles's rule, per node: the segment must hold every byte the pipeline lets be in flight,
        times the replicas, below the master's eviction watermark (90 %)."""
        need = self.buffer.bytes_in_flight * store.replicas
        have = int(store.global_segment_size * 0.9)
        if need > have:
            raise ValueError(
                f"store.global_segment_size = {store.global_segment_size.human_readable()} holds "
                f"{ByteSize(have).human_readable()} before Mooncake evicts, but buffer.produced_bytes + "
                f"buffer.max_bytes + buffer.ready_bytes = {ByteSize(self.buffer.bytes_in_flight).human_readable()} "
                f"x store.replicas = {store.replicas} may be in flight; raise store.global_segment_size to at "
                f"least {ByteSize(-(-need * 10 // 9)).human_readable()} or lower the buffer's byte bounds"
            )
        if store.replicas > 1 and store.master == "auto":
            raise ValueError(
                f"store.replicas = {store.replicas} needs that many processes holding segments, but with "
                "store.master = 'auto' only the buffer's process holds one; use replicas = 1, "
                "or attach (store.master = 'host:port') to a cluster with more segment holders"
            )

    def resolved_toml(self) -> str:
        return to_toml(self.model_dump(mode="json", exclude_none=True))



def load_run_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """The RunConfig of the TOML at `path` with `--set` overrides; a ConfigError names every bad key."""
    return validate(RunConfig, load_toml(path, overrides), source=str(path))


__all__ = ["RunConfig", "SimulateSpec", "default_of", "load_run_config"]
