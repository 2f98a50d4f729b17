"""The optimizers a run can use (`train.optimizer`), and the learning-rate schedule.

    optimizer = build_optimizer(model, cfg.train, device)      # the table's entry, checked
    OPTIMIZERS[cfg.train.optimizer].state_bytes                # what the estimator counts

To add an optimizer: write its builder (param groups, the train section, the device -> a
torch.optim.Optimizer) and add one entry to OPTIMIZERS. The entry declares two things:
- skips_on_device: whether its step() leaves every parameter and state untouched when the
  optimizer's `found_inf` attribute is a 0-dim device tensor holding 1, as torch's fused
  kernels do for the loss scaler. The trainer sets it on a non-finite step, so skipping costs
  no wait for the device. An optimizer that ignores `found_inf` declares False, and the step
  then reads the flag on the host and skips step() (training/step.py): one wait per step.
  A True declaration is checked when the optimizer is built (`_check_skips`), so a wrong one
  stops the run instead of applying a step it should have skipped.
- state_bytes: the optimizer's state per trainable parameter (AdamW: two fp32 moments, 8),
  for llmtrain estimate and the checkpoint's size.

This module imports nothing else of llmtrain (config/rules.py checks names against the table); `t`
below is a config's train section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class OptimizerKind:
    build: Callable[[list, Any, "torch.device"], "torch.optim.Optimizer"]
    settings: Callable[["torch.optim.Optimizer", Any], None]  # the config's, after a resume
    skips_on_device: bool  # step() honours a 0-dim `found_inf` on the device (see above)
    state_bytes: int  # optimizer state per trainable parameter
    about: str = ""  # the state, in llmtrain estimate's breakdown
    args: tuple[str, ...] = ()  # the keys train.optimizer_args may set


def _adamw(groups: list, t, device: "torch.device") -> "torch.optim.Optimizer":
    import torch
    # The fused kernel exists for CUDA and CPU, and reads found_inf; foreach is the fallback
    # elsewhere, and ignores it (_check_skips catches that).
    return torch.optim.AdamW(groups, lr=lr_at(0, t), fused=device.type in ("cuda", "cpu"))


def _adamw_settings(optimizer: "torch.optim.Optimizer", t) -> None:
    for group in optimizer.param_groups:
        group["betas"], group["eps"] = (t.beta1, t.beta2), t.eps


def _lion(groups: list, t, device: "torch.device") -> "torch.optim.Optimizer":
    return _lion_class()(groups, lr=lr_at(0, t))


def _lion_settings(optimizer: "torch.optim.Optimizer", t) -> None:
    betas = tuple(t.optimizer_args.get("betas", (0.9, 0.99)))  # the paper's
    for group in optimizer.param_groups:
        group["betas"] = betas


OPTIMIZERS: dict[str, OptimizerKind] = {
    "adamw": OptimizerKind(_adamw, _adamw_settings, skips_on_device=True, state_bytes=8,
                           about="AdamW: 2 fp32 moments per trainable parameter"),
    "lion": OptimizerKind(_lion, _lion_settings, skips_on_device=True, state_bytes=4,
                          about="Lion: 1 fp32 momentum per trainable parameter", args=("betas",)),
}


_LION = None


def _lion_class():
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the update is
    the sign of beta1 m + (1 - beta1) g, then m <- beta2 m + (1 - beta2) g; decoupled weight
    decay lr x wd. Its updates are +-lr per element, so its lr is usually 3-10x below AdamW's and
    its weight decay as much above. A step with `found_inf` (a 0-dim device tensor) set to 1
    changes nothing, without reading it on the host: every change is scaled by (1 - found_inf).
    Elementwise only, so FSDP2's and tensor parallel's sharded parameters (DTensors) update
    shard by shard exactly as whole ones."""
    global _LION
    if _LION is not None:
        return _LION
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
                    # elementwise: each rank's shard of a sharded parameter on its own; a
                    # replicated parameter's gradient may still be a per-rank partial sum (tensor
                    # parallel's norms, LoRA's A on a column-parallel layer): summed first
                    grad = p.grad
                    if hasattr(grad, "placements") and grad.placements != p.placements:
                        grad = grad.redistribute(p.device_mesh, p.placements)
                    w, g, m = (_local(x) for x in (p, grad, state["exp_avg"]))
                    if found_inf is None:
                        keep = 1.0
                    else:  # a skipped step's gradient is NaN or inf: zeroed, and every change x 0
                        keep = 1 - found_inf.to(w.dtype)
                        g = torch.where(found_inf.bool(), 0.0, g)
                    update = (m * beta1 + g * (1 - beta1)).sign_()
                    w.mul_(1 - lr * wd * keep)
                    w.add_(update * keep, alpha=-lr)
                    m.lerp_(g, (1 - beta2) * keep)
            return None

    _LION = Lion
    return Lion


def _local(x: "torch.Tensor") -> "torch.Tensor":
    return x.to_local() if hasattr(x, "to_local") else x


def build_optimizer(model: "torch.nn.Module", t, device: "torch.device") -> "torch.optim.Optimizer":
    """train.optimizer over the model's trainable parameters: weight decay on matrices only."""
    kind = OPTIMIZERS[t.optimizer]
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},  # biases, norms
    ]
    if kind.skips_on_device:
        _check_skips(t, device)
    optimizer = kind.build(groups, t, device)
    apply_settings(optimizer, t)
    return optimizer


def apply_settings(optimizer: "torch.optim.Optimizer", t) -> None:
    """The config's weight decay and the optimizer's own settings, on a new optimizer and after
    a resume: loading a checkpoint restores the saved param_groups, and the config must win."""
    matrices, vectors = optimizer.param_groups
    matrices["weight_decay"], vectors["weight_decay"] = t.weight_decay, 0.0
    OPTIMIZERS[t.optimizer].settings(optimizer, t)


def _check_skips(t, device: "torch.device") -> None:
    """One step of the optimizer over a scratch parameter with `found_inf` set: it must leave
    the parameter as it was, as its entry declares."""
    import torch
    param = torch.nn.Parameter(torch.ones(4, 4, device=device))
    param.grad = torch.ones_like(param)
    probe = OPTIMIZERS[t.optimizer].build([{"params": [param], "weight_decay": 0.0}], t, device)
    probe.found_inf = torch.ones((), device=device)
    probe.step()
    if not torch.equal(param.detach(), torch.ones_like(param)):
        raise RuntimeError(f"optimizer {t.optimizer!r} applied a step that found_inf marked to skip, on "
                           f"{device.type}; its OPTIMIZERS entry must declare skips_on_device=False")


def lr_at(step: int, t) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then train.lr_schedule:
    cosine to min_lr over the remaining steps; wsd (warmup-stable-decay) lr until the last
    decay_fraction of max_steps, then linear to min_lr at the last step; constant lr."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    schedule = getattr(t, "lr_schedule", "cosine")
    if schedule == "constant":
        return t.lr
    if schedule == "wsd":
        decay = max(1, round(t.decay_fraction * t.max_steps))
        start = t.max_steps - decay  # the first decaying step
        if step < start:
            return t.lr
        return t.lr + (t.min_lr - t.lr) * min(1.0, (step - start + 1) / decay)
    progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def set_lr(optimizer: "torch.optim.Optimizer", lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
