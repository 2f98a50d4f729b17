"""Tokenizer and Hugging Face causal LM, from a local folder or an inline architecture.

Nothing here touches the network or torch.distributed. `model_config` describes the model,
`build_model(..., device="meta")` gives its skeleton with no memory behind it; parallel/wrap.py
fills each rank's shards (seeded init or the pretrained folder's safetensors).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from ..config import Config
from ..data.tokenizer import local_model_dir


VOCAB_MULTIPLE = 64  # from scratch, the vocabulary is rounded up to this: faster matmuls


def model_config(cfg: Config, tokenizer) -> PretrainedConfig:
    m = cfg.model
    if m.name_or_path is not None:
        config = AutoConfig.from_pretrained(local_model_dir(m.name_or_path, "model.name_or_path"))
    else:
        arch = dict(m.architecture)
        arch.setdefault("vocab_size", -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)
        arch.setdefault("max_position_embeddings", cfg.data.seq_len)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            arch.setdefault(key, getattr(tokenizer, key))
        config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    config.use_cache = False  # training: no KV cache
    return config


def vocab_padding(cfg: Config, config: PretrainedConfig, tokenizer) -> str | None:
    """The log line stating the vocabulary rounding, when model_config chose the size."""
    if cfg.model.architecture is None or "vocab_size" in cfg.model.architecture:
        return None
    extra = config.vocab_size - len(tokenizer)
    return (f"vocab_size {config.vocab_size}: the tokenizer's {len(tokenizer)} tokens rounded up "
            f"to a multiple of {VOCAB_MULTIPLE} for faster matmuls ({extra} rows no token uses); "
            f"set model.architecture.vocab_size to choose another")


def build_model(config: PretrainedConfig, cfg: Config, device: str | torch.device,
                buffers: str | None = None):
    """The model's skeleton on `device` ("meta" allocates nothing), fp32.

    buffers="cpu" with device="meta": parameters on meta, buffers (rotary inv_freq, ...) real
    on CPU, computed as the model's __init__ computes them.
    """
    if buffers is not None:
        from accelerate import init_empty_weights
        context = init_empty_weights(include_buffers=False)
    else:
        context = torch.device(device)
    with context, quiet_torchao():
        return AutoModelForCausalLM.from_config(
            config, attn_implementation=cfg.model.attn_implementation, dtype=torch.float32
        )


@contextlib.contextmanager
def quiet_torchao():
    """A train.fp8 run imports torchao (transformers with its modeling code, parallel/float8.py),
    and on a CPU-only node torchao 0.18 warns that its CUDA kernels' libraries do not load (float8
    training uses none: its matmul is torch._scaled_mm on a GPU, an fp32 matmul on a CPU) and
    torch 2.13 that it registers enums the old way: four lines of noise in the run's log. Errors still show. (Other runs keep
    torchao out of the process: cli.without_torchao.)"""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def pretrained_dir(cfg: Config):
    return local_model_dir(cfg.model.name_or_path, "model.name_or_path")


class Absent(torch.nn.Module):
    """A part of the model another pipeline stage holds (parallel/pipeline.py): no parameters,
    and its input (the hidden states) passes through. Decoder layers are called with keyword
    arguments (attention_mask=...), which it takes and ignores. In place of an embedding or a
    head, its `weight` is None (code that asks which parameter is the head finds none)."""

    weight = None

    def forward(self, hidden_states=None, *args, **kwargs):
        return hidden_states


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks, found by the class names HF lists in _no_split_modules."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


def num_params(model: torch.nn.Module, trainable: bool = False) -> int:
    """Parameters (each tied one once); `trainable`: only those that train."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)


def flops_per_token(config: PretrainedConfig, n_params: int, seq_len: int,
                    trainable: int | None = None) -> float:
    """Training FLOPs per token, forward and backward: 6 per trained parameter that multiplies
    (forward, the input's gradient, the weight's), 4 per frozen one (LoRA's base: no weight
    gradient), plus 12 x layers x hidden x seq_len for the attention scores and their weighted
    sum (PaLM, appendix B; no discount for the causal mask). The input embedding is a lookup,
    not a matmul: left out, unless it is tied to the output head, whose matmul it is.
    `trainable`: how many of the n_params train (None: all); the frozen rest includes the
    embedding table. The derivation and a hand check: doc/benchmarks.md."""
    layers = getattr(config, "num_hidden_layers", 0)
    hidden = getattr(config, "hidden_size", 0)
    tied = getattr(config, "tie_word_embeddings", False)
    lookup = 0 if tied else getattr(config, "vocab_size", 0) * hidden
    frozen = max(0, n_params - (n_params if trainable is None else trainable) - lookup)
    return 6 * (n_params - lookup) - 2 * frozen + 12 * layers * hidden * seq_len


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside DDP's wrapper (FSDP2 wraps in place)."""
    from torch.nn.parallel import DistributedDataParallel
    return model.module if isinstance(model, DistributedDataParallel) else model
