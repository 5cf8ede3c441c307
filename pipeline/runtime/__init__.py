"""Runtimes: where a Pipeline's actors run. `local` (one event loop) and `ray` (one process per actor)
have the same shape: `await runtime.run(pipeline, folder, progress, resume)` runs the pipeline in the
run folder and leaves a `RunReport` in `runtime.report`, also when the run failed (its ledger is
written all the same)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class RunReport:
    """What a runtime hands back: the clock, the ledger's counts and records, and runtime extras."""

    version: int
    counts: dict[str, int]
    balanced: bool
    ledger_json: bytes | None
    started_at: float  # wall clock
    extra: dict[str, Any] = field(default_factory=dict)  # runtime-specific summary entries


class Runtime(Protocol):
    report: RunReport | None

    async def run(self, pipeline: Any, folder: Any, progress: Any, resume: Any) -> None: ...


__all__ = ["RunReport", "Runtime"]
