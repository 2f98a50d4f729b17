"""FP8 training (`train.fp8: tensorwise | rowwise`): the linear layers' matmuls in float8
through torchao's Float8Linear, on the meta skeleton, before tensor parallel and FSDP2.

    convert(model, "tensorwise", device, fsdp=True, compiled=True)   # parallel/wrap.py, before tensor parallel
    log.info(describe(model, "tensorwise", "bf16", "cuda", compiled=True))   # which layers, why the others not

Each converted layer casts its input, its weight and (in backward) the output's gradient to
float8 with a scale computed on the fly (tensorwise: one per tensor, e4m3 forward, e5m2 for
gradients; rowwise: one per row, e4m3 throughout) and multiplies with `torch._scaled_mm` (on a
CPU, emulated: the float8 operands, scaled back, multiplied in fp32 by torchao's `emulate`;
torch 2.13's CPU _scaled_mm is a scalar loop at ~0.1 GFLOP/s, 25x slower a step here);
the weight, its gradient and the optimizer state stay as they were (fp32, cast by FSDP2 or
autocast), so a checkpoint holds plain weights under their usual names, and export and resume
do not know FP8 was used. What stays in train.precision, and why (`why_not`):

- the output head: the chunked loss (model/loss.py) multiplies with its weight directly, and
  the logits' precision matters most there (torchtitan leaves it out too);
- a layer whose dimensions are not multiples of 16 (the float8 GEMM's requirement);
- on GPUs, a matmul too small to gain: casting costs more than the faster GEMM saves
  (`too_small`, from torchao's H100 measurements). On CPU every eligible layer converts: the
  FP8 matmuls run there for their numbers, not for speed.

Both shape tests judge the matmul each rank runs: under tensor parallel a column-parallel
layer's output features and a row-parallel layer's input features divided by parallel.tp
(a 2048 x 2048 q_proj is a 1024 x 2048 matmul per rank at tp 2: too small to gain).

On CUDA (NCCL), tensorwise layers all-gather in float8, half of bf16's bytes: under tensor
parallel they take torchao's float8 styles (an activation is cast before its all-gather,
parallel/tensor.py), and FSDP2 gathers their weights in float8 (`gathers_in_float8`). gloo has
no float8 ("Invalid scalar type", torch 2.13): on CPU both gather in train.precision and cast
after, as rowwise always does. A weight gathered in float8 is cast with a scale from its
amax over the whole weight: left to itself, each all-gather first all-reduces its own amax
(a layer's forward and again its backward: 1,113 small all-reduces per micro-batch at 70B,
each of which its gather waits for). `precompute_scales` computes them all in one all-reduce
instead; training/step.py calls it whenever the weights change (after each update, a load, the
evaluation weights), so a scale never outlives its weights.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from ..errors import UserError
from ..model.build import decoder_layers, quiet_torchao
from .tensor import split_dims

RECIPES = ("tensorwise", "rowwise")
HEAD = "the output head"
NOT_16 = "dims not multiples of 16"
SMALL = "too small to gain"


def convert(model: torch.nn.Module, recipe: str, device: torch.device, fsdp: bool,
            compiled: bool = False, tp: int = 1) -> int:
    """Swap `model`'s eligible nn.Linear layers for torchao's Float8Linear, in place (the
    parameters keep their names and tensors); `fsdp`: the model will be sharded by FSDP2;
    `compiled`: its layers will be compiled; `tp`: tensor parallel will split them over that
    many ranks. Returns how many converted."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise UserError(f"train.fp8: needs a GPU of compute capability 8.9 or newer (Ada, Hopper, "
                        f"Blackwell); {torch.cuda.get_device_name(device)} is {major}.{minor}; "
                        f"set train.fp8: none")
    Float8LinearConfig, convert_to_float8_training = _torchao()
    config = Float8LinearConfig.from_recipe_name(recipe)
    if gathers_in_float8(recipe, fsdp, device.type):
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # the tensorwise recipe's defaults otherwise
    if device.type != "cuda":  # the float8 operands multiplied in fp32, not by _scaled_mm's CPU loop
        config = dataclasses.replace(config, emulate=True)
    kept = high_precision(model, recipe, device.type, tp)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: module not in kept)
    if recipe == "rowwise" and compiled:
        # Inductor rounds rowwise scales unlike eager without it (pytorch #150859), as torchtitan sets.
        from torch._inductor import config as inductor  # not `import torch._inductor...`: it would make torch local
        inductor.emulate_precision_casts = True
    return sum(is_float8(m) for m in model.modules())


def gathers_in_float8(recipe: str, fsdp: bool, device_type: str) -> bool:
    """Whether FSDP2 all-gathers the float8 layers' weights in float8 (torchao's
    enable_fsdp_float8_all_gather), so that their scales want precompute_scales: tensorwise
    scaling only (torchao 0.18's Float8LinearConfig refuses it for rowwise, whose weights
    gather in high precision), a sharded model, and CUDA, whose NCCL gathers float8."""
    return recipe == "tensorwise" and fsdp and device_type == "cuda"


def high_precision(model: torch.nn.Module, recipe: str, device_type: str, tp: int = 1) -> dict:
    """{linear layer: why it stays in high precision} over `model`'s linear layers, whose
    matmuls are judged as each rank runs them under tensor parallel over `tp` ranks."""
    head = model.get_output_embeddings()
    split = split_dims(model, decoder_layers(model)) if tp > 1 else {}  # check-config: tp only with a plan
    kept = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            reason = why_not(module, recipe, device_type, head, split.get(module), tp)
            if reason is not None:
                kept[module] = reason
    return kept


def why_not(module: torch.nn.Module, recipe: str, device_type: str, head=None,
            tp_dim: int | None = None, tp: int = 1) -> str | None:
    """Why a linear layer stays in high precision; None: it trains in float8. `tp_dim`: the
    dim of its weight that tensor parallel splits over `tp` ranks (0: column-parallel, 1:
    row-parallel; None: not split): the shapes judged are those of the matmul each rank runs."""
    if module is head:
        return HEAD
    shape = list(module.weight.shape)  # the whole layer's, also once split (a DTensor's)
    if tp_dim is not None:
        shape[tp_dim] //= tp
    out_features, in_features = shape
    if out_features % 16 or in_features % 16:
        return NOT_16
    if device_type == "cuda" and too_small(out_features, in_features, recipe):
        return SMALL
    return None


def too_small(n: int, k: int, recipe: str) -> bool:
    """Whether an [M, K] x [K, N] matmul gains nothing in float8 on an H100, whatever M: the
    bounds under which torchao's float8 training benchmarks measured no speed-up over bf16
    (torchao/float8/README.md, performance tables): tensorwise K <= 4096 with N <= 1024;
    rowwise N <= 2048, K <= 1024, or both N <= 4096 and K <= 2048."""
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def is_float8(module: torch.nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"  # torchao's, without importing it


def describe(model: torch.nn.Module, recipe: str, precision: str, device_type: str, tp: int = 1,
             compiled: bool = False) -> str:
    """The start-up line: `fp8: 12 of 15 linear layers in float8 (tensorwise); bf16:
    lm_head (the output head), model.layers.*.mlp.down_proj (dims not multiples of 16)`; where
    FSDP2 gathers their weights in float8, `(tensorwise, weights all-gathered in float8)`; then
    what keeps it from gaining speed (`no_gain`)."""
    reasons = high_precision(model, recipe, device_type, tp)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    converted = sum(is_float8(m) for _, m in linears)
    kept: dict[str, list[str]] = {}  # reason -> name patterns (layer numbers as *)
    for name, module in linears:
        if not is_float8(module):
            reason = reasons.get(module, "not converted")
            pattern = re.sub(r"\.\d+\.", ".*.", name)
            if pattern not in kept.setdefault(reason, []):
                kept[reason].append(pattern)
    gathered = ", weights all-gathered in float8" if precomputes_scales(model) else ""
    line = f"fp8: {converted} of {len(linears)} linear layers in float8 ({recipe}{gathered})"
    if kept:
        line += f"; {precision}: " + ", ".join(f"{', '.join(names)} ({reason})" for reason, names in kept.items())
    return line + "".join(f"; {why}" for why in no_gain(device_type, compiled))


def no_gain(device_type: str, compiled: bool) -> list[str]:
    """Why this run's FP8 is no faster than train.precision (for the start-up line): a device
    without float8 tensor cores runs the float8 matmuls emulated (only CPUs get here: convert
    refuses GPUs below compute capability 8.9), and without train.compile torchao's casts are
    not fused, which costs a GPU more than its float8 matmuls save (doc/overview.md, FP8)."""
    reasons = []
    if device_type != "cuda":
        reasons.append(f"on {device_type} the float8 matmuls are emulated (no float8 tensor cores): "
                       f"FP8's numbers, not its speed")
    if not compiled:
        either = " on a GPU either" if reasons else ""
        reasons.append(f"train.compile is off: without it FP8 gains nothing{either} (torchao's casts "
                       f"are fused only when compiled)")
    return reasons


def precomputes_scales(model: torch.nn.Module) -> bool:
    """Whether `model` has float8 layers whose weights FSDP2 gathers in float8
    (gathers_in_float8 when it was converted): their scales want precompute_scales."""
    return any(is_float8(m) and m.config.enable_fsdp_float8_all_gather for m in model.modules())


def precompute_scales(model: torch.nn.Module) -> None:
    """The scale of every weight FSDP2 gathers in float8, from the weights as they are now, for
    their all-gathers until the next call: one all-reduce (of one amax per layer) over the
    sharding ranks and no wait for the device (torchao's precompute_float8_dynamic_scale_for_fsdp;
    torchtitan calls it after each optimizer step). Must follow every change of the weights: a
    scale left from other weights clips those it no longer fits, silently."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # imported by convert already
    precompute_float8_dynamic_scale_for_fsdp(model)


def _torchao():
    """torchao's float8 training API (imported quietly: model/build.py's quiet_torchao)."""
    try:
        with quiet_torchao():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise UserError("train.fp8: needs torchao, which is not installed in this environment; "
                        "install it with: pip install 'llmtrain[fp8]', or set train.fp8: none") from e
    return Float8LinearConfig, convert_to_float8_training
