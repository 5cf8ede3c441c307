"""Expert parallelism in the learner: each rank holds only its own experts of every MoE layer, and the tokens
of every rank travel to the ranks of their experts and back (`learner.expert_parallel`).

`shard_experts` swaps each MoE layer's fused experts module (transformers 5's `mlp.experts`: `gate_up_proj`
[E, 2I, H], `down_proj` [E, H, I], `act_fn`) for a `ShardedExperts` whose two parameters are DTensors on the
learner's one-dimensional mesh placed `Shard(0)`: rank r holds experts [r E/N, (r+1) E/N), under the same
names and the same placement FSDP2 gives its parameters, so the full state dict, DCP checkpoints (any world
size reads them) and gradient clipping treat them as they treat the FSDP-sharded rest. FSDP2 then shards the
dense parts as before and leaves these alone (`expert_params`, its `ignored_params`).

The forward (`dispatch`): every (token, top-k slot) pair is sent to its expert's rank with one autograd-aware
`all_to_all_single`, the rank runs its local experts on what it received (top-1, unit weight), the outputs go
back with a second all-to-all, and the sender weights and sums them per token as transformers' experts do.
Every rank runs every all-to-all of every forward and backward (an empty share still joins: the received
rows always feed the output), as the learner's equal passes per rank guarantee.

Gradients: each rank scales its loss by N for FSDP2's average over ranks (`stages.learner.step`); an expert's
gradient already sums every rank's tokens and is not averaged, so the local weights' gradients are scaled
by 1 / N on the way back (`_ScaleGrad`). The degree equals the world size: every rank is one shard of the
experts (a smaller group replicated over the world is not built).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single


def _exchange(tensor: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
    """Rows of `tensor` to every rank (`send_sizes[r]` to rank r), `recv_sizes[r]` from each; autograd-aware
    (the backward is the reverse exchange)."""
    out = tensor.new_empty(sum(recv_sizes), *tensor.shape[1:])
    with warnings.catch_warnings():  # deprecated for the functional collectives, which still change; gloo runs it
        warnings.filterwarnings("ignore", "torch.distributed.nn.functional.all_to_all_single is deprecated")
        return all_to_all_single(out, tensor, recv_sizes, send_sizes)


class _ScaleGrad(torch.autograd.Function):
    """The identity forward; the gradient times `factor` backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, factor: float) -> torch.Tensor:  # noqa: ANN001 - autograd's ctx
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return grad * ctx.factor, None


class ShardedExperts(torch.nn.Module):
    """One MoE layer's experts, this rank's `E / N` of them (see the module docstring); called as transformers
    calls its experts module: `(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`."""

    def __init__(self, experts: torch.nn.Module, mesh, world_size: int) -> None:  # noqa: ANN001 - a DeviceMesh
        super().__init__()
        from torch.distributed.tensor import DTensor, Shard

        self.num_experts = int(experts.gate_up_proj.shape[0])
        self.world_size, self.act_fn = world_size, experts.act_fn
        self.local_experts = self.num_experts // world_size
        first = dist.get_rank() * self.local_experts
        for name in ("gate_up_proj", "down_proj"):
            local = getattr(experts, name).detach()[first : first + self.local_experts].clone()
            shard = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            setattr(self, name, torch.nn.Parameter(shard, requires_grad=getattr(experts, name).requires_grad))

    def local_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's experts' weights as plain tensors in `dtype`, their gradients scaled by 1 / N."""
        scale = 1.0 / self.world_size
        return tuple(_ScaleGrad.apply(p.to_local(), scale).to(dtype) for p in (self.gate_up_proj, self.down_proj))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        top_k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        send = hidden[order // top_k]
        counts = torch.bincount(flat, minlength=self.num_experts).view(self.world_size, self.local_experts)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts)  # how many rows of each local expert every rank sends
        send_sizes, recv_sizes = counts.sum(1).tolist(), received.sum(1).tolist()
        rows = _exchange(send, send_sizes, recv_sizes)
        local_ids = torch.arange(self.local_experts, device=hidden.device).repeat(self.world_size)
        local_ids = local_ids.repeat_interleave(received.reshape(-1))
        out = self._run_local(rows, local_ids)
        back = _exchange(out, recv_sizes, send_sizes)
        unsorted = torch.empty_like(back).index_copy(0, order, back)
        weighted = unsorted.view(*top_k_weights.shape, -1) * top_k_weights.unsqueeze(-1).to(back.dtype)
        return weighted.sum(1)

    def _run_local(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Each received row through its local expert (top-1, unit weight); the output always depends on
        `rows`, so its all-to-all's backward runs on every rank."""
        gate_up, down = self.local_weights(rows.dtype)
        out = rows * 0
        for expert in torch.unique(local_ids).tolist():
            where = (local_ids == expert).nonzero().squeeze(-1)
            gate, up = torch.nn.functional.linear(rows[where], gate_up[expert]).chunk(2, dim=-1)
            out = out.index_add(0, where, torch.nn.functional.linear(self.act_fn(gate) * up, down[expert]))
        return out


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The `mlp` of every decoder layer whose experts are fused 3D weights (transformers 5's MoE layers)."""
    base = getattr(model, "model", model)
    blocks = [getattr(layer, "mlp", None) for layer in getattr(base, "layers", [])]
    return [b for b in blocks if hasattr(getattr(b, "experts", None), "gate_up_proj")]


def check_expert_parallel(degree: int, num_experts: int, world_size: int) -> None:
    """ValueError naming `learner.expert_parallel` unless `degree` can shard these experts over these ranks."""
    if degree < 1:
        raise ValueError(f"learner.expert_parallel must be at least 1, got {degree}")
    if degree == 1:
        return
    if num_experts == 0:
        raise ValueError(f"learner.expert_parallel = {degree} shards the experts of a mixture-of-experts model, but "
                         "the model is dense: set learner.expert_parallel = 1")
    if num_experts % degree:
        raise ValueError(f"learner.expert_parallel = {degree} must divide the model's {num_experts} experts: set "
                         f"it to a divisor of {num_experts}")
    if degree != world_size:
        raise ValueError(f"learner.expert_parallel = {degree} must equal learner.world_size = {world_size} (each rank "
                         "holds one shard of the experts; smaller expert groups are not supported): set both to "
                         "the same number, or learner.expert_parallel = 1")


def shard_experts(model: torch.nn.Module, mesh, degree: int) -> list[torch.nn.Parameter]:  # noqa: ANN001
    """Swap every MoE layer's experts for this rank's shard of them (a collective-free swap: each rank slices
    the weights it loaded); the new expert parameters, for FSDP2's `ignored_params`."""
    world = dist.get_world_size()
    blocks = moe_blocks(model)
    check_expert_parallel(degree, int(blocks[0].experts.gate_up_proj.shape[0]) if blocks else 0, world)
    for block in blocks:
        block.experts = ShardedExperts(block.experts, mesh, world)
    return expert_params(model)


def expert_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of every `ShardedExperts` in `model`."""
    return [p for m in model.modules() if isinstance(m, ShardedExperts) for p in m.parameters()]
