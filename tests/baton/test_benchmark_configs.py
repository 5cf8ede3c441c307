"""A benchmark built on a shipped config validates with that config as it is now: benchmarks/long_tail.py
swaps configs/agent-feedback.toml's environment for its own, which must take every option the config
gives the built-in one (it crashed on `show` once the config gained it)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from baton.schema import load_run_config
from benchmarks import long_tail


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_long_tail_benchmark_config_validates(mode: str, tmp_path: Path) -> None:
    args = argparse.Namespace(steps=2, seed=0, k=2, batch_groups=0, overrides=[])
    cfg = load_run_config(long_tail.BASE_CONFIG, long_tail.overrides(args, mode, tmp_path))
    assert cfg.environment is not None and cfg.environment.kind == long_tail.ENVIRONMENT
    shown = cfg.environment.options()["show"]  # the base config's option reaches the benchmark's environment
    env = long_tail.LongTailFeedback(**cfg.environment.options())
    assert env.inner.show == shown and env.inner.max_turns == env.turn_budget
