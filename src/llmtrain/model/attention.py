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

A layer may also attend within a sliding window (Mistral's `sliding_window`; Qwen2/3's
`use_sliding_window`, where the layers of each kind are named by the config's `layer_types`): a
query sees itself and the window - 1 tokens before it, as transformers' sliding_window_overlay
has it. A window at least as long as the sequence is no window. Where a layer has one, its mask
carries it (the BlockMask skips the tiles outside the window); layers of two kinds get one mask
each, by HF's layer kind (the models that mix them take a {kind: mask} mapping).

The BlockMask is built from each tile's first and last document (BLOCK tokens a tile): O(B S^2 /
BLOCK^2) bytes, never the B x S x S mask that create_block_mask evaluates when not compiled (64
MiB of bools a row at 8k tokens, ~0.7 GiB of peak memory with its intermediates).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

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
        if attention_mask is None:
            _no_window(kwargs, key.shape[2])
        elif not isinstance(attention_mask, torch.Tensor):  # a BlockMask
            from transformers.integrations.flex_attention import flex_attention_forward
            return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    AttentionInterface.register(CAUSAL_SDPA, attend)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(CAUSAL_SDPA)
    else:
        model.config._attn_implementation = CAUSAL_SDPA


FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer kinds (config.layer_types)


def layer_windows(config, seq: int) -> dict[str, int | None]:
    """The window of each kind of the model's layers, {kind: tokens a query sees, or None for the
    whole causal prefix}, at `seq` tokens: {FULL: None} for Llama; {FULL: 4096} for a Mistral
    (one window for every layer, config.sliding_window) below 4096 tokens; {FULL: None,
    SLIDING: 16} for a Qwen2 whose later layers slide. Raises ValueError for a kind of layer
    no path here attends as transformers does (e.g. Llama 4's chunked_attention)."""
    window = getattr(config, "sliding_window", None)
    window = window if isinstance(window, int) and window < seq else None
    kinds = getattr(config, "layer_types", None)
    if not kinds:
        return {FULL: window}
    unknown = sorted(set(kinds) - {FULL, SLIDING})
    if unknown:
        raise ValueError(f"layers of kind {', '.join(unknown)}")
    return {kind: window if kind == SLIDING else None for kind in dict.fromkeys(kinds)}


def attention_mask(model: torch.nn.Module, positions: torch.Tensor | None, seq: int, device,
                   flex: bool | None = None):
    """What lm_loss passes the model as attention_mask for `seq` tokens: None where every layer
    attends plainly causally (SDPA's is_causal, no mask), else a mask (document_mask's kinds) for
    the documents `positions` mark ([batch, seq], restarting at 0; None: one sequence) and the
    layers' windows: one, or {kind: mask} where the model mixes windowed and full layers.
    Eager attention without documents and flash attention get None: transformers builds eager's
    masks, windows included, and flash attention takes the window and the documents (from the
    position ids) itself."""
    implementation = model.config._attn_implementation
    if implementation.startswith("flash_attention") or (implementation == "eager" and positions is None):
        return None
    masks = {kind: document_mask(model, positions, flex, window, seq, device) if positions is not None
             else _window_mask(model, flex, window, seq, device) if window is not None else None
             for kind, window in layer_windows(model.config, seq).items()}
    return _one_or_by_kind(masks)


@functools.lru_cache(maxsize=4)
def _window_mask(model: torch.nn.Module, flex: bool | None, window: int, seq: int, device):
    """One sequence's windowed mask depends on its length alone: made once, not every micro-batch
    (a [seq, seq] boolean on CPU, 64 MiB at 8k tokens; a BlockMask on GPUs)."""
    return document_mask(model, None, flex, window, seq, device)


def _no_window(kwargs: dict, seq: int) -> None:
    """A layer attending with no mask must have no window shorter than its `seq` keys: lm_loss
    builds a mask for every kind of layer layer_windows finds with one; a family that passes
    transformers' attention a window its config does not show would otherwise attend wholly."""
    window = kwargs.get("sliding_window")
    if window is not None and window < seq:
        raise RuntimeError(f"a layer attends within {window} tokens, which its config's sliding_window and "
                           f"layer_types do not show: llmtrain's attention cannot honour it")


def _one_or_by_kind(masks: dict):
    """{kind: mask} as the model takes it: the one mask when every layer takes the same."""
    first = next(iter(masks.values()))
    return first if all(mask is first for mask in masks.values()) else masks


def document_mask(model: torch.nn.Module, positions: torch.Tensor | None, flex: bool | None = None,
                  window: int | None = None, seq: int | None = None, device=None):
    """The [batch, 1, seq, seq] mask that keeps attention causal within each document, for the
    model's attention implementation (None for flash attention: the position ids suffice in a
    batch of one row, which config/environment.py requires of it with packed rows), and within
    `window` tokens back. `positions` None: one document of `seq` tokens on `device` ([1, 1, seq,
    seq]). `flex`: a BlockMask for flex attention (sdpa only); None: on GPUs."""
    implementation = model.config._attn_implementation
    if implementation.startswith("flash_attention"):
        return None
    if positions is None:
        document = torch.zeros(1, seq, dtype=torch.long, device=device)
    else:
        document = (positions == 0).cumsum(dim=1)
    batch, seq = document.shape
    if implementation == CAUSAL_SDPA and (document.is_cuda if flex is None else flex):
        return block_mask(document, window)
    places = torch.arange(seq, device=document.device)
    allowed = _causal(places, places, window)
    if positions is not None:
        allowed = (document[:, :, None] == document[:, None, :]) & allowed
    allowed = allowed.expand(batch, seq, seq)[:, None]
    if implementation == "eager":  # added to the attention scores
        return torch.zeros(allowed.shape, device=document.device).masked_fill_(
            ~allowed, torch.finfo(torch.float32).min)
    return allowed


def _causal(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """[len(queries), len(keys)]: which keys each query (by their places in the sequence) sees,
    causally and within `window` tokens (itself and window - 1 before it; None: all before it)."""
    behind = queries[:, None] - keys[None, :]
    return (behind >= 0) & (behind < window) if window is not None else behind >= 0


BLOCK = 128  # tokens per tile of flex attention's BlockMask (create_block_mask's default)


def block_mask(document: torch.Tensor, window: int | None = None):
    """The flex-attention BlockMask of the causal mask within documents, `document`: [batch, seq]
    ids that never decrease along a row, and within `window` tokens back (None: no window). The
    same mask as create_block_mask(same_document, ...) gives, built from the tiles' ends: a query
    tile i and an earlier key tile j (both within a row) share a document iff j's last document
    is i's first, since ids never decrease. The pair is full (every token may attend: the kernel
    skips mask_mod) when one document covers both tiles, j < i and the window reaches from i's
    last token back to j's first; partial (mask_mod decides per token) on the diagonal, where a
    document boundary crosses them and where the window's edge does; empty otherwise (among them
    every pair wholly behind the window: a windowed row costs seq x window, not seq^2 / 2)."""
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
    if window is not None:  # tokens apart: at least (q - kv - 1) BLOCK + 1, at most (q - kv + 1) BLOCK - 1
        shared = shared & ((q - kv - 1) * BLOCK + 1 < window)
        whole = whole & ((q - kv + 1) * BLOCK - 1 < window)
    full, partial = shared & whole, shared & ~whole

    def ordered(blocks):  # as create_block_mask orders them: each row's blocks, ascending, first
        blocks = blocks[:, None].to(torch.int32)  # [batch, heads = 1, q tile, kv tile]
        indices = torch.argsort(blocks, dim=-1, descending=True, stable=True)
        return blocks.sum(dim=-1, dtype=torch.int32), indices.to(torch.int32)

    def same_document(b, h, q, kv):
        row = 0 if batch == 1 else b  # a mask of one row (no documents) serves every row
        allowed = (document[row, q] == document[row, kv]) & (kv <= q)
        return allowed if window is None else allowed & (q - kv < window)
    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=BLOCK, mask_mod=same_document,
                                    seq_lengths=(seq, seq))


def block_mask_bytes(batch: int, seq: int) -> int:
    """What block_mask's BlockMask holds: the kv and q views of the partial and the full blocks
    (a count per tile row and an index per tile pair, int32 each) and the document ids (int64)."""
    tiles = -(-seq // BLOCK)
    return batch * (4 * 4 * tiles * (tiles + 1) + 8 * seq)


def context_parallel_attention(model: torch.nn.Module, mesh) -> None:
    """Attention where each rank of `mesh` (the layout's cp group) holds 2 of the 2 x cp chunks of
    every sequence, rank r chunks r and 2 cp - 1 - r (context_chunks): its queries attend over the
    whole sequence's keys and values, gathered from the group (their gradients go back
    reduce-scattered). Exact: the same sums as one rank attending over the whole sequence.

    Plain causal layers get no mask (lm_loss passes None): each chunk attends causally to the
    keys before its end, aligned bottom-right (causal_chunks), which SDPA's flash and efficient
    kernels run with GQA and without a seq^2 mask. Documents and windows come as lm_loss's
    [batch, 1, local, whole] boolean mask (context_masks): SDPA over every gathered key under it."""
    from torch.distributed.tensor import DTensor, Partial, Shard
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cp, rank = mesh.size(), mesh.get_local_rank()

    def whole(x: torch.Tensor) -> torch.Tensor:  # [batch, heads, 2 chunks, dim] -> in sequence order
        gathered = DTensor.from_local(x, mesh, [Shard(2)]).full_tensor(grad_placements=[Partial()])
        return gathered.index_select(2, _gathered_order(cp, x.shape[2] // 2, x.device))

    def attend(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is None:
            _no_window(kwargs, 2 * cp * key.shape[2])
            return causal_chunks(query, whole(key), whole(value), rank, cp, **kwargs), None
        if not isinstance(attention_mask, torch.Tensor):
            raise RuntimeError("context parallel attention takes lm_loss's mask over the whole sequence")
        return sdpa_attention_forward(module, query, whole(key), whole(value), attention_mask, **kwargs)
    AttentionInterface.register(CP_SDPA, attend)
    model.set_attn_implementation(CP_SDPA)


def causal_chunks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rank: int, cp: int,
                  dropout: float = 0.0, scaling: float | None = None, **_) -> torch.Tensor:
    """Causal attention of context-parallel rank `rank`'s queries ([batch, heads, 2 chunks of c,
    dim]: chunks rank and 2 cp - 1 - rank) over the whole sequence's keys and values ([batch, kv
    heads, 2 cp c, dim]), as transformers' attention returns it: [batch, 2 c, heads, dim]. Each
    chunk sees the keys up to its own end, its i-th query the first (its chunk's start + i + 1):
    causal aligned bottom-right (torch's causal_lower_right), with no mask and the key/value heads
    as they are (enable_gqa), so SDPA's fast kernels run it."""
    from torch.nn.attention.bias import causal_lower_right

    c = query.shape[2] // 2
    gqa = query.shape[1] != key.shape[1]
    # as SDPA would under autocast (torch's causal bias checks the dtypes before autocast casts them)
    dtype = torch.get_autocast_dtype(query.device.type) if torch.is_autocast_enabled(query.device.type) else query.dtype
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    out = []
    for chunk, end in ((query[:, :, :c], (rank + 1) * c), (query[:, :, c:], (2 * cp - rank) * c)):
        keys, values = key[:, :, :end], value[:, :, :end]
        if end == c:  # the first chunk: square, plain causal
            o = F.scaled_dot_product_attention(chunk, keys, values, dropout_p=dropout, is_causal=True,
                                               scale=scaling, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(chunk, keys, values, attn_mask=causal_lower_right(c, end),
                                               dropout_p=dropout, scale=scaling, enable_gqa=gqa)
        out.append(o)
    return torch.cat(out, dim=2).transpose(1, 2).contiguous()


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


def context_masks(config, places: torch.Tensor, seq: int, positions: torch.Tensor | None = None):
    """What lm_loss passes a context-parallel model as attention_mask (attention_mask's forms):
    None where every layer is plainly causal (causal_chunks needs no mask), else context_mask by
    the layers' windows, one or {kind: mask}."""
    masks = {kind: context_mask(places, seq, positions, window) if positions is not None or window is not None
             else None for kind, window in layer_windows(config, seq).items()}
    return _one_or_by_kind(masks)


def context_mask(places: torch.Tensor, seq: int, positions: torch.Tensor | None = None,
                 window: int | None = None) -> torch.Tensor:
    """The [batch or 1, 1, len(places), seq] mask of a context-parallel rank's queries (at
    `places` of the sequence) over the whole sequence's keys: causal, within `window` tokens back,
    and within documents where `positions` (the whole sequence's, [batch, seq]) mark them."""
    keys = torch.arange(seq, device=places.device)
    allowed = _causal(places, keys, window)  # [local, seq]
    if positions is None:
        return allowed[None, None]
    document = (positions == 0).cumsum(dim=1)  # [batch, seq]
    same = document[:, places][:, :, None] == document[:, None, :]
    return (allowed[None] & same)[:, None]
