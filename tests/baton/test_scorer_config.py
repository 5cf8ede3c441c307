"""[reward.classifier], [reward.judge] and [distill] in the config: what they build, and each bad input named by
its key before anything starts (a teacher with another tokenizer among them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.builder import build_pipeline, make_reward
from baton.config import ConfigError, validate
from baton.schema import RunConfig
from stages.data.model import make_tiny_model
from stages.data.rewards import RewardFunction
from stages.scorers import ClassifierReward, ComposedReward, JudgeReward, SGLangTeacher, TorchTeacher
from tests.helpers.scorers import make_tiny_classifier
from tools.make_math_example import make_qwen_like_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("scorer-config")
    return {"student": make_tiny_model(root / "student"), "teacher": make_tiny_model(root / "teacher", seed=1),
            "classifier": make_tiny_classifier(root / "rm"),
            "foreign": make_qwen_like_model(root / "qwen-like", hidden_size=32, layers=1), "runs": root / "runs"}


def config(folders: dict[str, Path], **tables) -> RunConfig:
    return validate(RunConfig, {"run_root": str(folders["runs"]), "model": {"path": str(folders["student"])},
                                "telemetry": {"progress": False}, **tables})


def test_model_rewards_compose_with_rule_rewards(folders) -> None:
    cfg = config(folders, reward={
        "weights": {"classifier": 1.0, "judge": 0.25, "exact_match": 0.5}, "on_error": "drop",
        "classifier": {"model": str(folders["classifier"]), "timeout_s": 5, "concurrency": 4},
        "judge": {"url": "http://127.0.0.1:30000/v1", "model_name": "grader", "max_score": 5, "parse_retries": 1}})
    reward = make_reward(cfg)
    assert isinstance(reward, ComposedReward) and reward.on_error == "drop"
    assert isinstance(reward.rule, RewardFunction)
    (classifier, w1), (judge, w2) = reward.models
    assert isinstance(classifier, ClassifierReward) and w1 == 1.0 and classifier.server.settings.timeout_s == 5
    assert classifier.server.settings.concurrency == 4 and classifier.settings.url is None  # baton launches it
    assert isinstance(judge, JudgeReward) and w2 == 0.25 and judge.server.base_url == "http://127.0.0.1:30000"
    assert (judge.max_score, judge.parse_retries, judge.model_name) == (5, 1, "grader")
    only = make_reward(config(folders, reward={"weights": {"classifier": 1.0},
                                               "classifier": {"model": str(folders["classifier"])}}))
    assert only.rule is None and len(only.models) == 1


@pytest.mark.parametrize("reward, message", [
    ({"weights": {"classifier": 1.0}}, "no \\[reward.classifier\\] table"),
    ({"weights": {"exact_match": 1.0}, "judge": {"url": "http://127.0.0.1:1", "model_name": "g"}},
     "reward.weights has no 'judge'"),
    ({"function": "exact_match", "classifier": {"model": "MODEL"}}, "reward.function cannot compose"),
    ({"weights": {"judge": 1.0}, "judge": {"url": "http://127.0.0.1:1"}}, "needs model_name"),
    ({"weights": {"judge": 1.0}, "judge": {"url": "http://127.0.0.1:1", "model_name": "g", "template": "{x}"}},
     "reward.judge: template: KeyError"),  # the table named once, not as "= {...}"
    ({"weights": {"classifier": 1.0}, "classifier": {"model": "MODEL", "label": 3}}, "label 3 is not an output"),
    ({"weights": {"classifier": 1.0}, "classifier": {"model": "MODEL", "token_file": "t"}}, "without url"),
])
def test_bad_model_rewards_are_named(folders, reward: dict, message: str) -> None:
    for table in ("classifier",):
        if table in reward and reward[table].get("model") == "MODEL":
            reward[table]["model"] = str(folders["classifier"])
    with pytest.raises(ConfigError, match=message):
        config(folders, reward=reward)


def test_distill_builds_teachers_and_the_learners_term(folders) -> None:
    cfg = config(folders, distill={"teacher": str(folders["teacher"]), "coef": 0.5, "mode": "loss"})
    pipe = build_pipeline(cfg)
    teacher = pipe.producer.teacher.teachers["teacher"]
    assert isinstance(teacher, TorchTeacher) and Path(teacher.model) == folders["teacher"]
    assert (pipe.consumer.distill_coef, pipe.consumer.distill_mode) == (0.5, "loss")
    several = config(folders, distill={"teacher": {"a": str(folders["teacher"]), "b": "http://127.0.0.1:30000"},
                                       "teacher_key": "domain", "backend": "sglang"})
    pipe = build_pipeline(several)
    teachers = pipe.producer.teacher.teachers
    assert isinstance(teachers["a"], SGLangTeacher) and teachers["a"].settings.url is None  # baton launches it
    assert teachers["b"].server.base_url == "http://127.0.0.1:30000" and pipe.producer.teacher.key == "domain"
    assert build_pipeline(config(folders)).consumer.distill_coef == 0.0


def test_a_teacher_with_another_tokenizer_is_refused_before_the_run(folders) -> None:
    with pytest.raises(ConfigError, match="distill.teacher = .*qwen-like.*tokenizer differs.*baton export"):
        config(folders, distill={"teacher": str(folders["foreign"])})
    with pytest.raises(ConfigError, match="distill.teacher.code = "):
        config(folders, distill={"teacher": {"math": str(folders["teacher"]), "code": str(folders["foreign"])},
                                 "teacher_key": "domain"})


@pytest.mark.parametrize("distill, extra, message", [
    ({"teacher": {"a": "TEACHER", "b": "TEACHER"}}, {}, "set distill.teacher_key"),
    ({"teacher": "TEACHER", "teacher_key": "domain"}, {}, "remove teacher_key"),
    ({"teacher": "no/such/folder"}, {}, "neither a model folder"),
    ({"teacher": "TEACHER"}, {"replay": {"drop_zero_signal": True}}, "replay.drop_zero_signal = false"),
])
def test_bad_distillation_is_named(folders, distill: dict, extra: dict, message: str) -> None:
    where = str(folders["teacher"])
    distill = {k: ({n: where for n in v} if isinstance(v, dict) else where if v == "TEACHER" else v)
               for k, v in distill.items()}
    with pytest.raises(ConfigError, match=message):
        config(folders, distill=distill, **extra)
