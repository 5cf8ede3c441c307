"""Mixture-of-experts tensors between a learner and an inference server: expert names and layouts, and
the routed experts the server returns. Pure functions, no HTTP, no sglang import.

Expert weights come in two layouts:
* **fused** (transformers 5 in memory, what a learner's `state_dict()` holds): per MoE layer
  `<p>.mlp.experts.gate_up_proj` [E, 2I, H] (each expert's gate rows first, then its up rows) and
  `<p>.mlp.experts.down_proj` [E, H, I];
* **per expert** (what `save_pretrained` writes and what SGLang's and vLLM's loaders take):
  `<p>.mlp.experts.{e}.gate_proj.weight` [I, H], `...up_proj.weight` [I, H], `...down_proj.weight` [H, I].

`per_expert_tensors` and `fused_tensors` convert between them, exact inverses of each other (views, no
arithmetic), and leave every other tensor as it is. SGLang's loader silently skips the fused names while
answering "Success" (the experts stay stale), so an engine sends per-expert names always. The names and
patterns are the transfer plan's (`stages.weights.reshard.experts`), whose per-expert engine layout
names exactly these tensors.

Routed experts: SGLang returns, per request, base64 int32 [prompt + generated - 1, layers, top_k]: row j is
the routing of position j (the last token is never forwarded). `completion_routes` keeps the rows whose
logits sampled each generated token (row i = position prompt - 1 + i), the torch engine's alignment.
"""

from __future__ import annotations

import base64

import numpy as np
import torch

from stages.data.routing import MoELayout
from stages.weights.reshard.experts import FUSED_EXPERTS as FUSED
from stages.weights.reshard.experts import PER_EXPERT, expert_name


def per_expert_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with every fused expert tensor split into per-expert ones (see the module docstring);
    names already per expert, and every non-expert tensor, pass unchanged. ValueError for a fused
    gate_up whose rows do not split in two."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = FUSED.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, part = match["prefix"], match["part"]
        if tensor.dim() != 3:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; a fused expert tensor is [experts, out, in]")
        if part == "gate_up_proj":
            if tensor.shape[1] % 2:
                raise ValueError(f"{name} has {tensor.shape[1]} rows per expert: gate and up rows do not split")
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[expert_name(prefix, e, "gate_proj")] = gate[e]
                out[expert_name(prefix, e, "up_proj")] = up[e]
        else:
            for e in range(tensor.shape[0]):
                out[expert_name(prefix, e, "down_proj")] = tensor[e]
    return out


def fused_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `per_expert_tensors`: per-expert tensors stacked into the fused layout (a layer's
    experts must be 0..E-1, each with gate, up and down: else ValueError); every other tensor unchanged."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        match = PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
        else:
            experts.setdefault(match["prefix"], {}).setdefault(int(match["e"]), {})[match["part"]] = tensor
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        if ids != list(range(len(ids))):
            raise ValueError(f"{prefix}: experts {ids} are not 0..{len(ids) - 1}")
        missing = [f"{prefix}.{e}.{p}" for e in ids for p in ("gate_proj", "up_proj", "down_proj")
                   if p not in by_expert[e]]
        if missing:
            raise ValueError(f"{prefix}: missing {missing[:3]}")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]], dim=0) for e in ids])
        out[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in ids])
    return out


def has_fused_experts(tensors: dict[str, torch.Tensor]) -> bool:
    return any(FUSED.match(name) for name in tensors)


def decode_routes(encoded: str, layout: MoELayout) -> np.ndarray:
    """SGLang's `meta_info.routed_experts` (base64 int32) as [positions, moe layers, top_k] in the layout's
    id type. The server reports every decoder layer or only the MoE ones; either way the MoE layers are kept.
    ValueError when the length fits neither."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    moe, k = len(layout.layers), layout.top_k
    total = max(layout.layers) + 1
    for width, keep in ((total, list(layout.layers)), (moe, list(range(moe)))):
        if flat.size % (width * k) == 0:
            routes = flat.reshape(-1, width, k)[:, keep]
            if routes.size and (routes.min() < 0 or routes.max() >= layout.experts):
                raise ValueError(f"routed experts outside 0..{layout.experts - 1}")
            return routes.astype(layout.id_dtype)
    raise ValueError(f"{flat.size} routed expert ids do not fit [positions, {total} or {moe} layers, top_k {k}]")


def completion_routes(routes: np.ndarray, prompt_tokens: int, generated: int) -> np.ndarray:
    """Row i: the routing of the position whose logits sampled generated token i (position prompt - 1 + i),
    [generated, moe layers, top_k]. ValueError when the server returned too few positions."""
    start = prompt_tokens - 1
    if generated and routes.shape[0] < start + generated:
        raise ValueError(f"{routes.shape[0]} routed positions for {prompt_tokens} prompt and {generated} "
                         f"generated tokens (need {start + generated})")
    return np.ascontiguousarray(routes[start : start + generated])


def served_routes(meta: dict, layout: MoELayout, generated: int) -> np.ndarray:
    """The routed experts of a `/generate` answer's `meta_info`, one row per generated token
    (`completion_routes`); ValueError when the server sent none (an attached server needs
    --enable-return-routed-experts) or they do not fit."""
    if not meta.get("routed_experts"):
        raise ValueError("the server returned none (a server needs --enable-return-routed-experts)")
    return completion_routes(decode_routes(meta["routed_experts"], layout), int(meta["prompt_tokens"]), generated)
