"""`[learner] lora` in the config: what a LoRA run builds (the learner's adapter, each SGLang server launched
to serve it with room for the staleness window), and bad input refused before anything starts, naming the
key and the fix: a target module the model lacks, a rank the SGLang server refuses, too little room for
the window, an update path that cannot carry adapters."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton.builder import make_part
from baton.config import ConfigError, load_toml, validate
from baton.schema import RunConfig
from stages.engines.sglang_server import SGLangUnavailable, sglang_python

ROOT = Path(__file__).resolve().parents[2]
try:
    sglang_python()
    _NO_SGLANG = ""
except SGLangUnavailable as exc:
    _NO_SGLANG = str(exc)
needs_sglang = pytest.mark.skipif(bool(_NO_SGLANG), reason=_NO_SGLANG)  # the engine section checks its venv


def config(tmp_path: Path, engine: dict | None = None, **lora) -> dict:
    data = load_toml(ROOT / "configs" / "quickstart-lora.toml")
    data["model"] = {"path": str(tmp_path / "tiny")}  # made on first use: the check knows a Qwen2's modules
    data["learner"]["lora"] = {**data["learner"]["lora"], **lora}
    if engine is not None:
        data["engine"] = {"kind": "sglang", **engine}
    return data


def refused(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate(RunConfig, data)
    return str(info.value)


def test_the_lora_settings_reach_the_learner(tmp_path: Path) -> None:
    cfg = validate(RunConfig, config(tmp_path, rank=4, check_every=5))
    learner = make_part("learner", cfg, model=tmp_path / "tiny")
    assert learner.lora.rank == 4 and learner.lora.check_every == 5 and "lm_head" in learner.lora.target_modules


def test_an_unknown_target_module_names_the_key_and_the_modules(tmp_path: Path) -> None:
    message = refused(config(tmp_path, target_modules=["q_proj", "qkv_proj"]))
    assert "learner.lora.target_modules names ['qkv_proj']" in message and "'down_proj'" in message


@needs_sglang
def test_each_sglang_server_is_launched_for_the_adapters_and_the_window(tmp_path: Path) -> None:
    cfg = validate(RunConfig, config(tmp_path, engine={}, rank=4) | {"staleness": {"k": 3}})
    engine = make_part("engine", cfg, model=tmp_path / "tiny", index=0)
    assert (engine.lora.max_rank, engine.lora.max_loaded) == (4, 5)  # k + 2
    assert engine.lora.target_modules == tuple(cfg.learner.lora.target_modules)


@needs_sglang
@pytest.mark.parametrize("engine, says", [
    ({"max_lora_rank": 4}, "learner.lora.rank = 8 is above the SGLang server's --max-lora-rank 4"),
    ({"extra_args": ["--max-lora-rank", "4"]}, "--max-lora-rank 4"),
    ({"max_loaded_loras": 3}, "engine.max_loaded_loras = 3, but staleness.k = 2"),
    ({"update": "distributed"}, "engine.update = 'distributed' moves full weights only"),
])
def test_what_the_sglang_server_cannot_serve_is_refused(tmp_path: Path, engine: dict, says: str) -> None:
    assert says in refused(config(tmp_path, engine=engine))
