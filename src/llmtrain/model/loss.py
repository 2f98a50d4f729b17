"""The language-model loss without the full logits.

    head = chunk_head(model, config)  # once, on the wrapped model: its forward now returns hidden states
    loss = lm_loss(model, batch, head)

A plain loss materialises the logits of every token at once, [tokens x vocab], and an fp32 copy
and its gradient: at a 128k vocabulary and 8192 tokens, ~4 GB each. Here the output head is
applied to a chunk of tokens at a time: each chunk's logits give its loss and, at once, the
gradients of the hidden states and of the head's weight (softmax minus one-hot, divided by the
token count), and are freed. Backward only scales the saved gradients. Peak extra memory: one
chunk's logits, the hidden states' gradient and the head's fp32 gradient. The same sums as the
plain loss, in chunks: equal within float rounding (tests/test_model.py).

The head is reached through HF's `get_output_embeddings()`; `chunk_head` makes that module
return its input, so the model's forward (under its FSDP2 hooks, which gather the head with the
root and keep it gathered until backward) returns the final hidden states as `logits`. Only
model types whose forward applies the head and nothing after it are chunked (CHUNKED_TYPES);
others (logit soft-capping or scaling) keep the plain loss.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .parallel import unwrap

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


def chunk_head(model: torch.nn.Module, config, compile: bool = False) -> ChunkedHead | None:
    """Make the model's output head pass its input through, and return it for lm_loss to apply
    in chunks (`compile`: each chunk's work compiled); None (the model unchanged) where the
    model type is not known to apply the head plainly, or the head has a bias."""
    head = unwrap(model).get_output_embeddings()
    if (getattr(config, "model_type", None) not in CHUNKED_TYPES or not isinstance(head, torch.nn.Linear)
            or head.bias is not None):
        return None
    head.forward = _passthrough
    # The root's output is now a view of the final hidden states (HF slices them for the head),
    # and FSDP2 warns that an in-place op on a view would skip its pre-backward hook; lm_loss
    # applies none.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
    return ChunkedHead(head, torch.compile(_chunk) if compile else _chunk)


def _passthrough(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def lm_loss(model: torch.nn.Module, batch: torch.Tensor, head: ChunkedHead | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy; batch holds windows of seq_len + 1 tokens. With `head`
    (chunk_head's), the model returns hidden states and the loss is chunked."""
    out = model(input_ids=batch[:, :-1]).logits
    targets = batch[:, 1:].flatten()
    if head is None:
        return F.cross_entropy(out.float().flatten(0, 1), targets)
    return chunked_cross_entropy(out.flatten(0, 1), head.linear.weight, targets, chunk_fn=head.chunk_fn)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk: int | None = None, chunk_fn: Callable | None = None) -> torch.Tensor:
    """The mean over trained tokens (targets other than IGNORE, -100 as in F.cross_entropy) of
    CE(hidden[i] @ weight.T, targets[i]), [chunk x vocab] logits at a time (default:
    CHUNK_LOGIT_BYTES of fp32 logits). Gradients flow to hidden and weight. The count of trained
    tokens stays on the device."""
    chunk = chunk or max(1, CHUNK_LOGIT_BYTES // (4 * weight.shape[0]))
    trained = (targets != IGNORE).sum().clamp(min=1)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedCrossEntropy.apply(hidden, weight, targets, trained, chunk, chunk_fn or _chunk)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        logits = (hidden[start:start + chunk] @ weight.t()).float()
        total = total + F.cross_entropy(logits, targets[start:start + chunk], ignore_index=IGNORE,
                                        reduction="sum")
    return total / trained


def _chunk(h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, n: torch.Tensor):
    """One chunk: (its summed loss, d(mean loss)/d(logits) in h's dtype, d(mean loss)/d(h)),
    `n` the trained tokens of all chunks."""
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


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, n, chunk, chunk_fn):
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk]
            loss, grad, grad_hidden[start:start + chunk] = chunk_fn(h, weight, targets[start:start + chunk], n)
            total = total + loss
            grad_weight += grad.t() @ h  # a GEMM in the inputs' dtype (bf16 on tensor cores), summed in fp32
            del grad
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_out, grad_weight * grad_out, None, None, None, None
