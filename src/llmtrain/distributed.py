"""Process-group setup from the torchrun environment, or as a plain single process.

    world = init(cfg)       # reads RANK / WORLD_SIZE / LOCAL_RANK; nccl on GPUs, gloo on CPUs
    ...
    teardown()              # always, in a finally: a process that exits with the group alive
                            # can abort with "terminate called without an active exception"
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import Config


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(cfg: Config) -> World:
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if cfg.parallel.socket_ifname:
        os.environ.setdefault("NCCL_SOCKET_IFNAME", cfg.parallel.socket_ifname)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", cfg.parallel.socket_ifname)
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.parallel.collective_timeout_s),
                                device_id=device if device.type == "cuda" else None)
    else:  # a plain `llmtrain train`: a group of one, so FSDP2 and collectives still work
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return World(rank, local_rank, world_size, device)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_mean(values: list[float], device: torch.device) -> list[float]:
    """Average floats over ranks (one collective for all of them)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()
