"""How long a checkpoint blocks training: async saves against synchronous ones, interleaved.

    source workspace/llmtrain/env.sh
    torchrun --standalone --nproc-per-node 2 bench/checkpoint.py [--rounds 5] [--strategy fsdp]

Builds a Llama of about 21M parameters (about 250 MB of model + AdamW state) with llmtrain's
own parallelize/optimizer, takes one training step so the optimizer state exists, then
alternates synchronous and async `Checkpointer.save` calls. The async call returns once the
state is staged; the upload then runs on its own gloo group, and its wait is timed separately
(the training loop overlaps it with the next steps). Target: async blocked time <= 25% of a
synchronous save.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from llmtrain.config import load_config
from llmtrain.data.tokenizer import load_tokenizer
from llmtrain.model.build import model_config
from llmtrain.parallel.precision import grad_scaler
from llmtrain.parallel.wrap import parallelize
from llmtrain.rundir import Log
from llmtrain.training import distributed
from llmtrain.training.checkpoint import Checkpointer
from llmtrain.data.loader import Batch
from llmtrain.model.loss import lm_loss
from llmtrain.optimizers import build_optimizer

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--strategy", choices=["ddp", "fsdp"], default="fsdp")
    args = ap.parse_args()

    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    demo["model"]["tokenizer"] = str(REPO / "configs" / "demo" / "tokenizer")
    demo["model"]["architecture"].update(hidden_size=512, intermediate_size=1536,
                                         num_hidden_layers=6, num_attention_heads=8,
                                         num_key_value_heads=8)
    demo["data"]["dataset"] = str(REPO / "configs" / "demo" / "stories.txt")
    demo["run"] = {"name": "ckpt-bench", "dir": "/tmp/llmtrain-ckpt-bench"}
    demo["parallel"]["strategy"] = args.strategy
    demo["train"].update(keep_checkpoints=2, global_batch_size=16, micro_batch_size=8)
    config_path = Path("/tmp/llmtrain-ckpt-bench.yaml")
    config_path.write_text(yaml.safe_dump(demo))
    cfg = load_config(config_path, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    if int(os.environ.get("RANK", 0)) == 0:  # earlier checkpoints of the same steps would be skipped
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
    world = distributed.init(cfg)
    try:
        tokenizer = load_tokenizer(cfg)
        config = model_config(cfg, tokenizer)
        model = parallelize(cfg, config, world)
        optimizer = build_optimizer(model, cfg.train, world.device)
        batch = torch.randint(0, config.vocab_size, (8, cfg.data.seq_len + 1))
        lm_loss(model, Batch(batch)).backward()
        optimizer.step()
        state_mb = _state_mb(model, optimizer)

        log = Log(world.rank)
        compat = {}
        sync = Checkpointer(cfg, world, log, compat)
        async_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, async_checkpoint=True))
        asyn = Checkpointer(async_cfg, world, log, compat)
        extra = {"run": {}, "sampler": {}, "scaler": grad_scaler(cfg, world.device).state_dict()}
        sync_s, block_s, upload_s, step = [], [], [], 0
        for _ in range(args.rounds):
            step += 1
            dist.barrier()
            t0 = time.perf_counter()
            sync.save(step, model, optimizer, extra)
            dist.barrier()
            sync_s.append(time.perf_counter() - t0)

            step += 1
            dist.barrier()
            t0 = time.perf_counter()
            asyn.save(step, model, optimizer, extra)
            block_s.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            asyn.wait()
            dist.barrier()
            upload_s.append(time.perf_counter() - t1)
        if world.is_main:
            asyn.close()
            s, b, u = (statistics.median(x) for x in (sync_s, block_s, upload_s))
            print(f"{args.strategy}, {world.world_size} ranks, {state_mb:.0f} MB of model+optimizer "
                  f"state: sync save {s * 1000:.0f} ms; async blocks {b * 1000:.0f} ms "
                  f"({b / s:.0%} of sync), then uploads {u * 1000:.0f} ms in the background "
                  f"(medians of {args.rounds})", flush=True)
    finally:
        distributed.teardown()


def _state_mb(model, optimizer) -> float:
    """Global bytes of parameters and optimizer state (DTensors count their full size)."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for s in optimizer.state.values():
        n += sum(v.numel() * v.element_size() for v in s.values() if hasattr(v, "numel") and v.ndim)
    return n / 2**20


if __name__ == "__main__":
    main()
