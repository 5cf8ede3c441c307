"""A server engine preempted mid-decode and its requests carried on by the relay to a torch engine: the checks
tests/stages/engines/test_sglang.py and test_vllm.py share (stages.engines.server_engine, stages.rollout.relay)."""

from __future__ import annotations

import time
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from stages.engines.base import Completion, EnginePreempted, SamplingParams
from stages.engines.torch import TorchEngine
from stages.rollout.relay import Relay
from tests.helpers.engines import started, teacher_forced_logprobs

TOLERANCE = 1e-4  # as tests/stages/engines/test_engine.py's preempted torch engine: float32 both sides


async def preempted_mid_decode(engine: Any, twin: Any, prompts: list[list[int]],
                               params: SamplingParams) -> list[Completion]:
    """`engine`'s completions of `prompts`, preempted a quarter of the way through: `twin` (another engine on the same
    server) first times the same call whole, so the preemption lands mid-decode on a fast machine or a loaded one
    (a quarter, not half: the abort takes a moment to reach the server's scheduler, ~15% of the call on vLLM)."""
    t0 = time.perf_counter()
    await twin.generate(prompts, params)
    whole_s = time.perf_counter() - t0
    out: list[Completion] = []

    async def generate() -> None:
        out.extend(await engine.generate(prompts, params))

    async with anyio.create_task_group() as tg:
        tg.start_soon(generate)
        with anyio.fail_after(30):
            while engine.load == 0:  # its requests are on their way to the server
                await anyio.sleep(0.001)
        await anyio.sleep(whole_s / 4)
        engine.preempt()
    with pytest.raises(EnginePreempted):  # and it takes nothing more
        await engine.generate(prompts[:1], params)
    return out


def assert_partial(model: torch.nn.Module, prompts: list[list[int]], partials: list[Completion],
                   params: SamplingParams, version: int) -> None:
    """Each request came back preempted mid-decode with the tokens the server had, each with the logprob
    `model` gives it (the server's weights) and `version`."""
    for prompt, c in zip(prompts, partials, strict=True):
        assert c.finish_reason == "preempted" and 0 < len(c.tokens) < params.max_new_tokens, (c.finish_reason,
                                                                                               len(c.tokens))
        assert len(c.logprobs) == len(c.versions) == len(c.tokens) and set(c.versions.tolist()) == {version}
        expected = teacher_forced_logprobs(model, prompt, c.tokens)
        assert torch.allclose(torch.from_numpy(c.logprobs), expected, atol=TOLERANCE)


async def carried_to_torch(engine: Any, model_path: Any, weights: dict[str, torch.Tensor], version: int,
                           prompts: list[list[int]], partials: list[Completion], params: SamplingParams,
                           model: torch.nn.Module) -> tuple[float, list[Completion]]:
    """The relay carries each partial completion on to a torch engine holding `weights` as `version`: the stitched
    samples are whole, keep the server's tokens first, and their per-token logprobs are one teacher-forced pass of
    `model`'s; returns carried / (carried + lost) tokens of the relay's ledger for `engine`, and the samples."""
    relay, successor = Relay(), TorchEngine(model_path, name="torch-successor", seed=3)
    relay.add(successor)
    async with started(successor):
        await successor.receive_weights(version, weights)
        done = [await relay.carry(engine, p, c, params) for p, c in zip(prompts, partials, strict=True)]
    for prompt, partial, c in zip(prompts, partials, done, strict=True):
        kept = len(partial.tokens)
        assert len(c.tokens) == params.max_new_tokens and c.meta["carried_tokens"] == kept
        assert np.array_equal(c.tokens[:kept], partial.tokens) and set(c.versions.tolist()) == {version}
        expected = teacher_forced_logprobs(model, prompt, c.tokens)
        assert torch.allclose(torch.from_numpy(c.logprobs), expected, atol=TOLERANCE)
    counts = relay.counts[engine.name]
    assert counts["requests"] == len(prompts) and counts["tokens_carried"] == sum(len(c.tokens) for c in partials)
    return counts["tokens_carried"] / (counts["tokens_carried"] + counts["tokens_lost"]), done
