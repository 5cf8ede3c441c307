"""What goes into a vLLM server, version by version (the `VLLMEngine`'s push path, kept apart so the engine
stays one screen of lifecycle and requests): `fit_version` checks a version against the checkpoint before any
server sees it, `send_version` writes it whole or as a delta (`vllm_update`, `vllm_delta`), and `landed_check`
proves it landed by the server's probe logprobs (`sglang_probe.WeightProbe`, in the server's precision)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import torch

from stages.engines.base import EngineError
from stages.engines.sglang_probe import PushMismatch, WeightProbe, dtype_tolerance
from stages.engines.vllm_delta import PushedBase, push_delta
from stages.engines.vllm_update import push_weights

if TYPE_CHECKING:
    from stages.engines.vllm import VLLMEngine


def fit_version(engine: str, expected: dict[str, tuple[int, ...]], version: int,
                tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors of `version` (names and shapes `expected`): a version that does not fit whole (a
    wrong shape, a missing or unknown tensor) raises EngineError naming them, before any server sees it; a tied
    head the checkpoint does not store is left out."""
    problems = []
    for name, shape in expected.items():
        if name not in tensors:
            problems.append(f"{name} missing")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(tensors[name].shape)}, the model {shape}")
    problems += [f"{n} is not in the model" for n in tensors if n not in expected and n != "lm_head.weight"]
    if problems:
        raise EngineError(f"engine {engine}: weights of version {version} do not fit: {'; '.join(problems[:5])}")
    return {n: t for n, t in tensors.items() if n in expected}


async def landed_check(engine: VLLMEngine, version: int, tensors: dict[str, torch.Tensor]) -> float:
    """The largest gap between the server's probe logprobs and a forward of `tensors` in the server's precision
    (`sglang_probe.WeightProbe`, the engine's dtype bound); `PushMismatch` beyond it. Counted in the engine's stats
    (`probes`, `probe_gap_max`)."""
    if engine._probe is None:
        engine._probe = WeightProbe(engine.model_path, engine.dtype)
    tolerance = dtype_tolerance(engine.probe_tolerance, engine.dtype)
    expected = await anyio.to_thread.run_sync(engine._probe.expected, tensors, tolerance)
    served = await engine.prompt_logprobs(list(expected.tokens))
    gap = expected.difference([float(x) for x in served])
    engine.stats["probes"] = engine.stats.get("probes", 0) + 1
    engine.stats["probe_gap_max"] = max(gap, engine.stats.get("probe_gap_max", 0.0))
    if gap > expected.tolerance:
        raise PushMismatch(f"engine {engine.name}: version {version} is not what the server computes: its probe "
                           f"logprobs differ from the version's weights by {gap:.3g} "
                           f"(tolerance {expected.tolerance:g})")
    return gap


async def send_version(engine: VLLMEngine, version: int, tensors: dict[str, torch.Tensor],
                       damage: Callable[[Path], None] | None = None) -> None:
    """One push into `engine`'s server: a delta against what the server kept where `push` is "delta" and it
    keeps one (counted: `delta_pushes`; a server that no longer keeps it is sent the whole version:
    `delta_fallbacks`), else the whole version. `push_bytes` counts the bytes written for the server;
    `damage`: the push_refused fault's hook, on a whole version."""
    assert engine._http is not None and engine._base_url is not None
    delta = engine.push == "delta"
    figures = None
    if delta and engine._base is not None and damage is None:
        base, engine._base = engine._base, None  # until this push lands, nothing is known to be kept
        figures = await push_delta(engine._http, engine._base_url, version, tensors, base)
        engine.stats["delta_pushes" if figures is not None else "delta_fallbacks"] += 1
    if figures is None:
        engine._base = None
        await push_weights(engine._http, engine._base_url, version, tensors, keep=delta, damage=damage)
    engine.stats["push_bytes"] += figures["bytes"] if figures else sum(t.nbytes for t in tensors.values())
    if delta:
        engine._base = await anyio.to_thread.run_sync(PushedBase.of, version, tensors)
