"""How samples are scored: [reward] (rule functions and the model rewards of [reward.classifier] and
[reward.judge]) and [distill] (teacher models)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, model_validator

from baton.sections.base import Section, declared_defaults, same_as
from stages.data.rewards import ON_ERROR, RewardFunction, resolve, weighted_sum

if TYPE_CHECKING:
    from stages.scorers import ClassifierReward, ComposedReward, Distillation, JudgeReward

TEACHER_TIMEOUT_S = same_as("stages.scorers.teacher:TEACHER_TIMEOUT_S", 60.0)
DISTILL_MODES = same_as("stages.learner.losses:DISTILL_MODES", ("advantage", "loss"))

URL = r"^https?://[\w.-]+(:\d+)?(/[\w./-]*)?$"

SERVER_SETTINGS = declared_defaults("stages.scorers.server:ServerSettings")
CLASSIFIER_REWARD = declared_defaults("stages.scorers:ClassifierReward")
JUDGE_REWARD = declared_defaults("stages.scorers:JudgeReward")
JUDGE_TEMPLATE = JUDGE_REWARD("template", "Grade the response to the task below from 0 (wrong or useless) to 10 (fully "
                              "right).\n\nTask: {prompt}\nReference answer: {answer}\nResponse: {completion}\n\n"
                              "Reply with the grade only, a number from 0 to 10.")
REWARD_FUNCTION = declared_defaults("stages.data.rewards:RewardFunction")
GRPO_LEARNER = declared_defaults("stages.learner:GRPOLearner")
DISTILLATION = declared_defaults("stages.scorers:Distillation")


class ScorerSpec(Section):
    """What every model scorer's server takes (stages.scorers.server.ServerSettings)."""

    url: Annotated[str, Field(pattern=URL)] | None = Field(None, description="use this running server instead of "
                                                        "launching one from the model folder")
    token_file: str | None = Field(None, description="with url: a file holding the server's API token (sent as a "
                                   "bearer token; the token itself never goes in the config)")
    concurrency: int = Field(SERVER_SETTINGS("concurrency", 8), ge=1, description="requests of this scorer "
                             "in flight at once, over all groups of a producer process")
    timeout_s: float = Field(SERVER_SETTINGS("timeout_s", 30.0), gt=0, description="one request; past it the "
                             "samples fail ('<scorer> timeout'), counted like a failing reward function")
    retries: int = Field(SERVER_SETTINGS("retries", 2), ge=0, description="re-sends of a request after a "
                         "transport error (refused, reset)")
    max_restarts: int = Field(SERVER_SETTINGS("max_restarts", 3), ge=0, description="restarts of a launched "
                              "server that died, over the run (event scorer.restarted); then its samples fail")
    python: str | None = Field(None, description="interpreter with sglang for a launched server (default: "
                               "$BATON_SGLANG_PYTHON, then .venv-sglang)")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(SERVER_SETTINGS("dtype", "float32"),
        description="a launched server's weights (auto: the checkpoint's)")
    device: Literal["auto", "cpu", "cuda"] = Field(SERVER_SETTINGS("device", "auto"), description="a launched "
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
    label: int = Field(CLASSIFIER_REWARD("label", 0), ge=0, description="which output of the model's head "
                       "is the score")

    def make(self) -> ClassifierReward:
        """The scorer (reads the folder's config and tokenizer: `RunConfig` checks it before a run)."""
        from stages.scorers import ClassifierReward
        from stages.scorers.server import ServerSettings

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
    template: str = Field(JUDGE_TEMPLATE, description="the user message: a str.format "
                          "template with {prompt}, {completion} and {answer}")
    parser: str = Field(JUDGE_REWARD("parser", "number"), description="'number' (the first number in the answer) or "
                        "'pkg.module:function' from the answer's text to a float, or None when it finds no grade")
    max_score: float = Field(JUDGE_REWARD("max_score", 10.0), gt=0, description="the reward is the grade / "
                             "this; a grade outside [0, max_score] is a parse failure")
    max_tokens: int = Field(JUDGE_REWARD("max_tokens", 16), ge=1, description="most tokens of the judge's "
                            "answer")
    temperature: float = Field(JUDGE_REWARD("temperature", 0.0), ge=0, description="the judge's sampling "
                               "temperature (0: greedy)")
    parse_retries: int = Field(JUDGE_REWARD("parse_retries", 2), ge=0, description="asks again after an "
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
        from stages.scorers import JudgeReward
        from stages.scorers.server import ServerSettings

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
    timeout_s: float | None = Field(REWARD_FUNCTION("timeout_s", 10.0), gt=0, description="per call")
    on_error: Literal[ON_ERROR] = Field(REWARD_FUNCTION("on_error", "zero"), description="what a sample "  # type: ignore[valid-type]
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

    def make(self) -> RewardFunction | ComposedReward | None:
        """One function, or the weighted sum of `weights`, with the model rewards of [reward.classifier] and
        [reward.judge] composed in."""
        from stages.scorers import ComposedReward

        rules = {name: weight for name, weight in self.weights.items() if name not in MODEL_REWARDS}
        fn = self.function or (weighted_sum(*rules.items()) if rules else None)
        rule = RewardFunction(fn, timeout_s=self.timeout_s, on_error=self.on_error, batched=self.batched) if fn \
            else None
        models = [(getattr(self, name).make(), self.weights[name]) for name in MODEL_REWARDS
                  if getattr(self, name) is not None]
        return ComposedReward(rule, models, on_error=self.on_error) if models else rule


class DistillSpec(Section):
    """[distill]: on-policy distillation (stages.scorers.teacher; the learner's term: stages.learner.losses)."""

    teacher: str | dict[str, str] = Field(description="the teacher: a model folder, or the url of an SGLang "
                                          "server; several: {name = folder or url}, picked per sample by teacher_key")
    teacher_key: str | None = Field(None, description="with several teachers: the sample's metadata field "
                                    "(task.metadata_fields) whose value names its teacher")
    coef: float = Field(1.0, gt=0, description="the teacher term's weight: each model token's advantage gets "
                        "-coef x (student logprob - teacher logprob)")
    mode: Literal[DISTILL_MODES] = Field(GRPO_LEARNER("distill_mode", "advantage"),  # type: ignore[valid-type]
        description="'advantage': the teacher's term is added to GRPO's advantage; 'loss': it is the whole "
                    "advantage (pure distillation: rewards are scored and reported but train nothing)")
    baseline: bool = Field(GRPO_LEARNER("distill_baseline", True), description="subtract from each token's "
                           "teacher term the mean of the term at that position over the group's other samples (a "
                           "leave-one-out baseline: unbiased, lower variance; a random-init student distills "
                           "reverse-2 to reward 0.8 in ~120 versions with it, and is at 0.3 after 150 without)")
    backend: Literal["torch", "sglang"] = Field("torch", description="how a teacher folder is served: in the "
                                                "producer's process with torch, or on an SGLang server baton launches")
    on_error: Literal[ON_ERROR] = Field(DISTILLATION("on_error", "zero"),  # type: ignore[valid-type]
        description="a group its teacher failed to score: 'zero' (no teacher term: it trains on its reward) or "
                    "'drop' (dropped, counted)")
    token_file: str | None = Field(None, description="for teachers given by url: a file holding their API token")
    concurrency: int = Field(SERVER_SETTINGS("concurrency", 8), ge=1, description="sglang: requests per "
                             "teacher server in flight at once")
    timeout_s: float = Field(TEACHER_TIMEOUT_S, gt=0, description="sglang: one request")
    retries: int = Field(SERVER_SETTINGS("retries", 2), ge=0, description="sglang: re-sends after a "
                         "transport error")
    max_restarts: int = Field(SERVER_SETTINGS("max_restarts", 3), ge=0, description="sglang: restarts of a "
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

    def make(self) -> Distillation:
        """Each teacher (a folder in this process with torch, or on SGLang; a url on its server)."""
        from stages.scorers import Distillation, SGLangTeacher, TorchTeacher
        from stages.scorers.server import ServerSettings

        teachers: dict[str, Any] = {}
        for name, where in self.teachers().items():
            if is_url(where) or self.backend == "sglang":
                at = {"url": where} if is_url(where) else {"model": where}
                teachers[name] = SGLangTeacher(ServerSettings(**at, **self.model_dump(include={
                    "token_file", "concurrency", "timeout_s", "retries", "max_restarts", "python", "dtype", "device"})),
                    name=f"teacher-{name}")
            else:
                teachers[name] = TorchTeacher(where, dtype=self.dtype, name=f"teacher-{name}")
        return Distillation(teachers, key=self.teacher_key, on_error=self.on_error)


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
