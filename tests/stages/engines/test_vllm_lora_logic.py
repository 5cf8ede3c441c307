"""LoRA on the vLLM engine without a server: the launch flags, the folder check that refuses a damaged adapter
before the server is asked to load it, the versions of a request under an adapter, and `baton check` refusing
what vLLM cannot serve (the tied head, a mixture of experts' experts, a rank above 512, too few slots)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from baton.config import ConfigError, load_toml, validate
from baton.schema import RunConfig
from baton.sections.base import BuildContext
from stages.data.model import make_tiny_model
from stages.engines.base import SamplingParams
from stages.engines.sglang_lora import LoraServing
from stages.engines.vllm import VLLMEngine
from stages.engines.vllm_lora import SERVER_ENV, launch_args, tensor_digests, verify_folder
from stages.engines.vllm_protocol import completion_of
from stages.engines.vllm_server import VLLMServer
from stages.weights.adapter import AdapterError, to_peft_names, unpack_adapter, write_peft_folder
from tests.helpers.lora import LINEAR_TARGETS, adapter_version, peft_policy
from tests.stages.engines.test_vllm_logic import ATTACHED, ROOT, answer


def test_the_server_is_launched_with_room_for_the_window_at_a_rank_vllm_takes(tmp_path: Path) -> None:
    args = launch_args(LoraServing(max_rank=4, target_modules=("q_proj",), max_loaded=5))
    assert args[args.index("--max-lora-rank") + 1] == "8"  # vLLM takes 1, 8, 16, ...: the next one up
    assert args[args.index("--max-loras") + 1] == "5" and args[args.index("--max-cpu-loras") + 1] == "5"
    assert "--enable-lora" in args
    assert launch_args(LoraServing(max_rank=16, target_modules=("q_proj",)))[-1] == "16"
    env = VLLMServer(tmp_path, python="/bin/sh", env=SERVER_ENV).environment()
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"  # opens /v1/load_lora_adapter


def test_an_engine_asked_to_serve_adapters_on_the_head_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"not on \['lm_head'\].*learner.lora.target_modules"):
        VLLMEngine(tmp_path, lora=LoraServing(max_rank=8, target_modules=("q_proj", "lm_head")))


def test_a_damaged_adapter_folder_is_refused_before_loading(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", heads=2, kv_heads=1)
    spec, tensors = unpack_adapter(adapter_version(peft_policy(model, 1, targets=LINEAR_TARGETS), model,
                                                   probe=False))
    digests = tensor_digests(to_peft_names(spec, tensors))
    folder = write_peft_folder(tmp_path / "policy-v1", spec, tensors)
    verify_folder(folder, digests)  # as written: it reads back whole
    weights = folder / "adapter_model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-3] ^= 0xFF  # one byte of the last tensor's data
    weights.write_bytes(bytes(raw))
    with pytest.raises(AdapterError, match="fails its checksum"):
        verify_folder(folder, digests)
    with pytest.raises(AdapterError, match="missing"):
        verify_folder(write_peft_folder(tmp_path / "v2", spec, dict(list(tensors.items())[1:])), digests)
    weights.write_bytes(bytes(raw[:100]))  # cut short
    with pytest.raises(AdapterError, match="does not read back"):
        verify_folder(folder, digests)
    assert tensor_digests({"a": torch.ones(2)}) != tensor_digests({"a": torch.zeros(2)})


def test_a_request_under_an_adapter_is_the_adapters_version_throughout() -> None:
    spans = [{"version": "0", "start": 0, "end": 3}]  # the base's label: the adapter's tokens are not its
    c = completion_of(answer([5, 6, 7], [-1, -1, -1], spans=spans), 4, SamplingParams(3), spans=False)
    assert c.versions.tolist() == [4, 4, 4]


def lora_config(tmp_path: Path, **lora) -> dict:
    data = load_toml(ROOT / "configs" / "vllm-cpu.toml")
    data["model"]["path"] = str(tmp_path / "hd32")
    data["engine"]["urls"] = ATTACHED  # attached: no vLLM environment needed to validate
    data["learner"]["lora"] = {"rank": 4, "target_modules": ["q_proj", "v_proj"], **lora}
    return data


def refused(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate(RunConfig, data)
    return str(info.value)


def test_baton_check_refuses_what_vllm_cannot_serve(tmp_path: Path) -> None:
    cfg = validate(RunConfig, lora_config(tmp_path))
    ctx = BuildContext(seed=0, dtype="float32", k=2, runtime="local", name="t", model=tmp_path,
                       lora=cfg.learner.lora.spec())
    engine = cfg.engine.make(ctx)
    assert engine.lora == LoraServing(max_rank=4, target_modules=("q_proj", "v_proj"), max_loaded=4)  # k + 2
    message = refused(lora_config(tmp_path, target_modules=["q_proj", "lm_head"]))
    assert "learner.lora.target_modules" in message and "not on ['lm_head']" in message
    assert "above the vLLM server's --max-lora-rank 512" in refused(lora_config(tmp_path, rank=1024))
    few = lora_config(tmp_path)
    few["engine"]["max_loaded_loras"] = 3
    assert "engine.max_loaded_loras = 3, but staleness.k = 2" in refused(few)


def test_target_experts_with_vllm_is_refused(tmp_path: Path) -> None:
    data = load_toml(ROOT / "configs" / "quickstart-moe.toml")
    data["model"]["path"] = str(tmp_path / "moe")
    data["learner"].update(lora={"rank": 4, "target_experts": True}, routing_replay="off")
    data["engine"] = {"kind": "vllm", "urls": ATTACHED}
    message = refused(data)
    assert "learner.lora.target_experts = true: vLLM's CPU LoRA has no kernel" in message
    assert "engine.kind = 'torch'" in message
