"""Is a full-weight version really in the server? `WeightProbe` answers by what the server computes.

A server's "Success" does not say its weights changed: SGLang's loader skips names it does not know
(a fused expert tensor, for one) and still answers 200. So after each full-weight version lands, the
engine asks the server for its teacher-forced logprobs of a fixed token sequence (the probe, as a LoRA
adapter's landed check does: `stages.engines.sglang_lora`) and compares them with what the same weights
give in a torch forward of the model folder's architecture in the server's precision, run here on CPU with the
tensors the engine was handed (a bfloat16 server against a bfloat16 forward: on the tiny MoE a float32 forward
differed from vLLM's bfloat16 server by up to 0.092 after a push, a bfloat16 one by 0.0075). They must agree
within `tolerance`, relative beyond 1 (`stages.weights.adapter.Probe`'s measure); else the version is refused
(`PushMismatch`).

Every full-weight version is probed, dense or mixture-of-experts, and the folder's own weights at start
(version 0). In float32 the server and the reference agree to 1e-7 (the bound is 1e-5); in bfloat16 the bound
is `LOW_PRECISION_TOLERANCE`, measured. The reference model is built once per engine from the folder's config
(no weights read) and gets each version's tensors by `load_state_dict`, fused or per-expert names alike. It
costs one CPU copy of the model and a CPU forward of PROBE_LENGTH tokens per version: meant for models
that fit in host memory twice; set the engine's `probe_tolerance = None` for a large one. (The learner could
compute the expected logprobs instead, as a LoRA learner does for its adapters; for full weights that would
put a forward per version inside the learner's training loop, collective under FSDP and in the learner's own
precision, and a probe key through every weight transport: not done, see docs/guides/sglang.md.)
"""

from __future__ import annotations

from pathlib import Path

import torch

from stages.engines.base import EngineError
from stages.engines.sglang_moe import fused_tensors
from stages.weights.adapter import Probe

PROBE_LENGTH = 24
# The bound in precisions below float32 (relative beyond 1): the server's bfloat16 kernels and a float32 torch
# forward of the same weights differ by up to 0.6e-2 on the tiny Qwen2 and a bfloat16 torch forward no closer
# (docs/guides/sglang.md); a push that did not land differs by far more (0.23 after a few steps, 1 and beyond
# for a whole model left stale), a single step's change in a large model may not.
LOW_PRECISION_TOLERANCE = 1e-1


def dtype_tolerance(tolerance: float, dtype: str) -> float:
    """The probe's bound for a server in `dtype`: `tolerance` in float32, at least LOW_PRECISION_TOLERANCE below."""
    return tolerance if dtype == "float32" else max(tolerance, LOW_PRECISION_TOLERANCE)


class PushMismatch(EngineError):
    """The server's logprobs after a version landed differ from what the version's weights give."""


class WeightProbe:
    """The probe's tokens and the reference logprobs of a version (see the module docstring)."""

    def __init__(self, model_path: str | Path, dtype: str = "float32") -> None:
        """`dtype`: the server's precision; the reference forward runs in it ('auto' and 'float32': float32)."""
        from transformers import AutoConfig

        self.model_path = Path(model_path)
        config = AutoConfig.from_pretrained(self.model_path)
        vocab = int(config.vocab_size)
        # a fixed sequence spread over the vocabulary (the same for every version and every run)
        self.tokens = tuple((1 + 7919 * i) % vocab for i in range(PROBE_LENGTH))
        self._config = config
        self._dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float16 if dtype == "float16" else torch.float32
        self._model: torch.nn.Module | None = None

    def expected(self, tensors: dict[str, torch.Tensor], tolerance: float) -> Probe:
        """The probe with the logprobs `tensors` give (a forward on CPU in the server's precision), to be met within
        `tolerance`."""
        model = self._reference()
        own = model.state_dict()
        given = {n: t for n, t in fused_tensors(dict(tensors)).items() if n in own}
        missing = [n for n in own if n not in given and n != "lm_head.weight"]
        if missing:
            raise PushMismatch(f"the version has no {missing[:3]}: the probe cannot check it")
        with torch.no_grad():
            model.load_state_dict({n: t.detach().to("cpu", self._dtype) for n, t in given.items()}, strict=False)
            if getattr(self._config, "tie_word_embeddings", False):
                model.tie_weights()
            ids = torch.tensor([self.tokens])
            logits = model(input_ids=ids).logits[0, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        return Probe(self.tokens, tuple(float(x) for x in logp), tolerance)

    def _reference(self) -> torch.nn.Module:
        if self._model is None:
            from transformers import AutoModelForCausalLM

            kwargs = {"experts_implementation": "eager"} if getattr(self._config, "num_experts", 0) else {}
            self._model = AutoModelForCausalLM.from_config(self._config, dtype=self._dtype,
                                                           attn_implementation="eager", **kwargs).eval()
        return self._model

    def request(self, version: int) -> dict:
        """The `/generate` body that asks the server for its logprobs of the probe's tokens."""
        return {"input_ids": list(self.tokens), "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
                "return_logprob": True, "logprob_start_len": 0, "extra_key": f"probe-v{version}"}

    def check(self, version: int, expected: Probe, answer: dict) -> float:
        """The difference between the server's answer and `expected`; PushMismatch beyond the tolerance."""
        served = [lp for lp, *_ in answer["meta_info"]["input_token_logprobs"][1:]]
        diff = expected.difference(served)
        if diff > expected.tolerance:
            raise PushMismatch(f"version {version} is not what the server computes: its probe logprobs differ from "
                               f"the version's weights by {diff:.3g} (tolerance {expected.tolerance:g})")
        return diff


def checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape in the checkpoint's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if not shapes:
        raise EngineError(f"no *.safetensors weights in {folder}")
    return shapes


def folder_version(folder: Path) -> dict[str, torch.Tensor] | None:
    """The checkpoint's own weights (version 0), a tied head included as `lm_head.weight`; None for a folder
    with no config or weights (nothing to check a server against)."""
    from safetensors.torch import load_file

    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        return None
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    if untied_head(folder):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


def untied_head(folder: Path) -> bool:
    """The folder ties the head to the embedding and stores no `lm_head.weight`."""
    import json

    config = json.loads((folder / "config.json").read_text())
    return bool(config.get("tie_word_embeddings")) and "lm_head.weight" not in checkpoint_shapes(folder)
