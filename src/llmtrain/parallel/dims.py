"""Every degree of parallelism of a run, in one object: the only place that decides them.

    dims = ParallelDims.from_config(cfg, world_size, procs_per_node)
    dims.dp, dims.dp_rank(rank)        # data-parallel degree, and a rank's place in it
    dims.fsdp_mesh(device_type)        # the mesh FSDP2 shards over (None: all ranks, FSDP2's default)

The ranks are laid out, outermost first, as pipeline x replicate x shard x context x tensor:
tensor parallel innermost (its collectives run every layer, so its ranks share a node's fast
links), then context, the FSDP2 shard group, the replicas (HSDP: one per node group, their
all-reduce once a step crosses nodes), pipeline stages outermost. Their product is the world
size. Expert parallelism reuses data-parallel and context ranks (its degree divides
shard x context), so it is not a factor of the product. Today only replicate and shard can
exceed 1: ddp replicates over the world, fsdp shards over it, hsdp shards within groups of
`parallel.shard_size` ranks (default: one node's processes) and replicates across groups.

The data-parallel ranks (replicate x shard) each read their own share of every batch; a rank's
loss is reduced over them. This module imports nothing else of llmtrain at run time (config/rules.py
checks a config against it).
"""

from __future__ import annotations

from dataclasses import dataclass

SHARDED_STRATEGIES = ("fsdp", "hsdp")
LAYOUT = ("pipeline", "replicate", "shard", "context", "tensor")  # outermost first


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    strategy: str = "ddp"
    replicate: int = 1
    shard: int = 1
    context: int = 1
    tensor: int = 1
    pipeline: int = 1
    expert: int = 1

    @classmethod
    def from_config(cls, cfg, world_size: int, procs_per_node: int | None = None) -> "ParallelDims":
        """The degrees of `cfg` (a config.Config) on `world_size` ranks. procs_per_node: the processes of one node
        (torchrun's LOCAL_WORLD_SIZE in a job), hsdp's default shard group; None: the slurm
        section's."""
        strategy = cfg.parallel.strategy
        if strategy == "ddp":
            return cls(world_size, strategy, replicate=world_size)
        if strategy == "fsdp":
            return cls(world_size, strategy, shard=world_size)
        per_node = procs_per_node or min(world_size, cfg.world_size // cfg.slurm.nodes)
        shard = cfg.parallel.shard_size or per_node
        return cls(world_size, strategy, replicate=world_size // shard if shard >= 1 else 0, shard=shard)

    def problems(self) -> list[str]:
        """What is wrong, one line each, naming the key to change."""
        if self.strategy == "hsdp" and (self.shard < 1 or self.world_size % self.shard):
            return [f"parallel.shard_size: must divide the world size {self.world_size} (got {self.shard}); "
                    f"hsdp shards within groups of shard_size ranks and replicates across them"]
        product = self.pipeline * self.replicate * self.shard * self.context * self.tensor
        if product != self.world_size:
            sizes = " x ".join(f"{name} {getattr(self, name)}" for name in LAYOUT)
            return [f"parallel: the degrees multiply to {product} ({sizes}), not the world size "
                    f"{self.world_size}; change them or the processes (slurm.nodes x slurm.procs_per_node)"]
        return []

    @property
    def dp(self) -> int:
        """Data-parallel degree: the ranks that each train on their own share of a batch."""
        return self.replicate * self.shard

    @property
    def sharded(self) -> bool:
        """FSDP2 holds the parameters (fsdp, hsdp), not DDP."""
        return self.strategy in SHARDED_STRATEGIES

    def dp_rank(self, rank: int) -> int:
        """`rank`'s place among the data-parallel ranks (its batch share), by the layout above."""
        return rank // (self.context * self.tensor) % self.dp

    def fsdp_mesh(self, device_type: str):
        """The mesh FSDP2 shards over: None for fsdp (its default, one group of every rank); for
        hsdp a 2-D (replicate, shard) mesh: sharded within a group, replicated across groups."""
        if self.strategy != "hsdp":
            return None
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh(device_type, (self.replicate, self.shard), mesh_dim_names=("replicate", "shard"))

    def describe(self) -> str:
        """For the start-up log line: 'ddp over 4 ranks', 'hsdp over 8 ranks (2 replicas x 4-way shards)'."""
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        if self.strategy == "hsdp":
            return f"hsdp over {ranks} ({self.replicate} replicas x {self.shard}-way shards)"
        return f"{self.strategy} over {ranks}"
