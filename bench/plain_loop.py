"""The reference: a minimal PyTorch training loop, nothing llmtrain does that it does not need.

    [torchrun --nproc-per-node 2] python bench/plain_loop.py --layers 4 --hidden 256 --seq-len 256 \
        --micro-batch 8 --steps 40 --window 10

Same model class, optimizer, precision and batch as llmtrain's run; random tokens generated up
front; prints one JSON line with the tokens/s of each window of steps and the peak memory (on
CUDA). --arch '{"model_type": ..., ...}' gives another architecture (bench/gpu.py); --precision
bf16 runs under autocast, as llmtrain does without FSDP.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    args = parse_args()

    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = model_config(args)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    model = AutoModelForCausalLM.from_config(config).to(device)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    data = torch.randint(0, config.vocab_size, (args.steps, args.micro_batch, args.seq_len + 1), device=device)

    windows, start = [], time.perf_counter()
    for step in range(args.steps):
        batch = data[step]
        with autocast:
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % args.window == 0:
            loss.item()
            now = time.perf_counter()
            windows.append(args.window * args.micro_batch * args.seq_len * world / (now - start))
            start = now
    if int(os.environ.get("RANK", 0)) == 0:
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        print(json.dumps({"tokens_per_sec": windows, "peak_mem_gib": peak}), flush=True)
    if world > 1:
        dist.destroy_process_group()


def parse_args() -> argparse.Namespace:
    """The workload, shared with bench/hf_trainer.py."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--arch", help="a JSON architecture (model_type and fields) instead of the Llama above")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    return ap.parse_args()


def model_config(args):
    """--arch's architecture, or the CPU benchmark's Llama (4 x 256 by default)."""
    if args.arch:
        arch = json.loads(args.arch)
        return AutoConfig.for_model(arch.pop("model_type"), use_cache=False, **arch)
    return AutoConfig.for_model(
        "llama", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        max_position_embeddings=args.seq_len, tie_word_embeddings=False, use_cache=False)


if __name__ == "__main__":
    main()
