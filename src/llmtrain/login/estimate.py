"""The memory one GPU needs for a run, before it is queued: `llmtrain estimate`.

    llmtrain estimate --config FILE [--set K=V ...] [--world-size N] [--gpu-mem GIB]
    lines, fits = report(cfg, gpu_mem_gib=None, world_size=None)  # the table submit.sh --dry-run prints
    est = estimate(cfg)                                        # the figures: bytes per rank

Parameters are counted exactly on the model's meta skeleton, built as the trainer builds it
(LoRA adapters added; no weights). The rest are formulas for the trainer's step, in bytes per
rank. S: ranks a parameter is sharded over (fsdp: all; hsdp: parallel.shard_size; ddp: 1);
P, Pt: all, trainable parameters (sharded: FSDP2's ceil(rows / S) rows of each); p: bytes of
train.precision (2, fp32: 4); r: the residual stream's (p under FSDP2, 4 under autocast);
T = micro batch x seq_len; h, i, a, k, d, L, V: hidden, intermediate, heads, kv heads, head dim,
layers, vocabulary; Pl, Pr, H: one layer's, the root's (embeddings, final norm, head), the head's.

- parameters: 4 P / S, fp32; a LoRA run in bf16/fp16 stores its frozen base in p
  (parallel/wrap.store_frozen_base; DDP: the linear layers' weights, not the embedding or norms)
- gradients: 4 Pt / S, fp32; DDP holds them all along (its all-reduce buckets), FSDP2 rebuilds
  them in each backward (held throughout with accumulation); plus unsharded ones in flight, p
  each: the head's until the root's reduce-scatter, a layer's
- optimizer state: b Pt / S, b the optimizer's state bytes per parameter in optimizers.OPTIMIZERS
  (AdamW: 8, its two fp32 moments)
- param copies: FSDP2 gathers p (Pr + Pl): the root stays gathered from forward to backward, a
  layer while it computes (every layer without reshard_after_forward); DDP's bf16/fp16 autocast
  caches p per trained weight of every layer from forward to backward (a frozen one is cast at
  each use, not kept)
- activations, per layer and token: 2 ((4 + r) h + 8) (each RMSNorm keeps its fp32 input, its
  normalised values and its statistics: LayerNorm's mean and rstd, 8) + 2 p h (the norms' outputs,
  as the projections keep them; autocast: one copy per projection) + p (2 a d + 2 k d) + 4 a (SDPA
  keeps q, k, v, its output and the fp32 log-sum-exp, never the T x T scores; eager attention does:
  + a T (4 + p)); norms on the heads (Qwen3's q_norm, k_norm) + (4 + p)(a + k) d + 4 p i (gated MLP:
  gate, its activation, up, their product; 2 p i ungated) + x i (what the activation function keeps
  besides its input and output, x bytes a feature, measured on the model's own activation module: 0
  for fused SiLU and GELU, 12 for GPT-2's tanh GELU in eager operations) + h for each dropout on the
  residual stream (its mask; GPT-2's two) + (1 + p) times the adapted layer's input width for each
  LoRA dropout (its mask and lora_A's dropped input). A checkpointed layer keeps its input, r h, and
  one layer is recomputed at a time; backward holds T (p i + 8 h) of gradients. Once per model and
  token: the final norm's (4 + r) h + 8, the token ids (8) and, with rotary positions, their tables
  (2 d r at most: one row a sample). A pipeline stage holds its in-flight micro-batches'
  activations; one that sends also their outputs and one received gradient, r h a token each; one
  that receives, its inputs where r < 4 (its first norm keeps an fp32 copy)
- the attention masks, one per kind of layer whose rows hold several documents (fine-tuning
  samples, data.document_masking) or whose sliding window is shorter than seq_len, from forward
  to the first layer's backward (flex attention saves it for backward, as activation
  checkpointing does eager's): flex attention's BlockMask (sdpa on GPUs;
  model/attention.block_mask_bytes: 16 n (n + 1) + 8 seq_len per row, n = seq_len / 128 tiles,
  rounded up), eager's fp32 additive mask, 4 seq_len^2 per row; flash attention: none
- loss (train.chunked_loss): T r h (the hidden states' gradient) + 4 H (the head's fp32
  gradient) + C V (4 + p) (a chunk's fp32 logits and their cast, C = 256 MiB / 4 V tokens) +
  p H (a chunk's head-gradient product); a frozen head (LoRA) has neither gradient nor product;
  autocast's cast of an fp32 head, p H; the full logits' loss: T V (12 + p). The chunked loss's
  backward scales its saved gradients in place, so it holds no more than its forward
- comm buffers (FSDP2): the prefetched layer's all-gather output (p Pl per
  parallel.prefetch_layers) and the previous reduce-scatter's fp32 input (4 Pl; the root's 4 Pr),
  kept until the next one instead of record_stream. DDP: none, NCCL reduces the buckets in place

Tensor parallel (parallel.tp = t): every matrix (the layers' projections, the embedding, the
head) is split over the t ranks of a group before FSDP2 shards the rest, so the parameter
terms are divided by t (the norms' vectors, replicated, are left in: a few kB a layer); within a
layer the activations of the heads and the MLP's features are divided by t, and so are the
norms' (sequence parallel: each rank its seq_len / t tokens), but the gathered input each
projection keeps (2 p h per token, the attention's and the MLP's) is whole on every rank; the
loss holds the gathered hidden states and a chunk of V / t logits.

Context parallel (parallel.cp = c): a rank computes seq_len / c tokens of each sequence, so every
per-token term above is for T / c tokens; each layer also keeps the whole sequence's keys and
values, gathered from the group, for its attention's backward (DDP there holds a second gradient
copy: its buckets are not the gradients). Plain causal layers take no mask (attention.causal_chunks):
p 2 k d seq_len per row. Documents or a window take a boolean mask of the rank's queries over the
whole sequence, seq_len^2 / c bytes a row, held by the step (one per kind of layer that needs
one); each layer attending under it keeps the keys and values repeated to every query head, p 2 a
d seq_len, and the mask made a bias in p that SDPA saves for backward, p seq_len^2 / c a row.

Mixture-of-Experts layers (model/moe.py): E experts a layer, k of them per token, of width I.
Their weights, gradients and optimizer state are counted as they are held, whole stacks of E
(FSDP2 shards them by expert, ceil(E / S) a rank); per token, the MLP's 4 p i becomes k (4 p I +
2 p h), each used expert's gathered input and output, plus the router's logits and the two fp32
softmaxes kept for backward (the router's, the load-balancing loss's), E (p + 8); a shared expert
(Qwen2-MoE) adds its 4 p i. Measured on transformers' grouped-GEMM experts (its default): the
tensors saved for backward are these, to the byte (doc/benchmarks.md).

Expert parallel (parallel.ep = e): the experts' weights, gradients and state are split as FSDP2
splits them (E / (e x efsdp) = E / S experts a rank either way); what changes is the gathered
layer (a rank gathers its E / e experts, not all E: the param-copy and comm terms count
Pl - (1 - 1 / e) x the layer's experts) and the dispatch: the tokens a rank's experts receive
balance out on average, so the activations stay k x (4 p I + 2 p h) a token; a layer's
all-to-all buffers (the pairs sent and received, their outputs sent back and received), 4 k p h
a token, join the comm row while its backward runs.

Muon (train.optimizer: muon) adds a moment, its optimizer step: every gradient, the fp32 update
and result of each hidden-matrix parameter the rank holds (8 bytes each), and the largest stack
of whole matrices it orthogonalises at once, ceil(k / n) of the k matrices of one shape and
layout (n: the ranks a matrix is split over, shard x tp; without either, one matrix at a time),
with Newton-Schulz's work on them, 4 (4 M + 2 s^2) bytes a matrix of M elements and shorter
side s (optimizers/muon.py), in the comm row. 405B on 512 GPUs (fsdp x tp 8): 21 GiB, the peak.

The peak is the largest total of four moments (five with Muon): the loss at the end of forward
(every activation kept), the backward of the last layer and of the first (the other layers'
gradients reduced), and the root's reduce-scatter (FSDP2). It is tensor memory, what
torch.cuda.max_memory_allocated reports; the CUDA context, NCCL's own buffers and fragmentation
come on top, so a run fits when the total is within 90% of the GPU's memory (HEADROOM). It
matches the peaks torch's memory tracker measures in the trainer's own steps within a few
percent (tests/test_estimate.py, doc/benchmarks.md), and max_memory_allocated on an H100 within
3% (0.973-1.023: DDP and FSDP2, with and without activation checkpointing, tests/test_gpu.py),
for Llama-style layers (RMSNorm, gated MLP) run eagerly (not compiled), and GPT-2's (LayerNorm,
its GELU, dropout; tests/test_estimate.py: 1.00, where it read 0.92 before the activation and the
dropouts were counted). Not counted: dropout written as a function call (OPT, Falcon); and on a
CPU, where dropout keeps its scaled noise in the input's dtype (CUDA: a byte mask) and SDPA's math
kernel keeps the attention probabilities under attention dropout, the difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import Config, UserError
from ..gpus import gpu_called
from ..optimizers import OPTIMIZERS, state_bytes
from ..parallel.dims import PIPELINE_FAMILIES, ParallelDims, layout_name

GIB = 2**30
HEADROOM = 0.10  # of a GPU's memory: CUDA context, NCCL buffers, allocator fragmentation
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MUON_STEP = "Muon's optimizer step (its updates, a stack orthogonalised)"
# Where a family's config names its MLP's width (GPT-2 and GPT-J: n_inner, OPT: ffn_dim, Falcon:
# ffn_hidden_size); without one, 4 x hidden, as they default to.
MLP_WIDTH_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
ROWS = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer state",
        "param_copies": "param copies", "activations": "activations", "loss": "loss", "comm": "comm buffers"}


@dataclass(frozen=True)
class ModelShape:
    """What the formulas read from the model's meta skeleton and its Hugging Face config."""
    model_type: str
    params: int
    trainable: int
    rows: tuple  # (first dimension, numel, trainable, frozen linear weight, a matrix) of every parameter
    layer: int  # parameters of the largest decoder layer
    layer_trainable: int
    layer_matrices: int  # its projections (2-D weights) and their parameters
    layer_matrix_params: int  # ... those that train: autocast caches their casts
    root: int  # the rest: embeddings, final norm, head
    root_trainable: int
    head: int  # the output head's weight, vocab x hidden
    head_trainable: int
    head_linear: bool  # a linear layer's own weight, not the input embedding's
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    gated: bool  # a gated MLP (SwiGLU), as Llama's
    chunked: bool  # the loss runs in chunks (train.chunked_loss and a plain linear head)
    windows: tuple = (None,)  # each kind of layer's sliding window (model/attention.layer_windows), None: none
    layer_weights: tuple = ()  # (name, rows, cols) of the largest layer's trained matrices: Muon's stacks
    head_norms: bool = False  # norms on the queries' and keys' heads (Qwen3's q_norm, k_norm)
    activation_extra: float = 0.0  # bytes an MLP feature that its activation keeps besides input and output
    dropout_masks: int = 0  # a layer's dropouts on the residual stream (GPT-2's): a byte a hidden element each
    lora_dropout_bytes: int = 0  # per token, what LoRA's dropouts keep (their masks and dropped inputs)
    rotary: bool = True  # rotary position embeddings (Llama's): their cos and sin tables are kept
    # Mixture-of-Experts (model/moe.py): experts per layer, used per token, their width; 0: dense
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert, every token's
    active: int = 0  # parameters a token uses (params for a dense model)
    layer_expert_params: int = 0  # the largest layer's trained expert stacks [E, rows, cols]
    expert_weights: tuple = ()  # (row blocks, E, rows, cols) of each: Muon orthogonalises each expert's apart

    @property
    def mlp_width(self) -> int:
        """The MLP features one token computes: top-k experts' (and a shared expert's), or the dense MLP's."""
        if not self.experts:
            return self.intermediate
        return self.top_k * self.expert_intermediate + self.shared_intermediate

    @property
    def hidden_params(self) -> int:
        """The hidden matrices' parameters that train, experts included: Muon's share."""
        return self.layers * (self.layer_matrix_params + self.layer_expert_params)


@dataclass(frozen=True)
class Estimate:
    """Bytes per rank at the step's peak, by component (ROWS); `phase` names the moment."""
    parameters: int
    gradients: int
    optimizer: int
    param_copies: int
    activations: int
    loss: int
    comm: int
    phase: str
    params: int
    trainable: int
    world_size: int
    shard_size: int
    micro_batch: int
    tp: int = 1

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in ROWS)


def model_shape(cfg: Config) -> ModelShape:
    """The model built on the meta device as parallelize builds it (LoRA applied): seconds for
    70B parameters, no memory. Raises ModelNotFound (a UserError) if the model is not on disk."""
    from ..data.tokenizer import load_tokenizer
    from ..model.build import build_model, decoder_layers, model_config
    from ..model.lora import apply_lora, frozen_weights, is_adapter
    from ..model.loss import chunk_head
    from ..model.moe import MoE
    from ..optimizers.groups import row_blocks

    # The tokenizer only sizes an inline architecture's vocabulary; a folder's config.json has it.
    config = model_config(cfg, load_tokenizer(cfg) if cfg.model.architecture is not None else None)
    model = build_model(config, cfg, "meta")
    if cfg.model.lora_spec is not None:
        apply_lora(model, cfg.model.lora_spec)
    params = dict(model.named_parameters())  # tied weights once
    layers = decoder_layers(model)
    per_layer = [dict(layer.named_parameters()) for layer in layers]
    big, largest = max(zip(layers, per_layer), key=lambda lp: sum(p.numel() for p in lp[1].values()))
    in_layers = {id(p) for ps in per_layer for p in ps.values()}
    root = [p for p in params.values() if id(p) not in in_layers]
    matrices = [p for n, p in largest.items() if p.ndim == 2 and not is_adapter(n)]
    head = model.get_output_embeddings().weight
    linear = {id(p) for p in frozen_weights(model, linear_only=True)}  # under autocast, stored in p
    hidden, heads = config.hidden_size, config.num_attention_heads
    moe = MoE.of(config)
    experts = {n: p for n, p in largest.items() if p.ndim == 3 and p.requires_grad}
    moe_shape = {} if moe is None else dict(
        experts=moe.experts, top_k=moe.top_k,
        expert_intermediate=getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
        shared_intermediate=getattr(config, "shared_expert_intermediate_size", None) or 0,
        active=moe.active_params((n, p.numel()) for n, p in params.items())[1],
        layer_expert_params=sum(p.numel() for p in experts.values()),
        expert_weights=tuple((row_blocks(n), *p.shape) for n, p in experts.items()))
    return ModelShape(
        model_type=config.model_type,
        params=sum(p.numel() for p in params.values()),
        trainable=sum(p.numel() for p in params.values() if p.requires_grad),
        rows=tuple((p.shape[0] if p.ndim else 1, p.numel(), p.requires_grad, id(p) in linear, p.ndim == 2)
                   for p in params.values()),
        layer=sum(p.numel() for p in largest.values()),
        layer_trainable=sum(p.numel() for p in largest.values() if p.requires_grad),
        layer_matrices=len(matrices),
        layer_matrix_params=sum(p.numel() for p in largest.values() if p.ndim == 2 and p.requires_grad),
        root=sum(p.numel() for p in root), root_trainable=sum(p.numel() for p in root if p.requires_grad),
        head=head.numel(), head_trainable=head.numel() if head.requires_grad else 0,
        head_linear=head is not model.get_input_embeddings().weight,
        layers=len(layers), hidden=hidden, heads=heads,
        intermediate=next((w for key in MLP_WIDTH_KEYS if (w := getattr(config, key, None))), 4 * hidden),
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads, vocab=config.vocab_size,
        gated=any("gate" in name for name in largest),
        chunked=cfg.train.chunked_loss and chunk_head(model, config) is not None,
        windows=_windows(config),
        layer_weights=tuple((n.split(".")[-2], *p.shape) for n, p in largest.items()
                            if p.ndim == 2 and p.requires_grad),
        head_norms=any(n.endswith("q_norm.weight") for n in largest),
        rotary=any(name.endswith("rotary_emb") for name, _ in model.named_modules()),
        activation_extra=_activation_extra(big),
        **_dropouts(big, 2 if cfg.train.precision in ("bf16", "fp16") else 4),
        **{"active": sum(p.numel() for p in params.values()), **moe_shape},
    )


def _activation_extra(layer) -> float:
    """The bytes per MLP feature that the layer's activation function keeps for backward besides
    its input and its output (which the MLP term counts), measured by running each activation
    module of the layer on a small fp32 CPU tensor and summing what autograd saves: 0 for a fused
    one (SiLU, GELU, ReLU), 12 for GPT-2's tanh GELU written out in eager operations (transformers'
    NewGELUActivation: tanh's output, x / 2, 1 + tanh). Counted in fp32 at every precision:
    CUDA's autocast runs pow and what follows it in fp32 (GPT-2 124M, bf16, on an H100: 14.6 GiB
    measured, 15.6 estimated; 8.5 before the activation and the dropouts were counted). The
    largest counts."""
    import torch
    extra = 0.0
    for module in layer.modules():
        kind = type(module).__module__
        if (next(module.children(), None) is not None or next(module.parameters(), None) is not None
                or next(module.buffers(), None) is not None
                or not kind.startswith(("transformers.activations", "torch.nn.modules.activation"))):
            continue
        kept: dict[int, int] = {}

        def pack(t):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        # not a leaf, as the up projection's output; no random numbers: the caller's generator stays as it was
        x = torch.linspace(-4.0, 4.0, 512).reshape(8, 64).requires_grad_() * 1.0
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = module(x)
        except (RuntimeError, TypeError, ValueError):  # not an elementwise function of one tensor
            continue
        for t in (x, y):
            kept.pop(t.untyped_storage().data_ptr(), None)
        extra = max(extra, sum(kept.values()) / x.numel())
    return extra


def _dropouts(layer, p: int) -> dict:
    """What the layer's dropouts outside attention keep for backward, as ModelShape's fields:
    `dropout_masks`, those on the residual stream (GPT-2's and GPT-NeoX's), a mask each, a byte a
    hidden element; `lora_dropout_bytes`, LoRA's, each its mask and the dropped input that lora_A
    saves (p bytes), the adapted layer's input wide, per token. Attention's dropout runs inside
    SDPA's kernel on GPUs (flash, efficient): no mask kept. Functional dropouts (OPT's, Falcon's)
    are not modules, and not seen here."""
    import torch
    masks = lora = 0
    for name, module in layer.named_modules():
        if not isinstance(module, torch.nn.modules.dropout._DropoutNd) or not module.p:
            continue
        owner, _, own = name.rpartition(".")
        if own == "lora_dropout":  # set on the adapted linear layer itself (model/lora.py)
            lora += (1 + p) * layer.get_submodule(owner).in_features
        elif not any(word in own for word in ("attn", "attention")):  # attn_dropout: the probabilities'
            masks += 1
    return {"dropout_masks": masks, "lora_dropout_bytes": lora}


def _windows(config) -> tuple:
    """Each kind of layer's sliding window, at any sequence length; UserError for a kind that
    training cannot attend as (check-config names it too)."""
    from ..model.attention import layer_windows
    try:
        return tuple(layer_windows(config, 2**62).values())
    except ValueError as e:
        raise UserError(f"model: {e}, which llmtrain's attention cannot honour; choose a model without them") from None


def shard_size(cfg: Config, world: int) -> int:
    """Ranks a parameter is sharded over, as parallel/dims.py decides (hsdp's default: a node)."""
    return dims_of(cfg, world).shard


def dims_of(cfg: Config, world: int) -> ParallelDims:
    """The degrees parallel/dims.py decides for cfg on `world` ranks; UserError where they cannot work."""
    dims = ParallelDims.from_config(cfg, world)
    if problems := dims.problems():
        raise UserError(problems[0])
    return dims


def _split(m: ModelShape, tp: int) -> ModelShape:
    """What one rank of a tensor-parallel group holds of the sizes the formulas read: the
    matrices' share (the norms' vectors, a few kB a layer, counted as split too)."""
    if tp == 1:
        return m
    import dataclasses
    return dataclasses.replace(m, **{name: getattr(m, name) // tp for name in (
        "params", "trainable", "layer", "layer_trainable", "layer_matrix_params", "root", "root_trainable", "head",
        "head_trainable", "intermediate", "heads", "kv_heads", "vocab")})


def estimate(cfg: Config, world_size: int | None = None, micro_batch: int | None = None,
             shape: ModelShape | None = None) -> Estimate:
    """Bytes per rank at the peak of a training step of `cfg` on world_size ranks (default the
    config's), at micro_batch (default train.micro_batch_size)."""
    whole = shape or model_shape(cfg)
    world = world_size or cfg.world_size
    micro = micro_batch or cfg.train.micro_batch_size
    t, par = cfg.train, cfg.parallel
    dims = dims_of(cfg, world)
    if dims.pipeline > 1:
        return _pipelined(cfg, dims, whole, world, micro)
    tp, cp = dims.tensor, dims.context
    shard = dims.param_shards  # FSDP2 shards over the context-parallel ranks too
    m = _split(whole, tp)  # one rank's part of a tensor-parallel group's
    sharded = par.strategy != "ddp"
    p = PRECISION_BYTES[t.precision]
    autocast = not sharded and p < 4  # DDP and one process: fp32 weights, autocast to bf16/fp16
    res = p if sharded else 4  # the residual stream: FSDP2 computes in p, autocast leaves it fp32
    tokens = dims.tokens_per_rank(micro, cfg.data.seq_len)  # this rank's share of the micro-batch's
    accum = dims.accumulation(t.global_batch_size, micro)
    h, L = m.hidden, m.layers

    params = _param_bytes(whole, shard, p, linear_only=not sharded, tp=tp)
    grads = 4 * _sharded(whole, shard, trainable_only=True, tp=tp)
    deferred = 4 * whole.trainable // tp if sharded and not par.reduce_every_micro_batch and accum > 1 else 0
    held = grads if (not sharded and dims.loss_ranks > 1) or accum > 1 else 0  # gradients there from forward on
    if not sharded and cp > 1:  # DDP without gradients as bucket views (parallel/wrap.py): buckets too
        held += grads
    layer_acts = tokens * _layer_bytes(m, p, res, autocast, cfg, tp)
    masks = _masks(cfg, m)
    if cp > 1 and masks:  # the whole sequence's keys and values, gathered, repeated to every query head
        # (SDPA with a mask takes transformers' repeat_kv path) and kept for attention's backward; and
        # the boolean mask made a bias in p (SDPA's efficient kernel saves it for backward): each layer
        layer_acts += micro * cfg.data.seq_len * (2 * m.heads * m.head_dim * p + p * cfg.data.seq_len // cp)
    elif cp > 1:  # no mask (model/attention.causal_chunks): the gathered keys and values as they are
        layer_acts += micro * cfg.data.seq_len * 2 * m.kv_heads * m.head_dim * p
    every = cfg.model.activation_checkpointing_every
    checkpointed = -(-L // every) if cfg.model.activation_checkpointing else 0
    kept = (L - checkpointed) * layer_acts + checkpointed * tokens * res * h // tp + _once(m, tokens, res, tp)
    recompute = layer_acts if checkpointed else 0
    backward = tokens * (p * m.mlp_width + 8 * h)
    # cp: a boolean mask of this rank's queries by the whole sequence, each kind of layer's
    mask = _mask_bytes(cfg, micro, masks) if cp == 1 else masks * micro * cfg.data.seq_len ** 2 // cp
    kept += mask
    loss = _loss_bytes(m, tokens, p, res, autocast and (m.head_trainable > 0 or not m.head_linear))

    # Each moment: (gradients, param copies, activations, loss, comm buffers)
    if sharded:  # FSDP2: the root stays gathered from forward to backward
        # a layer gathered: expert parallel gathers its rank's 1 / ep of the experts only
        experts_not_held = m.layer_expert_params - m.layer_expert_params // dims.expert
        layer, layer_trainable = m.layer - experts_not_held, m.layer_trainable - experts_not_held
        gathered = p * (m.root + (1 if par.reshard_after_forward else L) * layer)
        # unsharded gradients: the head's, until the root's reduce-scatter, and the layer's
        in_flight = p * (m.head_trainable + layer_trainable)
        reduced = 4 * (m.trainable - m.root_trainable - m.layer_trainable) // shard  # other layers'
        prefetched = max(1, par.prefetch_layers) * p * layer  # all-gather outputs
        # expert parallel: a layer's all-to-all buffers (the pairs sent and received, their outputs
        # sent back and received) while its backward runs
        dispatch = 4 * m.top_k * tokens * h * p if dims.expert > 1 else 0
        phases = {
            "the loss, at the end of forward": (held, gathered, kept, loss, 0),
            "the backward of the last layer": (held + in_flight, gathered, kept + recompute + backward,
                                               0, prefetched + 4 * layer_trainable + dispatch),
            "the backward of the first layer": (max(held, reduced) + in_flight, p * (m.root + layer),
                                                layer_acts + backward + mask, 0, 4 * layer_trainable + dispatch),
            "the root's reduce-scatter, at the end of backward": (
                grads + p * m.root_trainable, 0, 0, 0, 4 * m.root_trainable),
        }
    else:  # DDP: every gradient held in its buckets; autocast caches each layer's weights
        cast = p * m.layer_matrix_params if autocast else 0
        # PowerSGD's error feedback: an fp32 copy of every gradient, kept from step to step
        feedback = 4 * m.trainable if par.grad_compression == "powersgd" else 0
        phases = {
            "the loss, at the end of forward": (held, L * cast, kept, loss, feedback),
            "the backward of the last layer": (held or 4 * m.head_trainable,
                                               (L - checkpointed + bool(checkpointed)) * cast,
                                               kept + recompute + backward, 0, feedback),
            "the backward of the first layer": (grads, cast, layer_acts + backward + mask, 0, feedback),
        }
    # each part's share of this rank's trainable parameters: the hidden matrices and the rest
    hidden = whole.hidden_params / max(1, whole.trainable)
    if t.optimizer == "muon":  # every gradient there; the updates and a stack of whole matrices
        stacked = sharded or tp > 1  # DTensors: stacks handed out over the ranks that split a matrix
        phases[MUON_STEP] = (grads, 0, 0, 0, _muon_step(
            whole, shard * tp if sharded else tp, stacked, tp,
            round(hidden * _sharded(whole, shard, trainable_only=True, tp=tp))))
    phase, (gradients, copies, activations, loss_bytes, comm) = max(
        phases.items(), key=lambda item: sum(item[1]))
    optimizer = round(state_bytes(t.optimizer, 1, hidden) * _sharded(whole, shard, trainable_only=True, tp=tp))
    return Estimate(parameters=params, gradients=gradients + deferred, optimizer=optimizer,
                    param_copies=copies, activations=activations, loss=loss_bytes, comm=comm,
                    phase=phase, params=whole.params, trainable=whole.trainable, world_size=world,
                    shard_size=shard, micro_batch=micro, tp=tp)


def in_flight(schedule: str, pp: int, rank: int, micro_batches: int, stages_per_rank: int = 1) -> int:
    """Stage forwards whose activations a pipeline rank holds at once, at most: GPipe runs every
    micro-batch's forward before the first backward; 1F1B holds pp - rank; interleaved 1F1B
    (torch's warm-up) (v - 1) pp + 2 (pp - 1 - rank) + 1 forwards of one of its v stages."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(micro_batches, pp - rank)
    return min(micro_batches * stages_per_rank, (stages_per_rank - 1) * pp + 2 * (pp - 1 - rank) + 1)


def _pipelined(cfg: Config, dims: ParallelDims, whole: ModelShape, world: int, micro: int) -> Estimate:
    """A pipeline's ranks (parallel/pipeline.py): each its stages' layers (the first also the
    embedding, the last the final norm, the head and the loss), the worst of the first and last.
    FSDP2 keeps a stage's parameters gathered from the first forward to the step's end
    (reshard_after_forward off under pp), and under 1F1B and GPipe its gradients unsharded in fp32
    until the last micro-batch's backward; a rank holds in_flight micro-batches' activations, and
    where it sends to a later stage their outputs too (the schedule keeps each until its backward)
    and the gradient it receives for one (this rank's slice of the sequence under tp); the last
    stage the final norm's, as without a pipeline."""
    from ..parallel.pipeline import stage_bounds
    t, par = cfg.train, cfg.parallel
    pp, v, tp = dims.pipeline, dims.stages_per_rank, dims.tensor
    sharded, shard = dims.sharded, dims.param_shards
    whole = _split(whole, tp)  # one tensor-parallel rank's part
    p = PRECISION_BYTES[t.precision]
    res = p if sharded else 4
    autocast = not sharded and p < 4
    tokens = dims.tokens_per_rank(micro, cfg.data.seq_len)
    accum = dims.accumulation(t.global_batch_size, micro)
    bounds = stage_bounds(whole.layers, pp * v)
    embedding = whole.root - whole.head if whole.head_linear else whole.root  # a tied head is refused
    per_layer = tokens * _layer_bytes(whole, p, res, autocast, cfg, tp)
    hidden = whole.hidden_params / max(1, whole.trainable)
    worst = None
    for rank in sorted({0, pp - 1}):
        stages = [rank + k * pp for k in range(v)]
        layers = sum(bounds[s][1] - bounds[s][0] for s in stages)
        held = layers * whole.layer + (embedding if 0 in stages else 0) + (
            whole.root - embedding if pp * v - 1 in stages else 0)
        trainable = held if whole.trainable == whole.params else round(held * whole.trainable / whole.params)
        checkpointed = cfg.model.activation_checkpointing
        kept_layer = tokens * res * whole.hidden // tp if checkpointed else per_layer
        forwards = in_flight(par.pp_schedule, pp, rank, accum, v)
        # a stage that sends keeps its outputs and receives a gradient; one that receives keeps its
        # inputs, which its first norm's fp32 copy is not where the residual stream is in p
        sends, receives = v > 1 or rank < pp - 1, v > 1 or rank > 0
        boundary = ((forwards + 1 if sends else 0) + (forwards if receives and res < 4 else 0)) \
            * tokens // tp * whole.hidden * res
        once = forwards * _once(whole, tokens, res, tp, final_norm=pp * v - 1 in stages, ids=0 in stages)
        activations = forwards * max(1, layers // v) * kept_layer + (per_layer if checkpointed else 0) \
            + tokens * (p * whole.mlp_width + 8 * whole.hidden) + boundary + once
        loss = _loss_bytes(whole, tokens, p, res, autocast) if pp * v - 1 in stages else 0
        params = 4 * -(-held // shard)
        gradients = 4 * -(-trainable // shard)
        copies, unsharded = 0, 0
        if sharded:
            copies = p * held  # gathered for the whole step
            if v == 1 and accum > 1:  # reduce-scattered at the last micro-batch only
                unsharded = 4 * trainable
        optimizer = round(state_bytes(t.optimizer, 1, hidden) * -(-trainable // shard))
        est = Estimate(parameters=params, gradients=gradients + unsharded, optimizer=optimizer, param_copies=copies,
                       activations=activations, loss=loss, comm=0,
                       phase=f"pipeline rank {rank} of {pp} ({forwards} micro-batch forwards in flight)",
                       params=whole.params * tp, trainable=whole.trainable * tp, world_size=world, shard_size=shard,
                       micro_batch=micro, tp=tp)
        if worst is None or est.total > worst.total:
            worst = est
    return worst


def _muon_step(m: ModelShape, ranks: int, stacked: bool, tp: int, hidden: int) -> int:
    """Muon's step (optimizers/muon.py): the fp32 update and result of each of the rank's `hidden`
    matrix parameters, and the largest stack it orthogonalises at once, ceil(k / ranks) whole
    matrices of the k of one layout (one matrix at a time where none is a DTensor), with
    Newton-Schulz's work on them: 4 (4 M + 2 s^2) bytes a matrix of M elements, s its shorter
    side. torch's memory tracker measures 0.95-0.98 of it over a step in one process
    (tests/test_estimate.py), 0.93-1.04 of a stack's part on 4 ranks of FSDP2 x tp 2."""
    from collections import Counter

    from ..parallel.tensor import PLANS
    plan = PLANS.get(m.model_type)
    row = {plan.rows, plan.mlp_rows} if tp > 1 and plan else set()  # row-parallel: their own stacks
    stacks = Counter((name in row, rows, cols) for name, rows, cols in m.layer_weights)
    work = max((4 * (-(-count * m.layers // ranks) if stacked else 1) * (4 * rows * cols + 2 * min(rows, cols) ** 2)
                for (_, rows, cols), count in stacks.items()), default=0)
    for blocks, experts, rows, cols in m.expert_weights:  # the rank's experts of one stack, at once
        held, rows = -(-experts // ranks) * blocks, rows // blocks
        work = max(work, 4 * held * (4 * rows * cols + 2 * min(rows, cols) ** 2))
    return 8 * hidden + work


def _sharded(m: ModelShape, shard: int, trainable_only: bool, tp: int = 1) -> int:
    """Parameters one rank holds: FSDP2 gives each rank ceil(rows / shard) rows of each (of a
    matrix's 1 / tp, tensor parallel's split)."""
    return sum(-(-rows // shard) * (numel // rows) // (tp if matrix else 1)
               for rows, numel, trains, _, matrix in m.rows if trains or not trainable_only)


def _param_bytes(m: ModelShape, shard: int, p: int, linear_only: bool, tp: int = 1) -> int:
    """The bytes of the parameters one rank holds: fp32, but a frozen base (LoRA) in p, all of
    it (FSDP2) or its linear layers' weights (autocast), as parallel/wrap.store_frozen_base."""
    return sum(-(-rows // shard) * (numel // rows) // (tp if matrix else 1)
               * (4 if trains or (linear_only and not linear) else p)
               for rows, numel, trains, linear, matrix in m.rows)


def _once(m: ModelShape, tokens: int, res: int, tp: int, final_norm: bool = True, ids: bool = True) -> int:
    """What a forward keeps once whatever its layers: the final norm's fp32 input, output and
    statistics (seq_len / tp tokens under tp), the token ids and the rotary tables (cos and sin;
    one row a sample at most: HF makes one for the batch where no positions are passed)."""
    return (tokens * ((4 + res) * m.hidden + 8) // tp if final_norm else 0) + (8 * tokens if ids else 0) \
        + (tokens * 2 * m.head_dim * res if m.rotary else 0)


def _layer_bytes(m: ModelShape, p: int, res: int, autocast: bool, cfg: Config, tp: int = 1) -> int:
    """Activation bytes one decoder layer keeps for backward, per token (`m`: one tensor-parallel
    rank's part, whose norms see seq_len / tp tokens and whose projections the gathered input)."""
    norms = 2 * ((4 + res) * m.hidden + 8) // tp  # LayerNorm's mean and rstd, RMSNorm's rstd: 8 at most
    # autocast casts a norm's output once per projection reading it: all but the two output ones
    norm_outputs = (m.layer_matrices - 2 if autocast else 2) * p * m.hidden
    attention = p * 2 * (m.heads + m.kv_heads) * m.head_dim + 4 * m.heads
    if m.head_norms:  # each keeps its input in fp32 and its normalised output
        attention += (4 + p) * (m.heads + m.kv_heads) * m.head_dim
    if cfg.model.attn_implementation == "eager":  # the scores' softmax, fp32 and cast
        attention += m.heads * cfg.data.seq_len * (4 + (p if p < 4 else 0))
    mlp = ((4 if m.gated else 2) * p + m.activation_extra) * m.mlp_width
    if m.experts:  # each of its top-k experts' input gathered and its output, p h each; the router's
        # logits (p) and two softmaxes kept for backward, fp32: the router's, and the balancing loss's
        mlp += m.top_k * 2 * p * m.hidden + m.experts * (p + 8)
    masks = m.dropout_masks * m.hidden // tp  # on the residual stream: seq_len / tp tokens under tp
    return int(norms + norm_outputs + attention + mlp) + masks + m.lora_dropout_bytes


def _masks(cfg: Config, m: ModelShape) -> int:
    """How many attention masks a micro-batch takes (model/attention.attention_mask): one per kind
    of layer whose rows hold several documents or whose window is shorter than the sequence."""
    documents = cfg.data.samples or cfg.data.document_masking
    return sum(documents or (window is not None and window < cfg.data.seq_len) for window in m.windows)


def _mask_bytes(cfg: Config, micro: int, masks: int) -> int:
    """The attention masks of a micro-batch (model/attention.py) without context parallel."""
    from ..model.attention import block_mask_bytes
    if cfg.model.attn_implementation == "eager":  # an fp32 [micro, 1, seq, seq] added to the scores
        return masks * 4 * micro * cfg.data.seq_len ** 2
    return masks * block_mask_bytes(micro, cfg.data.seq_len) if cfg.model.attn_implementation == "sdpa" else 0


def _loss_bytes(m: ModelShape, tokens: int, p: int, res: int, cast_head: bool) -> int:
    """The loss's peak: chunked (model/loss.py) or over the full logits. `cast_head`: autocast
    casts an fp32 head for the matmul."""
    from ..model.loss import CHUNK_LOGIT_BYTES
    cast = p if p < 4 else 0
    head_cast = p * m.head if cast_head else 0
    if not m.chunked:
        return tokens * (m.vocab * (12 + cast) + res * m.hidden) + head_cast
    chunk = min(tokens, max(1, CHUNK_LOGIT_BYTES // (4 * m.vocab)))
    return (tokens * res * m.hidden + (4 + p) * m.head_trainable + chunk * m.vocab * (4 + cast)
            + head_cast)


def gpu_memory(cfg: Config, gpu_mem_gib: float | None = None) -> tuple[str, float] | None:
    """(where from, GiB) of one GPU: --gpu-mem, else a GPU named in slurm.extra_args, partition
    or qos (`--gres=gpu:h100:4`, `--constraint=a100_80gb`); None if neither says."""
    if gpu_mem_gib is not None:
        if not gpu_mem_gib > 0 or math.isinf(gpu_mem_gib):
            raise UserError(f"--gpu-mem: must be a GPU's memory in GiB, > 0 (got {gpu_mem_gib})")
        return "--gpu-mem", gpu_mem_gib
    gpu = gpu_called(slurm_text(cfg))
    return (f"{gpu.name}, named in the slurm section", gpu.memory_gib) if gpu else None


def slurm_text(cfg: Config) -> str:
    """What of the slurm section can name a GPU: extra_args (--gres, --constraint), the
    partition and the qos."""
    s = cfg.slurm
    return " ".join(str(x) for x in (*s.extra_args, s.partition or "", s.qos or ""))


def largest_micro_batch(cfg: Config, usable: float, world: int, shape: ModelShape) -> int | None:
    """The largest micro batch whose peak is within `usable` bytes, among those that divide the
    rank's share of train.global_batch_size (the config's rule); None if not even 1 fits."""
    per_rank = max(1, cfg.train.global_batch_size // dims_of(cfg, world).dp)
    fitting = [m for m in range(1, per_rank + 1)
               if per_rank % m == 0 and estimate(cfg, world, m, shape).total <= usable]
    return fitting[-1] if fitting else None


def report(cfg: Config, gpu_mem_gib: float | None = None,
           world_size: int | None = None) -> tuple[list[str], bool | None]:
    """The estimate as printable lines: the run, a table of GiB per GPU, the verdict. Raises
    UserError (a bad --gpu-mem, a model not on disk)."""
    gpu = gpu_memory(cfg, gpu_mem_gib)
    shape = model_shape(cfg)
    est = estimate(cfg, world_size, shape=shape)
    mc, t = cfg.model, cfg.train
    every = mc.activation_checkpointing_every
    checkpointing = ("off" if not mc.activation_checkpointing
                     else "every layer" if every == 1 else f"every {every} layers")
    par = cfg.parallel
    layout = layout_name(par.strategy, est.tp, par.cp, shard_size(cfg, est.world_size), par.pp, par.pp_schedule,
                         par.ep, par.zero)
    experts = (f", {shape.active:,} active per token ({shape.top_k} of {shape.experts} experts a layer)"
               if shape.experts else "")
    lines = [f"{shape.model_type}: {shape.params:,} parameters ({shape.trainable:,} trainable{experts}); {layout} on "
             f"{est.world_size} "
             f"{'GPUs' if cfg.slurm.gpus_per_node else 'ranks'}, "
             f"{t.precision}, micro batch "
             f"{est.micro_batch} x {cfg.data.seq_len} tokens, activation checkpointing {checkpointing}",
             f"{'per GPU':<16} {'GiB':>7}  what"]
    what = _descriptions(cfg, est, shape)
    lines += [f"{row:<16} {getattr(est, name) / GIB:>7.2f}  {what[name]}" for name, row in ROWS.items()]
    lines.append(f"{'total':<16} {est.total / GIB:>7.2f}  at the peak: {est.phase} (each row at that moment)")
    if t.fp8 != "none":  # doc/overview.md, FP8
        lines.append(f"train.fp8 ({t.fp8}) is not counted: the figures are memory as without FP8 (its "
                     f"float8 copies of activations and weights are not in them)")
    lines += alternatives(cfg, est.world_size, shape, gpu[1] * (1 - HEADROOM) if gpu else None)
    if gpu is None:
        return lines + ["no GPU memory to compare with: pass --gpu-mem GIB, or name the GPU in "
                        "slurm.extra_args (--gres=gpu:h100:4)"], None
    source, gib = gpu
    usable = gib * (1 - HEADROOM)
    room = (f"{usable:.1f} GiB usable of {gib:g} GiB ({source}; {HEADROOM:.0%} kept for the CUDA "
            f"context, NCCL and fragmentation)")
    best = largest_micro_batch(cfg, usable * GIB, est.world_size, shape)
    if best is None:
        fixes = ([] if cfg.parallel.strategy == "fsdp" else ["shard over more GPUs (parallel.strategy: fsdp)"]) + \
            ([] if cfg.model.activation_checkpointing and cfg.model.activation_checkpointing_every == 1 else
             ["checkpoint every layer (model.activation_checkpointing: true, activation_checkpointing_every: 1)"]) + \
            ["split the layers over more GPUs (parallel.tp)", "or shorten data.seq_len"]
        return lines + [f"does not fit: {est.total / GIB:.2f} GiB > {room}, even at micro batch 1; "
                        f"{', '.join(fixes)}"], False
    fits = est.total <= usable * GIB
    verdict = "fits: {:.2f} GiB <=" if fits else "does NOT fit: {:.2f} GiB >"
    dp = dims_of(cfg, est.world_size).dp
    share = (f"the global batch per GPU, {t.global_batch_size} / {est.world_size}" if dp == est.world_size else
             f"the global batch per data-parallel rank, {t.global_batch_size} / {dp}")
    return lines + [f"{verdict.format(est.total / GIB)} {room}",
                    f"largest micro batch that fits: {best} (train.micro_batch_size is {t.micro_batch_size}; "
                    f"it must divide {share} = {t.global_batch_size // dp})"], fits



def alternatives(cfg: Config, world: int, shape: ModelShape, usable_gib: float | None) -> list[str]:
    """One line per strategy (ddp, fsdp, hsdp) x activation checkpointing (off, every layer),
    then fsdp x tensor parallel (tp 2, 4, 8 where a node's GPUs and the model allow) and the
    largest of those x context parallel 2: the total per GPU at this world size and micro batch,
    to see what another layout would need."""
    import dataclasses

    per_node = cfg.slurm.procs_per_node or cfg.slurm.gpus_per_node or 1
    model = {"model_type": shape.model_type, "num_attention_heads": shape.heads,
             "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab, "intermediate_size": shape.intermediate}
    valid = ParallelDims.candidates(cfg, world, per_node, shape.model_type, model)  # the layout's list
    plain = [d for d in valid if d.tensor == d.context == 1]
    tps = [d for d in valid if d.strategy == "fsdp" and d.context == 1 and d.tensor in (2, 4, 8)]
    widest = [d for d in valid if d.strategy == "fsdp" and d.context == 2 and tps and d.tensor == tps[-1].tensor]
    layouts = [(d.strategy, d.tensor, d.context) for d in plain + tps + widest]
    cells = []
    for strategy, tp, cp in layouts:
        for ac in (False, True):
            alt = dataclasses.replace(
                cfg, parallel=dataclasses.replace(cfg.parallel, strategy=strategy, tp=tp, cp=cp, shard_size=(
                    cfg.parallel.shard_size if strategy == "hsdp" else None), pp=1, pp_stages_per_rank=None, ep=1),
                model=dataclasses.replace(cfg.model, activation_checkpointing=ac,
                                          activation_checkpointing_every=1))
            try:
                total = estimate(alt, world, shape=shape).total / GIB
            except UserError:  # hsdp's shard size does not divide this world size
                continue
            fits = "" if usable_gib is None else (" fits" if total <= usable_gib else " too big")
            name = f"{layout_name(strategy, tp, cp)}{' + checkpointing' if ac else ''}"
            if strategy == "hsdp":
                name += f" ({shard_size(alt, world)}-way shards)"
            cells.append(f"  {name:<38} {total:>8.2f} GiB{fits}")
    for ep in (2, 4, 8) if shape.experts else ():  # fsdp x expert parallel, checkpointing every layer
        alt = dataclasses.replace(cfg, parallel=dataclasses.replace(
            cfg.parallel, strategy="fsdp", tp=1, cp=1, pp=1, pp_stages_per_rank=None, shard_size=None, ep=ep),
            model=dataclasses.replace(cfg.model, activation_checkpointing=True, activation_checkpointing_every=1))
        if world % ep or shape.experts % ep:
            continue
        total = estimate(alt, world, shape=shape).total / GIB
        fits = "" if usable_gib is None else (" fits" if total <= usable_gib else " too big")
        cells.append(f"  {layout_name('fsdp', ep=ep) + ' + checkpointing':<38} {total:>8.2f} GiB{fits}")
    for pp in (2, 4, 8):  # fsdp (ddp with one replica) x pipeline, 1F1B: the stages' worst rank
        if world % pp or shape.layers + 2 < pp or shape.model_type not in PIPELINE_FAMILIES:
            continue
        strategy = "ddp" if world == pp else "fsdp"
        alt = dataclasses.replace(cfg, parallel=dataclasses.replace(
            cfg.parallel, strategy=strategy, tp=1, cp=1, pp=pp, pp_schedule="1f1b", pp_stages_per_rank=None,
            shard_size=None, ep=1))
        try:
            total = estimate(alt, world, shape=shape).total / GIB
        except UserError:
            continue
        fits = "" if usable_gib is None else (" fits" if total <= usable_gib else " too big")
        cells.append(f"  {layout_name(strategy, pp=pp, schedule='1f1b'):<38} {total:>8.2f} GiB{fits}")
    return [f"other setups, {world} ranks (total per GPU):", *cells]


def _descriptions(cfg: Config, est: Estimate, shape: ModelShape) -> dict[str, str]:
    """The table's last column: what each row holds, for this strategy and precision."""
    precision = cfg.train.precision
    if cfg.parallel.strategy == "ddp":
        where, grads = "a full copy per GPU", "fp32, DDP's all-reduce buckets"
        copies = "none (fp32)" if precision == "fp32" else f"{precision} weights cached by autocast"
        comm = "none: NCCL reduces the buckets in place"
    else:
        replicas = dims_of(cfg, est.world_size).replicate
        split = f"tp {est.tp}'s split" if est.tp > 1 else ""
        where = ((f"sharded over {est.shard_size} GPUs" + (f" after {split}" if split else "") if est.shard_size > 1
                  else "not sharded" + (f" beyond {split}" if split else ""))  # hsdp's shard_size 1
                 + (f", {replicas} replicas" if replicas > 1 else ""))
        grads = "fp32 shards; unsharded ones in flight (the head's, a layer's)"
        dims = dims_of(cfg, est.world_size)
        if not cfg.parallel.reduce_every_micro_batch and dims.accumulation(cfg.train.global_batch_size, est.micro_batch) > 1:
            grads = "fp32 shards, and every layer's unsharded until the last micro-batch (reduced once a step)"
        copies = (f"{precision}: the root (embeddings, head) and the layers gathered now" if
                  cfg.parallel.reshard_after_forward else
                  f"{precision}: every layer, gathered from its forward to its backward (not resharded)")
        comm = "the prefetched layer's all-gather, a reduce-scatter input"
    pipelined = est.phase.startswith("pipeline rank")
    if pipelined and cfg.parallel.strategy != "ddp":
        grads = ("fp32 shards, and the stage's unsharded until the last micro-batch" if
                 cfg.parallel.pp_schedule != "interleaved_1f1b" else "fp32 shards")
        copies, comm = f"{precision}: the stage's layers, gathered for the whole step", "none outside the stage's sends"
    if est.phase == MUON_STEP:
        comm = "Muon's fp32 updates and results, a stack's whole matrices and Newton-Schulz's work"
    stored = "fp32"
    if shape.trainable < shape.params and precision != "fp32":  # parallel/wrap.store_frozen_base
        stored = (f"adapters fp32, the frozen base {precision}"
                  + (" (its linear layers)" if cfg.parallel.strategy == "ddp" else ""))
    head = "the head's fp32 gradient" if shape.head_trainable else "the frozen head: no gradient"
    return {"parameters": f"{stored}, {where}", "gradients": grads,
            "optimizer": OPTIMIZERS[cfg.train.optimizer].about, "param_copies": copies,
            "activations": ("the micro-batches in flight's, kept for backward; backward's own" if pipelined else
                            "kept for backward, a recomputed layer, backward's own"),
            "loss": f"a chunk's logits, {head}" if shape.chunked else "the full logits",
            "comm": comm}
