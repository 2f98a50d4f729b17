"""FP8 weights that FSDP2 all-gathers in float8 (parallel/float8.py, as on CUDA), their scales
precomputed by the trainer's Step whenever the weights change, against the same model gathered
in its precision and cast after (each weight's scale computed on the whole weight, in the
layer). A tiny Llama, fp32, schedule-free AdamW, in a process group of one:

    python tests/float8_probe.py cuda nccl PORT DIR   # one JSON line (tests/test_gpu.py)
    curves(torch.device("cpu"), DIR)                  # in a gloo group of one (tests/test_float8.py)

Each run: an update (its forward before any scale is precomputed: each weight's all-gather
all-reduces its own amax), a non-finite step skipped on the device, an update, the weights of
before it loaded back (as a resume) and the same update again, an update, an evaluation of
schedule-free's average weights, an update. Returns each run's losses (the evaluation's among them) and its
amax all-reduces per step. gloo carries these gathers: FSDP2 gathers a decoder layer's float8
weights with its norms' as bytes (float8 alone gloo refuses: "Invalid scalar type", torch 2.13).
"""

from __future__ import annotations

import copy
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import tiny_config
from llmtrain.config import load_config
from llmtrain.data.loader import Batch
from llmtrain.model.loss import lm_loss
from llmtrain.optimizers import build_optimizer
from llmtrain.parallel.wrap import apply_fsdp
from llmtrain.training.step import Step

MICRO_BATCHES, ROWS, SEQ = 2, 2, 32


class AllReduces(TorchDispatchMode):
    """Counts the functional all-reduces dispatched inside (torchao's amax reductions, DTensor's)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops._c10d_functional.all_reduce.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def curves(device: torch.device, folder: Path) -> dict[str, dict]:
    """{"gathered": run, "plain": run}, each {"losses": [...], "all_reduces": [...], "precomputes":
    whether the Step precomputes the model's scales, "host_syncs": the host's waits for the GPU
    in weights_changed after the reload (None on a CPU)}."""
    config = Path(folder) / "float8-probe.yaml"
    # no clipping: its norm's all-reduce would be counted with the amax ones
    config.write_text(yaml.safe_dump(tiny_config(
        parallel={"strategy": "fsdp"},
        train={"optimizer": "adamw_schedulefree", "lr_schedule": "constant", "lr": 1e-2, "grad_clip": 0.0})))
    cfg = load_config(config, world_size=1)
    return {name: run(cfg, device, gathered) for name, gathered in (("gathered", True), ("plain", False))}


def run(cfg, device: torch.device, gathered: bool) -> dict:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    # every projection, whatever the size filter would say on a GPU; the head stays, as convert leaves it;
    # off CUDA the float8 matmuls emulated, as parallel/float8.convert has them there
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=gathered, emulate=device.type != "cuda")
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda module, name: name != "lm_head")
    model.to(device)
    apply_fsdp(model, cfg)
    step = Step(model, None, build_optimizer(model, cfg.train, device),
                torch.amp.GradScaler(device.type, enabled=False), cfg)
    g = torch.Generator().manual_seed(1)
    batches = [Batch(torch.randint(0, 512, (ROWS, SEQ + 1), generator=g).to(device)) for _ in range(MICRO_BATCHES)]
    losses, all_reduces = [], []

    def train(loss_factor: float = 1.0) -> None:
        with AllReduces() as counted:
            loss, _ = step.forward_backward(batches, MICRO_BATCHES * ROWS * SEQ, loss_factor, norm=False)
        nonfinite = ~step.finite(loss, None)
        step.update(nonfinite.float(), lambda: bool(nonfinite))
        losses.append(float(loss))
        all_reduces.append(counted.count)

    train()
    train(float("nan"))  # as LLMTRAIN_INJECT_NAN_STEPS: skipped on every rank
    saved = copy.deepcopy(get_state_dict(step.model, step.optimizer))
    train()
    set_state_dict(step.model, step.optimizer, model_state_dict=saved[0], optim_state_dict=saved[1])
    syncs = host_syncs(step.weights_changed, device)  # as training/loop.py after a resume
    train()
    train()
    with step.eval_weights(), torch.no_grad():  # as training/report.py's evaluation
        losses.append(float(lm_loss(step.model, batches[0])))
    train()
    return {"losses": losses, "all_reduces": all_reduces, "precomputes": step.float8_scales, "host_syncs": syncs}


def host_syncs(fn, device: torch.device) -> int | None:
    """How many times `fn()` makes the host wait for the GPU (torch's sync debug mode, warning
    at each); None on a CPU."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


if __name__ == "__main__":
    device, backend, port, folder = torch.device(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)  # torch 2.11 wants an index
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        print(json.dumps(curves(device, Path(folder))))
    finally:
        dist.destroy_process_group()
