"""Wrapping decisions checked on real FSDP2 modules, in a process group of one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import tiny_config
from llmtrain.config import load_config
from llmtrain.model.parallel import apply_fsdp, configure_matmul_precision, local_slices


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def cfg(tmp_path, monkeypatch, write_config):
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path))
    return load_config(write_config(tiny_config(parallel={"strategy": "fsdp"})), world_size=1)


def test_root_and_last_layer_stay_gathered_after_forward(group, cfg):
    """Backward needs the embeddings, head and last layer at once: resharding them after
    forward would cost an extra all-gather per micro-batch."""
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=3, num_attention_heads=4))
    apply_fsdp(model, cfg)
    model(input_ids=torch.randint(0, 64, (2, 8)))
    layers = model.model.layers
    assert not isinstance(model.model.embed_tokens.weight, DTensor)  # still gathered
    assert not isinstance(model.lm_head.weight, DTensor)
    assert not isinstance(layers[2].mlp.up_proj.weight, DTensor)
    assert isinstance(layers[0].mlp.up_proj.weight, DTensor)  # freed until backward
    assert isinstance(layers[1].mlp.up_proj.weight, DTensor)


def test_fp32_uses_tf32_on_gpus_unless_the_config_says_no(cfg):
    import dataclasses
    before = torch.get_float32_matmul_precision()
    try:
        configure_matmul_precision(cfg, torch.device("cuda"))
        assert torch.get_float32_matmul_precision() == "high"  # TF32 tensor cores
        off = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, tf32=False))
        configure_matmul_precision(off, torch.device("cuda"))
        assert torch.get_float32_matmul_precision() == "highest"
        configure_matmul_precision(cfg, torch.device("cpu"))  # CPUs: left alone
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("rows,parts", [(10, 3), (9, 3), (2, 4), (1024, 8)])
def test_each_rank_reads_the_rows_fsdp2_gives_it(group, rows, parts):
    """local_slices agrees with FSDP2's torch.chunk split for every coordinate, uneven sizes too."""
    from types import SimpleNamespace
    from torch.distributed.tensor import Shard
    for coordinate in range(parts):
        mesh = SimpleNamespace(get_coordinate=lambda c=coordinate: [c], size=lambda dim: parts)
        fake = SimpleNamespace(placements=(Shard(0),), device_mesh=mesh)
        full = torch.arange(rows * 3).reshape(rows, 3)
        chunks = torch.chunk(full, parts)
        expected = chunks[coordinate] if coordinate < len(chunks) else full[:0]
        assert torch.equal(full[local_slices(full.shape, fake)], expected)
