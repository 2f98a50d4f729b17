"""Every wrapping of the model happens here: activation checkpointing, FSDP2 or DDP, precision.

    model = parallelize(cfg, config, world)

No rank ever materialises a second full copy for nothing: all ranks build the model on the
meta device, FSDP2 shards the skeleton (`fully_shard` per decoder layer, then the root), the
shards are allocated on the device, and rank 0 alone holds the full starting weights on CPU and
broadcasts them shard by shard (`set_model_state_dict(..., broadcast_from_rank0=True)`). This is
what lets a 70B model start on nodes that could not hold it once per GPU. DDP takes the same
path and then wraps the full module.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from .config import Config
from .distributed import World
from .model import build_model, decoder_layers, source_weights

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parallelize(cfg: Config, config, world: World) -> torch.nn.Module:
    source = source_weights(config, cfg) if world.is_main else None
    model = build_model(config, cfg, "meta")
    tied = _tied(model)  # decided on the skeleton, so every rank agrees
    if cfg.model.activation_checkpointing:
        # HF wraps each decoder layer's __call__ in non-reentrant torch.utils.checkpoint,
        # which keeps the parameter names (and so checkpoints) unchanged.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.parallel.strategy == "fsdp":
        apply_fsdp(model, cfg)
    model.to_empty(device=world.device)
    if tied and not _tied(model):  # to_empty allocates tied weights twice; FSDP2 keeps the tie
        model.tie_weights()
    _load_from_rank0(model, source)
    del source
    if cfg.parallel.strategy == "ddp" and world.world_size > 1:
        model = DDP(model, device_ids=[world.local_rank] if world.device.type == "cuda" else None)
    return model


def apply_fsdp(model: torch.nn.Module, cfg: Config) -> None:
    dtype = DTYPES[cfg.train.precision]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    reshard = cfg.parallel.reshard_after_forward
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)


def _tied(model: torch.nn.Module | None) -> bool:
    if model is None:
        return False
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    return out is not None and out.weight is inp.weight


def _load_from_rank0(model: torch.nn.Module, source: torch.nn.Module | None) -> None:
    full = source.state_dict() if source is not None else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                               broadcast_from_rank0=True))
    # Buffers (rotary inv_freq, ...) are not all in the state dict; FSDP2 leaves them unsharded.
    source_buffers = dict(source.named_buffers()) if source is not None else {}
    for name, buf in model.named_buffers():
        if source is not None:
            buf.copy_(source_buffers[name])
        dist.broadcast(buf, src=0)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DDP) else model


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool):
    """Reduce gradients across ranks only on the last micro-step of an accumulation."""
    if isinstance(model, DDP) and not enabled:
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        yield
    else:
        yield


def autocast(cfg: Config, device: torch.device):
    """Autocast for DDP and single-process runs; FSDP2 casts through its MixedPrecisionPolicy."""
    if cfg.train.precision == "fp32" or cfg.parallel.strategy == "fsdp":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[cfg.train.precision])


def grad_scaler(cfg: Config, device: torch.device) -> torch.amp.GradScaler:
    """fp16 needs loss scaling; for bf16 and fp32 the scaler is disabled and passes through."""
    return torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
