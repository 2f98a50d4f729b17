"""The starting weights of a wrapped model, each rank filling only what it owns: from scratch,
module by module under seeds that depend on neither the world size nor the strategy, or from a
pretrained folder's files, slice by slice (model/weight_files.py). See parallel/wrap.py."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import torch

from ..config import UserError
from ..model import moe
from ..model.lora import is_adapter
from ..model.weight_files import open_weights, weight_files


def local_slices(shape: torch.Size, tensor) -> tuple[slice, ...]:
    """The part of a full tensor of `shape` that this rank holds in `tensor` (a DTensor shard, or
    a plain tensor holding everything). Shard(d) splits like torch.chunk, as FSDP2 does; FSDP2's
    split of a tensor-parallel shard (a _StridedShard: the mesh's dimensions applied inner one
    first) is DTensor's own arithmetic."""
    index = [slice(0, n) for n in shape]
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return tuple(index)
    mesh = tensor.device_mesh
    if any(type(p).__name__ == "_StridedShard" for p in placements):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        size, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
        return tuple(slice(o, o + n) for o, n in zip(offset, size))
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
    finds them. A Mixture-of-Experts model's fused expert tensors are filled from the files' one
    tensor per expert (model/moe.py): a rank reads only the experts and rows it holds.
    """
    files = weight_files(folder)
    params = {n: p for n, p in model.named_parameters() if not is_adapter(n)}  # adapters: lora.py
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    model_type = getattr(getattr(model, "config", None), "model_type", None)

    def key_of(name: str) -> str | None:
        for key in (name, moe.stored_name(model_type, name)):
            for k in (key, key.removeprefix(prefix)):
                if k in files:
                    return k
        return None
    # (name, key, where): `where` (this rank's slices, expert, first row, end row) for one
    # expert's tensor of a fused MoE parameter (model/moe.py), None for a tensor stored as the
    # model holds it
    reads, missing = [], []
    for name, target in params.items():
        if (key := key_of(name)) is not None:
            reads.append((name, key, None))
        elif (parts := moe.pieces(model_type, name, target.shape)) and all(key_of(k) for k, *_ in parts):
            mine = local_slices(target.shape, target)
            reads += [(name, key_of(k), (mine, *where)) for k, *where in parts if _overlaps(mine, *where)]
        else:
            missing.append(name)
    if missing:
        raise UserError(f"model.name_or_path: {folder} has no tensor named {missing[0]!r} "
                        f"({len(missing)} missing); its weight files do not match "
                        f"{type(model).__name__}'s parameter names")
    by_file: dict[str, list] = {}
    for name, key, where in reads:
        by_file.setdefault(files[key], []).append((name, key, where))
    for file, entries in by_file.items():
        with open_weights(folder / file) as read:
            for name, key, where in entries:
                target = params[name]
                if where is None:
                    shape, rows = read(key, lambda shape: local_slices(shape, target))
                    expected = target.shape
                    if shape == expected:
                        _local(target).copy_(rows)
                else:
                    shape, expected = _read_expert(read, key, target, *where)
                if shape != expected:
                    raise UserError(f"model.name_or_path: {key} in {folder / file} has "
                                    f"shape {tuple(shape)}, the model expects {tuple(expected)}")


def _overlaps(mine: tuple[slice, ...], expert: int, first: int, end: int) -> bool:
    """Whether this rank's slices of a fused expert parameter hold any of that expert's rows."""
    return mine[0].start <= expert < mine[0].stop and max(first, mine[1].start) < min(end, mine[1].stop)


def _read_expert(read, key: str, target, mine: tuple[slice, ...], expert: int, first: int, end: int):
    """Copy one expert's file tensor (rows first:end of the fused parameter's expert `expert`)
    into this rank's part of `target` (`mine`: its local_slices); returns (its shape, the shape expected)."""
    lo, hi = max(first, mine[1].start), min(end, mine[1].stop)
    expected = torch.Size((end - first, target.shape[2]))
    shape, rows = read(key, lambda shape: (slice(lo - first, hi - first), mine[2]))
    if shape == expected:
        _local(target)[expert - mine[0].start, lo - mine[1].start:hi - mine[1].start].copy_(rows)
    return shape, expected


@torch.no_grad()
def copy_buffers(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Buffers (rotary inv_freq, ...) are computed in __init__ and not all in the state dict;
    the reference skeleton holds them for real, and FSDP2 leaves them unsharded."""
    source = dict(reference.named_buffers())
    for name, buf in model.named_buffers():
        buf.copy_(source[name])
