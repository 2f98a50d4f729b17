"""Every degree of parallelism of a run, in one object: the only place that decides them.

    dims = ParallelDims.from_config(cfg, world_size, procs_per_node)
    dims.dp, dims.dp_rank(rank)        # data-parallel degree, and a rank's place in it
    dims.fsdp_mesh(device_type)        # the mesh FSDP2 shards over (None: all ranks, FSDP2's default)
    dims.tp_mesh(device_type)          # the tensor-parallel group's mesh (parallel.tp > 1)

The ranks are laid out, outermost first, as pipeline x replicate x shard x context x tensor:
tensor parallel innermost (its collectives run every layer, so its ranks share a node's fast
links: parallel.tp must divide a node's processes), then context, the FSDP2 shard group, the
replicas (HSDP: one per node group, their all-reduce once a step crosses nodes), pipeline stages
outermost. Their product is the world size. Expert parallelism reuses data-parallel and context
ranks (its degree divides shard x context), so it is not a factor of the product. Today
replicate, shard and tensor can exceed 1: over the world / tp data-parallel ranks, ddp
replicates, fsdp shards, hsdp shards within groups of `parallel.shard_size` ranks (default: one
node's data-parallel ranks) and replicates across groups. Where tp x cp leave a node fewer than 2
data-parallel ranks, that default would shard nothing (every GPU the whole optimizer state): hsdp
then asks for parallel.shard_size rather than replicate silently or pick a group across nodes.

The data-parallel ranks (replicate x shard) each read their own share of every batch (the ranks
of one tensor-parallel group read the same samples); a step's loss is the sum over them, each
rank's divided by the step's global count of trained targets. This module imports nothing else
of llmtrain, nor torch at import (config/rules.py checks a config against it).
"""

from __future__ import annotations

import functools
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

    per_node: int = 0  # the processes of one node, where known (0: not known)
    # hsdp without parallel.shard_size: the node size its default shard group came from (0: the
    # key was set, or not hsdp); problems() names it when that default cannot shard
    default_node: int = 0

    @classmethod
    def from_config(cls, cfg, world_size: int, procs_per_node: int | None = None) -> "ParallelDims":
        """The degrees of `cfg` (a config.Config) on `world_size` ranks. procs_per_node: the processes of one node
        (torchrun's LOCAL_WORLD_SIZE in a job), hsdp's default shard group; None: the slurm
        section's."""
        strategy, tp, cp = cfg.parallel.strategy, cfg.parallel.tp, cfg.parallel.cp
        known = procs_per_node or 0
        dp = world_size // (tp * cp) if tp >= 1 and cp >= 1 else 0
        if strategy == "ddp":
            return cls(world_size, strategy, replicate=dp, context=cp, tensor=tp, per_node=known)
        if strategy == "fsdp":
            return cls(world_size, strategy, shard=dp, context=cp, tensor=tp, per_node=known)
        if cfg.parallel.shard_size is not None:
            shard = cfg.parallel.shard_size
            return cls(world_size, strategy, replicate=dp // shard if shard >= 1 else 0, shard=shard, context=cp,
                       tensor=tp, per_node=known)
        per_node = procs_per_node or min(world_size, cfg.world_size // cfg.slurm.nodes)
        shard = _default_shard(dp, per_node // (tp * cp) if dp else 0)
        return cls(world_size, strategy, replicate=dp // shard if shard else 0, shard=shard, context=cp, tensor=tp,
                   per_node=known, default_node=per_node)

    def problems(self) -> list[str]:
        """What is wrong, one line each, naming the key to change."""
        tp = self.tensor
        if tp < 1 or self.world_size % tp:
            return [f"parallel.tp: must divide the world size {self.world_size} (got {tp})"]
        if tp > 1 and self.per_node and self.per_node % tp:
            return [f"parallel.tp: must divide a node's {self.per_node} processes (got {tp}); a tensor-parallel "
                    f"group talks every layer and stays inside a node"]
        if tp > 1 and self.strategy == "ddp" and self.dp * self.context > 1:
            ranks = "data-parallel" if self.context == 1 else "data-parallel and context-parallel"
            return [f"parallel.tp: with {self.dp * self.context} {ranks} ranks, tensor parallel needs "
                    f"parallel.strategy fsdp or hsdp (got ddp); or set parallel.tp to the world size {self.world_size}"]
        cp = self.context
        if cp < 1 or (self.world_size // tp) % cp:
            return [f"parallel.cp: must divide the world size / parallel.tp = {self.world_size // tp} (got {cp})"]
        if self.strategy == "hsdp" and self.shard == 0 and self.default_node:
            return [_unset_shard_size(self.world_size // (tp * cp), self.default_node, tp, cp)]
        if self.strategy == "hsdp" and (self.shard < 1 or (self.world_size // (tp * cp)) % self.shard):
            if tp * cp > 1:
                return [f"parallel.shard_size: must divide the {self.world_size // (tp * cp)} data-parallel ranks "
                        f"(world size {self.world_size} / (parallel.tp {tp} x parallel.cp {cp}); got {self.shard})"]
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

    @property
    def loss_ranks(self) -> int:
        """The ranks whose losses add up to the step's: the data-parallel ranks, each cut into
        parallel.cp parts of the sequence (the gradients are averaged over as many)."""
        return self.dp * self.context

    def fsdp_mesh(self, device_type: str):
        """The mesh FSDP2 shards over: None for fsdp (its default, one group of every rank); for
        hsdp a 2-D (replicate, shard) mesh: sharded within a group, replicated across groups.
        With tensor or context parallel, the data-parallel part of the run's mesh (the ranks of a
        context-parallel group hold the same weights: FSDP2 shards them over those too)."""
        if self.tensor > 1 or self.context > 1:
            return self.mesh(device_type)["shard" if self.strategy == "fsdp" else ("replicate", "shard")]
        if self.strategy != "hsdp":
            return None
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh(device_type, (self.replicate, self.shard), mesh_dim_names=("replicate", "shard"))

    def tp_mesh(self, device_type: str):
        """The 1-D mesh of this rank's tensor-parallel group."""
        return self.mesh(device_type)["tensor"]

    def mesh(self, device_type: str):
        """The run's device mesh, (replicate, shard x context, tensor), made once per process."""
        return _mesh(self, device_type)

    def cp_group(self):
        """This rank's context-parallel process group (every rank makes every group, once)."""
        return _cp_group(self)

    def describe(self) -> str:
        """For the start-up log line: 'ddp over 4 ranks', 'hsdp over 8 ranks (2 replicas x 4-way shards)',
        'fsdp over 8 ranks (mesh: dp_shard 4 x tp 2)'. hsdp always states both its sizes, a shard
        group of 1 (every rank the whole model's state) included."""
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        if not self.sharded and self.loss_ranks == 1 and self.tensor > 1:  # nothing for DDP to average
            return f"tensor parallel over {ranks} (mesh: tp {self.tensor}; no data parallelism)"
        if self.tensor > 1 or self.context > 1:
            sizes = {"dp_replicate": self.replicate, "dp_shard": self.shard, "cp": self.context, "tp": self.tensor}
            shown = [name for name, n in sizes.items() if n > 1 or (self.strategy == "hsdp" and name[:3] == "dp_")]
            return f"{self.strategy} over {ranks} (mesh: {' x '.join(f'{name} {sizes[name]}' for name in shown)})"
        if self.strategy == "hsdp":
            return f"hsdp over {ranks} ({self.replicate} replicas x {self.shard}-way shards)"
        return f"{self.strategy} over {ranks}"


def _default_shard(dp: int, node_dp: int) -> int:
    """hsdp's shard group without parallel.shard_size: a node's data-parallel ranks (its NVLink
    domain: the per-layer all-gathers stay inside it, only the replicas' gradient all-reduce
    crosses nodes). 0 where that shards nothing (tp x cp fill the node) or does not divide the
    data-parallel ranks: any group then spans nodes, a trade of memory against inter-node traffic
    that is the user's to make (problems() asks for the key). One data-parallel rank: 1, nothing
    to shard or replicate."""
    if dp <= 1:
        return 1
    return node_dp if node_dp >= 2 and dp % node_dp == 0 else 0


def _unset_shard_size(dp: int, per_node: int, tp: int, cp: int) -> str:
    """The one line for an hsdp run whose default shard group cannot shard, with the values that can."""
    node_dp, processes = per_node / (tp * cp), f"{per_node} process{'es' if per_node != 1 else ''}"
    why = (f"a node holds fewer than 2 data-parallel ranks (its {processes} / (tp {tp} x cp {cp}) = {node_dp:g}"
           if node_dp < 2 else f"a node's data-parallel ranks do not divide the run's ({node_dp:g} of {dp}")
    sizes = [str(n) for n in range(2, dp + 1) if dp % n == 0]
    some = f"{', '.join(sizes[:-1])} or {sizes[-1]} shard across nodes ({dp}: as fsdp)" if len(sizes) > 1 else \
        f"{dp} shards across nodes as fsdp"
    return (f"parallel.shard_size: must be set for hsdp when {why}; not set); set a divisor of the {dp} "
            f"data-parallel ranks: {some}, 1 replicates the whole model on every GPU")


@functools.cache
def _mesh(dims: ParallelDims, device_type: str):
    """The mesh, and under FSDP2 x tensor parallel its (shard, tensor) dimensions flattened too:
    a parameter split over both makes its gradient norm partial over both, and without a
    flattened mesh DTensor reduces it in two all-reduces in a row, warning on every rank at the
    first step ("2 sequential all_reduce operations ... flatten mesh dimensions"); with it, one.
    The flattened group is the default one where it spans the world (no replicas)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device_type, (dims.replicate, dims.shard * dims.context, dims.tensor),
                            mesh_dim_names=("replicate", "shard", "tensor"))
    if dims.sharded and dims.shard * dims.context > 1 and dims.tensor > 1:
        mesh["shard", "tensor"]._flatten("shard_tensor")
    return mesh


@functools.cache
def _cp_group(dims: ParallelDims):
    """The ranks that differ only in their context coordinate: rank = (dp x cp + c) x tp + t."""
    import torch.distributed as dist
    cp, tp = dims.context, dims.tensor
    groups = [[(d * cp + c) * tp + t for c in range(cp)] for d in range(dims.world_size // (cp * tp))
              for t in range(tp)]
    group, _ = dist.new_subgroups_by_enumeration(groups)
    return group


def layout_name(strategy: str, tp: int = 1, cp: int = 1, shard: int = 0) -> str:
    """A layout as check-config and the estimator name it: 'fsdp', 'fsdp x cp 2 x tp 8',
    'hsdp x tp 8 (4-way shards)' (shard: hsdp's shard group, where known)."""
    name = strategy + (f" x cp {cp}" if cp > 1 else "") + (f" x tp {tp}" if tp > 1 else "")
    return name + (f" ({shard}-way shards)" if strategy == "hsdp" and shard else "")

