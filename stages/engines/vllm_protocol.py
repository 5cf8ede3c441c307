"""What the vLLM engine sends to and reads from a vLLM 0.32.0 server: pure functions, no HTTP (unit-tested alone).

* `generate_body`: one `/inference/v1/generate` request (the token-in/token-out route `--enable-scale-out`
  opens): token ids in, the sampled token's logprob (`logprobs: 0`) out, stop tokens, and `ignore_eos` when no
  stop token is asked for (the full length, as SGLang's engine runs it).
* `internal_id`: the id `/abort_requests` needs: the route prefixes the id it was given (`generate-tokens-`);
  a bare id answers 200 `{"aborted": 1}` and aborts nothing.
* `fit_context`: the new tokens a prompt leaves room for in the server's context (vLLM refuses more).
* `completion_of`: a response as a `Completion`, or None when it was aborted (to be generated again). Every
  token's version comes from the choice's `weight_versions` spans (`[start, end)` of output tokens sampled by
  weights labelled `version`, the label baton gives each push: `str(version)`); an unlabelled span (the
  server's initial weights) is the version the request was submitted under.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from stages.engines.base import Completion, ContextFull, EngineError, SamplingParams

GENERATE = "/inference/v1/generate"
ABORT = "/abort_requests"
ID_PREFIX = "generate-tokens-"


def generate_body(rid: str, prompt: list[int], params: SamplingParams, version: int = 0) -> dict[str, Any]:
    """The `/inference/v1/generate` request for one prompt, submitted under weight `version`: its `cache_salt`
    keeps prefix-cache entries to requests of one version (a prompt's KV computed by older weights must never
    serve a newer version's request)."""
    if not prompt:
        raise EngineError("vLLM's /inference/v1/generate takes no empty prompt: give each prompt one token at least")
    return {
        "request_id": rid,
        "token_ids": [int(t) for t in prompt],
        "output_mode": "tokens",
        "cache_salt": f"v{version}",
        "sampling_params": {
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stop_token_ids": list(params.stop_token_ids),
            # with no stop tokens asked for, run the full length (vLLM would stop at the model's EOS)
            "ignore_eos": not params.stop_token_ids,
            "logprobs": 0,  # the sampled token's own logprob
        },
    }


def internal_id(rid: str) -> str:
    """The id the server knows request `rid` by (what `/abort_requests` takes)."""
    return ID_PREFIX + rid


def version_of(tag: Any, submitted: int) -> int:
    """Our labels are str(version); a span with another label (the server's initial weights) is `submitted`."""
    try:
        return int(tag)
    except (TypeError, ValueError):
        return submitted


def completion_of(answer: Any, submitted: int, params: SamplingParams, engine: str = "vllm",
                  spans: bool = True, preempted: bool = False) -> Completion | None:
    """One `/inference/v1/generate` answer as a Completion (None: aborted; see the module docstring). Without
    `spans` (a request under a LoRA adapter: the spans label the base's weights) every token is `submitted`'s.
    `preempted` (the engine was): an aborted answer is the tokens it had, `finish_reason` "preempted"."""
    try:
        choice = answer["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise EngineError(f"engine {engine}: {GENERATE} answered no choice: {str(answer)[:300]}") from None
    finish = choice.get("finish_reason") or "length"
    if finish == "abort" and not preempted:
        return None
    tokens = np.array(choice.get("token_ids") or [], dtype=np.int32)
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(tokens) or any(int(c["token_id"]) != int(t) for c, t in zip(content, tokens, strict=True)):
        raise EngineError(f"engine {engine}: {len(content)} logprobs for {len(tokens)} tokens (or not theirs)")
    logprobs = np.array([c["logprob"] for c in content], dtype=np.float32)
    versions = np.full(len(tokens), submitted, dtype=np.int32)
    for span in (choice.get("weight_versions") or ()) if spans else ():
        versions[int(span["start"]) : int(span["end"])] = version_of(span.get("version"), submitted)
    stopped = finish == "stop" and len(tokens) > 0 and int(tokens[-1]) in params.stop_token_ids
    usage = answer.get("usage") or {}
    meta = {"rid": answer.get("request_id"), "prompt_tokens": int(usage.get("prompt_tokens") or 0)}
    return Completion(tokens, logprobs, versions, "preempted" if finish == "abort" else "stop" if stopped else "length",
                      meta)


def fit_context(engine: Any, prompt: list[int], params: SamplingParams) -> SamplingParams:
    """`params` with at most the new tokens the server's context leaves after `prompt`: vLLM refuses (400) a request
    whose prompt plus `max_tokens` exceeds its `max_model_len` (the model's max_position_embeddings by default),
    where SGLang and the torch engine stop at the context's end; ContextFull when the prompt alone fills it."""
    if engine._context is None:
        config = json.loads((Path(engine.model_path) / "config.json").read_text())
        engine._context = int(config.get("max_position_embeddings") or 0) or None
    if engine._context is None:
        return params
    room = engine._context - len(prompt)
    if room < 1:
        raise ContextFull(f"engine {engine.name}: a prompt of {len(prompt)} tokens fills the server's context of "
                          f"{engine._context} (engine.max_model_len); shorten the prompt or raise it")
    return replace(params, max_new_tokens=room) if params.max_new_tokens > room else params
