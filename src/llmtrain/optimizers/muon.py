"""Muon (Jordan et al. 2024; "Muon is Scalable for LLM Training", Liu et al. 2025):
`train.optimizer: muon`.

Each hidden weight matrix W (attention and MLP projections) steps along the orthogonalised
Nesterov momentum of its gradient:

    m <- mu m + (1 - mu) g;  u = (1 - mu) g + mu m;  O = NewtonSchulz5(u) ~ U V^T of u's SVD
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(rows, cols)) O

0.2 sqrt(max(rows, cols)) gives O the update RMS AdamW's updates have (Moonlight's scaling), so
train.lr and train.weight_decay mean what they mean for AdamW and one lr serves both parts. The
embeddings, the output head, norms and biases take AdamW (the standard split), at lr x
optimizer_args.adamw_lr_scale.

Newton-Schulz needs each matrix whole, in fp32 here. Under FSDP2/HSDP and tensor parallel every
rank holds a shard of every matrix: orthogonalising shards is wrong, and gathering every matrix
on every rank (torch.optim.Muon on DTensors) moves the whole model to every rank and repeats the
work there. Here the matrices of one shape (one per layer) are stacked and the stack is
redistributed from "every rank a shard of every matrix" to "every rank whole matrices of its
share of the stack": one all-to-all (DTensor Shard(1) -> Shard(0)), then each rank
orthogonalises its own matrices, and a second all-to-all brings each rank its shards of the
results back. Each rank receives about as many bytes as its shards hold, not the model's, and
does 1/n of the Newton-Schulz work (n: the ranks a matrix is sharded over; replicas of HSDP
repeat it). On gloo DTensor falls back to all-gather + chunk for the all-to-all: the same
numbers, more traffic; NCCL runs the real one.

A step with `found_inf` (0-dim, on the device) set to 1 changes nothing: every change is scaled
by (1 - found_inf), no host read.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from .inputs import keep_factor, local, whole_grad, zeroed_if_skipped

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as torch.optim.Muon's


def newton_schulz(u: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The orthogonalised matrices of a stack [k, rows, cols] (fp32; rows > cols transposed in)."""
    a, b, c = NS_COEFFICIENTS
    x = u.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """Param groups: {"params", "muon": True} for the hidden matrices, AdamW's for the rest."""

    def __init__(self, groups: list, lr: float, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, betas=(0.9, 0.95), eps: float = 1e-8):
        super().__init__(groups, {"lr": lr, "weight_decay": 0.0, "momentum": momentum, "nesterov": nesterov,
                                  "ns_steps": ns_steps, "betas": betas, "eps": eps, "muon": False})

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)  # 1: skip, on the device
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            (self._muon if group["muon"] else self._adamw)(group, params, found_inf, keep_factor(found_inf))
        return None

    def _muon(self, group: dict, params: list, found_inf, keep) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        updates = []
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            g, m = zeroed_if_skipped(found_inf, local(whole_grad(p))), local(state["momentum_buffer"])
            m.lerp_(g, (1 - mu) * keep)
            updates.append(g.lerp(m, mu) if group["nesterov"] else m.clone())
        for p, o in zip(params, orthogonalised(params, updates, group["ns_steps"])):
            w = local(p)
            w.mul_(1 - lr * wd * keep)
            w.add_(o.to(w.dtype) * keep, alpha=-lr * 0.2 * math.sqrt(max(p.shape[-2:])))

    def _adamw(self, group: dict, params: list, found_inf, keep) -> None:
        """AdamW, elementwise (so shard by shard), with its step count on the device."""
        lr, wd, (beta1, beta2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=local(p).device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            w, m, v = local(p), local(state["exp_avg"]), local(state["exp_avg_sq"])
            g = zeroed_if_skipped(found_inf, local(whole_grad(p)))
            state["step"].add_(keep)
            step = state["step"].clamp(min=1)
            m.lerp_(g, (1 - beta1) * keep)
            v.lerp_(g * g, (1 - beta2) * keep)
            denom = (v / (1 - beta2 ** step)).sqrt_().add_(eps)
            w.mul_(1 - lr * wd * keep)
            w.add_(m / denom * (keep * -lr / (1 - beta1 ** step)))


def orthogonalised(params: list, updates: list, steps: int) -> list[torch.Tensor]:
    """NewtonSchulz5 of each parameter's update (this rank's local part in, its local part of
    the orthogonalised whole matrix out). Plain tensors (DDP, one process) are whole already;
    sharded ones (DTensors) go by shape and layout, a stack each (see the module's docstring)."""
    out: list = [None] * len(params)
    stacks = defaultdict(list)
    for i, p in enumerate(params):
        if hasattr(p, "placements"):
            stacks[(tuple(p.shape), p.device_mesh, tuple(p.placements))].append(i)
        else:
            out[i] = newton_schulz(updates[i][None], steps)[0]
    for (shape, mesh, placements), members in stacks.items():
        for i, o in zip(members, _orthogonalise_stack(shape, mesh, placements, [updates[i] for i in members], steps)):
            out[i] = o
    return out


def _orthogonalise_stack(shape, mesh, placements, locals_: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    stride_of_one = torch.empty(shape, device="meta").stride()
    stacked_placements = [_shifted(pl) for pl in placements]
    # whole matrices, the stack split over the mesh dimensions that sharded the matrix
    whole_placements = [Replicate() if pl.is_replicate() else Shard(0) for pl in placements]
    global_shape = torch.Size((len(locals_), *shape))
    stride = (math.prod(shape), *stride_of_one)
    stack = DTensor.from_local(torch.stack(locals_), mesh, stacked_placements, shape=global_shape, stride=stride)
    whole = stack.redistribute(mesh, whole_placements)
    done = DTensor.from_local(newton_schulz(whole.to_local(), steps), mesh, whole_placements,
                              shape=global_shape, stride=stride)
    return list(done.redistribute(mesh, stacked_placements).to_local().unbind(0))


def _shifted(placement):
    """A matrix's placement as its place in a stack of matrices (one more leading dimension).
    FSDP2's split of a tensor-parallel shard is a _StridedShard, which is_shard() does not claim:
    it keeps its split factor."""
    if type(placement).__name__ == "_StridedShard":
        return type(placement)(placement.dim + 1, split_factor=placement.split_factor)
    return type(placement)(placement.dim + 1) if placement.is_shard() else placement
