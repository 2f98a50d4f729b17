"""The language-model loss without the full logits.

    head = chunk_head(model, config)  # once, on the wrapped model: its forward now returns hidden states
    loss = lm_loss(model, batch, head, normaliser)  # batch: a data.loader.Batch on the device

A plain loss materialises the logits of every token at once, [tokens x vocab], and an fp32 copy
and its gradient: at a 128k vocabulary and 8192 tokens, ~4 GB each. Here the output head is
applied to a chunk of tokens at a time: each chunk's logits give its loss and, at once, the
gradients of the hidden states and of the head's weight (softmax minus one-hot, divided by the
token count), and are freed. Backward only scales the saved gradients, in place (no second
copy). Peak extra memory, in forward: one chunk's logits, the hidden states' gradient and the
head's fp32 gradient (none for a frozen head, LoRA's: neither it nor its matmul is computed).
The same sums as the plain loss, in chunks: equal within float rounding (tests/test_model.py).

Under tensor parallel (parallel/tensor.py) each rank holds a slice of the head's rows (the
vocabulary) and the model returns each rank's slice of the sequence: the hidden states are
gathered over the group (the gradient goes back reduce-scattered), and each chunk's loss comes
from the slices: the logits' max, the sum of their exponentials and the target's logit are
all-reduced over the group (one number per token each), so no rank holds a token's full logits.

The head is reached through HF's `get_output_embeddings()`; `chunk_head` makes that module
return its input, so the model's forward (under its FSDP2 hooks, which gather the head with the
root and keep it gathered until backward) returns the final hidden states as `logits`. Only
model types whose forward applies the head and nothing after it are chunked (CHUNKED_TYPES);
others (logit soft-capping or scaling) keep the plain loss.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .attention import attention_mask, context_chunks, context_masks
from .build import Absent, unwrap

CHUNK_LOGIT_BYTES = 256 * 2**20  # one chunk's fp32 logits, at most
IGNORE = -100  # a target that is not trained (F.cross_entropy's ignore_index)
# Model types whose CausalLM forward is `logits = lm_head(hidden_states)`, nothing after it.
CHUNKED_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gpt2", "gpt_neox",
    "phi", "phi3", "olmo", "olmo2", "starcoder2", "stablelm", "smollm3",
})


@dataclass(frozen=True)
class ChunkedHead:
    """The output head lm_loss applies itself, and the function that does one chunk."""

    linear: torch.nn.Linear
    chunk_fn: Callable = None  # _chunk, or its torch.compile'd twin
    tp_mesh: object = None  # the tensor-parallel group's DeviceMesh: the head's rows are split over it


def chunk_head(model: torch.nn.Module, config, compile: bool = False, layout=None) -> ChunkedHead | None:
    """Make the model's output head pass its input through, and return it for lm_loss to apply
    in chunks (`compile`: each chunk's work compiled; `layout` (parallel/dims.Layout): where it
    has tensor parallel, the head's rows are split over its tp group); None (the model unchanged) where the model type is not known to apply the head
    plainly, or the head has a bias."""
    head = unwrap(model).get_output_embeddings()
    if isinstance(head, Absent):  # the head is another pipeline stage's, and so is the loss
        return ChunkedHead(head)
    if (getattr(config, "model_type", None) not in CHUNKED_TYPES or not isinstance(head, torch.nn.Linear)
            or head.bias is not None):
        return None
    head.forward = _passthrough
    # The root's output is now a view of the final hidden states (HF slices them for the head),
    # and FSDP2 warns that an in-place op on a view would skip its pre-backward hook; lm_loss
    # applies none.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    if layout is not None and layout.dims.tensor > 1:
        return ChunkedHead(head, _vocab_parallel_chunk, layout.mesh("tp"))
    return ChunkedHead(head, torch.compile(_chunk) if compile else _chunk)


def _passthrough(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def lm_loss(model: torch.nn.Module, batch, head: ChunkedHead | None = None,
            normaliser: float | None = None, layout=None, routers=None) -> torch.Tensor:
    """Next-token cross-entropy summed over the batch's trained targets and divided by
    `normaliser` (None: by their count, the mean). batch: a data.loader.Batch on the device:
    windows of seq_len + 1 tokens, with trained flags (others are not targets) and positions
    within each document (attention then stays within one, and within the layers' windows:
    attention.attention_mask). With
    `head` (chunk_head's), the model returns hidden states and the loss is chunked. Where the
    `layout` (parallel/dims.Layout) has context parallel, this rank's 2 of the 2 x cp chunks of
    every sequence (attention.context_chunks) and their targets only. `routers` (a Mixture-of-
    Experts model's model/moe.Routers): they collect this forward's routing, padding left out."""
    tokens = batch.tokens
    inputs, targets = tokens[:, :-1], lm_targets(batch)
    positions = batch.positions[:, :-1] if batch.positions is not None else None
    seq, config = inputs.shape[1], unwrap(model).config
    real = real_tokens(batch) if routers is not None else None
    if layout is not None and layout.dims.context > 1:
        places = context_chunks(seq, layout.coordinate("cp"), layout.dims.context, tokens.device)
        inputs, targets = inputs[:, places], targets[:, places]
        real = real[:, places] if real is not None else None
        extra = {"position_ids": positions[:, places] if positions is not None else places[None],
                 "attention_mask": context_masks(config, places, seq, positions)}
    else:
        extra = {"attention_mask": attention_mask(unwrap(model), positions, seq, tokens.device)}
        if positions is not None:
            extra["position_ids"] = positions
        elif head is not None and head.tp_mesh is not None:  # HF would count this rank's slice of the sequence
            extra["position_ids"] = torch.arange(seq, device=tokens.device)[None]
    if real is not None and head is not None and head.tp_mesh is not None:  # MoE layers route this rank's slice
        real = real.chunk(head.tp_mesh.size(), dim=1)[head.tp_mesh.get_local_rank()]
    with routers.collecting(real) if routers is not None else contextlib.nullcontext():
        out = model(input_ids=inputs, **extra).logits
    return hidden_loss(out, targets, head, normaliser)


def real_tokens(batch) -> torch.Tensor | None:
    """The input tokens that are not padding, [n, width - 1] (bool); None where all are. A
    padded row's padding is its last segment (its positions restart at 0: data/samples.py), one
    no target of which trains."""
    if batch.trained is None or batch.positions is None:
        return None
    segment = (batch.positions[:, :-1] == 0).cumsum(1)
    last = segment == segment[:, -1:]
    padded = ~(batch.trained[:, 1:].bool() & last).any(1, keepdim=True)
    return ~(last & padded)


def lm_targets(batch) -> torch.Tensor:
    """Each window's next tokens, IGNORE where a token is not trained."""
    targets = batch.tokens[:, 1:]
    return targets.masked_fill(~batch.trained[:, 1:], IGNORE) if batch.trained is not None else targets


def hidden_loss(out: torch.Tensor, targets: torch.Tensor, head: ChunkedHead | None = None,
                normaliser: float | None = None) -> torch.Tensor:
    """lm_loss from the model's output: the logits (`head` None), or the final hidden states the
    head is applied to in chunks (under tensor parallel each rank's slice of the sequence,
    gathered here). The last pipeline stage's loss too (parallel/pipeline.py)."""
    targets = targets.flatten()
    if head is None:
        total = F.cross_entropy(out.float().flatten(0, 1), targets, ignore_index=IGNORE, reduction="sum")
        return total / (normaliser if normaliser is not None else (targets != IGNORE).sum().clamp(min=1))
    weight, chunk_fn = head.linear.weight, head.chunk_fn
    if head.tp_mesh is not None:
        from torch.distributed.tensor import DTensor, Partial, Shard
        # the whole sequence on every rank of the group; in backward, each rank's part of the sum
        out = DTensor.from_local(out, head.tp_mesh, [Shard(1)]).full_tensor(grad_placements=[Partial()])
        local = weight.to_local()
        chunk_fn = functools.partial(_vocab_parallel_chunk, start=head.tp_mesh.get_local_rank() * local.shape[0],
                                     group=head.tp_mesh.get_group())
        weight = local
    return chunked_cross_entropy(out.flatten(0, 1), weight, targets, chunk_fn=chunk_fn, normaliser=normaliser)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk: int | None = None, chunk_fn: Callable | None = None,
                          normaliser: float | None = None) -> torch.Tensor:
    """The sum over trained tokens (targets other than IGNORE, -100 as in F.cross_entropy) of
    CE(hidden[i] @ weight.T, targets[i]) divided by `normaliser` (None: their count, which stays
    on the device: the mean), [chunk x vocab] logits at a time (default: CHUNK_LOGIT_BYTES of
    fp32 logits). Gradients flow to hidden and weight (to each that requires one)."""
    chunk = chunk or max(1, CHUNK_LOGIT_BYTES // (4 * weight.shape[0]))
    trained = normaliser if normaliser is not None else (targets != IGNORE).sum().clamp(min=1)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedCrossEntropy.apply(hidden, weight, targets, trained, chunk, chunk_fn or _chunk)
    total = hidden.new_zeros((), dtype=torch.float32)
    if isinstance(chunk_fn, functools.partial) and chunk_fn.func is _vocab_parallel_chunk:  # evaluation
        for start in range(0, hidden.shape[0], chunk):
            total = total + chunk_fn(hidden[start:start + chunk], weight, targets[start:start + chunk], trained,
                                     grads=False)[0]
        return total / trained
    for start in range(0, hidden.shape[0], chunk):
        logits = (hidden[start:start + chunk] @ weight.t()).float()
        total = total + F.cross_entropy(logits, targets[start:start + chunk], ignore_index=IGNORE,
                                        reduction="sum")
    return total / trained


def _chunk(h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, n: torch.Tensor):
    """One chunk: (its summed loss, d(loss)/d(logits) in h's dtype, d(loss)/d(h)), the loss being
    the sum over all chunks' trained tokens divided by `n`."""
    logits = (h @ weight.t()).float()
    lse = torch.logsumexp(logits, dim=-1)
    trained = t != IGNORE
    t = t.clamp(min=0)  # an ignored row gathers any class; the mask zeroes it
    loss = ((lse - logits.gather(1, t[:, None]).squeeze(1)) * trained).sum()
    scale = trained / n  # 1/n for a trained token, 0 for an ignored one
    # (softmax - onehot) / n, in place of the logits
    grad = logits.sub_(lse[:, None]).exp_()
    grad[torch.arange(t.shape[0], device=t.device), t] -= 1
    grad = grad.mul_(scale[:, None]).to(h.dtype)
    return loss, grad, grad @ weight


def _vocab_parallel_chunk(h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, n: torch.Tensor,
                          start: int = 0, group=None, grads: bool = True):
    """_chunk where `weight` holds the vocabulary rows [start, start + len(weight)) of a head
    split over `group`, and `h` every token: the same loss on every rank of the group, this
    rank's part of d(loss)/d(h) (their sum is the whole) and the gradient of its rows."""
    import torch.distributed as dist
    logits = (h @ weight.t()).float()  # [tokens, this rank's vocabulary]
    high = logits.max(dim=-1).values
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    logits.sub_(high[:, None])
    sums = logits.exp().sum(dim=-1)
    trained = t != IGNORE
    local = t - start
    mine = trained & (local >= 0) & (local < weight.shape[0])
    local = local.clamp(0, weight.shape[0] - 1)
    picked = logits.gather(1, local[:, None]).squeeze(1) * mine
    both = torch.stack([sums, picked])
    dist.all_reduce(both, group=group)  # the softmax's denominator and the target's logit, whole
    lse = both[0].log()
    loss = ((lse - both[1]) * trained).sum()
    if not grads:
        return loss, None, None
    grad = logits.sub_(lse[:, None]).exp_()  # softmax over this rank's rows
    grad[torch.arange(t.shape[0], device=t.device)[mine], local[mine]] -= 1
    grad = grad.mul_((trained / n)[:, None]).to(h.dtype)
    return loss, grad, grad @ weight


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, n, chunk, chunk_fn):
        grad_hidden = torch.empty_like(hidden)
        # A frozen head (LoRA) gets no gradient: neither its fp32 buffer nor its GEMM per chunk.
        grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if ctx.needs_input_grad[1] else None)
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]
            loss, grad, grad_hidden[start:start + chunk] = chunk_fn(h, weight, targets[start:start + chunk], n)
            total = total + loss
            if grad_weight is not None:
                grad_weight += grad.t() @ h  # a GEMM in the inputs' dtype (bf16 on tensor cores), summed in fp32
            del grad
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight = ctx.saved_tensors
        # In place: `grad_hidden * grad_out` would hold a second [tokens x hidden] (and head-sized)
        # copy beside the saved one, and make this backward, not the forward, the loss's peak.
        # Nothing reads the saved tensors again (a second backward through this graph, under
        # retain_graph, fails loudly on their version counters instead of reading scaled values).
        return (grad_hidden.mul_(grad_out), None if grad_weight is None else grad_weight.mul_(grad_out),
                None, None, None, None)
