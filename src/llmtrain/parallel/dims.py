"""The layout of a run: every degree of parallelism, the rules a layout must satisfy, each
rank's share of the work, and the process groups by role. The one owner of all four.

    dims = ParallelDims.from_config(cfg, world_size, procs_per_node)
    dims.problems(), dims.config_problems(cfg)   # one line each, naming the key to change
    dims.dp, dims.dp_rank(rank), dims.loss_ranks # each rank's share (no caller recomputes one)
    layout = Layout(dims, rank, "cuda")          # world.layout: this rank's view
    layout.mesh("loss"), layout.fsdp_mesh()      # the device meshes, by role

The ranks are laid out, outermost first, as pipeline x replicate x shard x context x tensor
(rank = (((p R + r) S + s) C + c) T + t): tensor parallel innermost (its collectives run every
layer, so its ranks share a node's fast links: parallel.tp must divide a node's processes), then
context, the FSDP2 shard group, the replicas (HSDP: one per node group, their all-reduce once a
step crosses nodes), pipeline stages outermost. Their product is the world size. Expert
parallelism reuses data-parallel and context ranks (its degree divides shard x context), so it
is not a factor of the product. Today replicate, shard, context and tensor can exceed 1: over the
world / (tp x cp) data-parallel ranks, ddp replicates, fsdp shards, hsdp shards within groups of
`parallel.shard_size` ranks (default: one node's data-parallel ranks) and replicates across groups.
Where tp x cp leave a node fewer than 2 data-parallel ranks, that default would shard nothing
(every GPU the whole optimizer state): hsdp then asks for parallel.shard_size rather than
replicate silently or pick a group across nodes.

The data-parallel ranks (replicate x shard) each read their own share of every batch (the ranks
of one tensor-parallel group read the same samples, those of a context-parallel group each 2 of
2 x cp chunks of every sequence); a step's loss is the sum over the replicate x shard x context
ranks, each rank's divided by the step's global count of trained targets.

Roles (Layout.mesh), each cut from one world mesh (never enumerated by hand, so the number of
process groups grows with the mesh's dimensions, not with the ranks; on NCCL each dimension is
one communicator split, torch's DeviceMesh `split_group`):

    role      dimensions                 used by
    batch     replicate x shard          the data share (the sampler's rank and degree)
    loss      replicate x shard x cp     a step's loss and its normaliser; DDP's all-reduce; evaluation
    fsdp      shard x cp                 FSDP2's shards (hsdp: fsdp_mesh() = replicate x fsdp, 2-D)
    fsdp_tp   shard x cp x tp            the gradient norm of a weight split by FSDP2 and tp: one all-reduce
    cp, tp, pp                           context parallel's gathers, tensor parallel's plan, the stages
    expert    pp, replicate, efsdp, ep   (efsdp x ep = shard x cp) made only where parallel.ep > 1

The FSDP2 mesh is never "all ranks" by default: under pipeline parallel that would shard across
stages. This module imports nothing else of llmtrain but the tensor-parallel plans (tensor.py),
nor torch at import (config/rules.py and the estimator ask it on a login node).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ..model.moe import experts_in
from .tensor import problems as plan_problems

SHARDED_STRATEGIES = ("fsdp", "hsdp")
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")  # (zbv, dualpipev: not yet, see _pipeline_problems)
PIPELINE_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3",  # rotary decoders: embed, layers, norm, head
                               "qwen2_moe", "qwen3_moe", "mixtral", "olmoe"})
LAYOUT = ("pipeline", "replicate", "shard", "context", "tensor")  # outermost first
MESH_DIMS = ("pp", "replicate", "shard", "cp", "tp")  # the world mesh's dimensions, in LAYOUT's order
ROLES = {"batch": ("replicate", "shard"), "loss": ("replicate", "shard", "cp"), "fsdp": ("shard", "cp"),
         "fsdp_tp": ("shard", "cp", "tp"), "pp": ("pp",), "replicate": ("replicate",), "cp": ("cp",),
         "tp": ("tp",)}


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
    stages_per_rank: int = 1  # pipeline stages a rank holds (interleaved schedules: 2 or more)

    per_node: int = 0  # the processes of one node, where known (0: not known)
    # hsdp without parallel.shard_size: the node size its default shard group came from (0: the
    # key was set, or not hsdp); problems() names it when that default cannot shard
    default_node: int = 0
    stray_shard_size: bool = False  # parallel.shard_size set for ddp or fsdp, which have no use for it

    @classmethod
    def from_config(cls, cfg, world_size: int, procs_per_node: int | None = None) -> "ParallelDims":
        """The degrees of `cfg` (a config.Config) on `world_size` ranks. procs_per_node: the processes of one node
        (torchrun's LOCAL_WORLD_SIZE in a job), hsdp's default shard group; None: the slurm
        section's."""
        strategy, tp, cp, pp = cfg.parallel.strategy, cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.pp
        known = procs_per_node or 0
        dp = world_size // (pp * tp * cp) if tp >= 1 and cp >= 1 and pp >= 1 else 0
        stray = cfg.parallel.shard_size is not None
        v = cfg.parallel.pp_stages_per_rank or (2 if cfg.parallel.pp_schedule == "interleaved_1f1b" else 1)
        common = {"context": cp, "tensor": tp, "pipeline": pp, "stages_per_rank": v, "per_node": known,
                  "expert": cfg.parallel.ep}
        if strategy == "ddp":
            return cls(world_size, strategy, replicate=dp, stray_shard_size=stray, **common)
        if strategy == "fsdp":
            return cls(world_size, strategy, shard=dp, stray_shard_size=stray, **common)
        if cfg.parallel.shard_size is not None:
            shard = cfg.parallel.shard_size
            return cls(world_size, strategy, replicate=dp // shard if shard >= 1 else 0, shard=shard, **common)
        per_node = procs_per_node or min(world_size, cfg.world_size // max(1, cfg.slurm.nodes))
        shard = _default_shard(dp, per_node // (tp * cp) if dp else 0)
        return cls(world_size, strategy, replicate=dp // shard if shard else 0, shard=shard, default_node=per_node,
                   **common)

    def problems(self) -> list[str]:
        """What is wrong with the degrees, one line each, naming the key to change."""
        if self.stray_shard_size:
            return [f"parallel.shard_size: only used with parallel.strategy: hsdp (got strategy {self.strategy})"]
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
        pp = self.pipeline
        if pp < 1 or (self.world_size // tp) % pp:
            return [f"parallel.pp: must divide the world size / parallel.tp = {self.world_size // tp} (got {pp})"]
        cp = self.context
        if cp < 1 or (self.world_size // (tp * pp)) % cp:
            of = f"parallel.tp x parallel.pp = {self.world_size // (tp * pp)}" if pp > 1 else f"parallel.tp = {self.world_size // tp}"
            return [f"parallel.cp: must divide the world size / {of} (got {cp})"]
        if self.strategy == "hsdp" and self.shard == 0 and self.default_node:
            return [_unset_shard_size(self.world_size // (tp * cp * pp), self.default_node, tp, cp)]
        if self.strategy == "hsdp" and (self.shard < 1 or (self.world_size // (tp * cp * pp)) % self.shard):
            if tp * cp * pp > 1:
                return [f"parallel.shard_size: must divide the {self.world_size // (tp * cp * pp)} data-parallel ranks "
                        f"(world size {self.world_size} / (parallel.pp {pp} x parallel.tp {tp} x parallel.cp {cp}); "
                        f"got {self.shard})"]
            return [f"parallel.shard_size: must divide the world size {self.world_size} (got {self.shard}); "
                    f"hsdp shards within groups of shard_size ranks and replicates across them"]
        if self.expert > 1 and self.strategy not in SHARDED_STRATEGIES:
            return [f"parallel.ep: expert parallel runs with parallel.strategy fsdp or hsdp (got {self.strategy}); "
                    f"set parallel.ep: 1"]
        if self.expert < 1 or (self.shard * cp) % self.expert:
            return [f"parallel.ep: must divide the shard x context-parallel ranks {self.shard * cp} (got "
                    f"{self.expert}); experts are spread over ranks that hold the same dense weights"]
        product = self.pipeline * self.replicate * self.shard * self.context * self.tensor
        if product != self.world_size:
            sizes = " x ".join(f"{name} {getattr(self, name)}" for name in LAYOUT)
            return [f"parallel: the degrees multiply to {product} ({sizes}), not the world size "
                    f"{self.world_size}; change them or the processes (slurm.nodes x slurm.procs_per_node)"]
        return []

    # -- each rank's share of the work: asked here, never recomputed --------------------------------

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

    @property
    def param_shards(self) -> int:
        """The ranks FSDP2 splits a parameter's (tensor-parallel slice's) rows over: its shard
        group, whose context-parallel ranks hold the same weights (1 under DDP)."""
        return self.shard * self.context if self.sharded else 1

    @property
    def seq_len_divisor(self) -> int:
        """What data.seq_len must be a multiple of: tensor parallel splits the sequence between
        layers over tp ranks, context parallel cuts it into 2 x cp chunks (a rank takes chunks r
        and 2 cp - 1 - r, which evens out causal attention's work), each split by tp."""
        return self.tensor * (2 * self.context if self.context > 1 else 1)

    def accumulation(self, global_batch: int, micro_batch: int) -> int:
        """Micro-batches a rank runs per step (at least 1)."""
        return max(1, global_batch // (micro_batch * self.dp))

    def tokens_per_rank(self, samples: int, seq_len: int) -> int:
        """The tokens a rank computes of `samples` sequences its data-parallel rank reads: a
        context-parallel rank its 1 / cp of each (tensor-parallel ranks all of them)."""
        return samples * seq_len // self.context

    # -- the rules a config and a model must satisfy under the layout ------------------------------

    def config_problems(self, cfg) -> list[str]:
        """What the rest of `cfg` (a config.Config) must satisfy under these degrees: the batch
        and evaluation shares, the sequence's split, and what tp and cp need of attention, compile
        and the loss. One line each, naming the key."""
        t, d, par = cfg.train, cfg.data, cfg.parallel
        world, p = self.world_size, []
        usable = not self.problems()
        dp = self.dp if usable else world  # data-parallel ranks
        ranks = f"the world size {world}" if dp == world else f"the {dp} data-parallel ranks"
        if 0 < t.eval_samples < dp and t.eval_every > 0:
            p.append(f"train.eval_samples: must be >= {ranks}, so every rank evaluates "
                     f"at least one sample (got {t.eval_samples})")
        micro = t.micro_batch_size * dp
        if micro > 0 and t.global_batch_size > 0 and t.global_batch_size % micro:
            what = ("world size" if dp == world else "data-parallel ranks (world size / parallel.tp)"
                    if self.context == 1 else "data-parallel ranks (world size / (parallel.tp x parallel.cp))")
            p.append(f"train.global_batch_size: must be divisible by micro_batch_size x {what} "
                     f"= {t.micro_batch_size} x {dp} = {micro} (got {t.global_batch_size})")
        chunks = self.seq_len_divisor if self.tensor >= 1 and self.context >= 1 else 1
        if chunks > 1 and usable and d.seq_len % chunks:
            if self.context == 1:
                p.append(f"data.seq_len: must be divisible by parallel.tp {self.tensor} (got {d.seq_len}); between "
                         f"layers each rank of a tensor-parallel group holds seq_len / tp tokens")
            else:
                p.append(f"data.seq_len: must be divisible by 2 x parallel.cp x parallel.tp = {chunks} (got "
                         f"{d.seq_len}); each context-parallel rank takes 2 of 2 x cp chunks of a sequence")
        if self.context > 1 and cfg.model.attn_implementation != "sdpa":
            p.append(f"model.attn_implementation: context parallel attends with sdpa over the gathered keys and "
                     f"values (got {cfg.model.attn_implementation}); set model.attn_implementation: sdpa")
        if self.context > 1 and t.compile:
            p.append("train.compile: not with context parallel yet (its attention gathers keys and values between "
                     "ranks); set train.compile: false with parallel.cp > 1")
        if self.pipeline > 1 and usable:
            p += self._pipeline_problems(cfg, dp)
        if par.zero is not None and self.pipeline > 1:
            p.append(f"parallel.zero: not with parallel.pp (got pp {self.pipeline}): a pipeline stage keeps its layers "
                     f"gathered over a step's micro-batches and reduces once a step anyway; remove parallel.zero")
        if par.grad_compression != "none" and self.loss_ranks == 1:
            p.append(f"parallel.grad_compression: compresses the gradients' reduction between data-parallel ranks "
                     f"(got {par.grad_compression} with one data-parallel rank); set it to none")
        elif par.grad_compression == "bf16" and usable and gradients_held(
                self.strategy, self.pipeline, par.reduce_every_micro_batch,
                n := self.accumulation(t.global_batch_size, t.micro_batch_size)):
            held = ("parallel.zero 1" if par.zero == 1 else "reduce_every_micro_batch: false"
                    if not par.reduce_every_micro_batch else f"parallel.pp {self.pipeline}" if self.pipeline > 1
                    else "hsdp's replicas")
            p.append(f"parallel.grad_compression: under FSDP2 bf16 is the dtype gradients are reduced and held in: with "
                     f"{held}, {n} micro-batches' gradients would be added up in bf16, not only sent so; use it where "
                     f"each micro-batch is reduced at once (fsdp without pp, parallel.zero 2 or 3), with one "
                     f"micro-batch a step, or under ddp")
        elif par.grad_compression == "powersgd" and self.sharded:
            p.append(f"parallel.grad_compression: powersgd compresses DDP's all-reduce of the gradients (got it with "
                     f"parallel.strategy {self.strategy}); use parallel.strategy ddp, or bf16 (FSDP2 then "
                     f"reduce-scatters the gradients in bf16)")
        if par.powersgd_rank < 1:
            p.append(f"parallel.powersgd_rank: must be >= 1 (got {par.powersgd_rank})")
        if par.tp > 1 and not t.chunked_loss:
            p.append("train.chunked_loss: tensor parallel computes the loss from each rank's slice of the "
                     "vocabulary, chunk by chunk; set train.chunked_loss: true (got false)")
        return p

    def _pipeline_problems(self, cfg, dp: int) -> list[str]:
        """What pipeline parallel needs of the rest of the config, and what it does not do yet."""
        par, t, p = cfg.parallel, cfg.train, []
        v = self.stages_per_rank
        if par.pp_schedule not in PIPELINE_SCHEDULES:
            # tried: their V placement runs, but their backward in two passes (input, then weight
            # gradients) meets the chunked loss, whose backward scales its saved gradients in place
            p.append(f"parallel.pp_schedule: {par.pp_schedule} splits each backward in two passes, which llmtrain's "
                     f"loss does not support yet; use {', '.join(PIPELINE_SCHEDULES)}")
        elif par.pp_schedule == "interleaved_1f1b" and v < 2:
            p.append(f"parallel.pp_stages_per_rank: interleaved_1f1b holds at least 2 stages a rank (got {v}); "
                     f"set 2 or more, or parallel.pp_schedule: 1f1b")
        elif par.pp_schedule != "interleaved_1f1b" and v != 1:
            p.append(f"parallel.pp_stages_per_rank: {par.pp_schedule} holds one stage a rank (got {v}); set "
                     f"parallel.pp_schedule: interleaved_1f1b, or leave parallel.pp_stages_per_rank unset")
        if self.context > 1:
            p.append(f"parallel.pp: not with parallel.cp yet (got cp {self.context}); use pipeline with tp, fsdp, "
                     f"hsdp or ddp")
        if self.strategy == "ddp" and dp > 1:
            p.append(f"parallel.strategy: with parallel.pp {self.pipeline} and {dp} data-parallel ranks, use fsdp or "
                     f"hsdp (each stage's weights gathered once a step); ddp pipelines a single replica only")
        if t.fp8 != "none":
            p.append(f"train.fp8: not with parallel.pp yet (got {t.fp8}); set train.fp8: none")
        if t.precision == "fp16":  # each stage's loss scaler would find its own overflows and skip alone
            p.append("train.precision: fp16 not with parallel.pp yet (its loss scaler skips steps stage by stage); "
                     "use bf16")
        return p

    def pipeline_warnings(self, cfg) -> list[str]:
        """What makes a pipeline run slow without being wrong: fewer micro-batches a step than stages
        (the pipeline is then mostly idle)."""
        t = cfg.train
        if self.pipeline <= 1 or t.micro_batch_size < 1 or self.dp < 1:
            return []
        n = self.accumulation(t.global_batch_size, t.micro_batch_size)
        if n >= self.pipeline:
            return []
        return [f"warning: parallel.pp {self.pipeline} with {n} micro-batch{'es' if n != 1 else ''} a step "
                f"(train.global_batch_size / (train.micro_batch_size x {self.dp} data-parallel ranks)) leaves "
                f"the pipeline mostly idle; lower train.micro_batch_size or raise train.global_batch_size "
                f"to at least {self.pipeline} micro-batches"]

    def model_problems(self, model_type: str | None, model_config: dict) -> list[str]:
        """What keeps a model (its config.json as a dict) from this layout: its family's
        tensor-parallel plan, and heads, key/value heads, vocabulary and MLP width that tp divides;
        the pipeline's families, layers and untied head."""
        p = plan_problems(model_type, model_config, self.tensor) if self.tensor >= 1 else []
        experts = experts_in(model_config)
        if self.expert > 1 and (experts <= 1 or experts % self.expert):
            p.append(f"parallel.ep: must divide the model's experts a layer (got {self.expert} for "
                     f"{experts or 'a dense model, no experts'}); set parallel.ep: 1" if experts <= 1 else
                     f"parallel.ep: must divide the model's {experts} experts a layer (got {self.expert})")
        if self.pipeline <= 1:
            return p
        if model_type not in PIPELINE_FAMILIES:
            p.append(f"parallel.pp: model type {model_type!r} has no pipeline stages in llmtrain yet (families: "
                     f"{', '.join(sorted(PIPELINE_FAMILIES))}); set parallel.pp: 1")
        layers = model_config.get("num_hidden_layers") or 0
        stages = self.pipeline * self.stages_per_rank
        if layers + 2 < stages:
            p.append(f"parallel.pp: {stages} stages need at least {stages - 2} decoder layers (the embedding and the "
                     f"head count as one each; the model has {layers}); lower parallel.pp")
        if self.tensor > 1 and experts > 1:  # each tp rank routes its slice: the stages' statistics would differ
            p.append(f"parallel.pp: not with parallel.tp for a Mixture-of-Experts model yet (got tp {self.tensor}); "
                     f"use pipeline with fsdp, hsdp or ddp")
        if model_config.get("tie_word_embeddings", False):  # False: the families' default
            p.append("parallel.pp: the model ties its input and output embeddings (tie_word_embeddings), which live "
                     "on the first and the last stage; untie them (model.architecture.tie_word_embeddings: false, "
                     "training from scratch) or set parallel.pp: 1")
        return p

    @classmethod
    def candidates(cls, cfg, world_size: int, per_node: int, model_type: str | None = None,
                   model_config: dict | None = None) -> list["ParallelDims"]:
        """Every valid layout of `cfg`'s run on world_size processes of per_node a node: strategy
        x tp (dividing a node) x cp (powers of 2), with the pipeline and expert degrees at 1 (their
        slots), each passing problems(), the sequence's split and (given the model's config) its
        family's plan. In a fixed order: strategy, then tp, then cp. The estimator lists some of
        them; the planner ranks them."""
        out = []
        for strategy in ("ddp", "fsdp", "hsdp"):
            for tp in [n for n in range(1, per_node + 1) if per_node % n == 0]:
                cp = 1
                while tp * cp <= world_size:
                    shard_size = cfg.parallel.shard_size if strategy == "hsdp" else None  # the user's, for hsdp
                    par = dataclasses.replace(cfg.parallel, strategy=strategy, tp=tp, cp=cp, shard_size=shard_size,
                                              pp=1, pp_stages_per_rank=None, ep=1)
                    dims = cls.from_config(dataclasses.replace(cfg, parallel=par), world_size, per_node)
                    if (not dims.problems() and cfg.data.seq_len % dims.seq_len_divisor == 0
                            and not (model_config and dims.model_problems(model_type, model_config))):
                        out.append(dims)
                    cp *= 2
        return out

    def describe(self) -> str:
        """For the start-up log line: 'ddp over 4 ranks', 'hsdp over 8 ranks (2 replicas x 4-way shards)',
        'fsdp over 8 ranks (mesh: dp_shard 4 x tp 2)'. hsdp always states both its sizes, a shard
        group of 1 (every rank the whole model's state) included."""
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        if self.pipeline > 1:
            inner = dataclasses.replace(self, world_size=self.world_size // self.pipeline, pipeline=1).describe()
            return f"pipeline of {self.pipeline} stages over {ranks}, each {inner}"
        if not self.sharded and self.loss_ranks == 1 and self.tensor > 1:  # nothing for DDP to average
            return f"tensor parallel over {ranks} (mesh: tp {self.tensor}; no data parallelism)"
        experts = (f"; experts over ep {self.expert} x {self.shard * self.context // self.expert}-way shards"
                   if self.expert > 1 else "")
        if self.tensor > 1 or self.context > 1:
            sizes = {"dp_replicate": self.replicate, "dp_shard": self.shard, "cp": self.context, "tp": self.tensor}
            shown = [name for name, n in sizes.items() if n > 1 or (self.strategy == "hsdp" and name[:3] == "dp_")]
            return f"{self.strategy} over {ranks} (mesh: {' x '.join(f'{name} {sizes[name]}' for name in shown)}){experts}"
        if self.strategy == "hsdp":
            return f"hsdp over {ranks} ({self.replicate} replicas x {self.shard}-way shards){experts}"
        return f"{self.strategy} over {ranks}{experts}"


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


def gradients_held(strategy: str, pp: int, reduce_every_micro_batch: bool, accumulation: int) -> bool:
    """Whether FSDP2 holds gradients over a step's micro-batches before their last reduction (the
    deferred reduce-scatter, a pipeline's, hsdp's replicas' partial sums), in its reduce dtype."""
    return strategy != "ddp" and accumulation > 1 and (not reduce_every_micro_batch or pp > 1 or strategy == "hsdp")


def layout_name(strategy: str, tp: int = 1, cp: int = 1, shard: int = 0, pp: int = 1, schedule: str = "",
                ep: int = 1, zero: int | None = None) -> str:
    """A layout as check-config and the estimator name it: 'fsdp', 'fsdp x cp 2 x tp 8',
    'hsdp x tp 8 (4-way shards)' (shard: hsdp's shard group, where known), 'pp 8 (1f1b) x fsdp x tp 8',
    'fsdp x ep 8', 'fsdp (ZeRO-2)' (zero: parallel.zero, where set)."""
    name = (strategy + (f" x cp {cp}" if cp > 1 else "") + (f" x tp {tp}" if tp > 1 else "")
            + (f" x ep {ep}" if ep > 1 else ""))
    name = (f"pp {pp}{f' ({schedule})' if schedule else ''} x " if pp > 1 else "") + name
    return (name + (f" ({shard}-way shards)" if strategy == "hsdp" and shard else "")
            + (f" (ZeRO-{zero})" if zero else ""))


@dataclass(frozen=True)
class Layout:
    """One rank's view of the layout: the degrees, its coordinates and its process groups by
    role (world.layout). The loss, the step, evaluation and the wrapping take this, not loose
    groups: which slice of a sequence a rank computes and which head it applies follow from it."""
    dims: ParallelDims
    rank: int
    device_type: str

    def coordinate(self, role: str) -> int:
        """This rank's place in `role`'s group (a ROLES name), by the layout's rank order."""
        sizes = dict(zip(MESH_DIMS, (self.dims.pipeline, self.dims.replicate, self.dims.shard, self.dims.context,
                                     self.dims.tensor)))
        place, stride = 0, 1
        for name in reversed(MESH_DIMS):  # innermost first
            if name in ROLES[role]:
                place += (self.rank // _stride(sizes, name) % sizes[name]) * stride
                stride *= sizes[name]
        return place

    def mesh(self, role: str):
        """The device mesh of `role` (ROLES), 1-D: this rank's group of it."""
        return _meshes(self.dims, self.device_type)[role]

    def fsdp_mesh(self):
        """The mesh FSDP2 shards over: fsdp's ranks (shard x cp), for hsdp with the replicas as
        the outer dimension of a 2-D (replicate, fsdp) mesh: sharded within, replicated across."""
        meshes = _meshes(self.dims, self.device_type)
        return meshes["hsdp"] if self.dims.strategy == "hsdp" else meshes["fsdp"]

    def expert_mesh(self):
        """The expert view, (pp, replicate, efsdp, ep, tp) with efsdp x ep = shard x cp: made only
        where the expert degree exceeds 1."""
        return _meshes(self.dims, self.device_type)["expert"]

    def expert_fsdp_mesh(self):
        """The mesh FSDP2 shards the experts over (expert parallel): the ranks holding the same
        experts, efsdp; for hsdp the replicas as its outer dimension, as fsdp_mesh()."""
        view = self.expert_mesh()
        return view["replicate", "efsdp"] if self.dims.strategy == "hsdp" else view["efsdp"]


def _stride(sizes: dict[str, int], name: str) -> int:
    """How many ranks apart two neighbours along mesh dimension `name` are."""
    inner = MESH_DIMS[MESH_DIMS.index(name) + 1:]
    return functools.reduce(lambda a, b: a * sizes[b], inner, 1)


@functools.cache
def _meshes(dims: ParallelDims, device_type: str) -> dict:
    """Every role's mesh, cut from one 1-D mesh over the world once per process (every rank
    makes the same calls in the same order, as DeviceMesh needs). The dense view unflattens the
    world into the layout's five dimensions; each role of several dimensions is their flattened
    mesh, kept here (slicing a flattened dimension back out of the root is deprecated since torch
    2.11). hsdp's 2-D mesh and the expert view are further views of the world, made only where
    the layout uses them. The flattened (shard, cp, tp) dimension lets DTensor sum the gradient
    norm of a weight split by FSDP2 and tensor parallel in one all-reduce: without it, two in a
    row and a warning on every rank ("2 sequential all_reduce operations ... flatten")."""
    from torch.distributed.device_mesh import init_device_mesh
    sizes = (dims.pipeline, dims.replicate, dims.shard, dims.context, dims.tensor)
    world = init_device_mesh(device_type, (dims.world_size,), mesh_dim_names=("world",))
    dense = world._unflatten(0, sizes, MESH_DIMS)
    meshes = {role: dense[names] if len(names) == 1 else dense[names]._flatten(role)
              for role, names in ROLES.items()}
    meshes["world"] = dense
    fsdp = dims.shard * dims.context
    if dims.strategy == "hsdp":
        meshes["hsdp"] = world._unflatten(0, (dims.pipeline, dims.replicate, fsdp, dims.tensor),
                                          ("pp", "replicate", "fsdp", "tp"))["replicate", "fsdp"]
    if dims.expert > 1:
        meshes["expert"] = world._unflatten(0, (dims.pipeline, dims.replicate, fsdp // dims.expert, dims.expert,
                                                dims.tensor), ("pp", "replicate", "efsdp", "ep", "tp"))
    return meshes
