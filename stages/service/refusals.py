"""What the service refuses, by name, at the first request that names it: a `Refused` becomes an HTTP 400 whose
body names the field and says what is supported (the SDK raises it as `tinker.BadRequestError`), never a failure
later in a run."""

from __future__ import annotations

from typing import Any


class Refused(ValueError):
    """A request names a field, value, loss or endpoint this service does not support; the message names it."""


def refuse_unless(condition: bool, message: str) -> None:
    if not condition:
        raise Refused(message)


def check_lora_config(lora: dict[str, Any]) -> None:
    """`create_model`'s `lora_config`: a rank >= 1, no seed (every adapter starts from the learner's one fixed
    init, `stages.learner.lora.INIT_SEED`) and at least one of attention, MLP, unembedding trained."""
    rank = lora.get("rank")
    refuse_unless(isinstance(rank, int) and rank >= 1, f"lora_config.rank must be an integer >= 1, got {rank!r}; "
                                                       "for full fine-tuning send create_model without lora_config")
    refuse_unless(lora.get("seed") is None, "lora_config.seed is not supported: baton initialises every adapter "
                                            "from one fixed seed; leave seed unset")
    refuse_unless(any(lora.get(k, True) for k in ("train_attn", "train_mlp", "train_unembed")),
                  "lora_config trains nothing: set one of train_attn, train_mlp, train_unembed")


def check_sampling_request(body: dict[str, Any]) -> None:
    """`asample`: prompt logprobs are served whole (not their last n, not top-k); sampling params beyond
    max_tokens, temperature, top_p and stops (token ids or strings) are refused by name."""
    refuse_unless(not body.get("record_stability_info"), "record_stability_info is not supported by baton serve yet")
    for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        refuse_unless(not body.get(key), f"{key} is not supported by baton serve yet; leave it 0")
    for key in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
        refuse_unless(body.get(key) is None, f"{key} is not supported by baton serve yet")
    params = body.get("sampling_params") or {}
    refuse_unless(params.get("max_tokens") is not None and int(params["max_tokens"]) >= 1,
                  "sampling_params.max_tokens must be set (>= 1): baton serve does not guess a budget")
    refuse_unless(params.get("seed") is None, "sampling_params.seed is not supported: the engine draws from its "
                                              "own seeded stream; leave seed unset")
    refuse_unless(params.get("top_k", -1) in (-1, 0), "sampling_params.top_k is not supported; leave it -1")
    stop = params.get("stop")
    refuse_unless(stop is None or isinstance(stop, str) and bool(stop) or isinstance(stop, list) and (
        all(isinstance(s, int) for s in stop) or all(isinstance(s, str) and s for s in stop)),
        "sampling_params.stop takes token ids (a list of ints) or non-empty strings, not a mix of both")
    refuse_unless(int(body.get("num_samples", 1)) >= 1, "num_samples must be >= 1")
