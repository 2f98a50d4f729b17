"""`llmtrain export` and `llmtrain generate`: a checkpoint as a plain Hugging Face model.

    llmtrain export --run-dir DIR [--step N] --out DIR
    llmtrain generate --model DIR | --run-dir DIR [--step N] --prompt TEXT [--max-new-tokens N]
                      [--temperature T] [--seed S]

Export reads the DCP files in one process (`no_dist`): DCP reshards whatever world size wrote
them into full tensors. The result loads with `AutoModelForCausalLM.from_pretrained` and needs
no llmtrain.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .checkpoint import BUFFERS, resolve
from .config import UserError


def load_checkpoint_model(run_dir: Path, step: int | None = None):
    """(model, tokenizer) of a run's checkpoint, full weights on CPU, in eval mode."""
    ckpt = resolve(Path(run_dir), step)
    config = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.to_empty(device="cpu")
    if tied:
        model.tie_weights()
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=ckpt, no_dist=True)  # in place, into the model's tensors
    buffers = torch.load(ckpt / BUFFERS, weights_only=True)
    for name, buf in model.named_buffers():
        buf.copy_(buffers[name])
    return model.eval(), AutoTokenizer.from_pretrained(ckpt)


def export(run_dir: Path, out: Path, step: int | None = None) -> Path:
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out: {out} exists and is not empty; choose a new folder")
    model, tokenizer = load_checkpoint_model(run_dir, step)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


def generate(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float,
             seed: int) -> str:
    torch.manual_seed(seed)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                             temperature=temperature if temperature > 0 else None, top_k=None,
                             top_p=None, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def load_folder(folder: Path):
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise UserError(f"--model: {folder} is not a Hugging Face model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder)
