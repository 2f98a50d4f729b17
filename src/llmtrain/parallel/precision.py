"""Precision, in one place: autocast (DDP and one process), the fp16 loss scaler, TF32, and the
dtypes the config names. FSDP2 casts through its MixedPrecisionPolicy instead (parallel/wrap.py)."""

from __future__ import annotations

import contextlib

import torch

from ..config import Config
from .dims import SHARDED_STRATEGIES

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def autocast(cfg: Config, device: torch.device):
    """Autocast for DDP and single-process runs; FSDP2 casts through its MixedPrecisionPolicy."""
    if cfg.train.precision == "fp32" or cfg.parallel.strategy in SHARDED_STRATEGIES:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[cfg.train.precision])


def grad_scaler(cfg: Config, device: torch.device) -> torch.amp.GradScaler:
    """fp16 needs loss scaling; for bf16 and fp32 the scaler is disabled and passes through.
    With FSDP2's DTensor gradients its overflow check reduces over the shards, so every rank
    agrees on skipping a step."""
    return torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")


def configure_matmul_precision(cfg: Config, device: torch.device) -> None:
    """fp32 runs on Ampere+ GPUs use TF32 tensor cores unless `train.tf32: false` (one API
    family only: mixing torch's legacy and new precision settings raises in 2.9+)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if cfg.train.tf32 else "highest")
