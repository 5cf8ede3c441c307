"""Provenance on vLLM: in a short real run of `configs/vllm-cpu.toml` (a real vLLM server, weights pushed after
every learner step while requests run: `/pause?mode=keep`, so a request can span two versions), every sample's
weight versions are the ones the vLLM engine reported, and the ledger's [oldest, newest] of every sample is its
group's span of them.

Three records of the same samples, kept apart: what the engine's `generate` returned (each token's version, from
the server's `weight_versions` spans), what the producer stored (the payload's `token_versions`, read back from
the store as it was put) and what the ledger says (`ledger.json`). Compared: the stored versions of each
completion equal one reported completion with the same prompt and tokens; the ledger's versions of each item
equal the min and max over its group's model tokens; and at least one completion ran across an update.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from buffers.codec import decode
from buffers.memory import MemoryStore
from stages.engines.vllm import VLLMEngine
from tests.helpers.engines import VLLM_MISSING

pytestmark = [pytest.mark.vllm, pytest.mark.long, pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING)]
CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "vllm-cpu.toml")
# 12 digits: 12 new tokens a request, long enough that pushes (one a step) land while requests run
SHORT = ("steps=10", "task.digits=12", "engine.batch_groups=8", "learner.groups_per_step=8", "learner.epochs=1",
         "telemetry.log_level='warning'", "watchdog.fail_after_s=1200",  # a server restart moves nothing
         "engine.start_timeout_s=900")  # a loaded 2-core machine

Key = tuple[tuple[int, ...], tuple[int, ...]]  # (prompt, completion tokens)


class Reporting:
    """An engine that keeps each completion's reported token versions by (prompt, tokens); the rest is the engine's."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.reported: dict[Key, list[tuple[int, ...]]] = defaultdict(list)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def generate(self, prompts, params):
        out = await self.engine.generate(prompts, params)
        for prompt, completion in zip(prompts, out, strict=True):
            key = (tuple(map(int, prompt)), tuple(map(int, completion.tokens)))
            self.reported[key].append(tuple(map(int, completion.versions)))
        return out


class StoredGroups(MemoryStore):
    """A memory store keeping, per group, each stored row's (prompt, completion, completion's token versions)."""

    def __init__(self) -> None:
        super().__init__()
        self.groups: dict[str, list[tuple[Key, tuple[int, ...]]]] = {}

    async def put(self, key: str, data) -> None:
        batch = decode(data)
        rows = []
        for i in range(batch.rows):
            row = batch.row(i)
            model = np.asarray(row["loss_mask"]).astype(bool)
            tokens, versions = np.asarray(row["tokens"]), np.asarray(row["token_versions"])
            rows.append(((tuple(map(int, tokens[~model])), tuple(map(int, tokens[model]))),
                         tuple(map(int, versions[model]))))
        self.groups[str(batch.meta["group"])] = rows
        await super().put(key, data)


@pytest.mark.timeout(1200)  # a server start (1-3 min on 2 shared cores) and 10 steps
def test_every_samples_versions_are_the_engines_and_the_ledgers(tmp_path: Path) -> None:
    from baton.builder import build_pipeline
    from baton.config import load_toml, validate
    from baton.schema import RunConfig

    raw = load_toml(CONFIG, [f"model.path='{tmp_path / 'hd32'}'", f"run_root='{tmp_path / 'runs'}'", *SHORT])
    pipe = build_pipeline(validate(RunConfig, raw, source=CONFIG))
    assert isinstance(pipe.producer.engines[0], VLLMEngine)
    engine = pipe.producer.engines[0] = Reporting(pipe.producer.engines[0])
    store = pipe.buffer.store = StoredGroups()
    summary = pipe.run()
    assert summary["version"] == 10 and summary["ledger_balanced"]

    unmatched = {key: list(v) for key, v in engine.reported.items()}
    for rows in store.groups.values():
        for key, versions in rows:
            assert versions in unmatched.get(key, []), f"stored versions {versions} were never reported for {key}"
            unmatched[key].remove(versions)
    spans = {group: (min(min(v) for _, v in rows), max(max(v) for _, v in rows))
             for group, rows in store.groups.items()}
    records = json.loads((Path(summary["run_dir"]) / "ledger.json").read_text())
    stored = [r for r in records if r["group"] in spans]
    assert len(stored) == sum(len(rows) for rows in store.groups.values()) > 0
    assert all(tuple(r["versions"]) == spans[r["group"]] for r in stored), "the ledger's span is the group's"
    across = [v for vs in engine.reported.values() for v in vs if len(set(v)) > 1]
    print(f"{sum(map(len, engine.reported.values()))} completions reported, {len(across)} across an update, "
          f"{len(store.groups)} groups stored")
    assert across, "no request ran across a weight update (keep mode records two versions then)"
    assert all(list(v) == sorted(v) for v in across), "versions only move forward within a request"
