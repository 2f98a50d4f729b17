"""Model building without memory, the decoder layers FSDP2 shards, and the lr schedule."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig

from llmtrain.config import TrainConfig
from llmtrain.model.build import decoder_layers, flops_per_token, num_params
from llmtrain.model.loss import chunked_cross_entropy
from llmtrain.optimizers import lr_at


def test_an_8b_model_builds_on_meta_without_memory():
    config = AutoConfig.for_model("llama", vocab_size=128256, hidden_size=4096,
                                  intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8)
    from transformers import AutoModelForCausalLM
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert time.perf_counter() - t0 < 30  # no 32 GB allocation behind it
    assert num_params(model) == 8_030_261_248  # Llama-3-8B, counted exactly
    assert all(p.is_meta for p in model.parameters())
    layers = decoder_layers(model)
    assert len(layers) == 32 and type(layers[0]).__name__ == "LlamaDecoderLayer"

    # An independent count: torch's FLOP counter over one forward and backward of an 8192-token
    # sequence (on meta: shapes only), which counts every matmul, the attention's included.
    from torch.utils.flop_counter import FlopCounterMode
    ids = torch.zeros(1, 8192, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counted = counter.get_total_flops() / 8192
    assert counted == pytest.approx(57.9e9, rel=1e-3)  # per token
    # The formula leaves out the embedding table (a lookup); it still counts the norms'
    # weights, which scale rather than multiply: 6 x 266,240 FLOPs, 3e-5 of the total.
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert norms == (2 * 32 + 1) * 4096
    assert flops_per_token(config, num_params(model), 8192) == pytest.approx(counted + 6 * norms,
                                                                            rel=1e-9)


def test_a_tied_embedding_counts_once_as_the_output_heads_matmul():
    """Tied (Llama-3.2-1B's shape, 2 of its 16 layers): the shared table is the head's matmul."""
    config = AutoConfig.for_model("llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                  num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                                  tie_word_embeddings=True)
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    from torch.utils.flop_counter import FlopCounterMode
    ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert flops_per_token(config, num_params(model), 2048) == pytest.approx(
        counter.get_total_flops() / 2048 + 6 * norms, rel=1e-9)


def test_a_lora_base_counts_4_flops_per_parameter_its_adapters_6():
    """LoRA (2 layers of Llama-3.2-1B's shape, untied): the frozen base computes its outputs and
    its inputs' gradients, not its weights' gradients: 4 FLOPs per parameter and token where
    full training takes 6. Torch's FLOP counter agrees to the FLOP, once two things the formula
    does not model are added: the norms' weights (which scale: 4 x their count) and the first
    layer's q, k, v projections and their A adapters, whose inputs (the frozen embedding's
    output) need no gradient: autograd skips those 2 per parameter (1/layers of the base's)."""
    from transformers import AutoModelForCausalLM
    from torch.utils.flop_counter import FlopCounterMode
    from llmtrain.config import LoraSpec
    from llmtrain.model.lora import apply_lora

    config = AutoConfig.for_model("llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                  num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                                  tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    apply_lora(model, LoraSpec(rank=16, alpha=32))
    ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    n, trainable = num_params(model), num_params(model, trainable=True)
    assert trainable == 2 * 16 * ((2048 + 2048) + 2 * (2048 + 512) + (2048 + 2048))  # q, k, v, o adapters
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    first = model.model.layers[0].self_attn
    skipped = sum(m.weight.numel() + m.lora_A.weight.numel()
                  for m in (first.q_proj, first.k_proj, first.v_proj))
    formula = flops_per_token(config, n, 2048, trainable)
    assert formula == counter.get_total_flops() / 2048 + 4 * norms + 2 * skipped
    # Against full training's count: 2 per frozen parameter that multiplies (not the lookup table).
    lookup = 128256 * 2048
    assert flops_per_token(config, n, 2048) - formula == 2 * (n - trainable - lookup)


def schedule(**kw) -> TrainConfig:
    return TrainConfig(**{"max_steps": 100, "global_batch_size": 8, "micro_batch_size": 8,
                          "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 10, **kw})


def test_warmup_then_cosine_to_min_lr():
    t = schedule()
    lrs = [lr_at(s, t) for s in range(t.max_steps)]
    assert lrs[:10] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])  # linear warmup
    assert lrs[10] == pytest.approx(1e-3)  # the peak right after warmup
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # then never rising
    assert lrs[55] == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(t.max_steps, t) == pytest.approx(1e-4)  # ends at min_lr


def test_no_warmup_starts_at_peak():
    assert lr_at(0, schedule(warmup_steps=0)) == pytest.approx(1e-3)


@pytest.mark.parametrize("dtype,tol,ignored", [(torch.float32, 1e-5, 0), (torch.bfloat16, 2e-2, 0),
                                               (torch.float32, 1e-5, 11)])
def test_the_chunked_loss_equals_the_plain_one_with_its_gradients(dtype, tol, ignored):
    """Chunks that do not divide the tokens (37 tokens, 8 at a time), fp32 and bf16 inputs, some
    targets not trained (-100): loss, hidden-state and head gradients equal F.cross_entropy's."""
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(50, 16, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    targets[torch.randperm(37)[:ignored]] = -100
    plain = F.cross_entropy((hidden @ weight.t()).float(), targets)
    plain.backward()
    want = (plain.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    chunked = chunked_cross_entropy(hidden, weight, targets, chunk=8)
    (chunked * 2).backward()  # the upstream gradient scales both
    assert abs(chunked.item() - want[0].item()) <= 1e-5
    assert torch.allclose(hidden.grad.float(), 2 * want[1].float(), atol=tol, rtol=tol)
    assert torch.allclose(weight.grad.float(), 2 * want[2].float(), atol=tol, rtol=tol)
    with torch.no_grad():
        assert abs(chunked_cross_entropy(hidden, weight, targets, chunk=8).item() - want[0].item()) <= 1e-5


def test_a_frozen_head_gets_no_gradient_and_its_matmul_is_not_run():
    """LoRA's head is frozen: the chunked loss computes the hidden states' gradient as before,
    bit for bit, and neither the head's gradient nor its [vocab x tokens] @ [tokens x width]
    matmul per chunk: 4 FLOPs per token, vocabulary row and width (the logits, the hidden
    states' gradient) where a trained head takes 6."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    tokens, vocab, width = 37, 50, 16
    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    flops, grads = {}, {}
    for trained in (True, False):
        weight.requires_grad_(trained)
        hidden.grad = weight.grad = None
        with FlopCounterMode(display=False) as counter:
            chunked_cross_entropy(hidden, weight, targets, chunk=8).backward()
        flops[trained], grads[trained] = counter.get_total_flops(), hidden.grad.clone()
    assert weight.grad is None
    assert torch.equal(grads[False], grads[True])
    assert flops[False] == 4 * tokens * vocab * width and flops[True] == 6 * tokens * vocab * width


def test_the_chunked_loss_never_holds_the_full_logits():
    """Torch's own tensor-memory tracker: the plain loss's peak holds [tokens x vocab] fp32 logits
    several times over; the chunked one about one chunk's, at the same loss."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    tokens, vocab, width = 2048, 8192, 32  # 64 MiB of fp32 logits
    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    peaks, values = {}, {}
    for name, fn in {"plain": lambda: F.cross_entropy(hidden @ weight.t(), targets),
                     "chunked": lambda: chunked_cross_entropy(hidden, weight, targets, chunk=256)}.items():
        hidden.grad = weight.grad = None
        tracker = MemTracker()
        tracker.track_external(hidden, weight)
        with tracker:
            loss = fn()
            loss.backward()
        values[name] = loss.item()
        peaks[name] = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    logits = tokens * vocab * 4
    assert abs(values["plain"] - values["chunked"]) <= 1e-5
    assert peaks["plain"] >= 2 * logits
    assert peaks["chunked"] <= logits / 4  # one 256-token chunk: 8 MiB
