"""Every wrapping of the model happens here: activation checkpointing, FSDP2/HSDP or DDP, precision.

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
import copy
import hashlib
import inspect
import json
import os
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import Config, UserError
from ..training.distributed import World
from .attention import causal_attention
from .build import build_model, decoder_layers, pretrained_dir
from .lora import apply_lora, frozen_weights, init_adapters, is_adapter

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SHARDED_STRATEGIES = ("fsdp", "hsdp")


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
        if cfg.model.attn_implementation == "sdpa":
            causal_attention(model)
        lora = cfg.model.lora_spec
        if lora is not None:
            apply_lora(model, lora)
            store_frozen_base(model, cfg)
        tied = _tied(model)  # decided on the skeleton, so every rank agrees
        if cfg.model.activation_checkpointing:
            checkpoint_layers(model, cfg.model.activation_checkpointing_every)
        if cfg.train.compile:
            compile_layers(model)
    with phase("sharding"):
        if cfg.parallel.strategy in SHARDED_STRATEGIES:
            apply_fsdp(model, cfg, device_mesh(cfg, world))
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
    if cfg.parallel.strategy == "ddp" and world.world_size > 1:
        # Gradients live in DDP's all-reduce buckets (no second copy, no copy-in per step), and
        # no buffer broadcast before every forward: the only buffers (rotary frequencies) are
        # computed alike on every rank and never change.
        # (torch 2.13 renamed broadcast_buffers to forward_sync_buffers and warns at the old name)
        no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
                   else "broadcast_buffers")
        model = DDP(model, device_ids=[world.local_rank] if world.device.type == "cuda" else None,
                    gradient_as_bucket_view=True, **{no_sync: False})
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
    folders (compile_caches)."""
    compile_caches()
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward)


def compile_caches() -> list[str]:
    """Inductor's and Triton's caches on the node's own disk ($TMPDIR, else /tmp), unless set:
    Triton's default is ~/.triton, which on a cluster is the shared filesystem, where every rank of
    every node would write its kernels."""
    import getpass
    import tempfile
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


# -- sharding ------------------------------------------------------------------------------


def shard_size(cfg: Config, world_size: int) -> int:
    """Ranks per FSDP shard group: the world for fsdp; parallel.shard_size (default: the
    processes of one node) for hsdp."""
    if cfg.parallel.strategy != "hsdp":
        return world_size
    return cfg.parallel.shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def device_mesh(cfg: Config, world: World):
    """None (FSDP2's default: one group of all ranks) for fsdp; a (replicate, shard) mesh for hsdp."""
    if cfg.parallel.strategy != "hsdp":
        return None
    from torch.distributed.device_mesh import init_device_mesh
    shard = shard_size(cfg, world.world_size)
    if shard < 1 or world.world_size % shard:
        raise UserError(f"parallel.shard_size: must divide the world size {world.world_size} "
                        f"(got {shard}); set it to the processes per node or a divisor of the world")
    return init_device_mesh(world.device.type, (world.world_size // shard, shard),
                            mesh_dim_names=("replicate", "shard"))


def apply_fsdp(model: torch.nn.Module, cfg: Config, mesh=None) -> None:
    """fully_shard each decoder layer, then the root (embeddings, final norm, head).

    The root and the last layer stay gathered after forward: backward needs them at once, so
    freeing them would only cost another all-gather per micro-batch (torchtitan does the same).
    """
    dtype = DTYPES[cfg.train.precision]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    reshard = cfg.parallel.reshard_after_forward
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, mp_policy=mp,
                    reshard_after_forward=reshard and i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    prefetch_layers(layers, cfg.parallel.prefetch_layers)


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


def local_slices(shape: torch.Size, tensor) -> tuple[slice, ...]:
    """The part of a full tensor of `shape` that this rank holds in `tensor` (a DTensor shard, or
    a plain tensor holding everything). Shard(d) splits like torch.chunk, as FSDP2 does."""
    index = [slice(0, n) for n in shape]
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return tuple(index)
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    for mesh_dim, placement in enumerate(placements):
        if not placement.is_shard():
            continue
        dim, parts = placement.dim, mesh.size(mesh_dim)
        start, stop = index[dim].start, index[dim].stop
        chunk = -(-(stop - start) // parts)
        lo = min(start + coordinate[mesh_dim] * chunk, stop)
        index[dim] = slice(lo, min(lo + chunk, stop))
    return tuple(index)


def _local(tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


# -- starting weights ----------------------------------------------------------------------


@torch.no_grad()
def init_from_scratch(model: torch.nn.Module, reference: torch.nn.Module, seed: int,
                      device: torch.device) -> int:
    """Initialise every parameter with HF's `_init_weights`, one module at a time; return the
    most bytes held at full size at once (the largest module).

    Each module that owns parameters is copied at full size from the meta `reference`, put on
    the device, initialised under a seed made of `seed` and its name, and each rank copies its
    slice. Tied parameters are initialised once, under their first name.
    """
    params = {n: p for n, p in model.named_parameters() if not is_adapter(n)}  # ties: first name wins
    done: set[str] = set()
    largest = 0
    for name in params:
        module_name, _, _ = name.rpartition(".")
        if module_name in done:
            continue
        done.add(module_name)
        full = copy.deepcopy(reference.get_submodule(module_name)).to_empty(device=device)
        largest = max(largest, sum(p.numel() * p.element_size() for p in full.parameters()))
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(_module_seed(seed, module_name))
            reference._init_weights(full)
        for pname, value in full.named_parameters(recurse=False):
            key = f"{module_name}.{pname}" if module_name else pname
            if key in params:
                target = params[key]
                _local(target).copy_(value[local_slices(value.shape, target)])
        del full
    return largest


def _module_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed per module (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@torch.no_grad()
def load_pretrained(model: torch.nn.Module, folder: Path) -> None:
    """Fill this rank's shards from the weight files of a Hugging Face model folder.

    safetensors (`model.safetensors`, or the shards named by `model.safetensors.index.json`):
    each tensor is read through safetensors' slicing, so only the rows this rank owns leave the
    disk, in the stored dtype, and are cast into the rank's shard (fp32; a LoRA base bf16/fp16:
    store_frozen_base). Older folders with only `pytorch_model*.bin` are memory-mapped
    (`torch.load(mmap=True)`): the rank touches only its rows' pages. Keys saved without the
    base model's prefix (`h.0...` for `transformer.h.0...`) are found too, as from_pretrained
    finds them.
    """
    files = _weight_files(folder)
    params = {n: p for n, p in model.named_parameters() if not is_adapter(n)}  # adapters: lora.py
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    keys = {name: name if name in files else name.removeprefix(prefix) for name in params}
    missing = [name for name, key in keys.items() if key not in files]
    if missing:
        raise UserError(f"model.name_or_path: {folder} has no tensor named {missing[0]!r} "
                        f"({len(missing)} missing); its weight files do not match "
                        f"{type(model).__name__}'s parameter names")
    by_file: dict[str, list[str]] = {}
    for name, key in keys.items():
        by_file.setdefault(files[key], []).append(name)
    for file, names in by_file.items():
        with _open_weights(folder / file) as read:
            for name in names:
                target = params[name]
                shape, rows = read(keys[name], lambda shape: local_slices(shape, target))
                if shape != target.shape:
                    raise UserError(f"model.name_or_path: {keys[name]} in {folder / file} has "
                                    f"shape {tuple(shape)}, the model expects {tuple(target.shape)}")
                _local(target).copy_(rows)


def _weight_files(folder: Path) -> dict[str, str]:
    """{tensor name: file name}, from an index or the single file; safetensors first."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (folder / index).is_file():
            return json.loads((folder / index).read_text())["weight_map"]
        if (folder / single).is_file():
            with _open_weights(folder / single) as read:
                return {key: single for key in read.keys()}
    raise UserError(f"model.name_or_path: no model.safetensors, pytorch_model.bin or index of "
                    f"either in {folder}; download the model's weights (bash download_data_model.sh)")


@contextlib.contextmanager
def _open_weights(path: Path):
    """read(key, slices_for_shape) -> (full shape, the rows sliced), for one weight file."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        with safe_open(path, framework="pt", device="cpu") as f:
            def read(key, slices):
                stored = f.get_slice(key)
                shape = torch.Size(stored.get_shape())
                return shape, stored[slices(shape)]
            read.keys = f.keys
            yield read
        return
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)

    def read(key, slices):
        tensor = state[key]
        return tensor.shape, tensor[slices(tensor.shape)]
    read.keys = state.keys
    yield read


@torch.no_grad()
def copy_buffers(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Buffers (rotary inv_freq, ...) are computed in __init__ and not all in the state dict;
    the reference skeleton holds them for real, and FSDP2 leaves them unsharded."""
    source = dict(reference.named_buffers())
    for name, buf in model.named_buffers():
        buf.copy_(source[name])


def _tied(model: torch.nn.Module | None) -> bool:
    if model is None:
        return False
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    return out is not None and out.weight is inp.weight


# -- the training step's helpers ------------------------------------------------------------


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DDP) else model


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool, cfg: Config):
    """Gradient reduction across ranks during an accumulation.

    DDP reduces on the last micro-step only (no_sync keeps local gradients, no extra memory).
    FSDP2/HSDP reduce-scatter after every micro-batch by default, so each rank only ever holds
    its gradient shard; `parallel.reduce_every_micro_batch: false` defers it to the last one at
    the cost of every layer's full fp32 gradient (+4 bytes per parameter per rank).
    HSDP all-reduces the shards across replicas (between nodes) on the last micro-batch only:
    before it, FSDP2 adds each reduce-scattered shard into a buffer of the shard's size
    (`set_requires_all_reduce(False)`), so the memory is the same as reducing every time.
    """
    if isinstance(model, DDP) and not enabled:
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule) and not cfg.parallel.reduce_every_micro_batch:
        model.set_requires_gradient_sync(enabled)  # neither reduce-scatter nor all-reduce
        yield
    elif isinstance(model, FSDPModule) and cfg.parallel.strategy == "hsdp":
        model.set_requires_all_reduce(enabled)
        yield
    else:
        yield


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
