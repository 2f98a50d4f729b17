"""Weights written one tensor at a time load as save_pretrained's do: one file, or several files
and their index, in any dtype export writes."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llmtrain.model.shards import ShardWriter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_written_tensor_by_tensor_load_in_transformers(tmp_path, dtype):
    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = model.state_dict()
    layout = [(name, t.dtype, tuple(t.shape)) for name, t in state.items()]
    total = sum(t.numel() * t.element_size() for t in state.values())
    writer = ShardWriter(tmp_path, layout, max_shard_bytes=total // 3)
    for name, t in state.items():
        writer.write(name, t)
    writer.close()
    config.save_pretrained(tmp_path)

    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"model-0000{k}-of-00004.safetensors" for k in range(1, 5)]  # 3 full, the rest
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == total

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, state[name]), name
    ids = torch.tensor([[1, 5, 9, 200]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_a_model_within_one_shard_is_one_file(tmp_path):
    writer = ShardWriter(tmp_path, [("a", torch.float16, (3,)), ("b", torch.float16, ())])
    writer.write("a", torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16))
    writer.write("b", torch.tensor(4.0, dtype=torch.float16))
    writer.close()
    from safetensors.torch import load_file
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    got = load_file(tmp_path / "model.safetensors")
    assert got["a"].tolist() == [1.0, 2.0, 3.0] and got["b"].item() == 4.0 and got["b"].shape == ()
