"""LoRA on the learner: `LoraSpec` (the `[learner] lora` table), the peft wrapping, and what a version
of a LoRA run publishes.

With `GRPOLearner(lora=LoraSpec(...))` the loaded model is wrapped with peft (`get_peft_model`) before
it is sharded: the base is frozen, only the `lora_A` / `lora_B` weights train and the optimizer holds
only them (stages.learner.step). Each version publishes the adapter alone
(`stages.weights.adapter`: peft's names plus the descriptor), gathered whole on rank 0 with
`full_tensor()` when the learner has several ranks (an adapter is small; the sharded mooncake push
carries full weights only, so a LoRA learner always takes this gather path). Every `check_every`
versions the descriptor carries a `Probe`: the learner's own logprobs of a fixed token sequence, which
each engine must reproduce before it serves the version. Checkpoints hold the adapter and its
optimizer state only; the base is the model folder (stages.learner.state).

On a mixture-of-experts model the default targets are the attention's projections (never the router);
`target_experts = True` adds the experts through peft's `target_parameters` (`EXPERT_PARAMETERS`, the
fused [E, out, in] tensors transformers 5 keeps in memory): each expert gets its own rank-r factors,
peft adds B_e A_e to the expert's weight for the forward (a parametrization: no hand-written LoRA
here). peft's `ParamWrapper` takes no dropout, so `target_experts` needs `dropout = 0`. The published
adapter names each expert parameter's factors by the parameter (`stages.weights.adapter`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from stages.weights.adapter import AdapterSpec, Probe, base_fingerprint, from_peft_names, pack_adapter

# peft's target_parameters for a mixture-of-experts model's fused experts (transformers 5: Qwen2/3-MoE, OLMoE,
# Mixtral, ...), in the order the experts module registers them (peft nests its wrappers in that order)
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
PROBE_TOKENS = 16  # tokens of the parity probe a version's descriptor carries
INIT_SEED = 0  # lora_A's random init: the same on every rank, as FSDP's shards of one tensor must be


@dataclass(frozen=True)
class LoraSpec:
    """`[learner] lora = { rank = 8, alpha = 16, dropout = 0.0, target_modules = [...], target_experts = false }`."""

    rank: int = 8
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input, in training only
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # module names (their last part)
    check_every: int = 1  # versions between engine parity checks (the descriptor's probe); 0: never
    check_tolerance: float = 1e-4  # most a probe's logprob may differ, relative beyond 1 (bf16 engines: ~0.05)
    target_experts: bool = False  # MoE models: adapt the experts too (EXPERT_PARAMETERS), not the attention alone

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"learner.lora.rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"learner.lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"learner.lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("learner.lora.target_modules is empty; name the modules to adapt, e.g. "
                             "['q_proj', 'v_proj']")
        if self.check_every < 0:
            raise ValueError(f"learner.lora.check_every must be >= 0, got {self.check_every}")
        if self.check_tolerance <= 0:
            raise ValueError(f"learner.lora.check_tolerance must be > 0, got {self.check_tolerance}")
        if self.target_experts and self.dropout:
            raise ValueError(f"learner.lora.target_experts = true needs learner.lora.dropout = 0 (peft adapts the "
                             f"fused experts without dropout), got dropout = {self.dropout}; set dropout = 0")

    @property
    def target_parameters(self) -> tuple[str, ...]:
        """peft's `target_parameters`: the fused experts with `target_experts`, else none."""
        return EXPERT_PARAMETERS if self.target_experts else ()

    def descriptor(self, base: str, probe: Probe | None = None) -> AdapterSpec:
        """The `AdapterSpec` of an adapter of these settings on the model folder of fingerprint `base`."""
        return AdapterSpec(self.rank, float(self.alpha), tuple(self.target_modules), base, probe,
                           self.target_parameters)


def check_targets(targets: tuple[str, ...] | list[str], linear: list[str]) -> None:
    """ValueError naming `learner.lora.target_modules` unless every target is one of the model's `linear`
    module names (their last parts; `lm_head` too, also when tied to the embedding)."""
    unknown = [m for m in targets if m not in linear]
    if unknown:
        raise ValueError(f"learner.lora.target_modules names {unknown}, not among the model's linear modules {linear}")


def check_expert_targets(spec: LoraSpec, parameter_names: list[str]) -> None:
    """ValueError naming `learner.lora.target_experts` when it is set and the model (its parameters' names)
    has no fused experts to adapt."""
    if spec.target_experts and not any(n.endswith(f".{t}") for n in parameter_names for t in spec.target_parameters):
        raise ValueError(f"learner.lora.target_experts = true, but the model has no fused experts "
                         f"({', '.join(spec.target_parameters)}): it is not a mixture of experts transformers 5 "
                         "fuses; set target_experts = false")


def wrap(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """`model` with LoRA adapters on `spec.target_modules` and `spec.target_parameters` (peft), its base
    frozen (`check_targets`, `check_expert_targets` first)."""
    from peft import LoraConfig, get_peft_model

    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    check_targets(spec.target_modules, sorted(linear))
    check_expert_targets(spec, [n for n, _ in model.named_parameters()])
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=list(spec.target_modules), bias="none",
                        target_parameters=list(spec.target_parameters) or None)
    with torch.random.fork_rng(), warnings.catch_warnings():  # every rank (and every run) starts from one adapter
        torch.manual_seed(INIT_SEED)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        # an adapter on a tied lm_head adapts the head alone (the embedding stays), as every engine applies it
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings=True.*", category=UserWarning)
        wrapped = get_peft_model(model, config)
    _check_parameter_names(wrapped, spec)
    return wrapped


def _check_parameter_names(model: torch.nn.Module, spec: LoraSpec) -> None:
    """The names `from_peft_names` gives each parameter target's factors are the parameters peft's wrappers
    adapt (the nesting order it relies on holds for this model); RuntimeError otherwise."""
    from peft.tuners.lora.layer import ParamWrapper

    descriptor = spec.descriptor("")
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            peft_name = f"{name}.lora_A.weight"  # name: base_model.model.<experts module>(.base_layer)*
            got = next(iter(from_peft_names(descriptor, {peft_name: torch.empty(0)})))
            want = f"{name.replace('.base_layer', '')}.{module.parameter_name}.lora_A.weight"
            if got != want:
                raise RuntimeError(f"peft wraps {want} as {peft_name}, which the adapter would name {got}")


def is_peft(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The trainable (adapter) parameters by name (peft's `lora_A.default` naming)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def gathered_adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights whole, in host memory, named as peft's `get_peft_model_state_dict` names them
    (`stages.weights.adapter.from_peft_names` names a parameter target's by the parameter; a collective with
    several ranks: every rank gathers; each rank gets the whole adapter)."""
    from peft import get_peft_model_state_dict
    from torch.distributed.tensor import DTensor

    whole = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
             for n, p in adapter_parameters(model).items()}
    return get_peft_model_state_dict(model, state_dict=whole, save_embedding_layers=False)


def probe_tokens(vocab_size: int) -> list[int]:
    """A fixed token sequence every id of which the model has (the probe of every version)."""
    return [(3 + 7 * i) % vocab_size for i in range(PROBE_TOKENS)]


def probe(model: torch.nn.Module, device: torch.device, tolerance: float) -> Probe:
    """The model's teacher-forced logprobs of `probe_tokens` (eval mode: no dropout; a collective forward
    with several ranks)."""
    tokens = probe_tokens(model.config.vocab_size)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ids = torch.tensor([tokens], device=device)
            logits = model(input_ids=ids).logits[0, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None]).squeeze(1)
    finally:
        model.train(was_training)
    return Probe(tuple(tokens), tuple(float(x) for x in logp.cpu()), tolerance)


@dataclass
class AdapterPublisher:
    """What a LoRA learner publishes per version (see the module docstring); `base` is the model folder."""

    spec: LoraSpec
    base: Path

    def __post_init__(self) -> None:
        self.fingerprint = base_fingerprint(self.base)

    def version(self, model: torch.nn.Module, device: torch.device, version: int) -> dict[str, torch.Tensor]:
        """The adapter of `version` with its descriptor (a probe when `version` is a multiple of
        `check_every`). A collective with several ranks."""
        spec = self.spec
        checked = spec.check_every > 0 and version % spec.check_every == 0
        descriptor = spec.descriptor(self.fingerprint, probe(model, device, spec.check_tolerance) if checked else None)
        return pack_adapter(descriptor, from_peft_names(descriptor, gathered_adapter(model)))


__all__ = ["EXPERT_PARAMETERS", "AdapterPublisher", "LoraSpec", "check_expert_targets", "check_targets",
           "gathered_adapter", "probe", "wrap"]
