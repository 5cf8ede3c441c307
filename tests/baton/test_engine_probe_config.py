"""`engine.probe_tolerance`: the server engines check every pushed version by the server's probe logprobs
(1e-5 in float32 by default); a TOML value reaches the engine, 'off' turns the check off (a model too large to
hold twice in host memory), and a bound that is not positive is refused naming the key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from baton.builder import make_part
from baton.config import ConfigError, load_toml, validate
from baton.schema import RunConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("config", ["sglang-cpu.toml", "vllm-cpu.toml"])
def test_the_probe_bound_reaches_the_engine_and_off_turns_it_off(config: str, tmp_path: Path) -> None:
    data = load_toml(ROOT / "configs" / config)
    data["engine"]["python"] = sys.executable  # the server's venv need not exist here: nothing is launched
    assert make_part("engine", validate(RunConfig, data), model=tmp_path / "m").probe_tolerance == 1e-5
    for given, built in ((1e-3, 1e-3), ("off", None)):
        data["engine"]["probe_tolerance"] = given
        assert make_part("engine", validate(RunConfig, data), model=tmp_path / "m").probe_tolerance == built
    data["engine"]["probe_tolerance"] = 0
    with pytest.raises(ConfigError, match="engine.probe_tolerance"):
        validate(RunConfig, data)
