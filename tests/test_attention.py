"""Attention within documents and windows (model/attention.py): flex attention's BlockMask, built
from the documents' tile ranges (and the window's), is the one create_block_mask gives, attends as
the dense mask does, and never allocates the seq x seq mask on the way; a sliding window (Mistral,
Qwen2's later layers) gives transformers' eager attention's logits and training curve, alone,
with documents packed in a row, and under context parallel."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import assert_same_curve, cli, losses, prepared_home, run_dir, tiny_config, torchrun
from llmtrain.model.attention import (BLOCK, attention_mask, block_mask_bytes, causal_attention, document_mask,
                                      layer_windows)

TILE_TENSORS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def sdpa_model():
    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    causal_attention(model)
    return model


def packed(*lengths) -> torch.Tensor:
    """Positions of a row of documents of these lengths (restarting at 0 at each)."""
    return torch.cat([torch.arange(n) for n in lengths])


class LargestTensor(TorchDispatchMode):
    """The bytes of the largest tensor any torch operation returns while it is active."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the reference
def test_flex_block_mask_is_create_block_masks_and_attends_within_each_document():
    # 520 tokens: a short last tile; documents inside a tile, across tiles, one ending on a tile's edge
    positions = torch.stack([packed(40, 88, 300, 2, 90), packed(520)])
    model = sdpa_model()
    mask = document_mask(model, positions, flex=True)

    document = (positions == 0).cumsum(dim=1)
    expected = create_block_mask(lambda b, h, q, kv: (document[b, q] == document[b, kv]) & (kv <= q),
                                 2, None, 520, 520, device="cpu")
    for name in TILE_TENSORS:
        assert torch.equal(getattr(mask, name), getattr(expected, name)), name
    assert (mask.seq_lengths, mask.BLOCK_SIZE) == (expected.seq_lengths, expected.BLOCK_SIZE)

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 520, 8) for _ in range(3))
    dense = document_mask(model, positions, flex=False)  # SDPA's boolean [batch, 1, seq, seq]
    assert torch.allclose(flex_attention(q, k, v, block_mask=mask),
                          F.scaled_dot_product_attention(q, k, v, attn_mask=dense), atol=1e-5)


def test_flex_block_mask_of_8k_tokens_allocates_kilobytes_not_the_seq_by_seq_mask():
    """create_block_mask uncompiled evaluates the mask on every (query, key) pair: 64 MiB of bools
    per row at 8k tokens, ~0.7 GiB of peak memory with its intermediates."""
    seq = 8192
    positions = torch.stack([packed(1000, 3000, 4192), packed(8192)])
    model, largest = sdpa_model(), LargestTensor()
    with largest:
        mask = document_mask(model, positions, flex=True)
    tiles = seq // BLOCK
    assert largest.nbytes <= 8 * 2 * seq  # the document ids, int64: nothing of seq x seq
    held = sum(getattr(mask, name).untyped_storage().nbytes() for name in TILE_TENSORS)
    assert held == 2 * 4 * 4 * tiles * (tiles + 1)
    assert block_mask_bytes(2, seq) == held + 8 * 2 * seq  # what llmtrain estimate counts


def windowed_pair(model_type: str, **window):
    """A tiny model of `model_type` with transformers' eager attention (the reference: its own
    masks, windows included), and the same weights under llmtrain's causal sdpa."""
    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, **window)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation("sdpa")
    causal_attention(ours)
    return eager, ours


WINDOWED = {  # every layer in a 16-token window; the later 2 of 4 layers only (layer_types)
    "mistral": {"sliding_window": 16},
    "qwen2": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2},
}


def test_layer_windows_name_each_kind_of_layer_and_drop_a_window_as_long_as_the_sequence():
    mistral, qwen2 = (AutoConfig.for_model(t, **WINDOWED[t]) for t in ("mistral", "qwen2"))
    assert layer_windows(mistral, 128) == {"full_attention": 16}
    assert layer_windows(mistral, 16) == {"full_attention": None}  # a query sees every earlier token anyway
    assert layer_windows(qwen2, 128) == {"full_attention": None, "sliding_attention": 16}
    assert layer_windows(AutoConfig.for_model("llama"), 128) == {"full_attention": None}
    assert layer_windows(AutoConfig.for_model("qwen2"), 128) == {"full_attention": None}  # use_sliding_window off
    llama4ish = AutoConfig.for_model("qwen2", layer_types=["chunked_attention", "full_attention"], num_hidden_layers=2)
    with pytest.raises(ValueError, match="layers of kind chunked_attention"):
        layer_windows(llama4ish, 128)


@pytest.mark.parametrize("model_type", WINDOWED)
@torch.no_grad()
def test_a_sliding_window_gives_transformers_eager_logits_alone_and_in_a_packed_row(model_type):
    """128 tokens, window 16: llmtrain's causal sdpa (SDPA's boolean mask, as on CPU) against
    transformers' eager attention; then two documents packed in a row (50 + 78 tokens) give each
    document's logits alone; the window dropped gives others. (The GPUs' BlockMask is the one
    create_block_mask gives and attends as this mask does: the test below. Through the model it
    needs inductor's CPU flex kernel, which fails to compile in a one-thread process, as the
    suite runs: torch 2.13, head dim 8.)"""
    flex = False
    eager, ours = windowed_pair(model_type, **WINDOWED[model_type])
    ids = torch.randint(0, 64, (2, 128), generator=torch.Generator().manual_seed(1))
    reference = eager(ids).logits
    mask = attention_mask(ours, None, 128, "cpu", flex=flex)
    assert (ours(ids, attention_mask=mask).logits - reference).abs().max() < 1e-5
    unwindowed, _ = windowed_pair(model_type)  # the same weights (the same seed), no window
    assert (unwindowed(ids).logits - reference).abs().max() > 1e-2  # what the window changes

    positions = torch.cat([torch.arange(50), torch.arange(78)])[None].expand(2, -1)
    for model in (ours, eager):  # eager: llmtrain's additive document mask, windowed too
        mask = attention_mask(model, positions, 128, "cpu", flex=flex)
        out = model(ids, attention_mask=mask, position_ids=positions).logits
        assert (out[:, :50] - eager(ids[:, :50]).logits).abs().max() < 1e-5
        assert (out[:, 50:] - eager(ids[:, 50:]).logits).abs().max() < 1e-5


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the reference
@pytest.mark.parametrize("window", [100, 300])
def test_a_windowed_block_mask_is_create_block_masks_and_skips_the_tiles_behind_the_window(window):
    positions = torch.stack([packed(40, 88, 300, 2, 90), packed(520)])
    document = (positions == 0).cumsum(dim=1)
    model = sdpa_model()
    mask = document_mask(model, positions, flex=True, window=window)
    expected = create_block_mask(lambda b, h, q, kv: (document[b, q] == document[b, kv]) & (kv <= q) & (q - kv < window),
                                 2, None, 520, 520, device="cpu")
    for name in TILE_TENSORS:
        assert torch.equal(getattr(mask, name), getattr(expected, name)), name
    # row 2 (one document): a 128-token tile sees at most ceil(window / 128) + 1 tiles, not every earlier one
    assert int((mask.kv_num_blocks + mask.full_kv_num_blocks)[1].max()) == -(-window // BLOCK) + 1
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 520, 8) for _ in range(3))
    dense = document_mask(model, positions, flex=False, window=window)
    assert torch.allclose(flex_attention(q, k, v, block_mask=mask),
                          F.scaled_dot_product_attention(q, k, v, attn_mask=dense), atol=1e-5)


def mistral_config(**sections) -> dict:
    """tiny_config's run with a Mistral of 2 layers attending within 16 tokens, at 128."""
    cfg = tiny_config(train={"max_steps": 10, "eval_every": 5, "checkpoint_every": 0}, **sections)
    cfg["model"]["architecture"] = {**cfg["model"]["architecture"], "model_type": "mistral", "sliding_window": 16}
    cfg["data"]["seq_len"] = 128
    return cfg


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    with prepared_home(tmp_path_factory, "window", mistral_config()) as home:
        yield home


@pytest.mark.slow
def test_a_sliding_window_trains_the_curve_of_transformers_eager_attention(windowed):
    """10 steps + 2 evaluations (fp32, seq 128, window 16): the default attention follows eager
    attention's curve (transformers' own windowed mask) within 1e-4, and the same model without
    its window trains another; with documents masked likewise."""
    _, config = windowed
    for name, extra in (("sdpa", []), ("eager", ["--set", "model.attn_implementation=eager"]),
                        ("nowindow", ["--set", "model.architecture.sliding_window=null"]),
                        ("docs-sdpa", ["--set", "data.document_masking=true"]),
                        ("docs-eager", ["--set", "data.document_masking=true", "--set",
                                        "model.attn_implementation=eager"])):
        cli("train", "--config", config, "--set", f"run.name={name}", *extra, check=True)
    assert_same_curve(run_dir(windowed, "sdpa"), run_dir(windowed, "eager"), tol=1e-4)
    assert_same_curve(run_dir(windowed, "docs-sdpa"), run_dir(windowed, "docs-eager"), tol=1e-4)
    apart = max(abs(a[2] - b[2]) for a, b in zip(losses(run_dir(windowed, "sdpa")),
                                                 losses(run_dir(windowed, "nowindow"))))
    assert apart > 1e-2, apart


@pytest.mark.slow
def test_a_sliding_window_under_cp2_trains_one_process_curve(windowed):
    """Context parallel attends windowed layers through its mask over the gathered keys: each
    rank's queries see only the keys inside their window (with documents too: the masks'
    arithmetic in tests/test_context_parallel.py)."""
    _, config = windowed
    if not (run_dir(windowed, "sdpa") / "metrics.jsonl").exists():  # run alone (-k): make it
        cli("train", "--config", config, "--set", "run.name=sdpa", check=True)
    torchrun(2, "train", "--config", config, "--set", "run.name=sdpa-cp2", "--set", "parallel.cp=2")
    assert_same_curve(run_dir(windowed, "sdpa-cp2"), run_dir(windowed, "sdpa"), tol=1e-4)
