"""Tensor and sequence parallel on Hugging Face decoders (`parallel.tp`): the ranks of one
tensor-parallel group (inside a node) split every layer's matmuls, and between the layers each
holds a slice of the sequence.

    apply_tensor_parallel(model, tp_mesh)   # on the meta skeleton, before checkpointing and FSDP2

Within a decoder layer (Megatron's scheme, torch's parallel styles):

    x [batch, seq/tp, hidden] -> norm (each rank its tokens) -> all-gather the sequence
      -> q, k, v: column-parallel (each rank its heads) -> attention on its heads, whole sequence
      -> o: row-parallel, reduce-scattered back to seq/tp          (the same for the MLP:
         gate, up column-parallel, down row-parallel)

The embedding is row-parallel over the vocabulary (each rank its rows, the lookups summed and
scattered over the sequence), the final norm sequence-parallel, and the output head's weight is
split over the vocabulary too: model/loss.py computes the loss from the vocabulary slices (three
all-reduces of one number per token), so no rank ever holds a token's full logits. A head tied to
the embedding stays tied (the same sharded parameter). LoRA adapters are split with their layer
(_attach_adapters). FP8's tensorwise layers (parallel/float8.py, converted before this) take
torchao's float8 styles: an activation is cast to float8 before its all-gather, once for all the
layers it feeds, and the gradients' reduce-scatters stay in high precision. The model is called
with explicit position ids: HF's model-level code would otherwise count a rank's seq/tp tokens.

A family is one entry in PLANS: the names of its attention and MLP projections and of the norms
that work on heads (Qwen3's q_norm, k_norm: each rank normalises its own heads). Another type is
refused by check-config until it has its entry (a wrong plan would train silently wrong).
Mixture-of-Experts families split their attention so and leave the MoE block whole (MOE below).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch at run time only where the model is split: check-config imports this
    import torch


@dataclass(frozen=True)
class Plan:
    """A decoder layer's module names, as HF's Llama family spells them."""
    attention: str = "self_attn"
    columns: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # of the attention, split by heads
    rows: str = "o_proj"
    mlp: str = "mlp"
    mlp_columns: tuple[str, ...] = ("gate_proj", "up_proj")
    mlp_rows: str = "down_proj"
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")  # on the residual stream
    head_norms: tuple[str, ...] = ()  # norms inside the attention over each head's features
    experts: bool = False  # the MLP is a Mixture-of-Experts block: left whole, on each rank's tokens


LLAMA = Plan()
# A Mixture-of-Experts layer's MLP (router, experts, a shared expert) is not split: each rank of
# the group routes its own slice of the sequence through its whole copy of the experts (no
# all-gather before it, no reduce-scatter after), and the copies' gradients, each from its
# rank's tokens, are summed over the group after backward (sum_partial_grads). Expert parallel
# is what splits the experts themselves.
MOE = Plan(mlp_columns=(), mlp_rows="", experts=True)
PLANS = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": Plan(head_norms=("q_norm", "k_norm")),
    "mixtral": MOE,
    "qwen2_moe": MOE,
    "qwen3_moe": Plan(mlp_columns=(), mlp_rows="", experts=True, head_norms=("q_norm", "k_norm")),
}


def apply_tensor_parallel(model: "torch.nn.Module", layers: "list[torch.nn.Module]", mesh,
                          float8_styles: bool = False) -> None:
    """Split `model` (a HF causal LM; `layers`: its decoder layers) over the 1-D tensor-parallel
    `mesh`, in place. `float8_styles`: torchao's float8 styles on its Float8Linear layers
    (tensorwise scaling only: a rowwise layer all-gathers in high precision)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    plan = PLANS[model.config.model_type]
    style = _styles(float8_styles, {"column": ColwiseParallel, "row": RowwiseParallel, "input": PrepareModuleInput})
    # SequenceParallel makes its module's parameters trainable (torch 2.13): LoRA's frozen norms
    # would train. What was frozen stays frozen.
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    adapters = _detach_adapters(layers)  # the styles split a linear layer's every parameter
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    # (a pipeline stage holds the embedding, the final norm and the head only where it is the first
    # or the last: the others are placeholders without weights, model/build.Absent)
    held = lambda module: getattr(module, "weight", None) is not None  # noqa: E731
    tied = held(head) and head.weight is embedding.weight
    decoder = model.get_decoder()
    if held(embedding):
        # The embedding: each rank looks up its vocabulary rows; the sum is scattered over the sequence.
        parallelize_module(embedding, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
        # Its reduce-scatter is asynchronous: the output is an AsyncCollectiveTensor. A torch.compile'd
        # layer unwraps such an input with trigger_wait(), which (torch 2.13) drops its requires_grad, so
        # the compiled layer sends no gradient back to the embedding (zero under FSDP2, a crash in
        # Redistribute.backward without it). Wait here, in eager, keeping the gradient's path.
        embedding.register_forward_hook(_waited)
    if held(decoder.norm):
        parallelize_module(decoder.norm, mesh, SequenceParallel(use_local_output=True))
    for layer in layers:
        styles = {name: SequenceParallel() for name in plan.norms}
        # attention and MLP take the whole sequence (an all-gather) and give back a slice of it
        attention = [f"{plan.attention}.{name}" for name in plan.columns]
        mlp = [f"{plan.mlp}.{name}" for name in plan.mlp_columns]
        styles[plan.attention] = style("input", layer, attention)(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()})
        if plan.experts:  # this rank's tokens, as a plain tensor; its output joins the residual as it is
            styles[plan.mlp] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                                  use_local_output=True)
        else:
            styles[plan.mlp] = style("input", layer, mlp)(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for name in attention + mlp:
            styles[name] = style("column", layer, [name])()
        for name in plan.head_norms:  # [batch, seq, heads, head_dim]: each rank its heads
            styles[f"{plan.attention}.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        for name in [f"{plan.attention}.{plan.rows}"] + ([] if plan.experts else [f"{plan.mlp}.{plan.mlp_rows}"]):
            styles[name] = style("row", layer, [name])(output_layouts=Shard(1))
        parallelize_module(layer, mesh, styles)
    _attach_adapters(adapters, plan, mesh)
    # The head: its weight split over the vocabulary; model/loss.py applies it (chunk_head).
    if tied:
        head.weight = embedding.weight
    elif held(head):
        head.weight = torch.nn.Parameter(distribute_tensor(head.weight, mesh, [Shard(0)]),
                                         requires_grad=head.weight.requires_grad)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def sum_partial_grads(model: "torch.nn.Module", mesh) -> None:
    """After backward, under tensor parallel: the gradients of the parameters each rank of the
    group holds whole and computes on its own tokens (an MoE layer's router and experts), summed
    over the group (`mesh`, the tp DeviceMesh) in one all-reduce; FSDP2's shards of them too."""
    import torch
    import torch.distributed as dist
    plan = PLANS.get(model.config.model_type)
    if plan is None or not plan.experts:
        return
    grads = [p.grad for name, p in model.named_parameters()
             if f".{plan.mlp}." in name and p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if not local:
        return
    flat = torch.cat([g.reshape(-1) for g in local])
    dist.all_reduce(flat, group=mesh.get_group())
    for g, part in zip(local, flat.split([g.numel() for g in local])):
        g.copy_(part.view_as(g))


def split_dims(model: "torch.nn.Module", layers: "list[torch.nn.Module]") -> dict:
    """{projection of `layers`: the dim of its weight that apply_tensor_parallel splits}: 0 for
    the column-parallel ones (each rank its output features), 1 for the row-parallel ones (its
    input features). FP8 judges each rank's matmul by it (parallel/float8.py)."""
    plan = PLANS[model.config.model_type]
    names = {**{f"{plan.attention}.{name}": 0 for name in plan.columns},
             **{f"{plan.mlp}.{name}": 0 for name in plan.mlp_columns},
             f"{plan.attention}.{plan.rows}": 1, **({} if plan.experts else {f"{plan.mlp}.{plan.mlp_rows}": 1})}
    return {layer.get_submodule(name): dim for layer in layers for name, dim in names.items()}


def _styles(float8: bool, plain: dict):
    """style(kind, layer, names): the parallel style class of `kind` (a key of `plain`: column,
    row, input) for the submodules `names` of `layer`: torchao's float8 variant where `float8`
    and every one of them is a Float8Linear (an input cast to float8 must feed only float8
    layers), else torch's."""
    if not float8:
        return lambda kind, layer, names: plain[kind]
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                       PrepareFloat8ModuleInput)
    variants = {"column": Float8ColwiseParallel, "row": Float8RowwiseParallel, "input": PrepareFloat8ModuleInput}

    def style(kind, layer, names):
        converted = all(isinstance(layer.get_submodule(name), Float8Linear) for name in names)
        return (variants if converted else plain)[kind]
    return style


def _detach_adapters(layers) -> list:
    """(name, linear layer, lora_A, lora_B, lora_dropout) of every layer with LoRA adapters
    (model/lora.py), taken off their layer for the parallel styles (which split every parameter
    of every submodule)."""
    found = []
    for layer in layers:
        for name, module in layer.named_modules():
            if hasattr(module, "lora_A"):
                found.append((name.rpartition(".")[2], module, module.lora_A, module.lora_B, module.lora_dropout))
                del module.lora_A, module.lora_B, module.lora_dropout
    return found


def _attach_adapters(found: list, plan: Plan, mesh) -> None:
    """Each adapter split as its layer: on a column-parallel layer (its output features split)
    B's rows, A whole; on a row-parallel one (its input features split) A's columns, B whole,
    and the layer's partial sums carry the adapter's. DTensor's arithmetic does the rest
    (model/lora.py's forward is unchanged)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    for name, module, lora_a, lora_b, dropout in found:
        module.lora_dropout = dropout
        column = name in plan.columns or name in plan.mlp_columns
        if not column and name not in (plan.rows, plan.mlp_rows):  # a layer the plan leaves whole
            module.lora_A, module.lora_B = lora_a, lora_b
            continue
        for adapter, placement in ((lora_a, Replicate() if column else Shard(1)),
                                   (lora_b, Shard(0) if column else Replicate())):
            adapter.weight = torch.nn.Parameter(distribute_tensor(adapter.weight, mesh, [placement]),
                                                requires_grad=adapter.weight.requires_grad)
        module.lora_A, module.lora_B = lora_a, lora_b


def _waited(module, args, output):
    """Forward hook: an AsyncCollectiveTensor output as a plain tensor (no copy), its gradient
    passed back unchanged."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    return _wait_function().apply(output) if isinstance(output, AsyncCollectiveTensor) else output


@functools.cache
def _wait_function():
    import torch

    class Wait(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.wait()

        @staticmethod
        def backward(ctx, grad):
            return grad

    return Wait


# transformers' config classes' defaults (5.x) for the sizes an inline architecture may leave out:
# a Mistral without num_key_value_heads has 8 of them, a Qwen2/Qwen3 32 whatever its heads, a Llama
# its heads. The vocabulary is left out: an inline model's comes from its tokenizer (model/build.py).
CONFIG_DEFAULTS = {
    "llama": {"num_attention_heads": 32, "intermediate_size": 11008},
    "mistral": {"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336},
    "qwen2": {"num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 22016},
    "qwen3": {"num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 22016},
    "mixtral": {"num_attention_heads": 32, "num_key_value_heads": 8},
    "qwen2_moe": {"num_attention_heads": 16, "num_key_value_heads": 16},
    "qwen3_moe": {"num_attention_heads": 32, "num_key_value_heads": 4},
}


def problems(model_type: str, config: dict, tp: int) -> list[str]:
    """What keeps a model (its config.json as a dict) from splitting over `tp` ranks."""
    if tp == 1:
        return []
    if model_type not in PLANS:
        return [f"parallel.tp: no tensor-parallel plan for model type {model_type!r} (known: "
                f"{', '.join(sorted(PLANS))}); set parallel.tp: 1"]
    given = {**CONFIG_DEFAULTS[model_type], **config}  # what the model will have
    if given.get("num_key_value_heads") is None:  # None or absent in a Llama: one per head
        given["num_key_value_heads"] = given["num_attention_heads"]
    split = ("num_attention_heads", "num_key_value_heads", "vocab_size") + (() if PLANS[model_type].experts
                                                                           else ("intermediate_size",))
    for key in split:
        value = given.get(key)
        if isinstance(value, int) and value % tp:
            return [f"parallel.tp: must divide the model's {key} {value} (got {tp}); each rank "
                    f"holds {key} / tp of them"]
    return []

