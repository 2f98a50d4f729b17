"""Expert parallel (`parallel.ep`): a Mixture-of-Experts layer's experts split over the ep ranks
of a shard group, tokens sent to the rank holding their expert and back by all-to-all.

    apply_expert_parallel(model, ep_mesh)            # on the meta skeleton, after tensor parallel
    shard_experts(layers, efsdp_mesh, mp, divide)    # FSDP2 over the rest, before the layers'

Each layer's fused expert stacks (transformers 5's `experts.gate_up_proj` [E, 2I, H] and
`down_proj` [E, H, I]) become DTensors split on the expert dimension over the ep mesh: rank r of
the group holds experts r E/ep .. (r + 1) E/ep - 1, whole. The experts module's forward (the
router's choice in, the weighted sum of the chosen experts' outputs out, as transformers' own)
becomes:

    each (token, choice) pair sorted by expert -> all-to-all: each rank receives the pairs of
    its experts from every rank of the group (uneven splits) -> its experts on them (a grouped
    matmul per projection, as transformers' grouped_mm) -> all-to-all back -> weighted by the
    router, summed per token

The splits are counts on the device; all_to_all_single needs them on the host, one read of the
group's counts per layer and forward (a backward reuses them; a checkpointed layer's recompute
reads again). The experts' gradients come back through the all-to-all's backward, so an expert's
gradient sums the tokens of its whole group; FSDP2 then averages it over the remaining ranks
(efsdp = shard x cp / ep). Dense weights average over all shard x cp ranks, so each expert's
gradient is scaled by 1 / ep on its way in (an identity whose backward scales): FSDP2's own
divide factor would do it in the reduce-scatter (PREMUL_SUM), which gloo lacks.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from ..model.moe import FUSED


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules holding a layer's fused expert stacks (gate_up_proj and down_proj)."""
    return [m for name, m in model.named_modules()
            if FUSED.fullmatch(f"{name}.gate_up_proj") and isinstance(getattr(m, "down_proj", None), torch.nn.Parameter)]


def apply_expert_parallel(model: torch.nn.Module, mesh) -> None:
    """Split every experts module's stacks over the 1-D ep `mesh` (Shard(0): whole experts a
    rank) and route its forward through the all-to-all."""
    from torch.distributed.tensor import Shard, distribute_tensor
    # Host reads and data-dependent shapes: eager under train.compile, the rest of the layer
    # compiled. (Wrapped here, not at import: torch.compiler.disable imports dynamo, ~0.5 s.)
    forward = torch.compiler.disable(dispatched_forward)
    for experts in experts_modules(model):
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)
            setattr(experts, name, torch.nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]),
                                                      requires_grad=param.requires_grad))
        experts.ep_group = mesh.get_group()
        experts.forward = types.MethodType(forward, experts)


def shard_experts(model: torch.nn.Module, mesh, mp_policy, reshard: bool) -> None:
    """FSDP2 over `mesh` (efsdp) for each experts module, before its layer's fully_shard."""
    from torch.distributed.fsdp import fully_shard
    for experts in experts_modules(model):
        fully_shard(experts, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard)


def dispatched_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward (hidden [T, H], each token's top-k experts and weights ->
    [T, H]) with the experts spread over the ep group."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
    group, ep = self.ep_group, dist.get_world_size(self.ep_group)
    gate_up, down = (_GradScaled.apply(_local(w), 1 / ep) for w in (self.gate_up_proj, self.down_proj))
    local = gate_up.shape[0]
    experts = local * ep
    top_k = top_k_index.shape[1]
    chosen = top_k_index.reshape(-1)
    order = chosen.argsort(stable=True)  # pairs by expert: by destination rank, then local expert
    counts = torch.bincount(chosen, minlength=experts)
    received = all_to_all_single(counts, [local] * ep, [local] * ep, group)  # [source rank, local expert]
    splits = torch.stack([counts.view(ep, local).sum(1), received.view(ep, local).sum(1)]).tolist()  # the host read
    sent, got = splits
    tokens = all_to_all_single_autograd(hidden_states[order // top_k], got, sent, group)
    # regroup what came from every rank by local expert, compute, and put it back in arrival order
    expert_of = torch.repeat_interleave(torch.arange(local, device=chosen.device).repeat(ep), received.view(-1))
    by_expert = expert_of.argsort(stable=True)
    per_expert = received.view(ep, local).sum(0).tolist()
    outputs = torch.empty_like(tokens)
    outputs[by_expert] = _experts(self, tokens[by_expert], gate_up, down, per_expert)
    back = all_to_all_single_autograd(outputs, sent, got, group)
    weighted = back * top_k_weights.reshape(-1)[order, None].to(back.dtype)
    return torch.zeros_like(hidden_states).index_add(0, order // top_k, weighted.to(hidden_states.dtype))


def _experts(module, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Each local expert on its rows of `x` (sorted by expert, `sizes` rows each): one grouped
    matmul per projection where the model asks for transformers' grouped_mm (its default) and
    torch has it for the device, else transformers' per-expert loop. On CPU the two are
    bit-identical, forward and backward (tests/test_expert_parallel.py)."""
    if grouped(module, x, gate_up):
        offsets = torch.tensor(sizes, device=x.device).cumsum(0, dtype=torch.int32)
        gate, up = F.grouped_mm(x, gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
        return F.grouped_mm(module.act_fn(gate) * up, down.transpose(-2, -1), offs=offsets)
    out = []
    for e, rows in enumerate(x.split(sizes)):
        gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
        out.append(F.linear(module.act_fn(gate) * up, down[e]))
    return torch.cat(out) if out else x[:0]


def grouped(module, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the experts run as grouped matmuls: the model's experts implementation is
    grouped_mm, torch has `F.grouped_mm` (2.10+), the input matches the weights' dtype, and on
    CUDA the GPU is Ampere or newer with bf16 weights (its kernels' scope)."""
    config = getattr(module, "config", None)
    if getattr(config, "_experts_implementation", None) != "grouped_mm" or not hasattr(F, "grouped_mm"):
        return False
    if x.dtype != weight.dtype:
        return False
    if weight.device.type == "cuda":
        return weight.dtype == torch.bfloat16 and torch.cuda.get_device_capability(weight.device) >= (8, 0)
    return weight.device.type == "cpu"


class _GradScaled(torch.autograd.Function):
    """The identity, whose backward scales the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _local(param):
    return param.to_local() if hasattr(param, "to_local") else param
