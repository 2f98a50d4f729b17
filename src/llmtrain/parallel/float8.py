"""FP8 training (`train.fp8: tensorwise | rowwise`): the linear layers' matmuls in float8
through torchao's Float8Linear, on the meta skeleton, before tensor parallel and FSDP2.

    convert(model, "tensorwise", device, fsdp=True, compiled=True)   # parallel/wrap.py, before tensor parallel
    log.info(describe(model, "tensorwise", "bf16", device))   # which layers, and why the others not

Each converted layer casts its input, its weight and (in backward) the output's gradient to
float8 with a scale computed on the fly (tensorwise: one per tensor, e4m3 forward, e5m2 for
gradients; rowwise: one per row, e4m3 throughout) and multiplies with `torch._scaled_mm`;
the weight, its gradient and the optimizer state stay as they were (fp32, cast by FSDP2 or
autocast), so a checkpoint holds plain weights under their usual names, and export and resume
do not know FP8 was used. What stays in train.precision, and why (`why_not`):

- the output head: the chunked loss (model/loss.py) multiplies with its weight directly, and
  the logits' precision matters most there (torchtitan leaves it out too);
- a layer whose dimensions are not multiples of 16 (the float8 GEMM's requirement);
- on GPUs, a matmul too small to gain: casting costs more than the faster GEMM saves
  (`too_small`, from torchao's H100 measurements). On CPU every eligible layer converts: the
  FP8 matmuls run there for their numbers (torch 2.13), not for speed.

On CUDA (NCCL), tensorwise layers all-gather in float8, half of bf16's bytes: under tensor
parallel they take torchao's float8 styles (an activation is cast before its all-gather,
parallel/tensor.py), and FSDP2 gathers their weights in float8. gloo has no float8 ("Invalid
scalar type", torch 2.13): on CPU both gather in train.precision and cast after, as rowwise
always does.
"""

from __future__ import annotations

import re

import torch

from ..errors import UserError
from ..model.build import quiet_torchao

RECIPES = ("tensorwise", "rowwise")
HEAD = "the output head"
NOT_16 = "dims not multiples of 16"
SMALL = "too small to gain"


def convert(model: torch.nn.Module, recipe: str, device: torch.device, fsdp: bool,
            compiled: bool = False) -> int:
    """Swap `model`'s eligible nn.Linear layers for torchao's Float8Linear, in place (the
    parameters keep their names and tensors); `fsdp`: the model will be sharded by FSDP2;
    `compiled`: its layers will be compiled. Returns how many converted."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise UserError(f"train.fp8: needs a GPU of compute capability 8.9 or newer (Ada, Hopper, "
                        f"Blackwell); {torch.cuda.get_device_name(device)} is {major}.{minor}; "
                        f"set train.fp8: none")
    Float8LinearConfig, convert_to_float8_training = _torchao()
    config = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise" and fsdp and device.type == "cuda":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # the tensorwise recipe's defaults otherwise
    head = model.get_output_embeddings()
    convert_to_float8_training(
        model, config=config,
        module_filter_fn=lambda module, name: why_not(module, recipe, device.type, head) is None)
    if recipe == "rowwise" and compiled:
        # Inductor rounds rowwise scales unlike eager without it (pytorch #150859), as torchtitan sets.
        import torch._inductor.config
        torch._inductor.config.emulate_precision_casts = True
    return sum(is_float8(m) for m in model.modules())


def why_not(module: torch.nn.Module, recipe: str, device_type: str, head=None) -> str | None:
    """Why a linear layer stays in high precision; None: it trains in float8. Shapes are the
    whole layer's (before tensor parallel splits it)."""
    if module is head:
        return HEAD
    out_features, in_features = module.weight.shape
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


def describe(model: torch.nn.Module, recipe: str, precision: str, device_type: str) -> str:
    """The start-up line: `fp8: 12 of 15 linear layers in float8 (tensorwise); bf16:
    lm_head (the output head), model.layers.*.mlp.down_proj (dims not multiples of 16)`."""
    head = model.get_output_embeddings()
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    converted = sum(is_float8(m) for _, m in linears)
    kept: dict[str, list[str]] = {}  # reason -> name patterns (layer numbers as *)
    for name, module in linears:
        if not is_float8(module):
            reason = why_not(module, recipe, device_type, head) or "not converted"
            pattern = re.sub(r"\.\d+\.", ".*.", name)
            if pattern not in kept.setdefault(reason, []):
                kept[reason].append(pattern)
    line = f"fp8: {converted} of {len(linears)} linear layers in float8 ({recipe})"
    if kept:
        line += f"; {precision}: " + ", ".join(f"{', '.join(names)} ({reason})" for reason, names in kept.items())
    return line


def _torchao():
    """torchao's float8 training API (imported quietly: model/build.py's quiet_torchao)."""
    try:
        with quiet_torchao():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise UserError("train.fp8: needs torchao, which is not installed in this environment; "
                        "install it with: pip install 'llmtrain[fp8]', or set train.fp8: none") from e
    return Float8LinearConfig, convert_to_float8_training
