"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine schedule."""

from __future__ import annotations

import math

import torch

from ..config import TrainConfig


def build_optimizer(model: torch.nn.Module, t: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},  # biases, norms
    ]
    # The fused kernel exists for CUDA (and CPU); foreach is the portable fallback.
    fused = device.type in ("cuda", "cpu")
    optimizer = torch.optim.AdamW(groups, lr=lr_at(0, t), fused=fused)
    apply_settings(optimizer, t)
    return optimizer


def apply_settings(optimizer: torch.optim.AdamW, t: TrainConfig) -> None:
    """The config's weight decay, betas and eps, on a new optimizer and after a resume: loading a
    checkpoint restores the saved param_groups, and the config must win (the changes are logged)."""
    matrices, vectors = optimizer.param_groups
    matrices["weight_decay"], vectors["weight_decay"] = t.weight_decay, 0.0
    for group in optimizer.param_groups:
        group["betas"], group["eps"] = (t.beta1, t.beta2), t.eps


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, cosine to min_lr."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
