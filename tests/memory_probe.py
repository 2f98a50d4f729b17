"""Each rank's peak tensor memory in a training step, for the memory estimator's test; run under
torchrun:

    torchrun --nproc-per-node 2 tests/memory_probe.py CONFIG OUT_DIR CASE=OVERRIDE,OVERRIDE ...

For each case the model, loss head, optimizer and step are the trainer's own (parallelize,
chunk_head, build_optimizer, training/step.py's Step) on random tokens; two steps run
first (optimizer state, DDP's rebuilt buckets), then one step under torch's memory tracker
(MemTracker; FSDPMemTracker for FSDP2), which counts every tensor's storage as the CUDA caching
allocator would (torch.cuda.max_memory_allocated; on CUDA that figure too). Writes
OUT_DIR/rank-R.json: {case: {"peak": bytes, "parts": {category: bytes}, "cuda_max_allocated"}}
(the allocator's peak less what earlier cases left allocated: on an H100 the cases after the
first read 17-55% high without it).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker

import torch.nn.attention.bias
from torch.utils._python_dispatch import _disable_current_modes

from llmtrain.config import load_config
from llmtrain.data.loader import Batch
from llmtrain.data.tokenizer import load_tokenizer
from llmtrain.model.build import model_config
from llmtrain.model.loss import chunk_head
from llmtrain.model.build import unwrap
from llmtrain.parallel.precision import grad_scaler
from llmtrain.parallel.wrap import parallelize
from llmtrain.training import distributed
from llmtrain.optimizers import build_optimizer
from llmtrain.parallel.dims import ParallelDims
from llmtrain.training.step import Step


_causal_lower_right = torch.nn.attention.bias.causal_lower_right


def causal_lower_right(*sizes):
    """torch's CausalBias (a tensor subclass holding no data: model/attention.causal_chunks, under
    context parallel) cannot be made under the tracker's dispatch mode: made outside it. Patched
    in for the tracked step only; model/attention.py imports it where it calls it."""
    with _disable_current_modes():
        return _causal_lower_right(*sizes)


def measure(cfg, world) -> dict:
    cuda = world.device.type == "cuda"
    # what earlier cases left allocated (their trackers keep some of it): not this case's peak
    before = torch.cuda.memory_allocated(world.device) if cuda else 0
    config = model_config(cfg, load_tokenizer(cfg))
    model = parallelize(cfg, config, world)
    head = chunk_head(model, config, layout=world.layout)
    optimizer = build_optimizer(model, cfg.train, world.device)
    scaler = grad_scaler(cfg, world.device)
    generator = torch.Generator().manual_seed(world.rank)
    shape = (cfg.train.micro_batch_size, cfg.data.seq_len + 1)
    targets = float(shape[0] * (shape[1] - 1))

    trainer = Step(model, head, optimizer, scaler, cfg, world.layout)

    accum = world.dims.accumulation(cfg.train.global_batch_size, cfg.train.micro_batch_size)

    def step(tracker=None):  # a rank's micro-batches of a step: under pp, those in flight at once
        batches = [Batch(torch.randint(0, 400, shape, generator=generator)).to(world.device) for _ in range(accum)]
        trainer.forward_backward(batches, accum * targets)
        if tracker is not None:  # DDP: its buckets, which the gradients are views of, exist from here on
            tracker.track_external(unwrap(model), optimizer)
        trainer.apply()

    sharded = cfg.parallel.strategy != "ddp"
    tracker = FSDPMemTracker(model, optimizer) if sharded else MemTracker()

    def afresh(module, args) -> None:
        """Each micro-batch's forward of the root (of a pipeline stage: each in flight) starts its
        statistics afresh: the trackers refuse a root called twice in one step. The peak counts
        every tensor alike; only the per-module split would be off."""
        modules = tracker._mod_tracker
        if module in tracker.memory_tracking and not modules.is_bw and modules.parents == {"Global"}:
            del tracker.memory_tracking[module]

    step()
    step(None if sharded else tracker)
    if cuda:  # the allocator's own count of the same step, for the GPU test
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(world.device)
    hook = torch.nn.modules.module.register_module_forward_pre_hook(afresh)  # before the trackers' own
    try:
        with mock.patch.object(torch.nn.attention.bias, "causal_lower_right", causal_lower_right), tracker:
            step()
    finally:
        hook.remove()
    snapshot = tracker.get_tracker_snapshot("peak")[world.device]
    return {"peak": snapshot["Total"], "parts": {str(getattr(k, "value", k)): v for k, v in snapshot.items()},
            **({"cuda_max_allocated": torch.cuda.max_memory_allocated(world.device) - before} if cuda else {})}


def main() -> None:
    config, out, cases = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    figures, world = {}, None
    for case in cases:
        name, _, overrides = case.partition("=")
        cfg = load_config(config, overrides.split(",") if overrides else [],
                          world_size=int(os.environ.get("WORLD_SIZE", 1)))
        world = world or distributed.init(cfg)
        # one process group for every case; each case's own degrees (its strategy)
        world = dataclasses.replace(world, dims=ParallelDims.from_config(cfg, world.world_size))
        figures[name] = measure(cfg, world)
        gc.collect()  # the case's model and optimizer, before the next one's
    (out / f"rank-{world.rank}.json").write_text(json.dumps(figures))
    distributed.teardown(world, True)


if __name__ == "__main__":
    main()
