"""A config error says what the user can do: which kind a key belongs to and how to switch kinds, the
nearest key to a misspelled one, and a table's name once, not its prefixes over again."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from baton.config import ConfigError, kind_of, load_toml, section_classes, validate
from baton.schema import RunConfig
from baton.sections import data

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.toml"


def problems(*overrides: str) -> list[str]:
    """The lines of the ConfigError the quickstart with `overrides` raises."""
    with pytest.raises(ConfigError) as caught:
        validate(RunConfig, load_toml(QUICKSTART, overrides), source="quickstart")
    return [line.strip() for line in str(caught.value).splitlines()[1:]]


def test_a_key_of_another_kind_names_its_kind_and_how_to_switch() -> None:
    lines = problems('task.kind="dataset"')
    digits = next(line for line in lines if "'task.digits'" in line)
    assert "'digits' belongs to task.kind = \"reverse-digits\", not \"dataset\"" in digits
    assert "edit a copy of the config's [task] table" in digits
    assert "--set task='{kind = \"dataset\", path = ..., ...}'" in digits  # the kind's required keys
    assert "missing key 'task.path' (kind \"dataset\" needs it)" in " ".join(lines)


def test_the_whole_table_set_the_message_suggests_switches_the_kind(tmp_path: Path) -> None:
    rows = tmp_path / "train.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    table = f'task={{kind = "dataset", path = "{rows}", prompt_field = "prompt"}}'
    config = validate(RunConfig, load_toml(QUICKSTART, [table]))
    assert isinstance(config.task, data.DatasetTaskSpec) and config.task.path == str(rows)


def test_a_key_two_kinds_share_names_both() -> None:
    lines = problems('task.kind="addition"')
    assert any("'digits' belongs to task.kind = \"reverse-digits\", not \"addition\"" in line for line in lines)


@pytest.mark.parametrize(("override", "nearest"), [
    ("learner.lrr=1e-3", "learner.lr"),
    ("stepz=3", "steps"),
    ("learner.lora.rnk=4", "learner.lora.rank"),  # a nested table's keys
    ('reward={function = "exact_match", classifer = {model = "m"}}', "reward.classifier"),
])
def test_a_misspelled_key_gets_the_nearest_one(override: str, nearest: str) -> None:
    (line,) = [line for line in problems(override) if line.startswith("unknown key")]
    assert f"did you mean {nearest!r}? (or remove it)" in line


def test_a_key_with_nothing_near_says_to_remove_it() -> None:
    (line,) = problems("zzzzzz=1")
    assert line == "unknown key 'zzzzzz' (remove it, or check its spelling)"


def test_a_table_check_names_the_table_once() -> None:
    (line,) = problems('reward={weights = {foo = 1.0}}')
    assert line.startswith("reward: unknown reward 'foo'"), line
    assert "{...}" not in line and "reward: reward" not in line


def test_a_kind_table_check_names_the_table_not_the_kind_tag() -> None:
    (line,) = problems('task={kind = "dataset", path = "x"}')  # was "task.dataset = {...}: give exactly ..."
    assert line == "task: give exactly one of task.prompt_field (text) and task.messages_field (chat messages)"


def test_every_kind_union_of_the_schema_is_seen_as_one() -> None:
    """The walk that finds a key's table sees each `kind` section as its kinds (the switch hint needs them)."""
    task = section_classes(RunConfig.model_fields["task"].annotation)
    assert {kind_of(m) for m in task} >= {"reverse-digits", "addition", "dataset"}
    assert section_classes(RunConfig.model_fields["faults"].annotation)  # an array of tables
    assert section_classes(RunConfig.model_fields["steps"].annotation) == []


def test_the_quickstart_itself_is_valid() -> None:
    assert validate(RunConfig, tomllib.loads(QUICKSTART.read_text())).task.kind == "reverse-digits"


def test_elastic_engines_run_on_ray_with_checkpoints_and_not_beside_a_gateway() -> None:
    """`[rollout] max_engines` with runtime = 'ray' passes its check, with checkpoints too (a Ray checkpoint cut
    asks every producer process live at the cut: tests/e2e/test_ray_episodes.py); with a gateway it is refused,
    naming the keys."""
    ray = ["runtime='ray'", "store={kind='ray'}", "rollout.max_engines=2"]
    for every in (0, 5):
        cfg = validate(RunConfig, load_toml(QUICKSTART, [*ray, f"checkpoint.every={every}"]), source="quickstart")
        assert cfg.rollout.max_engines == 2 and cfg.runtime == "ray" and cfg.checkpoint.every == every
    with pytest.raises(ConfigError, match=r"max_engines does not combine with \[gateway\]"):
        validate(RunConfig, load_toml(QUICKSTART, ["rollout.max_engines=2", "gateway={}"]), source="quickstart")


def test_ray_resources_name_a_role_and_a_custom_resource_above_zero() -> None:
    """`[ray.resources]` (docs/guides/multi-node.md): a role other than the four, a CPU or GPU (they come from
    the stage) or an amount not above 0 is refused naming the key; a valid table reaches the pipeline."""
    assert any("ray.resources.engines: not a role; use one of engine, buffer, learner, learner_ranks" in line
               for line in problems("ray.resources.engines={node_b = 0.01}"))
    assert any("ray.resources.learner.GPU = 1.0: give a custom resource" in line
               for line in problems("ray.resources.learner={GPU = 1}"))
    assert any("ray.resources.buffer.node_a = 0.0" in line for line in problems("ray.resources.buffer={node_a = 0}"))
    config = validate(RunConfig, load_toml(QUICKSTART, ["ray.resources.learner_ranks={node_c = 0.01}"]))
    assert config.ray.resources == {"learner_ranks": {"node_c": 0.01}}
