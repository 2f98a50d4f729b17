"""Throughput, MFU, peak memory and the compact progress line."""

from __future__ import annotations

import resource
import sys

import torch

# Dense bf16 peak FLOP/s per GPU, from the vendors' datasheets (no sparsity).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12,
              "L4": 121e12, "V100": 125e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def progress_line(step: int, total: int, loss: float, lr: float, tokens_per_sec: float,
                  eta_s: float) -> str:
    return (f"step {step}/{total} | loss {loss:.4f} | lr {lr:.2e} | "
            f"{tokens_per_sec:,.0f} tok/s | eta {format_duration(eta_s)}")


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
