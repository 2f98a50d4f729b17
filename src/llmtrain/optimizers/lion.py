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

from .inputs import keep_factor, local, whole_grad, zeroed_if_skipped


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)  # 1: skip, on the device
        keep = keep_factor(found_inf)
        for group in self.param_groups:
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                w, m = local(p), local(state["exp_avg"])
                g = zeroed_if_skipped(found_inf, local(whole_grad(p)))
                update = (m * beta1 + g * (1 - beta1)).sign_()
                w.mul_(1 - lr * wd * keep)
                w.add_(update * keep, alpha=-lr)
                m.lerp_(g, (1 - beta2) * keep)
        return None


