"""`llmtrain plan`: every layout a run can take on a cluster, the memory each needs per GPU (the
estimator's, login/estimate.py) and the step time a cost model predicts for it, ranked.

    gpu = gpu_named("h100")                                   # the datasheet's figures
    ranked = plan(cfg, shape, world=64, per_node=8, gpu=gpu)  # [(Candidate, Cost)], fastest first
    lines = report(cfg, ranked, gpu, world, per_node)         # the table, why the best wins, its --set
    mine = predict(cfg, gpu, world, per_node)                  # the config's own layout: a Cost

The cost model, per optimizer step and GPU (each term in seconds; T: a micro-batch's tokens on
this GPU's tensor-parallel group, m: micro-batches a step, L: layers, h: hidden, p: 2 bytes):

    compute   training FLOPs (model/build.flops_per_token: 6 per active parameter that multiplies,
              12 L h seq for attention) x the step's tokens / GPUs, plus the recomputed forwards
              (a third of a layer's, for each checkpointed layer), at MATMUL_EFFICIENCY of the
              datasheet's dense bf16 peak (the kernels' average, not a GEMM's best); FP8's linear FLOPs at its fp8 peak, less FP8_OVERHEAD
    fsdp      all-gathers of the GPU's tensor-parallel part of the weights (p bytes; twice a
              micro-batch resharded after forward (ZeRO-3), once without (ZeRO-2), once a step
              under pp and ZeRO-1) and reduce-scatters of the trainable parameters' gradients
              (fp32, or bf16 under parallel.grad_compression; every micro-batch, or once a step),
              (S - 1) / S of it on the wire over S shards; hsdp adds the replicas' all-reduce of a
              shard's gradients; ddp one all-reduce of every trainable gradient (in bf16, or as
              PowerSGD's factors, under parallel.grad_compression).
              They overlap compute: only what exceeds it, plus one layer's gather and reduction, is
              exposed (all of it on a CPU, whose cores do both)
    tp        sequence parallel's all-gathers and reduce-scatters, 4 a layer forward, 4 backward
              (and 4 per recomputed layer) of T x h, on NVLink: exposed
    cp        each layer's keys and values gathered forward and their gradients reduced backward
    ep        2 all-to-alls a MoE layer forward and 2 backward of k T h, and a host read per layer
              and forward (parallel/experts.py)
    host      the host's dispatch of each layer pass: HOST_LAYER_S, + HOST_TP_LAYER_S under tp
              (DTensor's styles; 2.2 ms compiled), + HOST_CP_LAYER_S under cp, +
              HOST_FSDP_LAYER_S under FSDP2 (fsdp, hsdp), times GPU.host_scale; a GPU
              hides it behind the step's device work up to that work's time, so only the excess
              is exposed (all of it on a CPU, whose host is its device)
    bubble    the pipeline's, (pp - 1) / (v m + pp - 1) of the step idle
    p2p       the activations sent to the next stage and their gradients back

Every collective moves its bytes at LINK_EFFICIENCY of the GPU's NVLink bandwidth when its group
sits inside a node, else of the GPU's network bandwidth. Where a job's preflight measured the
cluster (training/preflight.py writes $LLMTRAIN_HOME/cluster/<GPU>.json), its all-reduce bus
bandwidths inside and across nodes replace those, and compute scales by its GEMM rate against
GEMM_EFFICIENCY of the datasheet. All-gathers and reduce-scatters (fsdp, tp, cp) move theirs at
GPU.gather_scale of that rate: 1 under NCCL, gloo's measured on a CPU. What the model does not know:
kernel efficiency at small shapes, NCCL's latency at thousands of ranks, the overlap FSDP2's
prefetch reaches, stragglers, a GPU node's host (the host figures are this project's CI CPU's). Its
figures rank layouts; they are not a promise of tokens/s (doc/benchmarks.md, "The planner", compares
them with measured runs).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, UserError
from ..config.schema import ZERO_STAGES
from ..data.sources import HOME_VAR
from ..parallel.dims import PIPELINE_FAMILIES, ParallelDims, gradients_held, layout_name
from ..gpus import GPU, GPUS, gpu_called
from .estimate import GIB, HEADROOM, ModelShape, estimate, model_shape, slurm_text

# Of the datasheet's peak, what a training step's kernels reach on average: large GEMMs 0.70-0.75
# on an H100, attention and the elementwise rest far less. 0.5 puts Llama-3-70B on 64 H100s at
# 45% MFU, near the 38-43% published for Llama 3 and NeMo (doc/benchmarks.md, "The planner").
MATMUL_EFFICIENCY = 0.5
LINK_EFFICIENCY = 0.8  # of a link's bandwidth a large collective reaches (NCCL's bus bandwidth)
FP8_OVERHEAD = 0.75  # of FP8's matmul speed left after its casts and scales (torchao's float8 training)
HOST_READ_S = 30e-6  # one device-to-host read of expert parallel's splits, the stream drained
# The host's work a decoder layer (forward and backward): the plain layer's dispatch, and what
# tensor parallel's DTensor styles, context parallel's DTensor gathers of the keys and values and
# FSDP2's hooks add (dispatch and redistributions, not the links: the same at a degree of 2 and
# 8). Measured by bench/host.py on the CI machine's CPU, 2026-11-29: the plain layer 2.0-2.9 ms
# eager (1.4-2.3 compiled: kept at the eager figure); tp +11.5-16.7 ms eager, +1.7-2.7 compiled;
# cp +3.2-4.4 (eager: training refuses train.compile under cp); FSDP2 +4.8-8.4 over 2 and 8 ranks
# (its hooks stay outside compiled layers; charged at 6, the middle), of the size training's own
# profile shows (FSDP2's post-backward hook alone 8-8.5 ms a layer pass under fsdp and fsdp x cp on
# 2 processes; 1.9 under tp 2, whose FSDP2 group is one rank; 2026-11-29). A GPU node's host is
# not measured yet (bench/host.py --device cuda). Under ep, the host read that drains the stream
# each MoE layer (HOST_READ_S) keeps the host from running ahead, which the overlap below does not
# know.
HOST_LAYER_S = 2.5e-3
HOST_TP_LAYER_S = {False: 14e-3, True: 2.2e-3}  # by train.compile
HOST_CP_LAYER_S = 3.6e-3
HOST_FSDP_LAYER_S = 6e-3


def gpu_named(name: str) -> GPU:
    """The GPU `name` spells (`h100`, `H200`, `a100-80gb`); UserError naming those the planner
    knows (the table's GPUs with a network figure)."""
    gpu = gpu_called(name)
    if gpu is None or not gpu.plannable:
        known = ", ".join(g.name for _, g in GPUS if g.plannable)
        raise UserError(f"--gpu: {name!r} is not a GPU the planner knows ({known}); name one of those")
    return gpu


def gpu_in(name: str | None, cfg: Config) -> GPU:
    """--gpu's GPU, else the one the slurm section names (extra_args' --gres or --constraint,
    the partition, the qos), with the cluster's measurements where a preflight recorded them;
    UserError where neither names one."""
    if name:
        return measured(gpu_named(name))
    gpu = gpu_called(slurm_text(cfg))
    if gpu is None or not gpu.plannable:
        raise UserError("--gpu: the slurm section names no GPU the planner knows (slurm.extra_args' --gres, the "
                        "partition); name it: --gpu h100")
    return measured(gpu)


def measured(gpu: GPU) -> GPU:
    """`gpu` with the newest preflight record of its kind ($LLMTRAIN_HOME/cluster/*.json, a
    device name the table reads as this GPU): its GEMM rate and bandwidths."""
    home = os.environ.get(HOME_VAR)
    records = []
    for path in sorted(Path(home).glob("cluster/*.json")) if home else ():
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        called = gpu_called(str(record.get("device_name", "")))
        if called is not None and called.name == gpu.name and record.get("matmul", {}).get("dtype") == "bfloat16":
            records.append(record)
    if not records:
        return gpu
    r = max(records, key=lambda r: r.get("time", 0))
    when = time.strftime("%Y-%m-%d", time.gmtime(r.get("time", 0)))
    return dataclasses.replace(
        gpu, gemm_tflops=r.get("matmul_tflops"), intra_gbs=r.get("intra_node_busbw_gbps"),
        inter_gbs=r.get("inter_node_busbw_gbps"),
        measured=f"measured by job {r.get('job_id')}'s preflight on {r.get('nodes')} nodes, {when}")


@dataclass(frozen=True)
class Candidate:
    """One way to run the config: its layout and the choices that trade memory for speed."""
    strategy: str
    tp: int = 1
    cp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    ep: int = 1
    checkpointing: int = 1  # 0: off; k: every k-th layer
    micro_batch: int = 1
    reshard: bool = True  # fsdp: free a layer's gathered weights after its forward
    fp8: bool = False
    reduce_each: bool = True  # fsdp: reduce-scatter the gradients every micro-batch, not once a step
    compression: str = "none"  # the config's parallel.grad_compression where the layout takes it (lossy: never chosen)
    shard_size: int | None = None  # hsdp: the shard group (None: a node's data-parallel ranks)

    def overrides(self) -> list[str]:
        """The `--set` arguments that make a config this candidate."""
        sets = [f"parallel.strategy={self.strategy}", f"parallel.tp={self.tp}", f"parallel.cp={self.cp}",
                f"parallel.pp={self.pp}", f"parallel.ep={self.ep}",
                f"model.activation_checkpointing={'true' if self.checkpointing else 'false'}",
                f"train.micro_batch_size={self.micro_batch}", f"train.fp8={'tensorwise' if self.fp8 else 'none'}"]
        if self.pp > 1:
            sets.append(f"parallel.pp_schedule={self.schedule}")
        sets.append(f"parallel.grad_compression={self.compression}")  # none too: the config's may not apply
        if self.strategy == "hsdp":
            sets.append(f"parallel.shard_size={self.shard_size if self.shard_size else 'null'}")
        if self.checkpointing:
            sets.append(f"model.activation_checkpointing_every={self.checkpointing}")
        if self.strategy != "ddp" and self.pp == 1:
            sets.append(f"parallel.reshard_after_forward={'true' if self.reshard else 'false'}")
            sets.append(f"parallel.reduce_every_micro_batch={'true' if self.reduce_each else 'false'}")
        sets.append(f"parallel.zero={self.zero or 'null'}")  # the same settings by name, or none
        return sets

    @property
    def zero(self) -> int | None:
        """The ZeRO stage that these FSDP2 settings are (parallel.zero), if one is."""
        if self.strategy == "ddp" or self.pp > 1:
            return None
        settings = {"reshard_after_forward": self.reshard, "reduce_every_micro_batch": self.reduce_each}
        return next((n for n, stage in ZERO_STAGES.items() if stage == settings), None)

    def describe(self) -> str:
        name = layout_name(self.strategy, self.tp, self.cp, pp=self.pp,
                           schedule=self.schedule if self.pp > 1 else "", ep=self.ep, shard=self.shard_size or 0)
        ac = {0: "no checkpointing", 1: "checkpointing"}.get(self.checkpointing,
                                                              f"checkpointing 1 in {self.checkpointing}")
        fsdp = self.strategy != "ddp" and self.pp == 1
        stage = {1: ["ZeRO-1"], 2: ["ZeRO-2"], 3: []}.get(self.zero)  # 3: fsdp itself
        extras = [ac] + (stage if stage is not None else ["kept gathered"] * (fsdp and not self.reshard) + [
            "reduced once a step"] * (fsdp and not self.reduce_each))
        extras += [f"{self.compression} gradients"] if self.compression != "none" else []
        return f"{name}, {', '.join(extras + (['fp8'] if self.fp8 else []))}"

    def config(self, cfg: Config) -> Config:
        par = dataclasses.replace(cfg.parallel, strategy=self.strategy, tp=self.tp, cp=self.cp, pp=self.pp,
                                  pp_schedule=self.schedule, pp_stages_per_rank=None, ep=self.ep,
                                  reshard_after_forward=self.reshard, reduce_every_micro_batch=self.reduce_each,
                                  zero=self.zero,
                                  grad_compression=self.compression,
                                  shard_size=self.shard_size if self.strategy == "hsdp" else None)
        model = dataclasses.replace(cfg.model, activation_checkpointing=bool(self.checkpointing),
                                    activation_checkpointing_every=self.checkpointing or 1)
        train = dataclasses.replace(cfg.train, micro_batch_size=self.micro_batch,
                                    fp8="tensorwise" if self.fp8 else "none")
        return dataclasses.replace(cfg, parallel=par, model=model, train=train)


@dataclass(frozen=True)
class Cost:
    """A candidate's predicted step: seconds in all and by part (compute, then what each degree
    adds that is not hidden behind it), its memory per GPU (the estimator's total), tokens/s per
    GPU and MFU (of the bf16 peak)."""
    seconds: float
    parts: dict
    memory: int
    tokens_per_s: float
    mfu: float

    @property
    def main(self) -> str:
        """The largest part but compute, with its share of the step ('compute' where none is)."""
        name, s = max(((k, v) for k, v in self.parts.items() if k != "compute"), key=lambda kv: kv[1],
                      default=("compute", 0.0))
        return "compute" if s <= 0.01 * self.seconds else f"{name} {s / self.seconds:.0%}"


def model_dict(shape: ModelShape) -> dict:
    """What ParallelDims.model_problems reads of a config.json, from the estimator's shape."""
    return {"model_type": shape.model_type, "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
            "vocab_size": shape.vocab, "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
            "num_experts": shape.experts, "tie_word_embeddings": not shape.head_linear}


def layouts(cfg: Config, shape: ModelShape, world: int, per_node: int):
    """Every layout the layout owner accepts for this model on `world` GPUs of `per_node` a node:
    strategy x tp (inside a node) x cp x pp (1F1B; interleaved with 2 stages a rank) x ep (MoE:
    dividing the experts and shard x cp) x hsdp's shard group (a node's data-parallel ranks, or 2,
    4, ... nodes'); yields (candidate, its ParallelDims). One data-parallel rank is ddp's alone,
    one replica fsdp's."""
    model = model_dict(shape)
    powers = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= world]
    pps = [n for n in powers if n == 1 or (shape.model_type in PIPELINE_FAMILIES and n <= shape.layers)]
    eps = [n for n in powers if n == 1 or (shape.experts and shape.experts % n == 0)]
    tps = [n for n in powers if n <= per_node and per_node % n == 0]
    for strategy, tp, cp, pp, ep in itertools.product(("ddp", "fsdp", "hsdp"), tps, powers, pps, eps):
        if tp * cp * pp > world:
            continue
        for schedule in ("1f1b", "interleaved_1f1b") if pp > 1 else ("1f1b",):
            for shard_size in _shard_sizes(strategy, world // (tp * cp * pp), per_node // (tp * cp)):
                base = Candidate(strategy, tp, cp, pp, schedule, ep, shard_size=shard_size)
                dims = ParallelDims.from_config(base.config(cfg), world, per_node)
                how = cfg.parallel.grad_compression  # the user's, where this layout can have it
                if dims.loss_ranks > 1 and (how == "bf16" or (how == "powersgd" and strategy == "ddp")):
                    base = dataclasses.replace(base, compression=how)
                alt = base.config(cfg)
                if (dims.problems() or dims.config_problems(alt) or cfg.data.seq_len % dims.seq_len_divisor
                        or dims.model_problems(shape.model_type, model)):
                    continue
                if (strategy != "ddp" and dims.dp == 1) or (strategy == "hsdp" and dims.replicate == 1):
                    continue  # nothing to shard, or one replica: ddp's or fsdp's layout again
                if cfg.train.global_batch_size % dims.dp == 0:
                    yield base, dims


def _shard_sizes(strategy: str, dp: int, node_dp: int) -> list[int | None]:
    """hsdp's shard groups to try: a node's data-parallel ranks (None: the default), then 2, 4,
    ... nodes' while they leave 2 replicas or more; one, None, for the other strategies."""
    if strategy != "hsdp" or node_dp < 1:
        return [None]
    return [None] + [node_dp * k for k in (2, 4, 8, 16) if node_dp * k * 2 <= dp and dp % (node_dp * k) == 0]


def candidates(cfg: Config, shape: ModelShape, world: int, per_node: int, gpu: GPU, fp8: bool = True):
    """Each layout (layouts()) x checkpointing (off, 1 in 2, every layer) x the micro batches
    dividing a rank's share of the global batch x keeping fsdp's weights gathered x reducing
    fsdp's gradients once a step (with accumulation) x FP8 (where the GPU has it; not under pp);
    yields (candidate, its ParallelDims)."""
    for base, dims in layouts(cfg, shape, world, per_node):
        per_rank = cfg.train.global_batch_size // dims.dp
        fsdp = base.strategy != "ddp" and base.pp == 1
        for checkpointing in (0, 2, 1):
            for micro in [m for m in range(1, per_rank + 1) if per_rank % m == 0]:
                gathers = [(True, True), (False, True)] if fsdp else [(True, True)]
                if fsdp and per_rank > micro:  # accumulation: the reduction's two places
                    gathers += [(True, False), (False, False)]
                for (reshard, each), f8 in itertools.product(
                        gathers, (False, True) if fp8 and gpu.fp8_tflops and base.pp == 1 else (False,)):
                    # FSDP2 would hold the gradients in bf16 over the micro-batches (ParallelDims.config_problems)
                    held = gradients_held(base.strategy, base.pp, each, per_rank // micro)
                    compression = "none" if held and base.compression == "bf16" else base.compression
                    yield dataclasses.replace(base, checkpointing=checkpointing, micro_batch=micro, reshard=reshard,
                                              fp8=f8, reduce_each=each, compression=compression), dims


def plan(cfg: Config, shape: ModelShape, world: int, per_node: int, gpu: GPU,
         fp8: bool = True) -> list[tuple[Candidate, Cost]]:
    """The candidates that fit the GPU's memory less HEADROOM, fastest first (`fp8` False: none
    with FP8). A micro batch that does not fit is the last one tried of its layout (a larger one
    needs more)."""
    usable = gpu.memory_gib * (1 - HEADROOM) * GIB
    fitting, too_big = [], set()
    for cand, dims in candidates(cfg, shape, world, per_node, gpu, fp8):
        key = dataclasses.replace(cand, micro_batch=0, fp8=False)
        if key in too_big:
            continue
        alt = cand.config(cfg)
        memory = estimate(alt, world, shape=shape).total
        if memory > usable:
            too_big.add(key)
            continue
        fitting.append((cand, cost(alt, dims, shape, gpu, per_node, memory)))
    return sorted(fitting, key=lambda pair: pair[1].seconds)


def _flops_per_token(shape: ModelShape, seq: int) -> tuple[float, float]:
    """(all, the linear layers') training FLOPs per token, as model/build.flops_per_token counts them."""
    lookup = shape.vocab * shape.hidden if shape.head_linear else 0
    frozen = max(0, shape.params - shape.trainable - lookup)
    linear = 6 * (shape.active - lookup) - 2 * frozen
    return linear + 12 * shape.layers * shape.hidden * seq, linear


def cost(cfg: Config, dims: ParallelDims, shape: ModelShape, gpu: GPU, per_node: int, memory: int) -> Cost:
    """The predicted step of `cfg` laid out as `dims` (the module's docstring has the model)."""
    t, seq = cfg.train, cfg.data.seq_len
    tp, cp, pp, ep, L, h = dims.tensor, dims.context, dims.pipeline, dims.expert, shape.layers, shape.hidden
    p = 2 if t.precision in ("bf16", "fp16") else 4
    world = dims.world_size
    m = dims.accumulation(t.global_batch_size, t.micro_batch_size)
    step_tokens = t.global_batch_size * seq
    total, linear = _flops_per_token(shape, seq)
    checkpointed = (-(-L // cfg.model.activation_checkpointing_every) / L) if cfg.model.activation_checkpointing else 0
    flops = total * step_tokens / world * (1 + checkpointed / 3)
    peak = gpu.bf16_tflops * 1e12 * MATMUL_EFFICIENCY * gpu.compute_scale
    if t.fp8 != "none" and gpu.fp8_tflops:
        fp8 = gpu.fp8_tflops * 1e12 * MATMUL_EFFICIENCY * FP8_OVERHEAD * gpu.compute_scale
        compute = flops * (linear / total) / fp8 + flops * (1 - linear / total) / peak
    else:
        compute = flops / peak

    def link(ranks_spanned: int, gathers: bool = False) -> float:
        """Bytes/s of a group whose ranks lie within `ranks_spanned` consecutive ones, in its
        all-reduces (or, `gathers`, its all-gathers and reduce-scatters)."""
        inside = ranks_spanned <= per_node
        busbw = gpu.intra_gbs if inside else gpu.inter_gbs  # measured: what an all-reduce reaches
        rate = busbw * 1e9 if busbw else (gpu.nvlink_gbs if inside else gpu.network_gbs) * 1e9 * LINK_EFFICIENCY
        return rate * gpu.gather_scale if gathers else rate

    tokens = t.micro_batch_size * seq // cp  # a micro-batch's tokens on this GPU's tensor-parallel group
    parts = {"compute": compute}
    # data parallel: the weights' gathers and the gradients' reduction, overlapping compute
    weights = (shape.params - L * shape.layer_expert_params * (1 - 1 / ep)) / tp
    grads = weights * shape.trainable / shape.params  # LoRA: the adapters' alone are reduced
    if dims.sharded:
        shards = dims.shard * cp
        kept = not cfg.parallel.reshard_after_forward and not cfg.parallel.reduce_every_micro_batch  # ZeRO-1
        gathers = 1 if pp > 1 or kept else (2 if cfg.parallel.reshard_after_forward else 1) * m
        reductions = m if pp == 1 and cfg.parallel.reduce_every_micro_batch else 1
        reduced = 2 if cfg.parallel.grad_compression == "bf16" else 4  # bytes a gradient on the wire
        moved = (gathers * weights * p + reductions * grads * reduced) * (shards - 1) / shards / pp
        comm = moved / link(shards * tp, gathers=True)
        if dims.replicate > 1:
            comm += 2 * grads / shards * reduced * (dims.replicate - 1) / dims.replicate / pp / link(world)
    else:  # DDP's all-reduce of fp32 gradients, bf16 or PowerSGD's rank-r factors (parallel/compression.py)
        dp, how = dims.dp, cfg.parallel.grad_compression
        wire = 2.0 if how == "bf16" else 4.0
        if how == "powersgd" and shape.layer_weights:
            wire *= sum(cfg.parallel.powersgd_rank * (r + c) for _, r, c in shape.layer_weights) / sum(
                r * c for _, r, c in shape.layer_weights)
        comm = 2 * grads * wire * (dp - 1) / max(dp, 1) / pp / link(dp * cp * tp) if dp > 1 else 0.0
    # overlapping compute; on a CPU (host serial) the collectives take the cores the compute needs
    exposed = comm if gpu.host_serial else max(0.0, comm - compute) + comm / max(L // pp, 1)
    parts["fsdp" if dims.sharded else "ddp"] = exposed
    if tp > 1:  # sequence parallel: 4 collectives a layer forward, 4 backward, 4 a recomputed layer
        parts["tp"] = (8 + 4 * checkpointed) * L / pp * m * tokens * h * p * (tp - 1) / tp / link(tp, gathers=True)
    if cp > 1:  # keys and values gathered forward (again where recomputed), their gradients reduced
        kv = 2 * max(shape.kv_heads // tp, 1) * shape.head_dim * seq * t.micro_batch_size * p * (cp - 1) / cp
        parts["cp"] = (2 + checkpointed) * L / pp * m * kv / link(cp * tp, gathers=True)
    if ep > 1 and shape.experts:
        routed = shape.top_k * tokens // tp * h * p * (ep - 1) / ep
        parts["ep"] = (4 + 2 * checkpointed) * L / pp * m * (routed / link(ep * tp) + HOST_READ_S / 2)
    # The host's work: each layer's kernels dispatched (forward, backward, a recomputed forward),
    # DTensor adding more under tensor and context parallel. A GPU's host queues kernels ahead of
    # them, so only what exceeds the device's work shows; a CPU does both in turn.
    extra = ((HOST_TP_LAYER_S[t.compile] if tp > 1 else 0.0) + (HOST_CP_LAYER_S if cp > 1 else 0.0)
             + (HOST_FSDP_LAYER_S if dims.sharded else 0.0))
    host = L / pp * m * (1 + checkpointed / 3) * (HOST_LAYER_S + extra) * gpu.host_scale
    parts["host"] = host if gpu.host_serial else max(0.0, host - sum(parts.values()))
    work = sum(parts.values())
    if pp > 1:
        v = dims.stages_per_rank
        bubble = (pp - 1) / (v * m + pp - 1)
        parts["bubble"] = work * bubble / (1 - bubble)
        parts["p2p"] = 2 * v * m * tokens // tp * h * p / link(world // pp + 1)  # to the next stage and back
    seconds = sum(parts.values())
    return Cost(seconds, parts, memory, step_tokens / world / seconds,
                total * step_tokens / world / seconds / (gpu.bf16_tflops * 1e12))


def candidate_of(cfg: Config) -> Candidate:
    """The config's own choices as a candidate."""
    par, model = cfg.parallel, cfg.model
    fsdp = par.strategy != "ddp" and par.pp == 1  # where the two FSDP2 choices are the planner's to make
    return Candidate(par.strategy, par.tp, par.cp, par.pp, par.pp_schedule, par.ep,
                     model.activation_checkpointing_every if model.activation_checkpointing else 0,
                     cfg.train.micro_batch_size, par.reshard_after_forward or not fsdp, cfg.train.fp8 != "none",
                     par.reduce_every_micro_batch or not fsdp, par.grad_compression,
                     par.shard_size if par.strategy == "hsdp" else None)


def predict(cfg: Config, gpu: GPU, world: int, per_node: int, shape: ModelShape | None = None) -> Cost:
    """The cost model's step for the config's own layout on `world` GPUs of `per_node` a node,
    its memory the estimator's."""
    shape = shape or model_shape(cfg)
    memory = estimate(cfg, world, shape=shape).total
    return cost(cfg, ParallelDims.from_config(cfg, world, per_node), shape, gpu, per_node, memory)


def verdict(cfg: Config, gpu: GPU | None = None) -> str:
    """The planner's word on the config's own layout, for `submit.sh --dry-run`: whether it fits,
    and how much faster the planner's best is ('fits; the planner's best is 1.40x faster: ...').
    It never changes the config."""
    gpu = gpu or gpu_in(None, cfg)
    world, per_node = cfg.world_size, cfg.slurm.procs_per_node or cfg.slurm.gpus_per_node or 1
    shape = model_shape(cfg)
    mine = predict(cfg, gpu, world, per_node, shape)
    memory = mine.memory
    fits = memory <= gpu.memory_gib * (1 - HEADROOM) * GIB
    ranked = plan(cfg, shape, world, per_node, gpu)
    said = (f"fits ({memory / GIB:.1f} GiB a {gpu.name}), predicted {mine.tokens_per_s:,.0f} tokens/s a GPU"
            if fits else f"does not fit ({memory / GIB:.1f} GiB a {gpu.name})")
    if not ranked:
        return f"{said}; no layout fits {world} {gpu.name}s"
    best, c = ranked[0]
    if best == candidate_of(cfg) or c.seconds >= mine.seconds * 0.99:
        return f"{said}; the planner finds nothing faster"
    return (f"{said}; the planner's best is {mine.seconds / c.seconds:.2f}x faster: {best.describe()}, micro batch "
            f"{best.micro_batch} (llmtrain plan --config {cfg.path} shows it and its --set arguments)")


def report(cfg: Config, ranked: list[tuple[Candidate, Cost]], gpu: GPU, world: int, per_node: int,
           top: int = 5) -> list[str]:
    """The best `top` as a table, why the best wins over the next, and its --set arguments."""
    nodes = world // per_node
    facts = (f"{gpu.measured}: a {gpu.gemm_tflops:.0f} TFLOP/s bf16 GEMM, all-reduce "
             f"{gpu.intra_gbs or 0:.0f} GB/s inside a node, {gpu.inter_gbs or 0:.0f} across" if gpu.measured
             else "datasheet figures")
    head = (f"plan: {cfg.model.name_or_path or shape_name(cfg)} on {nodes} node{'s' if nodes != 1 else ''} x "
            f"{per_node} {gpu.name} ({gpu.memory_gib:g} GiB, {gpu.bf16_tflops:g} bf16 TFLOP/s; {facts}), seq_len "
            f"{cfg.data.seq_len}, global batch {cfg.train.global_batch_size}")
    if not ranked:
        return [head, "no layout fits: every candidate needs more than "
                f"{gpu.memory_gib * (1 - HEADROOM):.1f} GiB a GPU; add nodes or lower data.seq_len"]
    shown = best_of_each(ranked)[:top]
    lines = [head, f"{len(ranked)} candidates fit; the fastest {len(shown)} layouts, each at its best micro batch, "
                   f"checkpointing and FP8 (predicted):",
             f"  {'#':>2}  {'layout':<70} {'micro':>5} {'GiB/GPU':>8} {'tok/s/GPU':>10} {'MFU':>5}  main cost"]
    for i, (cand, c) in enumerate(shown, 1):
        lines.append(f"  {i:>2}  {cand.describe():<70} {cand.micro_batch:>5} {c.memory / GIB:>8.1f} "
                     f"{c.tokens_per_s:>10,.0f} {c.mfu:>5.0%}  {c.main}")
    best, c = shown[0]
    if len(shown) > 1:
        other, d = shown[1]
        lines.append(f"why: {c.seconds:.2f} s a step against {d.seconds:.2f} s for #2 ({d.seconds / c.seconds:.2f}x); "
                     + ", ".join(f"{k} {c.parts.get(k, 0):.2f} vs {d.parts.get(k, 0):.2f} s"
                                 for k in sorted(set(c.parts) | set(d.parts),
                                                 key=lambda k: (-round(abs(c.parts.get(k, 0) - d.parts.get(k, 0)), 2),
                                                                -c.parts.get(k, 0), k))[:3]))  # ties as printed
    lines.append("use it: " + " ".join(f"--set {s}" for s in best.overrides()))
    return lines


def best_of_each(ranked: list[tuple[Candidate, Cost]]) -> list[tuple[Candidate, Cost]]:
    """The fastest candidate of each layout (strategy, tp, cp, pp and schedule, ep), in order."""
    seen, out = set(), []
    for cand, c in ranked:
        key = (cand.strategy, cand.tp, cand.cp, cand.pp, cand.schedule, cand.ep)
        if key not in seen:
            seen.add(key)
            out.append((cand, c))
    return out


def shape_name(cfg: Config) -> str:
    arch = cfg.model.architecture or {}
    return f"a {arch.get('model_type', 'model')} from model.architecture"
