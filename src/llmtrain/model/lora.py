"""LoRA: low-rank adapters on chosen linear layers, the base model frozen.

    model:
      name_or_path: meta-llama/Llama-3.1-8B
      lora: {rank: 16, alpha: 32, dropout: 0.05, target_modules: [q_proj, k_proj, v_proj, o_proj]}

Each targeted nn.Linear keeps its own weight (frozen) and gains two trainable matrices as
submodules, `lora_A` [rank x in] and `lora_B` [out x rank]:

    y = x W^T + b + (dropout(x) A^T B^T) * alpha / rank       (B starts at zero: y starts as the base's)

The module's class and the base weight's name do not change (`...q_proj.weight`): pretrained
weights load as for full training, FSDP2 shards the adapters with their layer, and activation
checkpointing and torch.compile wrap the layer as before. The adapters' names are peft's
(`...q_proj.lora_A.weight`), so `llmtrain export` writes an adapter folder peft loads
(`PeftModel.from_pretrained(base, dir)`) by adding peft's `base_model.model.` prefix.

Initialisation is peft's default (A: Kaiming-uniform with a = sqrt(5), B: zeros), under a seed
made of train.seed and the module's name: the same adapters on any world size and strategy.
Adapters are kept and trained in fp32 whatever the base's storage (bf16/fp16 runs store the
frozen base in that precision: parallel/wrap.py's store_frozen_base); checkpoints hold only what
trains (the adapters) and its optimizer state, and a resume reloads the base from its source.
"""

from __future__ import annotations

import hashlib
import math
import types

import torch
import torch.nn.functional as F

from ..config import LoraSpec, UserError

def targets(model: torch.nn.Module, spec: LoraSpec) -> dict[str, torch.nn.Linear]:
    """The linear layers the adapters go on: those whose last name part is in target_modules
    (peft's rule for a list of names); the output head never."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = {name: m for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and m is not head
             and name.rpartition(".")[2] in spec.target_modules}
    if not found:
        names = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise UserError(f"model.lora.target_modules: no linear layer of {type(model).__name__} is named "
                        f"{', '.join(spec.target_modules)}; its linear layers are: {', '.join(names)}")
    return found


def apply_lora(model: torch.nn.Module, spec: LoraSpec) -> int:
    """Freeze the model and add adapters to the target layers (on the layers' device: meta for
    a skeleton); return the number of trainable parameters."""
    for p in model.parameters():
        p.requires_grad_(False)
    trainable = 0
    for layer in targets(model, spec).values():
        device = layer.weight.device
        layer.lora_A = torch.nn.Linear(layer.in_features, spec.rank, bias=False, device=device)
        layer.lora_B = torch.nn.Linear(spec.rank, layer.out_features, bias=False, device=device)
        layer.lora_dropout = torch.nn.Dropout(spec.dropout) if spec.dropout else torch.nn.Identity()
        layer.lora_scaling = spec.scaling
        layer.forward = types.MethodType(_lora_forward, layer)
        trainable += spec.rank * (layer.in_features + layer.out_features)
    return trainable


def _lora_forward(self, x: torch.Tensor) -> torch.Tensor:
    out = F.linear(x, self.weight, self.bias)
    return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.lora_scaling


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def frozen_weights(model: torch.nn.Module, linear_only: bool) -> list[torch.nn.Parameter]:
    """The frozen parameters (each once); `linear_only`: only the weights of linear layers not
    tied to the input embedding, those a matmul reads (under autocast, cast for it)."""
    params = {id(p): p for p in model.parameters() if not p.requires_grad}
    if linear_only:
        embedding = model.get_input_embeddings().weight
        params = {id(m.weight): m.weight for m in model.modules()
                  if isinstance(m, torch.nn.Linear) and id(m.weight) in params and m.weight is not embedding}
    return list(params.values())


@torch.no_grad()
def init_adapters(model: torch.nn.Module, seed: int, local_slices) -> None:
    """peft's initialisation, seeded by train.seed and each adapter's name; every rank computes
    the full matrix and keeps its slice (`local_slices(shape, param)`, as parallel/weights.py's)."""
    for name, param in model.named_parameters():
        if not is_adapter(name):
            continue
        full = torch.empty(param.shape, dtype=torch.float32)
        if ".lora_A." in name:
            generator = torch.Generator().manual_seed(_seed(seed, name))
            bound = 1 / math.sqrt(param.shape[1])  # kaiming_uniform_(a=sqrt(5)) on [rank, in]
            full.uniform_(-bound, bound, generator=generator)
        else:
            full.zero_()
        local = param.to_local() if hasattr(param, "to_local") else param
        local.copy_(full[local_slices(full.shape, param)].to(local.device))


def _seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"lora:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def peft_config(spec: LoraSpec, base: str | None) -> dict:
    """adapter_config.json as peft writes it for this adapter."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": sorted(spec.target_modules), "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}}


@torch.no_grad()
def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  scaling: float) -> torch.Tensor:
    """A target layer's weight with its adapter folded in, W + B A alpha/rank, in fp32 (the
    base's weight upcast from its storage): `llmtrain export --merge`, one layer at a time."""
    return weight.float() + lora_b.float() @ lora_a.float() * scaling
