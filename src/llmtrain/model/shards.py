"""A checkpoint's weights as Hugging Face safetensors files, one decoder layer at a time.

    checkpoint = Checkpoint(ckpt)                    # its DCP metadata, read once
    checkpoint.read(names)                           # those tensors alone, full, to evaluate
    write_weights(folder, checkpoint, skeleton, torch.bfloat16, lora=(spec, base) or None)

    writer = ShardWriter(folder, [(name, dtype, shape), ...])   # the whole layout, up front
    writer.write(name, tensor)                                  # in that order, as each is read
    writer.close()                                              # model.safetensors.index.json

`llmtrain export` (export.py) never holds the model: each layer's tensors are read (from the
checkpoint, or for a merged LoRA export from the base's files in their stored dtype, the
adapters added in fp32), cast and written before the next layer is read; the peak is about one
layer in fp32. safetensors' own save_file takes every tensor of a file at once, so a 140 GB model
would be held whole to write it. The format allows better: a file is an 8-byte header length, a
JSON header with each tensor's dtype, shape and byte range, then the bytes in that order; the
layout is known before any data (names and shapes from the model's meta skeleton), so each
file's header is written first and each tensor's bytes follow as soon as it is read. The folder
is what `save_pretrained` writes: `model.safetensors`, or past MAX_SHARD_BYTES the files
`model-0000K-of-0000N.safetensors` and the index naming each tensor's file.
"""

from __future__ import annotations

import json
import re
import struct
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..config import LoraSpec, UserError
from ..optimizers import to_eval_weights
from ..rundir import BUFFERS, META
from . import moe
from .lora import is_adapter, merged_weight
from .weight_files import open_weights, weight_files  # the base's files, read as training reads them

try:  # transformers 5 saves some models' weights in their Hub layout (per-expert MoE weights)
    from transformers.core_model_loading import revert_weight_conversion
except ImportError:  # transformers 4 saves the module names as they are
    def revert_weight_conversion(model, state_dict):
        return state_dict

MAX_SHARD_BYTES = 5 * 10**9  # the Hub's usual file size (transformers 4's default max_shard_size)
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                      torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
                      torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def nbytes(dtype: torch.dtype, shape) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


class Checkpoint(dcp.FileSystemReader):
    """A DCP checkpoint's model tensors by name (without the state's `model.` key): their shapes
    and dtypes from its metadata, any of them read alone (DCP reads only their bytes). The
    metadata is read once: dcp.load reads it at every call, here one a layer, and a large run's
    lists every shard of every tensor and of its optimizer state.

    The weights read are the ones to evaluate: where the optimizer trains other weights than
    those (schedule-free AdamW), optimizers.to_eval_weights makes them from the parameters and
    the optimizer state it asks for, as the optimizer's eval_weights() does in the run."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.metadata = super().read_metadata()
        self.tensors = {k.removeprefix("model."): m for k, m in self.metadata.state_dict_metadata.items()
                        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
        self.meta = json.loads((Path(path) / META).read_text())

    def read_metadata(self, *args, **kwargs):
        return self.metadata

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The full tensors, in the dtype they were saved in."""
        if not names:
            return {}
        state = {"model": {n: torch.empty(self.tensors[n].size, dtype=self.tensors[n].properties.dtype)
                           for n in names}}
        self._load(state)
        return self.to_eval_weights(state["model"])

    def to_eval_weights(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` (read from here; changed in place) as the weights to evaluate."""
        return to_eval_weights(self.meta, tensors, lambda key: self.read_state(list(tensors), key))

    def read_state(self, names: list[str], key: str) -> dict[str, torch.Tensor]:
        """The optimizer state tensor `key` (e.g. schedule-free's "z") of each parameter in
        `names` that has one, full, by name."""
        saved = self.metadata.state_dict_metadata
        found = {n: saved[f"optim.state.{n}.{key}"] for n in names if f"optim.state.{n}.{key}" in saved}
        state = {"optim": {"state": {n: {key: torch.empty(m.size, dtype=m.properties.dtype)}
                                     for n, m in found.items()}}}
        self._load(state)
        return {n: entry[key] for n, entry in state["optim"]["state"].items()}

    def _load(self, state: dict) -> None:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=self, no_dist=True)


def write_weights(folder: Path, checkpoint: Checkpoint, skeleton: torch.nn.Module, dtype: torch.dtype,
                  lora: tuple[LoraSpec, Path] | None = None) -> None:
    """The weights save_pretrained would write for `skeleton` (the model on meta), one decoder
    layer at a time: a full run's from the checkpoint; a LoRA run's (`lora`: its spec and base
    folder) from the base's files, the adapters merged in fp32. Floating tensors in `dtype`."""
    shapes = skeleton.state_dict()

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    # The whole layout first (ShardWriter writes each file's header before its data); transformers 5
    # renames and splits some models' tensors on saving (revert_weight_conversion): planned on meta.
    groups = _by_layer(_saved_names(skeleton))
    plans = [revert_weight_conversion(skeleton, {n: cast(shapes[n]) for n in group}) for group in groups]
    writer = ShardWriter(folder, [(n, t.dtype, tuple(t.shape)) for plan in plans for n, t in plan.items()])
    read = (_checkpoint_layers(checkpoint, cast) if lora is None else
            _merged_layers(checkpoint, *lora, skeleton, cast))
    for group, plan in zip(groups, plans):
        tensors = revert_weight_conversion(skeleton, read(group))
        for name in plan:
            writer.write(name, tensors[name])
        del tensors  # before the next layer is read, not after
    writer.close()


def _saved_names(model: torch.nn.Module) -> list[str]:
    """The state dict's names save_pretrained writes: each parameter under its first name (a tied
    output head shares the input embedding's weight, which comes first and is the one kept, as
    transformers keeps it), the persistent buffers; not `_keys_to_ignore_on_save`."""
    first = dict(model.named_parameters())
    every = dict(model.named_parameters(remove_duplicate=False))
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    return [n for n in model.state_dict() if n not in ignore and (n in first or n not in every)]


def _by_layer(names: list[str]) -> list[list[str]]:
    """The names grouped by decoder layer (the part up to the first number: `model.layers.12.`),
    in their order; a name outside the layers (embeddings, final norm, head) is a group alone."""
    groups: dict[str, list[str]] = {}
    for name in names:
        layer = re.match(r".*?\.\d+\.", name)
        groups.setdefault(layer.group(0) if layer else name, []).append(name)
    return list(groups.values())


def _checkpoint_layers(checkpoint: Checkpoint, cast):
    """read(names) for a full run: the checkpoint's fp32 weights, cast; buffers from buffers.pt
    (every checkpoint saves them all, replicated)."""
    buffers = torch.load(Path(checkpoint.path) / BUFFERS, weights_only=True)

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        got = checkpoint.read([n for n in names if n in checkpoint.tensors])
        # pop: each fp32 tensor goes as soon as its cast exists, not at the layer's end
        return {n: cast(got.pop(n) if n in got else buffers[n]) for n in names}
    return read


def _merged_layers(checkpoint: Checkpoint, spec: LoraSpec, base: Path, skeleton, cast):
    """read(names) for a LoRA run: the base's tensors from its files in their stored dtype (found
    as training found them: parallel.load_pretrained), a target's weight in fp32 with B A
    alpha/rank added, each cast as it is read; buffers the files lack from buffers.pt. The
    adapters are read once, all."""
    adapters = checkpoint.read([n for n in checkpoint.tensors if is_adapter(n)])
    buffers = torch.load(Path(checkpoint.path) / BUFFERS, weights_only=True)
    files = weight_files(base)
    prefix = f"{getattr(skeleton, 'base_model_prefix', '')}."
    shapes = skeleton.state_dict()

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        got, by_file = {}, {}
        for name in names:
            key = name if name in files else name.removeprefix(prefix)
            if key in files:
                by_file.setdefault(files[key], []).append((name, key))
            elif name in buffers:
                got[name] = cast(buffers[name])
            elif (fused := _fused_experts(base, files, skeleton, name, shapes[name].shape)) is not None:
                got[name] = cast(fused)  # experts are frozen under LoRA: the base's, as stored
            else:
                raise UserError(f"{base} has no tensor named {name!r}; export needs the base folder "
                                f"the run trained on")
        for file, entries in by_file.items():
            with open_weights(base / file) as read_file:  # one file mapped at a time: its pages go at close
                for name, key in entries:
                    shape, weight = read_file(key, lambda shape: (slice(None),) * len(shape))
                    if shape != shapes[name].shape:
                        raise UserError(f"{base}: {key} has shape {tuple(shape)}, the run's model "
                                        f"{tuple(shapes[name].shape)}; export needs the base folder "
                                        f"the run trained on")
                    lora = name.removesuffix("weight")
                    if f"{lora}lora_A.weight" in adapters:
                        weight = merged_weight(weight, adapters[f"{lora}lora_A.weight"],
                                               adapters[f"{lora}lora_B.weight"], spec.scaling)
                    got[name] = cast(weight)
        return {n: got[n] for n in names}
    return read


def _fused_experts(base: Path, files: dict, skeleton, name: str, shape) -> torch.Tensor | None:
    """A fused MoE expert parameter of the base, made from its files' one tensor per expert
    (model/moe.py); None where `name` is none or the files lack one of its parts."""
    parts = moe.pieces(skeleton.config.model_type, name, shape)
    prefix = f"{getattr(skeleton, 'base_model_prefix', '')}."
    keys = [next((k for k in (key, key.removeprefix(prefix)) if k in files), None) for key, *_ in parts or []]
    if not parts or None in keys:
        return None
    by_file: dict[str, list] = {}  # each file opened once for all its experts' tensors
    for key, (_, expert, first, end) in zip(keys, parts):
        by_file.setdefault(files[key], []).append((key, expert, first, end))
    fused = None
    for file, entries in by_file.items():
        with open_weights(base / file) as read_file:
            for key, expert, first, end in entries:
                _, weight = read_file(key, lambda s: (slice(None),) * len(s))
                fused = weight.new_empty(shape) if fused is None else fused
                fused[expert, first:end] = weight
    return fused


class ShardWriter:
    """safetensors files written tensor by tensor, each file's header first."""

    def __init__(self, folder: Path, layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 max_shard_bytes: int = MAX_SHARD_BYTES):
        """layout: every tensor of the model, in the order write() will get them."""
        self.folder = Path(folder)
        files: list[list] = [[]]
        size = 0
        for entry in layout:  # greedy, in order; a tensor larger than a shard gets its own file
            n = nbytes(entry[1], entry[2])
            if files[-1] and size + n > max_shard_bytes:
                files.append([])
                size = 0
            files[-1].append(entry)
            size += n
        names = (["model.safetensors"] if len(files) == 1 else
                 [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
        self.files = list(zip(names, files))
        self.queue = [(name, dtype, tuple(shape)) for _, entries in self.files
                      for name, dtype, shape in entries]
        self.total = sum(nbytes(dtype, shape) for _, dtype, shape in self.queue)
        self.next = 0  # the queue's next tensor
        self.file_index = 0  # the file it goes to
        self.open_file = None
        self.left_in_file = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.queue[self.next]
        got = (name, tensor.dtype, tuple(tensor.shape))
        assert got == expected, f"write order: expected {expected}, got {got}"
        if self.open_file is None:
            self._start_file(*self.files[self.file_index])
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self.open_file.write(data.data)
        self.next += 1
        self.left_in_file -= 1
        if self.left_in_file == 0:
            self.open_file.close()
            self.open_file = None
            self.file_index += 1

    def _start_file(self, file_name: str, entries: list) -> None:
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in entries:
            end = offset + nbytes(dtype, shape)
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, end]}
            offset = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads it
        self.open_file = open(self.folder / file_name, "wb")
        self.open_file.write(struct.pack("<Q", len(text)) + text)
        self.left_in_file = len(entries)

    def close(self) -> None:
        """Check that every tensor came; with several files, write the index."""
        assert self.next == len(self.queue), f"{len(self.queue) - self.next} tensors never written"
        if len(self.files) > 1:
            weight_map = {name: file_name for file_name, entries in self.files for name, _, _ in entries}
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n")
