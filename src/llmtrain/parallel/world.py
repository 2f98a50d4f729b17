"""This process's place in the run: its rank, its device, the process group's store, and the
degrees of parallelism (dims.py). training/distributed.py makes it once a process starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .dims import ParallelDims

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    store: dist.Store | None = None  # the group's store; rank 0 hosts it under train.slurm
    dims: ParallelDims | None = None  # every degree of parallelism (None: one process, ddp)

    def __post_init__(self):
        if self.dims is None:
            object.__setattr__(self, "dims", ParallelDims(self.world_size, replicate=self.world_size))

    @property
    def is_main(self) -> bool:
        return self.rank == 0
