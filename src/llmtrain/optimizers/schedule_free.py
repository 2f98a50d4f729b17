"""Schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled"):
`train.optimizer: adamw_schedulefree`.

No decay schedule: after the warmup the lr stays constant (train.lr_schedule: constant), and the
weights to evaluate are an average of the iterates. Three sequences: z takes AdamW-like steps, x
is the running average of z (weight c = lr_max^2 / sum of lr_max^2 so far), and the gradient is
taken at y = (1 - beta1) z + beta1 x. The model's parameters hold y while training, the
optimizer's state z and the second moment: x = lerp(y, z, 1 - 1/beta1), so no third copy is kept.

    with optimizer.eval_weights():  # the parameters hold x inside (evaluation)
        ...

Exports read x the same way from a checkpoint (its meta.json's "eval_shift", from the
optimizer table's entry: model/shards.py). Its arithmetic follows the `schedulefree` package's AdamWScheduleFree 1.4
(weight_lr_power 2, r 0, warmup by our own schedule), checked against it in tests/test_optimizers.py;
written here so that a skipped step (`found_inf`, 0-dim, on the device) changes nothing without a
host read: the step count, the averaging weights and every tensor are scaled by (1 - found_inf).
"""

from __future__ import annotations

import contextlib

import torch

from .inputs import keep_factor, local, whole_grad, zeroed_if_skipped


class AdamWScheduleFree(torch.optim.Optimizer):
    def __init__(self, groups: list, lr: float, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)  # 1: skip, on the device
        keep = keep_factor(found_inf)
        for group in self.param_groups:
            lr, wd, (beta1, beta2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    device = local(p).device
                    # per parameter, as AdamW's step: plain tensors that DCP saves with the state
                    for name in ("k", "lr_max", "weight_sum"):
                        state[name] = torch.zeros((), dtype=torch.float32, device=device)
                    state["z"] = p.detach().clone(memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                y, z, v = local(p), local(state["z"]), local(state["exp_avg_sq"])
                g = zeroed_if_skipped(found_inf, local(whole_grad(p)))
                k, lr_max, weight_sum = state["k"], state["lr_max"], state["weight_sum"]
                k.add_(keep)
                if found_inf is None:
                    lr_max.clamp_(min=lr)
                else:
                    lr_max.copy_(torch.where(found_inf.bool(), lr_max, lr_max.clamp(min=lr)))
                weight = lr_max * lr_max
                weight_sum.add_(weight * keep)
                ckp1 = torch.where(weight_sum > 0, weight / weight_sum, 0.0)  # 0 until a step is taken
                v.lerp_(g * g, (1 - beta2) * keep)
                normalised = g / (v / (1 - beta2 ** k.clamp(min=1))).sqrt_().add_(eps)
                if wd != 0:
                    normalised.add_(y, alpha=wd)
                y.lerp_(z, ckp1 * keep)
                y.add_(normalised * (lr * (beta1 * (1 - ckp1) - 1) * keep))
                z.sub_(normalised * (lr * keep))
        return None

    @contextlib.contextmanager
    def eval_weights(self):
        """The parameters hold x (the average) inside, y again after, exactly: y is copied
        aside, not recomputed from x (the round trip would round, and a run that evaluates
        would then train on other weights than one that does not). The copy is this rank's
        parameters in fp32 while evaluating (under FSDP2 its shards), where the gradients were
        during the step: they are freed by then."""
        kept = []
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if "z" in self.state[p]:
                        kept.append((p, local(p).clone()))
                        local(p).lerp_(local(self.state[p]["z"]), 1 - 1 / group["betas"][0])
        try:
            yield
        finally:
            with torch.no_grad():
                for p, y in kept:
                    local(p).copy_(y)
