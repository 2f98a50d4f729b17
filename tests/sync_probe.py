"""`llmtrain train` with every host read of a tensor and every Python-level collective counted,
step by step; run in place of `-m llmtrain` under torchrun:

    torchrun --nproc-per-node 2 tests/sync_probe.py OUT_DIR train --config FILE

Writes OUT_DIR/rank-R.json: {step: [event, ...]}, an event being "read:<op> <shape>" (a value
copied to the host: item/bool/float, tolist, numpy; on a GPU each waits for the device) or
"collective:<name>" ("... over N of M ranks" on a subgroup). A step's events are those from its
forward/backward to the next one's, so its logging, evaluation and saving count in. Everything
else is llmtrain as a user runs it.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from llmtrain.cli import exit_process, main
from llmtrain.training.step import Step

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list",
               "reduce_scatter_tensor", "all_gather_into_tensor", "barrier", "gather_object")
events: dict[int, list[str]] = {}
step = [0]


def record(event: str) -> None:
    events.setdefault(step[0], []).append(event)


class HostReads(TorchDispatchMode):
    """item(), bool(), float() and int() of a tensor all end in aten._local_scalar_dense."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            record(f"read:item {tuple(args[0].shape)}")
        return func(*args, **(kwargs or {}))


def counted(name, original):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        record(name(*args) if callable(name) else name)
        return original(*args, **kwargs)
    return wrapper


def collective(name, original):
    """Counted as "collective:<name>", or "collective:<name> over N of M ranks" on a subgroup
    (HSDP's all-reduce across replicas: the ranks holding the same shard)."""
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        group = kwargs.get("group")
        size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        where = f" over {size} of {dist.get_world_size()} ranks" if size != dist.get_world_size() else ""
        record(f"collective:{name}{where}")
        return original(*args, **kwargs)
    return wrapper


def install() -> None:
    for op in ("tolist", "numpy"):
        setattr(torch.Tensor, op, counted(lambda t, op=op, *_: f"read:{op} {tuple(t.shape)}",
                                          getattr(torch.Tensor, op)))
    for name in COLLECTIVES:
        setattr(dist, name, collective(name, getattr(dist, name)))
    original = Step.forward_backward

    @functools.wraps(original)
    def forward_backward(*args, **kwargs):
        step[0] += 1
        return original(*args, **kwargs)
    Step.forward_backward = forward_backward


if __name__ == "__main__":
    out = Path(sys.argv[1])
    rank = int(os.environ.get("RANK", "0"))

    def write() -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank-{rank}.json").write_text(json.dumps(events))
    atexit.register(write)
    install()
    with HostReads():
        code = main(sys.argv[2:])
    exit_process(code)
