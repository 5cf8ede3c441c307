"""The opt-in memory report of a host process (`pipeline.runtime.memory`): off without its variable,
and with it, records that name what grew since the warm-up."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

from pipeline.runtime.memory import ENV, MemoryReport, MemorySettings, watch_memory


def test_off_without_the_variable_and_for_hosts_not_named(tmp_path: Path) -> None:
    assert watch_memory("consumer-0", env={}) is None
    assert watch_memory("consumer-0", env={ENV: ""}) is None
    assert watch_memory("producer-0", env={ENV: str(tmp_path / "m")}) is None  # default: the learner's host only
    assert not list(tmp_path.iterdir())


def test_settings_travel_as_environment_variables(tmp_path: Path) -> None:
    settings = MemorySettings(path=str(tmp_path / "m"), hosts=("consumer-0", "buffer-0"), warmup_s=5.0,
                              every_s=2.0, frames=3)
    assert MemorySettings.from_env(settings.env()) == settings
    assert MemorySettings.from_env({ENV: "x", f"{ENV}_HOSTS": "*"}).watches("producer-3")


_held: list[bytes] = []


def _grow() -> None:
    _held.extend(bytes(1000) + bytes([i % 256]) for i in range(3000))


def test_records_name_the_allocation_site_that_grew(tmp_path: Path) -> None:
    assert not tracemalloc.is_tracing()
    report = MemoryReport(MemorySettings(path=str(tmp_path / "m"), warmup_s=3600, every_s=3600, frames=4), "consumer-0")
    first = report.write()  # the first record starts tracemalloc and takes the baseline
    assert tracemalloc.is_tracing()
    assert first["rss_mb"] > 0 and first["since_warmup_mb"]["rss"] == 0
    _grow()
    second = report.write()
    report.close()
    assert not tracemalloc.is_tracing()
    assert second["since_warmup_mb"]["traced"] >= 2.5  # 3,000 objects of ~1 kB
    top = second["grown"][0]
    assert top["kb"] >= 2500 and top["count"] >= 3000
    assert any("test_memory_report.py" in frame for frame in top["at"])
    lines = [json.loads(x) for x in (tmp_path / "m.consumer-0.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and lines[0]["host"] == "consumer-0"  # close() wrote the last one
    _held.clear()


def test_the_thread_writes_after_its_warm_up(tmp_path: Path) -> None:
    env = {ENV: str(tmp_path / "m"), f"{ENV}_WARMUP_S": "0", f"{ENV}_EVERY_S": "0.05", f"{ENV}_FRAMES": "0"}
    report = watch_memory("consumer-0", env=env)
    assert report is not None
    report._thread.join(timeout=0.3)  # it keeps writing until closed
    report.close()
    report._thread.join(timeout=5)
    lines = (tmp_path / "m.consumer-0.jsonl").read_text().splitlines()
    assert len(lines) >= 2
    assert not tracemalloc.is_tracing()  # frames = 0: native counters only
    assert "in_use" in json.loads(lines[-1])["heap_mb"]

