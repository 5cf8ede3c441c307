"""LoRA adapters as weight versions: what a version of a LoRA run carries, and what engines do with it.

A LoRA learner publishes each version as the adapter alone: the `lora_A` / `lora_B` weights, named as
peft's `get_peft_model_state_dict` names them (`base_model.model.<module>.lora_A.weight`), plus one
reserved entry, `ADAPTER_KEY`, a uint8 tensor holding the msgpack `AdapterSpec`: rank, alpha, target
modules and target parameters, the fingerprint of the base model it applies to, and optionally a `Probe`.
The descriptor travels inside the version, so every transport moves an adapter exactly like full
weights: whole or not at all, checksummed, in one version (`stages.weights.base`). The version
declares itself an adapter on receipt: the transport's engine side decodes the descriptor once
(`as_received`) and hands the engine an `AdapterVersion`; an engine tells an adapter from full weights
by that type alone, never by tensor names, and a descriptor that does not decode is refused like any
version that does not check out.

Parameter targets (peft's `target_parameters`: a mixture-of-experts model's fused expert tensors
`mlp.experts.gate_up_proj` [E, out, in] and `mlp.experts.down_proj`) travel under the parameter's own
name, `base_model.model.<parameter>.lora_A.weight` with A [E * r, in] and B [out, E * r] (expert e's
factors are A's rows e*r..e*r+r and B's columns e, e+E, ...: peft's layout), so every name says which
weight it adapts. peft itself names them by how it nests its wrappers on the experts module (the first
target parameter innermost: `experts.base_layer.lora_A`, the last `experts.lora_A`); `from_peft_names`
and `to_peft_names` convert, and a PEFT folder is written with peft's names.

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
    # peft's target_parameters, in the order their module registers them (e.g. "mlp.experts.gate_up_proj",
    # "mlp.experts.down_proj"): weights of 3 dimensions [experts, out, in], each expert its own rank-r factors
    target_parameters: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def parameter_target(self, module: str) -> str | None:
        """The target parameter `module` (a dotted path, e.g. `model.layers.0.mlp.experts.down_proj`) names, or None."""
        return next((t for t in self.target_parameters if module == t or module.endswith(f".{t}")), None)


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


def base_weight_name(adapter_name: str, spec: AdapterSpec | None = None) -> tuple[str, str]:
    """(the base weight an adapter tensor adapts, "A" or "B"): `<module>.weight`, or for a parameter target of
    `spec` the parameter itself. AdapterError for any other name."""
    match = _NAME.match(adapter_name)
    if match is None:
        raise AdapterError(f"{adapter_name!r} is not a LoRA weight (expected {PEFT_PREFIX}<module>.lora_A.weight "
                           "or .lora_B.weight)")
    module = match["module"]
    if spec is not None and spec.parameter_target(module) is not None:
        return module, match["part"]
    return f"{module}.weight", match["part"]


def _expected_shapes(spec: AdapterSpec, weight: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]] | str:
    """{"A": shape, "B": shape} the factors of `weight` (of `shape`) must have, or what does not fit."""
    if spec.parameter_target(weight) is not None:
        if len(shape) != 3:
            return f"{weight} has shape {shape}; a target parameter must be [experts, out, in]"
        experts, out, fan_in = shape
        return {"A": (experts * spec.rank, fan_in), "B": (out, experts * spec.rank)}
    leaf = weight.rsplit(".", 2)[-2]
    if leaf not in spec.target_modules:
        return f"{weight}: {leaf} is not among the adapter's target modules {list(spec.target_modules)}"
    out, fan_in = shape
    return {"A": (spec.rank, fan_in), "B": (out, spec.rank)}


def adapter_pairs(spec: AdapterSpec, tensors: dict[str, torch.Tensor],
                  shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Base weight name -> (A, B) for every adapted weight, checked against the base's weight `shapes`:
    each a target, A of shape [rank, in] and B [out, rank] for a base weight [out, in] (for a target
    parameter [E, out, in]: A [E * rank, in], B [out, E * rank]), both present. AdapterError naming what
    does not fit."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        weight, part = base_weight_name(name, spec)
        parts.setdefault(weight, {})[part] = tensor
    if "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:  # a tied head: the embedding's
        shapes = {**shapes, "lm_head.weight": shapes["model.embed_tokens.weight"]}
    problems = []
    for weight, ab in parts.items():
        want = _expected_shapes(spec, weight, tuple(shapes[weight])) if weight in shapes else \
            f"{weight} is not a weight of the base model"
        if isinstance(want, str):
            problems.append(want)
        elif set(ab) != {"A", "B"}:
            problems.append(f"{weight} has no lora_{'B' if 'A' in ab else 'A'}")
        else:
            problems += [f"{weight} lora_{p} has shape {tuple(ab[p].shape)}, expected {want[p]}"
                         for p in "AB" if tuple(ab[p].shape) != want[p]]
    if not parts:
        problems.append("the adapter holds no LoRA weights")
    if problems:
        raise AdapterError(f"adapter does not fit the base model: {'; '.join(problems[:5])}")
    return {weight: (ab["A"], ab["B"]) for weight, ab in parts.items()}


def expert_delta(a: torch.Tensor, b: torch.Tensor, experts: int, scaling: float) -> torch.Tensor:
    """(alpha / r) B_e A_e for every expert e of a target parameter, [E, out, in] in float32 (peft's
    `ParamWrapper.get_delta_weight` for a [experts, out, in] parameter)."""
    a = a.float().reshape(experts, -1, a.shape[-1])  # [E, r, in]
    b = b.float().reshape(b.shape[0], -1, experts)  # [out, r, E]
    return torch.einsum("ore,eri->eoi", b, a) * scaling


def merged_weights(base: dict[str, torch.Tensor], spec: AdapterSpec,
                   pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each adapted weight merged as peft merges it, W + (alpha / r) B A (per expert for a target parameter),
    computed in float32 and returned in W's dtype and device (new tensors; `base` is left as it is)."""
    out = {}
    for weight, (a, b) in pairs.items():
        w = base[weight]
        a, b = a.to(w.device), b.to(w.device)
        delta = expert_delta(a, b, w.shape[0], spec.scaling) if w.dim() == 3 else (b.float() @ a.float()) * spec.scaling
        out[weight] = (w.float() + delta).to(w.dtype)
    return out


def _wrapped_on(spec: AdapterSpec, module: str) -> list[str]:
    """The target parameters peft wraps on `module` (a dotted path), in its module's registration order."""
    return [t for t in spec.target_parameters if f".{module}".endswith(f".{t.rpartition('.')[0]}")]


def from_peft_names(spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` named as peft names them, renamed to this module's names (see the module docstring): a
    parameter target's `<experts>(.base_layer)*k.lora_A.weight` becomes `<experts>.<parameter>.lora_A.weight`
    (peft wraps the first of n parameters innermost, so k base layers name parameter n - 1 - k)."""
    if not spec.target_parameters:
        return dict(tensors)
    out = {}
    for name, tensor in tensors.items():
        match = _NAME.match(name)
        module = match["module"] if match is not None else ""
        depth = 0
        while module.endswith(".base_layer"):
            module, depth = module[: -len(".base_layer")], depth + 1
        wrapped = _wrapped_on(spec, module) if match is not None else []
        if not wrapped:
            out[name] = tensor
            continue
        if depth >= len(wrapped):
            raise AdapterError(f"{name!r}: {depth} base layers, but {module} wraps only {wrapped}")
        parameter = wrapped[len(wrapped) - 1 - depth].rpartition(".")[2]
        out[f"{PEFT_PREFIX}{module}.{parameter}.lora_{match['part']}.weight"] = tensor
    return out


def to_peft_names(spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `from_peft_names`: the names a PEFT folder holds."""
    out = {}
    for name, tensor in tensors.items():
        match = _NAME.match(name)
        target = spec.parameter_target(match["module"]) if match is not None else None
        if target is None:
            out[name] = tensor
            continue
        module = match["module"].rpartition(".")[0]
        wrapped = _wrapped_on(spec, module)
        depth = len(wrapped) - 1 - wrapped.index(target)
        out[f"{PEFT_PREFIX}{module}{'.base_layer' * depth}.lora_{match['part']}.weight"] = tensor
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
        **({"target_parameters": list(spec.target_parameters)} if spec.target_parameters else {}),
    }


def write_peft_folder(folder: str | Path, spec: AdapterSpec, tensors: dict[str, torch.Tensor],
                      base_path: str | Path | None = None) -> Path:
    """The adapter as a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`, peft's names), written
    into a temporary sibling and renamed into place: a reader sees the whole adapter or no folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    named = to_peft_names(spec, {n: t for n, t in tensors.items() if n != ADAPTER_KEY})
    save_file({n: t.detach().cpu().contiguous() for n, t in named.items()},
              staging / "adapter_model.safetensors")
    (staging / "adapter_config.json").write_text(json.dumps(peft_config(spec, base_path), indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder
