"""Model building without memory, the decoder layers FSDP2 shards, and the lr schedule."""

from __future__ import annotations

import math
import time

import pytest
import torch
from transformers import AutoConfig

from llmtrain.config import TrainConfig
from llmtrain.model.build import decoder_layers, flops_per_token, num_params
from llmtrain.training.optim import lr_at


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
