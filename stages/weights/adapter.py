"""LoRA adapters as weight versions: what a version of a LoRA run carries, and what engines do with it.

A LoRA learner publishes each version as the adapter alone: the `lora_A` / `lora_B` weights, named as
peft's `get_peft_model_state_dict` names them (`base_model.model.<module>.lora_A.weight`), plus one
reserved entry, `ADAPTER_KEY`, a uint8 tensor holding the msgpack `AdapterSpec`: rank, alpha, target
modules, the fingerprint of the base model it applies to, and optionally a `Probe`. The descriptor
travels inside the version, so every transport moves an adapter exactly like full weights: whole or
not at all, checksummed, in one version (`stages.weights.base`). The version declares itself an adapter
on receipt: the transport's engine side decodes the descriptor once (`as_received`) and hands the
engine an `AdapterVersion`; an engine tells an adapter from full weights by that type alone, never by
tensor names, and a descriptor that does not decode is refused like any version that does not check out.

Invariants an engine keeps (`stages.engines.base`): an adapter is applied to the engine's base model
(the model folder it started from), never on top of an earlier version; one whose base fingerprint,
names or shapes do not fit that model is refused whole; one carrying a `Probe` is served only after
the engine's own teacher-forced logprobs of the probe's tokens equal the learner's within its
tolerance, so an adapter that never reached the engine is refused, never mistaken for staleness.

The helpers here are the one place the adapter's arithmetic lives: `merged_weights` (W + alpha/r B A,
as peft merges), `peft_config` and `write_peft_folder` (a folder `peft.PeftModel.from_pretrained` and
SGLang's `/load_lora_adapter` read).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
import xxhash

ADAPTER_KEY = "lora.adapter"  # the reserved entry of an adapter version: its msgpack AdapterSpec, as uint8
PEFT_PREFIX = "base_model.model."
_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
_FINGERPRINT_BYTES = 1 << 20  # of each weight file's data, from its start and from its end


class AdapterError(ValueError):
    """An adapter version that does not fit (descriptor, names, shapes, base) or failed its probe."""


class Probe(msgspec.Struct, frozen=True):
    """A fixed token sequence and the learner's teacher-forced logprob of each token after the first
    (temperature 1, the adapter applied): what the engine must reproduce within `tolerance`
    (`Probe.difference`)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    tolerance: float

    def difference(self, served: list[float] | tuple[float, ...]) -> float:
        """The largest difference between the engine's logprobs and the learner's, relative beyond 1 in size
        (|a - b| / max(1, |b|)): a trained adapter gives some probe tokens logprobs of -20 and below, where
        float32 rounding alone (a merged weight against peft's two matmuls) exceeds 1e-4 absolute."""
        if len(served) != len(self.logprobs):
            return float("inf")
        return max((abs(a - b) / max(1.0, abs(b)) for a, b in zip(served, self.logprobs, strict=True)), default=0.0)


class AdapterSpec(msgspec.Struct, frozen=True):
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base: str  # `base_fingerprint` of the model folder the adapter applies to
    probe: Probe | None = None

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def pack_adapter(spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The version a LoRA learner publishes: the adapter's tensors and the descriptor under ADAPTER_KEY."""
    blob = msgspec.msgpack.encode(spec)
    return {**tensors, ADAPTER_KEY: torch.frombuffer(bytearray(blob), dtype=torch.uint8)}


def unpack_adapter(tensors: dict[str, torch.Tensor]) -> tuple[AdapterSpec, dict[str, torch.Tensor]] | None:
    """(descriptor, adapter tensors) of an adapter version; None for full weights. AdapterError when the
    descriptor does not decode."""
    if ADAPTER_KEY not in tensors:
        return None
    raw = tensors[ADAPTER_KEY]
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise AdapterError(f"{ADAPTER_KEY} must be a 1-D uint8 tensor, got {raw.dtype} of shape {tuple(raw.shape)}")
    try:
        spec = msgspec.msgpack.decode(raw.cpu().numpy().tobytes(), type=AdapterSpec)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise AdapterError(f"the adapter's descriptor does not decode: {exc}") from None
    return spec, {n: t for n, t in tensors.items() if n != ADAPTER_KEY}


@dataclass(frozen=True)
class AdapterVersion:
    """A received adapter version: its decoded descriptor and its LoRA tensors (the reserved entry left
    out). Made once per version on receipt (`as_received`); what an engine gets in place of full weights."""

    spec: AdapterSpec
    tensors: dict[str, torch.Tensor]


def as_received(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | AdapterVersion:
    """What an engine is handed for a version that arrived as `tensors`: an `AdapterVersion` when it holds
    the descriptor (decoded here), else `tensors` themselves. AdapterError when the descriptor does not decode."""
    adapter = unpack_adapter(tensors)
    return tensors if adapter is None else AdapterVersion(*adapter)


def base_weight_name(adapter_name: str) -> tuple[str, str]:
    """(`<module>.weight`, "A" or "B") for a peft adapter tensor name; AdapterError for any other name."""
    match = _NAME.match(adapter_name)
    if match is None:
        raise AdapterError(f"{adapter_name!r} is not a LoRA weight (expected {PEFT_PREFIX}<module>.lora_A.weight "
                           "or .lora_B.weight)")
    return f"{match['module']}.weight", match["part"]


def adapter_pairs(spec: AdapterSpec, tensors: dict[str, torch.Tensor],
                  shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Base weight name -> (A, B) for every adapted module, checked against the base's weight `shapes`:
    each module a target, A of shape [rank, in] and B [out, rank] for a base weight [out, in], both
    present. AdapterError naming what does not fit."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        weight, part = base_weight_name(name)
        parts.setdefault(weight, {})[part] = tensor
    if "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:  # a tied head: the embedding's
        shapes = {**shapes, "lm_head.weight": shapes["model.embed_tokens.weight"]}
    problems = []
    for weight, ab in parts.items():
        leaf = weight.rsplit(".", 2)[-2]
        if weight not in shapes:
            problems.append(f"{weight} is not a weight of the base model")
        elif leaf not in spec.target_modules:
            problems.append(f"{weight}: {leaf} is not among the adapter's target modules {list(spec.target_modules)}")
        elif set(ab) != {"A", "B"}:
            problems.append(f"{weight} has no lora_{'B' if 'A' in ab else 'A'}")
        else:
            out, fan_in = shapes[weight]
            want = {"A": (spec.rank, fan_in), "B": (out, spec.rank)}
            problems += [f"{weight} lora_{p} has shape {tuple(ab[p].shape)}, expected {want[p]}"
                         for p in "AB" if tuple(ab[p].shape) != want[p]]
    if not parts:
        problems.append("the adapter holds no LoRA weights")
    if problems:
        raise AdapterError(f"adapter does not fit the base model: {'; '.join(problems[:5])}")
    return {weight: (ab["A"], ab["B"]) for weight, ab in parts.items()}


def merged_weights(base: dict[str, torch.Tensor], spec: AdapterSpec,
                   pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each adapted weight merged as peft merges it, W + (alpha / r) B A, computed in float32 and returned
    in W's dtype and device (new tensors; `base` is left as it is)."""
    out = {}
    for weight, (a, b) in pairs.items():
        w = base[weight]
        delta = (b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)) * spec.scaling
        out[weight] = (w.float() + delta).to(w.dtype)
    return out


def base_fingerprint(folder: str | Path) -> str:
    """A cheap identity of a model folder's weights: xxh3 of config.json and, per safetensors file, its
    name, size, header and the first and last MiB of its data. Two folders with the same files match,
    wherever they are."""
    folder = Path(folder)
    h = xxhash.xxh3_64()
    config = folder / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for file in sorted(folder.glob("*.safetensors")):
        size = file.stat().st_size
        h.update(file.name.encode())
        h.update(size.to_bytes(8, "little"))
        with open(file, "rb") as f:
            h.update(f.read(_FINGERPRINT_BYTES))
            f.seek(max(0, size - _FINGERPRINT_BYTES))
            h.update(f.read(_FINGERPRINT_BYTES))
    return f"{folder.name}:{h.hexdigest()}"


def weight_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Every weight's name and shape in a model folder's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def peft_config(spec: AdapterSpec, base_path: str | Path | None = None) -> dict:
    """The adapter's `adapter_config.json`, as peft writes it for a plain LoRA."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
        "target_modules": list(spec.target_modules), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "base_model_name_or_path": str(base_path) if base_path is not None else None, "inference_mode": True,
    }


def write_peft_folder(folder: str | Path, spec: AdapterSpec, tensors: dict[str, torch.Tensor],
                      base_path: str | Path | None = None) -> Path:
    """The adapter as a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`), written into a
    temporary sibling and renamed into place: a reader sees the whole adapter or no folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items() if n != ADAPTER_KEY},
              staging / "adapter_model.safetensors")
    (staging / "adapter_config.json").write_text(json.dumps(peft_config(spec, base_path), indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder
