"""Every wrapping of the model happens here, in one order (parallelize):

    build on the meta device -> this rank's pipeline stage (parallel/pipeline.py) -> LoRA adapters (frozen base stored in the run's precision)
      -> FP8 linear layers (parallel/float8.py) -> tensor + sequence parallel (parallel/tensor.py)
      -> expert parallel (parallel/experts.py) -> activation checkpointing -> torch.compile per layer
      -> FSDP2/HSDP (on world.dims' mesh) -> allocate this rank's shards
      -> weights (parallel/weights.py: seeded init or sliced load) -> DDP

    model = parallelize(cfg, config, world, startup)

No rank ever holds a full copy of the model it does not need. Every rank builds the skeleton on
the meta device, FSDP2 shards it (`fully_shard` per decoder layer, then the root; HSDP: on a 2-D
mesh, sharded within a group of `parallel.shard_size` ranks and replicated across groups), the
rank's shards are allocated on its device, and then each rank fills in only what it owns:

- from scratch, module by module: one module's full weights are initialised on the device from a
  seed derived from `train.seed` and the module's name, and the rank keeps its slice. On one
  device type (CUDA and CPU generators differ) the values depend on neither the world size nor
  the strategy, so DDP, FSDP, HSDP and a single process start identical;
- pretrained: each rank reads only the slices it owns from the model's safetensors files
  (`model.safetensors` or the shards named by `model.safetensors.index.json`), in the stored
  dtype, and upcasts them slice by slice (a LoRA run's frozen base is stored in bf16/fp16 when
  it trains in that precision: store_frozen_base).

Peak memory at start-up is the rank's own shards plus one module's full weights. DDP takes the
same path with the whole model as its "shard", then wraps it.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import inspect
import os
import tempfile
import types
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import Config
from ..model.attention import causal_attention, context_parallel_attention
from ..model.build import build_model, decoder_layers, pretrained_dir
from ..model.lora import apply_lora, frozen_weights, init_adapters
from . import float8
from .dims import SHARDED_STRATEGIES
from . import compression
from .experts import apply_expert_parallel, shard_experts
from .pipeline import keep_stage
from .precision import DTYPES
from .tensor import apply_tensor_parallel
from .weights import copy_buffers, init_from_scratch, load_pretrained, local_slices
from .world import World


def parallelize(cfg: Config, config, world: World, watch=None, resuming: bool = False) -> torch.nn.Module:
    """The model, wrapped for cfg.parallel.strategy, with its starting weights on world.device.
    `watch` (watchdog.Watchdog) times the start-up phases and ends one that hangs. `resuming`: a
    checkpoint will overwrite every weight (not LoRA's base, which checkpoints leave out), so
    none is read or initialised here: a requeued 70B full fine-tune read its 140 GB of
    pretrained safetensors on every start, only to replace them."""
    phase = watch.phase if watch is not None else lambda name: contextlib.nullcontext()
    with phase("building"):
        model = build_model(config, cfg, "meta")
        reference = build_model(config, cfg, "meta", buffers="cpu")  # full shapes, real buffers
        if world.dims.pipeline > 1:  # this rank's stage only: the other stages' parts become Absent
            keep_stage(model, world.layout)
        if world.dims.context > 1:  # config/rules.py: sdpa only
            context_parallel_attention(model, world.layout.mesh("cp"))
        elif cfg.model.attn_implementation == "sdpa":
            causal_attention(model)
        lora = cfg.model.lora_spec
        if lora is not None:
            apply_lora(model, lora)
            store_frozen_base(model, cfg)
        tied = _tied(model)  # decided on the skeleton, so every rank agrees
        if cfg.train.fp8 != "none":  # before tensor parallel, which gives float8 layers float8 styles
            float8.convert(model, cfg.train.fp8, world.device, fsdp=world.dims.sharded, compiled=cfg.train.compile,
                           tp=world.dims.tensor)
        if world.dims.tensor > 1:
            # float8 all-gathers need NCCL: gloo has no float8 ("Invalid scalar type", torch 2.13)
            apply_tensor_parallel(model, decoder_layers(model), world.layout.mesh("tp"),
                                  float8_styles=cfg.train.fp8 == "tensorwise" and world.device.type == "cuda")
        if world.dims.expert > 1:  # each rank its share of every MoE layer's experts (parallel/experts.py)
            apply_expert_parallel(model, world.layout.expert_mesh()["ep"])
        if cfg.model.activation_checkpointing:
            checkpoint_layers(model, cfg.model.activation_checkpointing_every)
        if cfg.train.compile:
            compile_layers(model)
    with phase("sharding"):
        if world.dims.sharded:
            experts = world.layout.expert_fsdp_mesh() if world.dims.expert > 1 else None
            apply_fsdp(model, cfg, world.layout.fsdp_mesh(), experts)
        model.to_empty(device=world.device)
        if tied and not _tied(model):  # to_empty allocates tied weights twice; FSDP2 keeps the tie
            model.tie_weights()
    with phase("loading"):
        if resuming and lora is None:
            pass  # the checkpoint holds every parameter; training/checkpoint.py loads it
        elif cfg.model.name_or_path is not None:
            load_pretrained(model, pretrained_dir(cfg))
        else:
            init_from_scratch(model, reference, cfg.train.seed, world.device)
        if lora is not None:
            init_adapters(model, cfg.train.seed, local_slices)
        copy_buffers(model, reference)
    del reference
    if not world.dims.sharded and world.dims.loss_ranks > 1:  # over the world: rules.py allows no tp here
        # Gradients live in DDP's all-reduce buckets (no second copy, no copy-in per step), and
        # no buffer broadcast before every forward: the only buffers (rotary frequencies) are
        # computed alike on every rank and never change.
        # (torch 2.13 renamed broadcast_buffers to forward_sync_buffers and warns at the old name)
        no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
                   else "broadcast_buffers")
        # With context parallel, gradients as views of the buckets came out wrong after a no_sync
        # micro-batch (grad norm 1.40 for 1.20 at step 1, torch 2.13, gloo; exact without
        # accumulation): they get their own tensors there, one more gradient-sized copy.
        group = world.layout.mesh("loss").get_group()
        model = DDP(model, device_ids=[world.local_rank] if world.device.type == "cuda" else None,
                    process_group=group, gradient_as_bucket_view=world.dims.context == 1, **{no_sync: False})
        if cfg.parallel.grad_compression != "none":  # bf16 or PowerSGD on the wire (parallel/compression.py)
            compression.register(model, cfg, group)
    return model


def store_frozen_base(model: torch.nn.Module, cfg: Config) -> list[torch.nn.Parameter]:
    """A LoRA run in bf16/fp16 stores its frozen base in that precision, not fp32: half the
    bytes (a 70B base on 8 GPUs: 16.5 GiB per GPU instead of 33), the same numbers bit for bit.
    FSDP2 casts every parameter to train.precision before computing with it, and autocast (DDP,
    one process) casts a linear layer's weight for its matmul, so the stored copy is cast
    once instead of every step. Under autocast the embedding table (and a head tied to it) and
    the norms' weights stay fp32: they are used as stored, and in bf16 they would make the
    residual stream bf16. The adapters, their gradients and optimizer state stay fp32 (FSDP2
    requires one dtype among the parameters that train, not the frozen ones); fp32 runs keep
    the base in fp32. Returns the parameters stored in the lower precision."""
    dtype = DTYPES[cfg.train.precision]
    if dtype == torch.float32:
        return []
    frozen = frozen_weights(model, linear_only=cfg.parallel.strategy not in SHARDED_STRATEGIES)
    for param in frozen:
        param.data = param.data.to(dtype)  # on the meta skeleton: allocated so by to_empty
    return frozen


def compile_layers(model: torch.nn.Module) -> None:
    """torch.compile each decoder layer's forward, in place: the layer's FSDP2 hooks and its
    activation checkpointing wrap the call around that forward and stay eager, the parameter
    names (so checkpoints) do not change, and the layers share one compiled graph (same code,
    parameters as inputs). Compilation happens in the first step; its caches go to node-local
    folders (compile_caches).

    transformers 5 checkpoints inside a layer's forward, and only in the class's outermost
    forward: compiled whole, under FSDP2 (which swaps the class) a checkpointed layer silently
    kept all its activations, and under tensor parallel the checkpoint in the graph failed on
    DTensors. So a checkpointed layer's own forward is compiled and the checkpoint runs eagerly
    around it (_checkpointed)."""
    compile_caches()
    for layer in decoder_layers(model):
        forward = type(layer).forward
        if (getattr(layer, "gradient_checkpointing", False)
                and forward.__code__.co_name == "forward_with_checkpointing"):  # transformers 5
            body = torch.compile(types.MethodType(forward.__wrapped__, layer))
            layer.forward = functools.partial(_checkpointed, layer, body)
        else:
            layer.forward = torch.compile(layer.forward)


def _checkpointed(layer, body, *args, **kwargs):
    """A checkpointed layer's forward: `body` (its compiled forward) under the layer's
    checkpoint function when training with gradients, as HF's forward_with_checkpointing does."""
    if layer.training and torch.is_grad_enabled():
        kwargs.pop("use_cache", None)  # training runs without a KV cache (model/build.py)
        return layer._gradient_checkpointing_func(functools.partial(body, **kwargs), *args)
    return body(*args, **kwargs)


def compile_caches() -> list[str]:
    """Inductor's and Triton's caches on the node's own disk ($TMPDIR, else /tmp), unless set:
    Triton's default is ~/.triton, which on a cluster is the shared filesystem, where every rank of
    every node would write its kernels."""
    root = Path(tempfile.gettempdir())
    user = getpass.getuser()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / f"torchinductor_{user}"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / f"triton_{user}"))
    return [os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"]]


def compile_seconds() -> float:
    """Seconds torch.compile has spent so far in this process (tracing, forward and backward
    graphs), by dynamo's own account."""
    from torch._dynamo.utils import calculate_time_spent
    return float(calculate_time_spent().get("total_wall_time", 0.0))


def checkpoint_layers(model: torch.nn.Module, every: int = 1) -> list[bool]:
    """Activation checkpointing on decoder layers 0, every, 2 x every, ...: those recompute their
    forward in backward instead of keeping its activations; the others keep them (selective
    checkpointing: memory for compute, in steps of 1/every). HF wraps each layer's forward in
    non-reentrant torch.utils.checkpoint, inside FSDP2's hooks, and keeps the parameter names
    (so checkpoints) unchanged. Returns which layers recompute."""
    kwargs, layers = {"use_reentrant": False}, decoder_layers(model)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5: selective built in
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i % every == 0
    return [bool(layer.gradient_checkpointing) for layer in layers]


def apply_fsdp(model: torch.nn.Module, cfg: Config, mesh=None, experts=None) -> None:
    """fully_shard each decoder layer, then the root (embeddings, final norm, head). `experts`
    (expert parallel: Layout.expert_fsdp_mesh): each layer's experts first, over the ranks that
    hold the same ones (parallel/experts.shard_experts).

    The root and the last layer stay gathered after forward: backward needs them at once, so
    freeing them would only cost another all-gather per micro-batch (torchtitan does the same).
    """
    dtype = DTYPES[cfg.train.precision]
    # parallel.grad_compression bf16: the gradients reduce-scattered (and hsdp's all-reduced) in bf16
    reduce = torch.bfloat16 if cfg.parallel.grad_compression == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce)
    reshard = cfg.parallel.reshard_after_forward
    layers = decoder_layers(model)
    if cfg.parallel.pp > 1:  # the schedule runs every micro-batch's forward before the backwards
        reshard = False      # catch up: gathered once a step, not once a micro-batch (as torchtitan)
    if experts is not None:
        shard_experts(model, experts, mp, reshard)
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, mp_policy=mp,
                    reshard_after_forward=reshard and i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    # a rank's layers of several pipeline stages are not run one after the other: FSDP2's implicit
    prefetch_layers(layers, cfg.parallel.prefetch_layers if cfg.parallel.pp_schedule != "interleaved_1f1b" else 0)


def reshard(model: torch.nn.Module) -> None:
    """Free what FSDP2 holds gathered: after a forward without gradients (an evaluation) the
    root and the last layer stay gathered (reshard_after_forward=False, no backward to free
    them), and the next forward would compute with those copies even though the weights have
    changed since (schedule-free's evaluation weights are swapped back): it gathers anew."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def prefetch_layers(layers: list, ahead: int) -> None:
    """Each layer's forward starts the all-gathers of the next `ahead` layers before its own
    compute, and its backward those of the `ahead` layers before it, so communication overlaps
    compute even when the host is not running ahead of the GPU (FSDP2's implicit prefetch relies
    on that). Costs `ahead` more layers of gathered parameters per rank. 0: FSDP2's implicit."""
    if ahead < 1:
        return
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + ahead])
        layer.set_modules_to_backward_prefetch(layers[max(0, i - ahead):i][::-1])


def _tied(model: torch.nn.Module | None) -> bool:
    if model is None:
        return False
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    return getattr(out, "weight", None) is not None and out.weight is getattr(inp, "weight", None)


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool, cfg: Config):
    """Gradient reduction across ranks during an accumulation.

    DDP reduces on the last micro-step only (no_sync keeps local gradients, no extra memory).
    FSDP2/HSDP reduce-scatter after every micro-batch by default, so each rank only ever holds
    its gradient shard; `parallel.reduce_every_micro_batch: false` defers it to the last one at
    the cost of every layer's full fp32 gradient (+4 bytes per parameter per rank).
    With the weights kept gathered after forward too (ZeRO-1: `parallel.zero: 1`), they stay
    gathered until the last micro-batch's backward: one all-gather and one reduce-scatter a step,
    as ZeRO-1's all-reduce.
    HSDP all-reduces the shards across replicas (between nodes) on the last micro-batch only:
    before it, FSDP2 adds each reduce-scattered shard into a buffer of the shard's size
    (`set_requires_all_reduce(False)`), so the memory is the same as reducing every time.
    """
    if isinstance(model, DDP) and not enabled:
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule) and not cfg.parallel.reduce_every_micro_batch:
        model.set_requires_gradient_sync(enabled)  # neither reduce-scatter nor all-reduce
        if not cfg.parallel.reshard_after_forward:
            model.set_reshard_after_backward(enabled)
        yield
    elif isinstance(model, FSDPModule) and cfg.parallel.strategy == "hsdp":
        model.set_requires_all_reduce(enabled)
        yield
    else:
        yield
