"""Attention within documents (model/attention.py): flex attention's BlockMask, built from the
documents' tile ranges, is the one create_block_mask gives, attends as the dense mask does, and
never allocates the seq x seq mask on the way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from llmtrain.model.attention import BLOCK, block_mask_bytes, causal_attention, document_mask

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
