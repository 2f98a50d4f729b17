"""This process's place in the run: its rank, its device, the process group's store, and the
layout (dims.py: the degrees, and this rank's view with its process groups by role).
training/distributed.py makes it once a process starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .dims import Layout, ParallelDims

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
    def layout(self) -> Layout:
        """This rank's view of the layout: its coordinates and its groups by role (Layout.mesh)."""
        return Layout(self.dims, self.rank, self.device.type)

    @property
    def is_main(self) -> bool:
        return self.rank == 0
