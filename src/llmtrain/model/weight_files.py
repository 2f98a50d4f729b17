"""A Hugging Face model folder's weight files, read tensor by tensor and slice by slice:
training's sharded load (parallel/weights.py) and export's streaming writer (model/shards.py)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from ..config import UserError
from ..data.sources import WEIGHT_FILES


def weight_files(folder: Path) -> dict[str, str]:
    """{tensor name: file name}, from an index or the single file; safetensors first."""
    for single, index in WEIGHT_FILES:
        if (folder / index).is_file():
            return json.loads((folder / index).read_text())["weight_map"]
        if (folder / single).is_file():
            with open_weights(folder / single) as read:
                return {key: single for key in read.keys()}
    raise UserError(f"model.name_or_path: no model.safetensors, pytorch_model.bin or index of "
                    f"either in {folder}; download the model's weights (bash download_data_model.sh)")


@contextlib.contextmanager
def open_weights(path: Path):
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
