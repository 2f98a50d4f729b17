"""The host's work per decoder layer, plain and under tensor parallel's DTensor styles, context
parallel's DTensor gathers and FSDP2's hooks, eager or compiled: the figures login/plan.py's
HOST_LAYER_S, HOST_TP_LAYER_S and HOST_CP_LAYER_S come from.

    python bench/host.py [--device cuda] [--tp 2 8] [--cp 2 8] [--fsdp 8] [--compile] [--repeats 15]

A Llama of 8 layers x 128 hidden (8 heads), one row of 8 tokens: the kernels' work is next to
nothing, so a forward and backward's time is what the host spends dispatching them. Tensor
parallel runs on torch's fake process group (one process as rank 0 of `--tp` ranks; its
collectives return at once), through parallel/tensor.apply_tensor_parallel as training applies it,
so what it adds over the plain layer is DTensor's dispatch and redistributions, not a link.
Context parallel runs as model/loss.lm_loss runs it: rank 0's 2 chunks (8 tokens) of a cp x 8
token sequence, its keys and values gathered through DTensor (model/attention.py); FSDP2 over
`--fsdp` ranks on each layer and the root, resharded after forward (ZeRO-3, the default). On a
GPU (`--device cuda`) the time is the host's until the device drains: the kernels are queued
asynchronously and the last one is waited for once a pass. Prints milliseconds a layer (forward
and backward): the median of `--repeats` passes after 3 of warm-up, one thread.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAYERS, HIDDEN, HEADS, TOKENS = 8, 128, 8, 8
ONE = """
import statistics, sys, time, torch, torch.distributed as dist
sys.path.insert(0, {src!r})
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import LlamaConfig, LlamaForCausalLM
torch.set_num_threads(1)
device, tp, cp, fsdp = torch.device({device!r}), {tp}, {cp}, {fsdp}
config = LlamaConfig(vocab_size=512, hidden_size={hidden}, intermediate_size=3 * {hidden}, num_hidden_layers={layers},
                     num_attention_heads={heads}, num_key_value_heads={heads}, max_position_embeddings=64)
config._attn_implementation = "sdpa"
torch.manual_seed(0)
model = LlamaForCausalLM(config).to(device)
tokens = torch.randint(0, 512, (1, {tokens}), device=device)
extra = dict(position_ids=torch.arange({tokens}, device=device)[None])
if tp > 1 or cp > 1 or fsdp > 1:
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp * cp * fsdp)
    mesh = init_device_mesh(device.type, (tp * cp * fsdp,))
if fsdp > 1:  # FSDP2 as parallel/wrap.py applies it: each layer, then the root (resharded after forward)
    from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
if tp > 1:
    from llmtrain.parallel.tensor import apply_tensor_parallel
    apply_tensor_parallel(model, list(model.model.layers), mesh)
if cp > 1:  # as model/loss.lm_loss runs it: rank 0's 2 chunks of a cp x {tokens} token sequence
    from llmtrain.model.attention import context_chunks, context_masks, context_parallel_attention
    context_parallel_attention(model, mesh)
    places = context_chunks(cp * {tokens}, 0, cp, device)
    extra = dict(position_ids=places[None], attention_mask=context_masks(config, places, cp * {tokens}))
if {compile}:
    for layer in model.model.layers:
        layer.compile()
def one():
    if fsdp > 1:  # the root, whose forward FSDP2 hooks (its head: 8 tokens x 512, next to nothing)
        out = model(input_ids=tokens, **extra).logits
    else:  # the decoder (under tp the head's rows are split for model/loss.py's chunked head)
        out = model.model(input_ids=tokens, **extra).last_hidden_state
    out.float().pow(2).mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
times = []
for i in range(3 + {repeats}):
    t0 = time.perf_counter()
    one()
    times.append(time.perf_counter() - t0)
print(statistics.median(times[3:]) / {layers} * 1e3)
"""


def per_layer_ms(device: str, tp: int, repeats: int, compile: bool = False, cp: int = 1, fsdp: int = 1) -> float:
    """The host's milliseconds a layer (forward and backward) at `tp`, `cp` or `fsdp` (all 1: the
    plain layer), in a process of its own."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    code = ONE.format(src=src, device=device, tp=tp, cp=cp, fsdp=fsdp, hidden=HIDDEN, layers=LAYERS, heads=HEADS, tokens=TOKENS,
                      repeats=repeats, compile=compile)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"tp {tp}, cp {cp}, fsdp {fsdp}: failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--fsdp", type=int, nargs="+", default=[8])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--compile", action="store_true", help="each decoder layer compiled, as train.compile does")
    args = ap.parse_args()
    t0 = time.time()
    plain = per_layer_ms(args.device, 1, args.repeats, args.compile)
    how = f"{args.device}{', compiled' if args.compile else ''}"
    print(f"{how}: the plain layer {plain:.2f} ms of host work a layer (forward and backward)")
    for tp in args.tp:
        ms = per_layer_ms(args.device, tp, args.repeats, args.compile)
        print(f"{how}: tp {tp} (DTensor's sequence-parallel styles) {ms:.2f} ms a layer, "
              f"{ms - plain:+.2f} ms over the plain layer")
    for cp in [] if args.compile else args.cp:  # training refuses train.compile under cp
        ms = per_layer_ms(args.device, 1, args.repeats, args.compile, cp)
        print(f"{how}: cp {cp} (DTensor's gathers of the keys and values) {ms:.2f} ms a layer, "
              f"{ms - plain:+.2f} ms over the plain layer")
    for fsdp in args.fsdp:
        ms = per_layer_ms(args.device, 1, args.repeats, args.compile, fsdp=fsdp)
        print(f"{how}: fsdp over {fsdp} (FSDP2's gathers and reductions a layer) {ms:.2f} ms a layer, "
              f"{ms - plain:+.2f} ms over the plain layer")
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
