"""Mixture-of-Experts decoders: which families train, how their checkpoint files store the
experts, the router's load-balancing loss, and the parameters a token actually uses.

    moe = MoE.of(config)                      # None for a dense model
    moe.active_params(model_or_shapes)        # top-k experts + the dense part
    routers = Routers(model, moe)             # hooks on every layer's router
    with routers.collecting(real_tokens):     # a micro-batch's forward
        loss = lm_loss(...)
    aux, counts = routers.take()              # its load-balancing loss, tokens per expert per layer

transformers 5 holds a layer's experts fused, `mlp.experts.gate_up_proj` [E, 2I, H] (each
expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I], while the Hub's
files (and save_pretrained, which reverts the fusion) hold one tensor per expert:
`mlp.experts.{e}.gate_proj.weight` [I, H] (Mixtral: `block_sparse_moe.experts.{e}.w1.weight`,
w3 the up, w2 the down, and its router `block_sparse_moe.gate`). `pieces` says which file
tensor fills which rows of a fused one, so parallel/weights.py reads each rank's experts alone.

The load-balancing loss is the Switch Transformer's, as transformers computes it
(`load_balancing_loss_func`): over every MoE layer's router and every real token of the
micro-batch, f_e = the share of top-k assignments that went to expert e, P_e = the mean router
probability of e, loss = E x sum_e f_e P_e (top_k when balanced). Each micro-batch's joins its
training loss at `router_aux_loss_coef` / micro-batches, so the gradient reduction averages it
over micro-batches and data-parallel ranks (the exact LM normaliser, a count of targets, does
not apply to it). Padding rows do not count; tokens of packed documents each count once.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch at run time only: check-config asks `problems` on a login node
    import torch


@dataclass(frozen=True)
class Stored:
    """How a family's checkpoint files name one expert's weights."""
    block: str  # the MoE block's module name in the files (transformers' is `mlp`)
    gate: str
    up: str
    down: str


QWEN = Stored("mlp", "gate_proj", "up_proj", "down_proj")
FAMILIES = {"qwen2_moe": QWEN, "qwen3_moe": QWEN, "olmoe": QWEN,
            "mixtral": Stored("block_sparse_moe", "w1", "w3", "w2")}
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # transformers' spellings
FUSED = re.compile(r"(.*)\.mlp\.experts\.(gate_up_proj|down_proj)")


def experts_in(config: dict) -> int:
    """The routed experts per MoE layer of a config.json (a dict); 0 for a dense model."""
    return max([v for k in EXPERT_COUNT_KEYS if isinstance(v := config.get(k), int)] or [0])


def problems(model_type: str | None, config: dict) -> list[str]:
    """A Mixture-of-Experts family llmtrain does not load, route and balance correctly yet."""
    if experts_in(config) <= 1 or model_type in FAMILIES:
        return []
    return [f"model: {model_type!r} is a Mixture-of-Experts family llmtrain does not train yet (its experts' "
            f"layout, router or loss differ; families: {', '.join(sorted(FAMILIES))}); choose one of those"]


def moe_layers(config: dict) -> list[int]:
    """The decoder layers with experts (Qwen2/3-MoE may keep some dense: mlp_only_layers,
    decoder_sparse_step)."""
    layers, step = config.get("num_hidden_layers") or 0, config.get("decoder_sparse_step") or 1
    dense = set(config.get("mlp_only_layers") or ())
    return [i for i in range(layers) if i not in dense and (i + 1) % step == 0]


def stored_problems(model_type: str, config: dict, names: set[str], folder) -> list[str]:
    """Whether a pretrained folder's weight files (their tensor names) hold the experts its
    config.json describes, one tensor per expert or fused: checked on the login node, before
    the queue, from the index or the safetensors header (no tensor is read)."""
    stored, experts, layers = FAMILIES.get(model_type), experts_in(config), moe_layers(config)
    if stored is None or experts <= 1 or not layers or not names:
        return []
    def have(key: str) -> bool:  # saved with the base model's prefix or without, as the loader finds them
        return key in names or key.removeprefix("model.") in names

    for layer in (layers[0], layers[-1]):
        at = f"model.layers.{layer}.{stored.block}.experts"
        wanted = [f"{at}.{e}.{stored.gate}.weight" for e in (0, experts - 1)]
        fused = f"model.layers.{layer}.mlp.experts.gate_up_proj"
        if not have(fused) and not all(have(key) for key in wanted):
            missing = next(key for key in wanted if not have(key))
            return [f"model.name_or_path: {folder}'s weight files hold no {missing} (its config.json has "
                    f"{experts} experts in layer {layer}, stored one tensor per expert or fused as {fused}); "
                    f"the files and config.json do not match: download the model again"]
    return []


@dataclass(frozen=True)
class MoE:
    """A model's experts: E routed experts per MoE layer, top_k per token, the loss's weight."""
    model_type: str
    experts: int
    top_k: int
    aux_coef: float

    @classmethod
    def of(cls, config, aux_coef: float | None = None) -> "MoE | None":
        """None for a dense model. `aux_coef`: train.router_aux_loss_coef (None: the model's)."""
        as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        experts = experts_in(as_dict)
        if experts <= 1:
            return None
        coef = as_dict.get("router_aux_loss_coef", 0.0) if aux_coef is None else aux_coef
        return cls(as_dict["model_type"], experts, int(as_dict["num_experts_per_tok"]), float(coef or 0.0))

    def active_params(self, named_shapes) -> tuple[int, int]:
        """(total, active) parameters: a token uses top_k of the E experts of each MoE layer and
        every other parameter. named_shapes: (name, numel) pairs, e.g. from named_parameters()."""
        total = experts = 0
        for name, numel in named_shapes:
            total += numel
            if FUSED.fullmatch(name):
                experts += numel
        return total, total - experts + experts * self.top_k // self.experts


def pieces(model_type: str, name: str, shape) -> list[tuple[str, int, int, int]] | None:
    """The file tensors that make the fused parameter `name` of `shape`: (key, expert, first
    row, end row), each [end - first, shape[2]] filling rows first:end of that expert. None
    where `name` is not a fused expert tensor of a known family."""
    stored, match = FAMILIES.get(model_type), FUSED.fullmatch(name)
    if stored is None or match is None:
        return None
    at = f"{match[1]}.{stored.block}.experts"
    if match[2] == "down_proj":
        return [(f"{at}.{e}.{stored.down}.weight", e, 0, shape[1]) for e in range(shape[0])]
    half = shape[1] // 2
    return [(f"{at}.{e}.{which}.weight", e, lo, lo + half)
            for e in range(shape[0]) for which, lo in ((stored.gate, 0), (stored.up, half))]


def stored_name(model_type: str, name: str) -> str:
    """Where the files keep a parameter that is not a fused expert tensor (Mixtral's router)."""
    stored = FAMILIES.get(model_type)
    if stored is None or stored.block == "mlp":
        return name
    return name.replace(".mlp.", f".{stored.block}.")


def router_class(model) -> type:
    """The module class whose first output is a layer's router logits (transformers records
    them from it for output_router_logits)."""
    recorder = getattr(model, "_can_record_outputs", {}).get("router_logits")
    cls = getattr(recorder, "target_class", recorder)
    if not isinstance(cls, type):
        raise ValueError(f"{type(model).__name__} names no router module (_can_record_outputs)")
    return cls


class Routers:
    """Forward hooks on every router of `model`: a micro-batch's load-balancing loss and tokens
    per expert per layer, on the device (no host read).

    A hook computes its layer's statistics whenever gradients are on, collected or not: under
    activation checkpointing the layer runs again in backward, and the recomputation must save
    the same tensors as the forward did (torch's non-reentrant checkpoint checks); only the
    forward inside `collecting` keeps them."""

    def __init__(self, model: "torch.nn.Module", moe: MoE):
        self.moe = moe
        cls = router_class(model)
        routers = [(name, m) for name, m in model.named_modules() if isinstance(m, cls)]
        self.handles = [m.register_forward_hook(self._hook) for _, m in routers]
        self.layers = len(self.handles)
        # each router's decoder layer (a pipeline stage holds some of the model's)
        self.layer_of = {m: int(re.search(r"layers\.(\d+)\.", name)[1]) for name, m in routers}
        self.fired: list[int] = []  # the collected statistics' decoder layers
        self.real = None  # [tokens] float weights: 1 for a real token, 0 for padding; None: all real
        self.open = False
        self.stats: list = []

    @contextlib.contextmanager
    def collecting(self, real: "torch.Tensor | None"):
        """Keep the statistics of the forward inside; `real`: this rank's input tokens [n, seq]
        that are not padding (bool), None where all are real."""
        self.real, self.open, self.stats, self.fired = (None if real is None else real.reshape(-1).float()), True, [], []
        try:
            yield
        finally:
            self.open = False

    def _hook(self, module, args, output):
        import torch
        if not (self.open or torch.is_grad_enabled()):
            return
        logits = output[0] if isinstance(output, tuple) else output
        stats = layer_stats(logits, self.moe.top_k, self.moe.experts, self.real)
        if self.open:
            self.stats.append(stats)
            self.fired.append(self.layer_of[module])

    def take(self) -> "tuple[torch.Tensor, torch.Tensor]":
        """The collected forward's (load-balancing loss, tokens per expert [layers, E])."""
        summed, counts = self.summed()
        return balancing_loss(summed, self.moe.experts), counts

    def summed(self, device=None) -> "tuple[torch.Tensor, torch.Tensor]":
        """The collected forward's statistics summed over its layers, [2 E + 1]: assignments per
        expert, summed probabilities per expert (with their gradient), rows; and the tokens per
        expert [layers, E] (their decoder layers: self.fired). Summed vectors of several forwards
        over disjoint layers (pipeline stages) add up to the whole model's: balancing_loss of their
        sum is the loss. `device`: where the zeros go when nothing was collected (a stage without
        MoE layers)."""
        import torch
        stats, self.stats = self.stats, []
        if not stats:
            return (torch.zeros(2 * self.moe.experts + 1, device=device),
                    torch.zeros(0, self.moe.experts, device=device))
        counts = torch.stack([c for c, _, _ in stats])
        probs = torch.stack([p for _, p, _ in stats])
        rows = sum(r for _, _, r in stats)  # every layer's rows, as transformers sums them
        return torch.cat([counts.sum(0), probs.sum(0), rows.reshape(1)]), counts

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def balancing_loss(summed: "torch.Tensor", experts: int) -> "torch.Tensor":
    """transformers' load-balancing loss from statistics summed over every MoE layer (Routers.summed):
    E x sum_e f_e P_e."""
    counts, probs, rows = summed[:experts], summed[experts:2 * experts], summed[-1].clamp(min=1e-9)
    return experts * ((counts / rows) * (probs / rows)).sum()


def layer_stats(logits: "torch.Tensor", top_k: int, experts: int, real: "torch.Tensor | None"):
    """One router's (assignments per expert, summed probabilities per expert, rows), over the
    real tokens: the assignments carry no gradient, the probabilities do."""
    import torch
    probs = torch.softmax(logits.float(), dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices.detach()
    weight = real if real is not None else probs.new_ones(probs.shape[0])
    counts = probs.new_zeros(experts).scatter_add_(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
    return counts, (probs * weight[:, None]).sum(0), weight.sum()


def imbalance(counts: "torch.Tensor") -> float:
    """The busiest expert's tokens over the mean, in the worst layer (1.0: balanced). counts:
    [layers, E] summed over a step (and ranks)."""
    mean = counts.mean(dim=1).clamp(min=1e-9)
    return float((counts.max(dim=1).values / mean).max())
