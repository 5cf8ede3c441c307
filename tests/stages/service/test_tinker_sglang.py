"""`baton serve --engine sglang` driven by the official `tinker` SDK: the saved adapters are sampled on one real
SGLang server (launched at the first sample, shared by the module: a start costs about a minute here) holding at most
two adapters. A trained adapter's samples carry the trained model's teacher-forced logprobs (forward through the
SDK) within the SGLang LoRA tests' bound, and differ from the base's; several samples and a stop token work;
adapters evicted as least recently used come back serving their own weights; a full fine-tuning's sampler is
refused by name."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker", reason="the tinker SDK is not installed: pip install -e '.[tinker]'")
from tinker import types  # noqa: E402

from baton.tinker_client import create_full_training_client  # noqa: E402
from stages.engines.sglang_server import SGLangUnavailable, sglang_python  # noqa: E402
from tests.helpers.tinker_service import running_service  # noqa: E402
from tests.stages.learner.test_ranks import groups  # noqa: E402
from tests.stages.service.test_tinker_sdk import datums  # noqa: E402

try:
    sglang_python()
    _MISSING = ""
except SGLangUnavailable as exc:
    _MISSING = str(exc)

pytestmark = [pytest.mark.sglang, pytest.mark.long, pytest.mark.slow, pytest.mark.skipif(bool(_MISSING),
                                                                                         reason=_MISSING)]
torch.set_num_threads(1)
PROMPT = [1, 5, 6, 7]
TOLERANCE = 1e-5  # tests/stages/engines/test_sglang_lora.py: the learner's adapter served on SGLang, float32


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with running_service(tmp_path_factory.mktemp("serve-sglang"), "--engine", "sglang", "--max-lora-rank", "8",
                         "--max-loaded-adapters", "2") as served:
        yield served


@pytest.fixture(scope="module")
def service(served):
    os.environ["TINKER_TELEMETRY"] = "0"
    return tinker.ServiceClient(base_url=served[0]["base_url"], api_key=Path(served[0]["key_file"]).read_text())


def step(training, seed: int) -> None:
    training.forward_backward(datums(groups(seed, n=2, group_size=3), np.full(6, 0.5), "cross_entropy"),
                              "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def assert_a_stop_token_ends_greedy_samples(sampler) -> None:
    """A greedy sample, then two more with one of its tokens (the first not seen before it) as the stop: each is
    the first one cut after that token, and says "stop"."""
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    first = list(sampler.sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result().sequences[0].tokens)
    k = next((i for i in range(1, len(first)) if first[i] not in first[:i]), 0)
    stopped = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(
        max_tokens=8, temperature=0.0, stop=[first[k]])).result().sequences
    for seq in stopped:
        assert list(seq.tokens) == first[:k + 1] and seq.stop_reason == "stop"


def assert_adapters_evicted_least_recently_used(training, calls, tolerance: float) -> None:
    """Three saves of one model, two adapters loaded at most: each save's prompt logprobs are the model's at that
    save, also after its adapter was evicted and loaded again. The one evicted is the least recently used (used in
    the order 0 1 0 2 0 1: 2 evicts 1, not 0, and 1 then evicts 2: four loads and two unloads, where evicting the
    oldest loaded would take five and three). The server's list of adapters is checked after every load and
    unload: a server holding more, or other, adapters than the sampler's fails the call."""
    tokens = PROMPT + [9, 12, 3, 8]
    saves, expected = [], []
    for seed in (11, 12, 13):
        step(training, seed)
        saves.append(training.save_weights_and_get_sampling_client().result())
        expected.append(teacher_forced(training, tokens))
    assert min(np.abs(expected[i] - expected[j]).max() for i, j in ((0, 1), (1, 2), (0, 2))) > 1e-3
    loads, unloads = calls()
    for i in (0, 1, 0, 2, 0, 1):
        got = np.array(saves[i].compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:])
        assert np.abs(got - expected[i]).max() <= tolerance, (i, np.abs(got - expected[i]).max())
    after = calls()  # (the adapters loaded before this test are unloaded too: loads - unloads)
    assert (after[0] - loads, after[1] - unloads) == (4, 2 + loads - unloads), (loads, unloads, after)


def teacher_forced(training, tokens: list[int]) -> np.ndarray:
    """The training model's logprob of each token after the first (forward through the SDK)."""
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                                        "weights": np.zeros(len(tokens) - 1, dtype=np.float32)})
    return training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def sampled_gaps(service, served, training) -> tuple[object, float, float]:
    """The trained adapter's sampler and, over three of its samples, the largest gap of their logprobs and of the
    sampler's prompt logprobs of them to the trained model's teacher-forced logprobs (shared with the vLLM test).
    Each sample is as long as asked, and the base model's sampler scores it differently (it does not serve the base)."""
    sampler = training.save_weights_and_get_sampling_client().result()
    base = service.create_sampling_client(base_model=served[0]["model"]).result()
    out = sampler.sample(types.ModelInput.from_ints(PROMPT), 3, types.SamplingParams(max_tokens=6, stop=[])).result()
    assert len(out.sequences) == 3
    worst_sampled = worst_prompt = 0.0
    for seq in out.sequences:
        assert len(seq.tokens) == 6 == len(seq.logprobs) and seq.stop_reason == "length"
        full = PROMPT + list(seq.tokens)
        scored = teacher_forced(training, full)
        worst_sampled = max(worst_sampled, float(np.abs(scored[len(PROMPT) - 1:] - seq.logprobs).max()))
        prompt_logprobs = np.array(sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()[1:])
        worst_prompt = max(worst_prompt, float(np.abs(prompt_logprobs - scored).max()))
        untrained = np.array(base.compute_logprobs(types.ModelInput.from_ints(full)).result()[1:])
        assert np.abs(untrained - scored).max() > 1e-2  # the sampler does not serve the base
    return sampler, worst_sampled, worst_prompt


def test_a_trained_adapter_samples_on_sglang_with_the_trained_models_logprobs(served, service) -> None:
    training = service.create_lora_training_client(base_model=served[0]["model"], rank=4).result()
    step(training, 5)
    sampler, *gaps = sampled_gaps(service, served, training)
    worst = max(gaps)
    assert worst <= TOLERANCE, worst
    print(f"largest gap between SGLang's logprobs and the trained model's: {worst:.3g}")

    assert_a_stop_token_ends_greedy_samples(sampler)


def server_calls(folder: Path) -> tuple[int, int]:
    """How many adapters the service's SGLang server loaded and unloaded so far (its access log)."""
    log = "".join(p.read_text() for p in folder.glob("sglang-service-sglang-*.log"))
    return log.count("POST /load_lora_adapter_from_tensors "), log.count("POST /unload_lora_adapter ")


def test_adapters_evicted_as_least_recently_used_come_back_serving_their_own_weights(served, service) -> None:
    """On the service's SGLang server, room for two adapters (`assert_adapters_evicted_least_recently_used`)."""
    training = service.create_lora_training_client(base_model=served[0]["model"], rank=4).result()
    assert_adapters_evicted_least_recently_used(training, lambda: server_calls(served[1]), TOLERANCE)


def test_a_full_fine_tuning_sampler_is_refused_by_name(served, service) -> None:
    """What the SGLang server cannot serve is refused at save_weights_for_sampler; the capabilities name the
    engine."""
    import httpx

    info = served[0]
    answer = httpx.get(f"{info['base_url']}/api/v1/get_server_capabilities", timeout=30,
                       headers={"X-API-Key": Path(info["key_file"]).read_text()})
    assert answer.json()["baton"]["sampling"].startswith("sglang engine")
    training = create_full_training_client(service, served[0]["model"]).result()
    with pytest.raises(tinker.BadRequestError, match="fully fine-tuned model is not supported by baton serve "
                                                      "--engine sglang"):
        training.save_weights_for_sampler("full").result()
    with pytest.raises(tinker.BadRequestError, match="--max-lora-rank 8"):
        service.create_lora_training_client(base_model=served[0]["model"], rank=16).result(
        ).save_weights_for_sampler("big").result()
