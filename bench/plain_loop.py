"""The reference: a minimal PyTorch training loop, nothing llmtrain does that it does not need.

    [torchrun --nproc-per-node 2] python bench/plain_loop.py --layers 4 --hidden 256 --seq-len 256 \
        --micro-batch 8 --steps 40 --window 10

Same model class, optimizer, precision and batch as llmtrain's run; random tokens generated up
front; prints one JSON line with the tokens/s of each window of steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--window", type=int, default=10)
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        max_position_embeddings=args.seq_len, tie_word_embeddings=False, use_cache=False,
    ))
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    data = torch.randint(0, args.vocab, (args.steps, args.micro_batch, args.seq_len + 1))

    windows, start = [], time.perf_counter()
    for step in range(args.steps):
        batch = data[step]
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
        print(json.dumps({"tokens_per_sec": windows}), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
