"""How training attends: causal within a window, or within each document of it.

A window of text, or a row of samples, either is one sequence (causal attention, no mask at
all) or holds several documents that must not see each other (data.document_masking, packed
fine-tuning samples). Then the batch carries each token's position within its document; the
positions restart at 0 where a document starts, so they are the model's position ids as they
are and give the documents:

    positions  0 1 2 3 0 1 2 0 1
    document   1 1 1 1 2 2 2 3 3    (a new one at every 0)

and a token attends to the earlier tokens of its own document only: a block-diagonal causal
mask, built on the device from the positions (no host read), in the form the model's attention
implementation takes. With sdpa (the default): on GPUs a flex-attention BlockMask (the kernel
skips the blocks no token of a document needs: packed rows cost what their documents cost, not
what a full window costs), elsewhere SDPA's boolean mask; with eager attention an additive mask;
flash attention finds the documents from the position ids itself (its varlen kernel), but only
in a batch of one row: config/environment.py refuses it with packed rows and micro batches over 1.

The BlockMask is built from each tile's first and last document (BLOCK tokens a tile): O(B S^2 /
BLOCK^2) bytes, never the B x S x S mask that create_block_mask evaluates when not compiled (64
MiB of bools a row at 8k tokens, ~0.7 GiB of peak memory with its intermediates).
"""

from __future__ import annotations

import torch

CAUSAL_SDPA = "llmtrain_causal_sdpa"


def causal_attention(model: torch.nn.Module) -> None:
    """Training attends causally within each window, and windows are never padded: SDPA with
    is_causal and no mask at all. HF's own "sdpa" path builds its mask from position_ids and
    checks them for packed sequences, which reads a device value on the host (a stall) in every
    forward. An attention function HF has no mask builder for gets no mask, unless the caller
    passes a ready 4-D one (document_mask): that one."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attend(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):  # a BlockMask
            from transformers.integrations.flex_attention import flex_attention_forward
            return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    AttentionInterface.register(CAUSAL_SDPA, attend)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(CAUSAL_SDPA)
    else:
        model.config._attn_implementation = CAUSAL_SDPA


def document_mask(model: torch.nn.Module, positions: torch.Tensor, flex: bool | None = None):
    """The [batch, 1, seq, seq] mask that keeps attention causal within each document, for the
    model's attention implementation (None for flash attention: the position ids suffice in a
    batch of one row, which config/environment.py requires of it with packed rows).
    `flex`: a BlockMask for flex attention (sdpa only); None: on GPUs."""
    implementation = model.config._attn_implementation
    if implementation.startswith("flash_attention"):
        return None
    document = (positions == 0).cumsum(dim=1)
    batch, seq = positions.shape
    if implementation == CAUSAL_SDPA and (positions.is_cuda if flex is None else flex):
        return block_mask(document)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()
    allowed = (document[:, :, None] == document[:, None, :]) & causal
    allowed = allowed[:, None]
    if implementation == "eager":  # added to the attention scores
        return torch.zeros(allowed.shape, device=positions.device).masked_fill_(
            ~allowed, torch.finfo(torch.float32).min)
    return allowed


BLOCK = 128  # tokens per tile of flex attention's BlockMask (create_block_mask's default)


def block_mask(document: torch.Tensor):
    """The flex-attention BlockMask of the causal mask within documents, `document`: [batch, seq]
    ids that never decrease along a row. The same mask as create_block_mask(same_document, ...)
    gives, built from the tiles' ends: a query tile i and an earlier key tile j (both within a
    row) share a document iff j's last document is i's first, since ids never decrease. The pair
    is full (every token may attend: the kernel skips mask_mod) when one document covers both
    tiles and j < i; partial (mask_mod decides per token) on the diagonal and where a document
    boundary crosses them; empty otherwise."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, seq = document.shape
    tiles = -(-seq // BLOCK)
    tile = torch.arange(tiles, device=document.device)
    q, kv, start = tile[:, None], tile[None], tile * BLOCK
    first = document[:, start]  # [batch, tiles]: the document of each tile's first token
    last = document[:, (start + BLOCK).clamp(max=seq) - 1]  # and of its last
    shared = (kv <= q) & (last[:, None, :] >= first[:, :, None])  # [batch, q tile, kv tile]
    # create_block_mask pads the last tile's missing rows as masked: a short tile is never full
    whole = (start[:, None] + BLOCK <= seq) & (kv < q) & (first[:, None, :] == last[:, :, None])
    full, partial = shared & whole, shared & ~whole

    def ordered(blocks):  # as create_block_mask orders them: each row's blocks, ascending, first
        blocks = blocks[:, None].to(torch.int32)  # [batch, heads = 1, q tile, kv tile]
        indices = torch.argsort(blocks, dim=-1, descending=True, stable=True)
        return blocks.sum(dim=-1, dtype=torch.int32), indices.to(torch.int32)

    def same_document(b, h, q, kv):
        return (document[b, q] == document[b, kv]) & (kv <= q)
    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=BLOCK,
                                    mask_mod=same_document, seq_lengths=(seq, seq))


def block_mask_bytes(batch: int, seq: int) -> int:
    """What block_mask's BlockMask holds: the kv and q views of the partial and the full blocks
    (a count per tile row and an index per tile pair, int32 each) and the document ids (int64)."""
    tiles = -(-seq // BLOCK)
    return batch * (4 * 4 * tiles * (tiles + 1) + 8 * seq)


def context_parallel_attention(model: torch.nn.Module, group, device_type: str) -> None:
    """Attention where each rank of `group` (parallel.cp ranks) holds 2 of the 2 x cp chunks of
    every sequence, rank r chunks r and 2 cp - 1 - r (context_chunks): its queries attend over the
    whole sequence's keys and values, gathered from the group (their gradients go back
    reduce-scattered), under the [batch, 1, local, whole] boolean mask lm_loss passes (causal by
    the tokens' places in the whole sequence, and within documents). Exact: the same sums as one
    rank attending over the whole sequence."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Shard
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mesh = DeviceMesh.from_group(group, device_type)
    cp = group.size()

    def whole(x: torch.Tensor) -> torch.Tensor:  # [batch, heads, 2 chunks, dim] -> in sequence order
        gathered = DTensor.from_local(x, mesh, [Shard(2)]).full_tensor(grad_placements=[Partial()])
        return gathered.index_select(2, _gathered_order(cp, x.shape[2] // 2, x.device))

    def attend(module, query, key, value, attention_mask, **kwargs):
        if not isinstance(attention_mask, torch.Tensor):
            raise RuntimeError("context parallel attention needs lm_loss's mask over the whole sequence")
        return sdpa_attention_forward(module, query, whole(key), whole(value), attention_mask, **kwargs)
    AttentionInterface.register(CP_SDPA, attend)
    model.set_attn_implementation(CP_SDPA)


CP_SDPA = "llmtrain_context_parallel_sdpa"


def context_chunks(seq: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """The places in a sequence of `seq` tokens that context-parallel rank `rank` of `cp` holds:
    chunks rank and 2 cp - 1 - rank of 2 cp (a head and a tail chunk, so that every rank has as
    much causal attention to compute)."""
    c = seq // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])


def _gathered_order(cp: int, c: int, device) -> torch.Tensor:
    """Indices that put the ranks' gathered chunks (rank j: chunk j, then chunk 2 cp - 1 - j) in
    sequence order."""
    order = [j * 2 * c + (0 if chunk < cp else c) for chunk in range(2 * cp)
             for j in [chunk if chunk < cp else 2 * cp - 1 - chunk]]
    return torch.cat([torch.arange(start, start + c, device=device) for start in order])


def context_mask(places: torch.Tensor, seq: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The [batch or 1, 1, len(places), seq] mask of a context-parallel rank's queries (at
    `places` of the sequence) over the whole sequence's keys: causal, and within documents where
    `positions` (the whole sequence's, [batch, seq]) mark them."""
    keys = torch.arange(seq, device=places.device)
    allowed = places[:, None] >= keys[None, :]  # [local, seq]
    if positions is None:
        return allowed[None, None]
    document = (positions == 0).cumsum(dim=1)  # [batch, seq]
    same = document[:, places][:, :, None] == document[:, None, :]
    return (allowed[None] & same)[:, None]
