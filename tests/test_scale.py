"""Scale this machine cannot run, simulated: Llama-3-70B on 64 ranks, on the meta device with
torch's fake process group (no memory, no communication), through the code a real start runs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig

from conftest import tiny_config
from llmtrain.config import load_config
from llmtrain.model.build import build_model
from llmtrain.parallel.weights import init_from_scratch
from llmtrain.parallel.wrap import apply_fsdp

LLAMA3_70B = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                         num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                         max_position_embeddings=8192, tie_word_embeddings=False)


@pytest.fixture
def fake_world_of_64():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=64)
    yield
    dist.destroy_process_group()


def test_70b_on_64_ranks_starts_with_a_shard_and_one_module(fake_world_of_64, tmp_path, monkeypatch,
                                                           write_config):
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path))
    cfg = load_config(write_config(tiny_config(parallel={"strategy": "fsdp"})), world_size=1)
    model = build_model(LLAMA3_70B, cfg, "meta")
    reference = build_model(LLAMA3_70B, cfg, "meta", buffers="cpu")
    apply_fsdp(model, cfg)
    total = sum(p.numel() for p in model.parameters())
    shard = sum(p.to_local().numel() for p in model.parameters())
    assert total == 70_553_706_496
    # Rank 5's shard: each tensor's rows split like torch.chunk over 64 ranks.
    expected = sum(math.ceil(p.shape[0] / 64) * p[0].numel() for p in reference.parameters())
    assert shard == expected and shard * 4 / 1e9 == pytest.approx(4.41, abs=0.01)
    largest = init_from_scratch(model, reference, 1234, torch.device("meta"))
    # The most it ever holds at full size is one module: the embedding (or head), 4.2 GB in fp32.
    assert largest == 128256 * 8192 * 4
    # The start-up peak on paper: 8.6 GB of an 80 GB GPU (before: 280 GB on rank 0's host).
    assert (shard * 4 + largest) / 1e9 == pytest.approx(8.61, abs=0.01)
