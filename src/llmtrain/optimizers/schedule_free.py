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
        """One step over each group's parameters at once (torch._foreach_*: a handful of kernels
        a group, not a dozen a parameter; 720 small parameters took 49 ms a step one by one on CPU)."""
        found_inf = getattr(self, "found_inf", None)  # 1: skip, on the device
        keep = keep_factor(found_inf)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step(group, params, found_inf, keep)
        return None

    def _step(self, group: dict, params: list, found_inf, keep) -> None:
        lr, wd, (beta1, beta2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if not state:
                # per parameter, as AdamW's step: plain tensors that DCP saves with the state
                for name in ("k", "lr_max", "weight_sum"):
                    state[name] = torch.zeros((), dtype=torch.float32, device=local(p).device)
                state["z"] = p.detach().clone(memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        y, z, v = ([local(x) for x in xs] for xs in (params, [s["z"] for s in states], [s["exp_avg_sq"] for s in states]))
        g = [zeroed_if_skipped(found_inf, local(whole_grad(p))) for p in params]
        k, lr_max, weight_sum = ([s[name] for s in states] for name in ("k", "lr_max", "weight_sum"))
        n = len(params)

        def times_keep(xs: list) -> list:  # each x (a 0-dim tensor) x keep
            return xs if found_inf is None else torch._foreach_mul(xs, keep)

        # the averaging: c = lr_max^2 / the sum of lr_max^2 so far (lr_max: the largest lr yet)
        torch._foreach_add_(k, keep)
        if found_inf is None:
            torch._foreach_clamp_min_(lr_max, lr)
        else:  # weight 0 keeps lr_max exactly, 1 takes the clamped value exactly
            torch._foreach_lerp_(lr_max, torch._foreach_clamp_min(lr_max, lr), [keep] * n)
        weight = torch._foreach_mul(lr_max, lr_max)
        torch._foreach_add_(weight_sum, times_keep(weight))
        # 0 until a step is taken (0 / tiny); weight_sum >= weight > 0 afterwards, where the clamp is idle
        ckp1 = torch._foreach_div(weight, torch._foreach_clamp_min(weight_sum, torch.finfo(torch.float32).tiny))
        # Adam's normalised gradient, with its second moment's bias correction
        if found_inf is None:
            torch._foreach_lerp_(v, torch._foreach_mul(g, g), 1 - beta2)
        else:
            torch._foreach_lerp_(v, torch._foreach_mul(g, g), [(1 - beta2) * keep] * n)
        correction = torch._foreach_pow(beta2, torch._foreach_clamp_min(k, 1))
        torch._foreach_neg_(correction)
        torch._foreach_add_(correction, 1)  # 1 - beta2^k
        denom = torch._foreach_div(v, correction)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        normalised = torch._foreach_div(g, denom)
        if wd != 0:
            torch._foreach_add_(normalised, y, alpha=wd)
        # y towards z by c, then along the gradient; z along it
        torch._foreach_lerp_(y, z, times_keep(ckp1))
        coefficient = torch._foreach_mul(ckp1, -beta1 * lr)
        torch._foreach_add_(coefficient, lr * (beta1 - 1))  # lr (beta1 (1 - c) - 1)
        torch._foreach_addcmul_(y, normalised, times_keep(coefficient))
        torch._foreach_add_(z, normalised if found_inf is None else torch._foreach_mul(normalised, keep), alpha=-lr)

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
