"""Peak tensor memory and time of the loss: plain (full logits) vs chunked (model/loss.py).

    python bench/loss.py [--tokens 4096] [--vocab 128256] [--hidden 256]

Forward and backward of the output head and cross-entropy over `tokens` hidden states, fp32,
on the CPU, measured by torch's tensor-memory tracker (MemTracker). The logits' size does not
depend on the hidden width, so a narrow one keeps the matmuls short; the saving is what a
Llama-3 vocabulary costs per micro-batch of that many tokens.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

from llmtrain.model.loss import chunked_cross_entropy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, requires_grad=True)
    weight = (torch.randn(args.vocab, args.hidden) / args.hidden ** 0.5).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,))
    logits_gib = args.tokens * args.vocab * 4 / 2**30
    print(f"{args.tokens} tokens x {args.vocab} vocabulary: {logits_gib:.2f} GiB of fp32 logits")
    print("| loss | peak tensor memory GiB | seconds | loss value |")
    print("| --- | --- | --- | --- |")
    runs = {"plain": lambda: F.cross_entropy(hidden @ weight.t(), targets),
            "chunked": lambda: chunked_cross_entropy(hidden, weight, targets)}
    for name, fn in runs.items():
        hidden.grad = weight.grad = None
        tracker = MemTracker()
        tracker.track_external(hidden, weight)
        t0 = time.perf_counter()
        with tracker:
            loss = fn()
            loss.backward()
        seconds = time.perf_counter() - t0
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] / 2**30
        print(f"| {name} | {peak:.2f} | {seconds:.1f} | {loss.item():.6f} |")


if __name__ == "__main__":
    main()
