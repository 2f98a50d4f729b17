"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): `train.optimizer: lion`.

The update is the sign of beta1 m + (1 - beta1) g, then m <- beta2 m + (1 - beta2) g; decoupled
weight decay lr x wd. Its updates are +-lr per element, so its lr is usually 3-10x below AdamW's
and its weight decay as much above. A step with `found_inf` (a 0-dim device tensor) set to 1
changes nothing, without reading it on the host: every change is scaled by (1 - found_inf).
Elementwise only, so FSDP2's and tensor parallel's sharded parameters (DTensors) update shard by
shard exactly as whole ones.
"""

from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)  # 1: skip, on the device
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                w, g, m = (local(x) for x in (p, whole_grad(p), state["exp_avg"]))
                keep, g = skip_factor(found_inf, g)
                update = (m * beta1 + g * (1 - beta1)).sign_()
                w.mul_(1 - lr * wd * keep)
                w.add_(update * keep, alpha=-lr)
                m.lerp_(g, (1 - beta2) * keep)
        return None


def whole_grad(p: torch.Tensor) -> torch.Tensor:
    """p's gradient with p's own placements. Elementwise updates take each rank's shard of a
    sharded parameter on its own, but a replicated parameter's gradient may still be a per-rank
    partial sum (tensor parallel's norms, LoRA's A on a column-parallel layer): summed first."""
    grad = p.grad
    if hasattr(grad, "placements") and grad.placements != p.placements:
        grad = grad.redistribute(p.device_mesh, p.placements)
    return grad


def skip_factor(found_inf: torch.Tensor | None, g: torch.Tensor):
    """(keep, g): keep is 1, or 1 - found_inf on the device, to scale every change of a step by;
    a skipped step's gradient is NaN or inf, so it is zeroed (0 x NaN would still be NaN)."""
    if found_inf is None:
        return 1.0, g
    return 1 - found_inf.to(g.dtype), torch.where(found_inf.bool(), 0.0, g)


def local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if hasattr(x, "to_local") else x
