"""The mixture-of-experts keys: `[model] experts` makes a tiny Qwen3-MoE, `[learner] routing_replay` reaches the
learner, and what cannot replay (a dense model, an engine that does not return its experts) is refused before
anything starts, naming the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.builder import make_part
from baton.config import ConfigError, load_toml, validate
from baton.schema import RunConfig
from stages.data.model import make_tiny_model
from stages.data.routing import folder_moe_layout

ROOT = Path(__file__).resolve().parents[2]


def config(tmp_path: Path, **learner) -> dict:
    data = load_toml(ROOT / "configs" / "quickstart-moe.toml")
    data["model"]["path"] = str(tmp_path / "moe")
    data["learner"].update(learner)
    return data


def refused(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate(RunConfig, data)
    return str(info.value)


def test_the_moe_quickstart_makes_an_moe_and_its_learner_replays(tmp_path: Path) -> None:
    cfg = validate(RunConfig, config(tmp_path))
    folder = cfg.model.make()
    layout = folder_moe_layout(folder)
    assert layout is not None and (layout.experts, layout.top_k, layout.layers) == (8, 2, (0, 1))
    assert make_part("learner", cfg, model=folder).routing_replay == "rollout"
    # what each token's experts cost in the store, said by `baton check`
    assert "routed experts: 4 B of each token's" in cfg.window_report()


def test_replay_on_a_dense_model_is_refused(tmp_path: Path) -> None:
    data = config(tmp_path)
    data["model"]["experts"] = 0
    assert "model.experts = 0 makes a dense model" in refused(data)
    dense = make_tiny_model(tmp_path / "dense")
    data["model"] = {"path": str(dense), "create": False}
    message = refused(data)
    assert "learner.routing_replay = 'rollout'" in message and "is dense" in message


def test_an_expert_parallel_degree_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    assert "learner.expert_parallel = 3 must divide the model's 8 experts" in refused(
        config(tmp_path, world_size=1, expert_parallel=3))
    assert "learner.expert_parallel = 2 must equal learner.world_size = 1" in refused(
        config(tmp_path, expert_parallel=2))
    data = config(tmp_path, world_size=2, expert_parallel=2, routing_replay="off")
    data["model"]["experts"] = 0
    assert "learner.expert_parallel = 2 shards the experts" in refused(data)
    dense = make_tiny_model(tmp_path / "dense")
    data["model"] = {"path": str(dense), "create": False}
    assert "the model is dense" in refused(data)
    lora = config(tmp_path, world_size=2, expert_parallel=2, lora={"rank": 4})
    assert "learner.expert_parallel = 2 and [learner] lora" in refused(lora)
    cfg = validate(RunConfig, config(tmp_path, world_size=2, expert_parallel=2))
    assert make_part("learner", cfg, model=cfg.model.make()).expert_parallel == 2


def test_replay_with_an_engine_that_returns_no_experts_is_refused(tmp_path: Path) -> None:
    data = config(tmp_path)
    data["engine"] = {"kind": "tests.baton.test_moe_config:NoExperts"}
    message = refused(data)
    assert "this engine cannot return them" in message and "learner.routing_replay = 'off'" in message
    data["engine"] = {"kind": "tests.baton.test_moe_config:WithExperts"}
    assert validate(RunConfig, data).learner.routing_replay == "rollout"


def test_replay_off_needs_nothing(tmp_path: Path) -> None:
    data = config(tmp_path, routing_replay="off")
    data["engine"] = {"kind": "tests.baton.test_moe_config:NoExperts"}
    assert validate(RunConfig, data).learner.routing_replay == "off"


class NoExperts:
    """A plug-in engine that says nothing of routed experts (so it returns none)."""


class WithExperts:
    returns_routed_experts = True


def test_a_load_balancing_loss_on_a_dense_model_is_refused(tmp_path: Path) -> None:
    data = config(tmp_path, load_balance_coef=0.01, routing_replay="off")
    assert validate(RunConfig, data).learner.load_balance_coef == 0.01  # an MoE: fine
    data["model"]["experts"] = 0
    assert "learner.load_balance_coef = 0.01 weighs" in refused(data)
    data["model"] = {"path": str(make_tiny_model(tmp_path / "dense")), "create": False}
    assert "but the model is dense" in refused(data)
