"""Param groups by name pattern: an optimizer's groups are data in its OPTIMIZERS entry.

    groups = param_groups(kind.groups, labelled(model))    # torch's param groups, in the table's order

A table is a tuple of ParamGroup (name, patterns), matched against each trainable parameter's
label, "<role>:<qualified name>"; the first group with a matching pattern (fnmatch) takes it, so
a table ends with a group that takes "*". The role comes from the module, not the name, since
families name their embeddings and head differently (embed_tokens, wte, word_embeddings;
lm_head, embed_out):

    embedding  an nn.Embedding's weight (tokens, positions); a head tied to it is this one parameter
    head       the output head's weight (the model's get_output_embeddings())
    router     a Mixture-of-Experts router's weight (its module's class ends in Router; Qwen2-MoE's
               shared_expert_gate): it scores experts, it does not transform the hidden states
    matrix     any other parameter of 2 or more dimensions: the hidden matrices, LoRA's adapters, an
               MoE layer's experts (a stack of matrices, [experts, rows, cols])
    vector     the rest: norms, biases

e.g. "matrix:model.layers.0.self_attn.q_proj.weight", "embedding:transformer.wte.weight",
"vector:model.norm.weight". Each group also says how many matrices each of its parameters'
rows hold (`row_blocks`): 2 for a fused MoE [gate; up] stack (transformers' experts.gate_up_proj),
1 for the rest: Muon orthogonalises each expert's gate and up apart. Every group of the table is made, empty ones too (a LoRA run's
vectors): a checkpoint's param_groups are matched to the optimizer's by position (torch's
Optimizer.load_state_dict), and hold no name (a key that an older checkpoint lacks fails its
load), so optimizers/ finds a group's name by that order (named_groups).

This module imports no torch until a model is labelled: the login node's commands read the tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ParamGroup:
    """One param group: the trainable parameters whose label matches one of `patterns` and no
    earlier group's."""
    name: str  # how optimizers/ asks for it (describe, held_state_bytes, an optimizer's settings)
    patterns: tuple[str, ...]
    state_bytes: int | None = None  # its optimizer state per parameter, where not the entry's

    def takes(self, label: str) -> bool:
        return any(fnmatchcase(label, pattern) for pattern in self.patterns)


# Weight decay on matrices only (apply_settings): the matrices, then the biases and norms.
MATRICES_AND_VECTORS = (ParamGroup("matrices", ("embedding:*", "head:*", "router:*", "matrix:*")),
                        ParamGroup("vectors", ("*",)))


def labelled(model: "torch.nn.Module") -> list[tuple[str, "torch.nn.Parameter"]]:
    """The model's trainable parameters with their labels, in the model's order."""
    import torch
    inner = getattr(model, "module", model)  # DDP's wrapper has not the model's methods
    head = inner.get_output_embeddings()
    embeddings = {id(m.weight) for m in inner.modules() if isinstance(m, torch.nn.Embedding)}
    routers = {id(p) for name, m in inner.named_modules()
               if type(m).__name__.endswith("Router") or name.endswith("shared_expert_gate") for p in m.parameters()}

    def role(p) -> str:
        if id(p) in embeddings:
            return "embedding"
        if head is not None and p is head.weight:
            return "head"
        if id(p) in routers:
            return "router"
        return "matrix" if p.ndim >= 2 else "vector"
    return [(f"{role(p)}:{name}", p) for name, p in inner.named_parameters() if p.requires_grad]


def row_blocks(label: str) -> int:
    """The matrices a parameter's rows stack: 2 for an MoE layer's fused experts [gate; up]."""
    return 2 if label.endswith(".experts.gate_up_proj") else 1


def param_groups(table: tuple[ParamGroup, ...], params: list[tuple[str, Any]]) -> list[dict]:
    """torch's param groups of labelled parameters: one per entry of `table`, in its order (empty
    ones too), each parameter in the first whose patterns match its label."""
    groups: list[dict] = [{"params": [], "row_blocks": []} for _ in table]
    for label, p in params:
        takers = [i for i, group in enumerate(table) if group.takes(label)]
        assert takers, f"no param group takes {label}: a table's last group must take '*'"
        groups[takers[0]]["params"].append(p)
        groups[takers[0]]["row_blocks"].append(row_blocks(label))
    return groups
