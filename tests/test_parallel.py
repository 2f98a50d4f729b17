"""Wrapping decisions checked on real FSDP2 modules, in a process group of one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import tiny_config
from llmtrain.config import load_config
from llmtrain.model.build import decoder_layers
from llmtrain.model.parallel import apply_fsdp, checkpoint_layers, configure_matmul_precision, local_slices


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


@pytest.mark.parametrize("every,recomputed", [(1, [2, 2, 2, 2, 2]), (2, [2, 1, 2, 1, 2]),
                                              (3, [2, 1, 1, 2, 1])])
def test_selective_checkpointing_recomputes_every_kth_layer_and_changes_no_gradient(every, recomputed):
    """A layer that is checkpointed runs its forward twice in a training step (again in
    backward); the others once. The gradients are the plain model's, bit for bit."""
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config)
    model = LlamaForCausalLM(config)
    model.load_state_dict(plain.state_dict())
    assert checkpoint_layers(model, every) == [n == 2 for n in recomputed]
    runs = [0] * 5
    for i, layer in enumerate(decoder_layers(model)):
        # The MLP inside: HF checkpoints the layer's forward, inside the layer's own hooks.
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    ids = torch.randint(0, 128, (2, 16))
    for m in (plain, model):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
    assert runs == recomputed
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name
