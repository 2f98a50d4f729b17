"""Muon under FSDP2: our stacked all-to-all against torch.optim.Muon on DTensors, interleaved.

    source workspace/llmtrain/env.sh
    torchrun --standalone --nproc-per-node 2 bench/muon.py [--layers 8] [--hidden 256] [--rounds 5]
    torchrun --standalone --nproc-per-node 4 bench/muon.py --tp 2     # FSDP2 x tensor parallel

A Llama's hidden matrices, sharded by FSDP2 (fully_shard per layer, then the root; with --tp,
over the data-parallel ranks after tensor parallel split each layer), the same random gradients
on both; one optimizer step of each, alternating. Prints, per step: the collectives each issues
(DTensor's CommDebugMode), the wall time (median), and how far our sharded result is from the
same Muon on whole matrices in one process (it must be ~0). torch.optim.Muon runs Newton-Schulz
in bf16 and gathers every matrix on every rank; ours in fp32, each rank its share of the
matrices, moved by all_to_all_single (gloo runs it as NCCL does: the counts are NCCL's too).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from transformers import LlamaConfig, LlamaForCausalLM

from llmtrain.optimizers.muon import Muon
from llmtrain.parallel.tensor import apply_tensor_parallel


def hidden_matrices(model) -> list:
    ends = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    return [p for p in model.parameters() if p.ndim == 2 and id(p) not in ends]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         vocab_size=1024)
    whole = LlamaForCausalLM(config)
    grads = [torch.randn_like(p) for p in hidden_matrices(whole)]
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("shard", "tensor"))
    models = []
    for _ in range(2):
        model = LlamaForCausalLM(config)
        model.load_state_dict(whole.state_dict())
        if args.tp > 1:
            apply_tensor_parallel(model, list(model.model.layers), mesh["tensor"])
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        models.append(model)
    ours = Muon([{"params": hidden_matrices(models[0]), "muon": True}], lr=0.02)
    theirs = torch.optim.Muon(hidden_matrices(models[1]), lr=0.02, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
    reference = Muon([{"params": hidden_matrices(whole), "muon": True}], lr=0.02)

    def step(optimizer, params) -> tuple[float, int]:
        for p, g in zip(params, grads):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if hasattr(p, "placements") else g.clone()
        dist.barrier()
        with CommDebugMode() as comm:
            start = time.perf_counter()
            optimizer.step()
            dist.barrier()
            seconds = time.perf_counter() - start
        return seconds, comm.get_total_counts()

    times = {"llmtrain": [], "torch": []}
    counts = {}
    for _ in range(args.rounds):
        for name, optimizer, model in (("llmtrain", ours, models[0]), ("torch", theirs, models[1])):
            seconds, count = step(optimizer, hidden_matrices(model))
            times[name].append(seconds)
            counts[name] = count
        step(reference, hidden_matrices(whole))
    error = max(float((p.full_tensor() - q).abs().max())
                for p, q in zip(hidden_matrices(models[0]), hidden_matrices(whole)))
    n = len(grads)
    if rank == 0:
        layout = f"FSDP2 {world // args.tp} x tp {args.tp}" if args.tp > 1 else f"FSDP2 over {world} ranks"
        print(f"{n} hidden matrices ({args.layers} layers x 7, hidden {args.hidden}), {layout} (gloo)")
        print(f"{'':10} {'collectives/step':>17} {'per matrix':>11} {'median s/step':>14}")
        for name in times:
            print(f"{name:10} {counts[name]:>17} {counts[name] / n:>11.1f} {statistics.median(times[name]):>14.4f}")
        print(f"ours vs whole matrices in one process after {args.rounds} steps: max |diff| {error:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
