"""`[learner] lora` on the mixture-of-experts quickstart: `target_experts` reaches the learner, and where it
cannot work it is refused before anything starts, naming the key and the fix: a dense model, dropout (peft
adapts the fused experts without it), an SGLang engine (its MoE LoRA needs CUDA kernels), expert parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.builder import make_part
from baton.config import ConfigError, load_toml, validate
from baton.schema import RunConfig
from stages.engines.sglang_server import SGLangUnavailable, sglang_python
from stages.learner.lora import EXPERT_PARAMETERS

ROOT = Path(__file__).resolve().parents[2]
try:
    sglang_python()
    _NO_SGLANG = ""
except SGLangUnavailable as exc:
    _NO_SGLANG = str(exc)


def config(tmp_path: Path, **lora) -> dict:
    data = load_toml(ROOT / "configs" / "quickstart-moe.toml")
    data["model"]["path"] = str(tmp_path / "moe")
    data["learner"]["lora"] = {"rank": 4, **lora}
    return data


def refused(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate(RunConfig, data)
    return str(info.value)


def test_target_experts_reaches_the_learner_and_is_off_by_default(tmp_path: Path) -> None:
    cfg = validate(RunConfig, config(tmp_path, target_experts=True))
    learner = make_part("learner", cfg, model=cfg.model.make())
    assert learner.lora.target_experts and learner.lora.target_parameters == EXPERT_PARAMETERS
    assert not validate(RunConfig, config(tmp_path)).learner.lora.spec().target_parameters


def test_target_experts_where_it_cannot_work_is_refused(tmp_path: Path) -> None:
    dense = config(tmp_path, target_experts=True)
    dense["model"]["experts"] = 0
    dense["learner"]["routing_replay"] = "off"
    assert "learner.lora.target_experts = true adapts a mixture of experts' experts, but model.experts = 0" \
        in refused(dense)
    assert "learner.lora.target_experts = true needs learner.lora.dropout = 0" in refused(
        config(tmp_path, target_experts=True, dropout=0.1))
    parallel = config(tmp_path, target_experts=True)
    parallel["learner"].update(world_size=2, expert_parallel=2)
    assert "learner.expert_parallel = 2 and [learner] lora do not go together" in refused(parallel)


@pytest.mark.skipif(bool(_NO_SGLANG), reason=_NO_SGLANG)  # the engine section checks its venv
def test_target_experts_with_sglang_is_refused(tmp_path: Path) -> None:
    data = config(tmp_path, target_experts=True)
    data["engine"] = {"kind": "sglang"}
    data["learner"]["routing_replay"] = "off"
    message = refused(data)
    assert "learner.lora.target_experts = true: SGLang does not serve adapters on the experts" in message
    assert "engine.kind = 'torch'" in message
