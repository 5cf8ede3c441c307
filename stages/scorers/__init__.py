"""Model scorers: rewards a model computes and teachers for on-policy distillation (docs/guides/model-rewards.md).

  base.py        the protocols (`ModelReward`, `Teacher`), `ScorerError`, the stats each keeps
  server.py      `ServerSettings`, what every server-backed scorer shares; `ScoringServer`: a scorer's HTTP
                 server, launched by baton on loopback or given by url; concurrency cap, timeouts, retries,
                 restarts of a launched server that died
  classifier.py  `ClassifierReward`: a sequence-classification model on SGLang's /classify
  judge.py       `JudgeReward`: a generative model on an OpenAI-compatible chat endpoint, a rubric, a parser
  teacher.py     `TorchTeacher`, `SGLangTeacher`, `Distillation`: per-token teacher logprobs of the
                 student's tokens, into the rollout batch's `teacher_logprobs` field
  compose.py     `ComposedReward`: rule rewards and model rewards in one weighted sum

Below the rollout, beside the gateway, above the engines (it reuses `stages.engines.sglang_server`). The
learner never imports this package: the teacher's logprobs reach it only as a codec field.
"""

from stages.scorers.base import Lifecycle, ModelReward, ScorerError, Teacher
from stages.scorers.classifier import ClassifierReward
from stages.scorers.compose import ComposedReward
from stages.scorers.judge import JudgeReward
from stages.scorers.server import ServerSettings
from stages.scorers.teacher import TEACHER_FIELD, Distillation, SGLangTeacher, TorchTeacher

__all__ = [
    "TEACHER_FIELD",
    "ClassifierReward",
    "ComposedReward",
    "Distillation",
    "JudgeReward",
    "Lifecycle",
    "ModelReward",
    "SGLangTeacher",
    "ScorerError",
    "ServerSettings",
    "Teacher",
    "TorchTeacher",
]
