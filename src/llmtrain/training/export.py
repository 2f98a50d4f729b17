"""`llmtrain export` and `llmtrain generate`: a checkpoint as a plain Hugging Face model.

    llmtrain export --run-dir DIR [--step N] --out DIR [--dtype fp32|bf16|fp16] [--merge]
    llmtrain generate --model DIR | --run-dir DIR [--step N] --prompt TEXT [--max-new-tokens N]
                      [--temperature T] [--seed S]

Export reads the DCP files in one process (`no_dist`): DCP reshards whatever world size wrote
them into full tensors. The result is made for use, not for more training: it loads with
`AutoModelForCausalLM.from_pretrained` without llmtrain, generates with the KV cache on, has a
generation_config.json that `model.generate(**inputs)` runs with as it is (sampling, the
tokenizer's special tokens), and every file is readable by the group (a shared filesystem).

dtype: fp32 by default, the trained weights bit for bit (training keeps fp32 master weights;
bf16/fp16 are compute precisions); bf16 halves the folder and is what serving usually loads.

A LoRA run exports its adapters as peft writes them (adapter_config.json naming the base's
folder, adapter_model.safetensors): `PeftModel.from_pretrained(base, out)` loads them; with
--merge, the adapters folded into the base's weights, a plain model folder.

Memory: export never holds the model. An adapter export reads the adapters alone (the base is
not opened); a model folder is written one decoder layer at a time (shards.py), so the peak is
about one layer in fp32, not the model (a 70B's was 280 GB and more).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from ..config import LoraSpec, UserError
from ..model.lora import apply_lora, is_adapter, peft_config
from ..model.shards import Checkpoint, write_weights
from ..optimizers import to_eval_weights
from ..rundir import BUFFERS, META, resolve_checkpoint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# What `model.generate(**inputs)` on an export does when asked nothing else (and what
# `llmtrain generate` does without --temperature/--max-new-tokens): temperature sampling over
# the whole vocabulary (top_k 0: HF's default would be 50).
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 0, "max_new_tokens": 64}


def load_checkpoint_model(run_dir: Path, step: int | None = None):
    """(model, tokenizer) of a run's checkpoint on CPU, in eval mode, set up for generation (KV
    cache on, the export's generation config): a full run's fp32 weights; a LoRA run's base
    from the base's folder in the dtype it is stored in (a bf16 base is not doubled to fp32),
    with the checkpoint's adapters on it (lora.py), cast to that dtype too."""
    ckpt = resolve_checkpoint(Path(run_dir), step)
    return _load(ckpt, *lora_of(ckpt))


def _load(ckpt: Path, spec: LoraSpec | None, base: Path | None):
    if spec is not None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
        apply_lora(model, spec)
        state = {"model": {k: v for k, v in model.state_dict().items() if is_adapter(k)}}
    else:
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
    # the weights to evaluate (schedule-free's average), in place; its state read only where needed
    to_eval_weights(json.loads((ckpt / META).read_text()), state["model"],
                    lambda key: Checkpoint(ckpt).read_state(list(state["model"]), key))
    if spec is None:
        buffers = torch.load(ckpt / BUFFERS, weights_only=True)
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])
    else:  # the layers' inputs arrive in the base's dtype; the adapters (fp32) must match them
        model.to(model.get_input_embeddings().weight.dtype)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    # Checkpoints carry the training config, where model/build.py turns the KV cache off; without it
    # generate recomputes the whole sequence for every token (56x slower for 200 tokens).
    model.config.use_cache = True
    model.generation_config = generation_config(tokenizer, model.config)
    return model.eval(), tokenizer


def generation_config(tokenizer, config) -> GenerationConfig:
    """SAMPLING with the tokenizer's special tokens (the model config's where it has none). A
    tokenizer without a pad token pads with eos, as HF generate would after a warning per call."""
    def token(name: str):
        tok = getattr(tokenizer, name, None)
        return tok if tok is not None else getattr(config, name, None)
    eos = token("eos_token_id")
    pad = token("pad_token_id")
    return GenerationConfig(**SAMPLING, use_cache=True, bos_token_id=token("bos_token_id"),
                            eos_token_id=eos, pad_token_id=pad if pad is not None else eos)


def lora_of(ckpt: Path) -> tuple[LoraSpec | None, Path | None]:
    """A checkpoint's LoRA settings and its base model's folder (None, None: full training)."""
    meta = json.loads((ckpt / META).read_text())
    raw = meta.get("compat", {}).get("lora")
    if raw is None:
        return None, None
    return LoraSpec.parse(raw), Path(meta["base_model"])


def export(run_dir: Path, out: Path, step: int | None = None, dtype: str = "fp32", merge: bool = False) -> Path:
    """The checkpoint as a model folder; a LoRA run's as a peft adapter folder, or with `merge`
    as a model folder with the adapters folded into the weights."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out: {out} exists and is not empty; choose a new folder")
    ckpt = resolve_checkpoint(Path(run_dir), step)
    spec, base = lora_of(ckpt)
    if merge and spec is None:
        raise UserError(f"--merge: {run_dir} is not a LoRA run (its checkpoints hold the whole model); "
                        f"export it without --merge")
    checkpoint = Checkpoint(ckpt)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    new_parents = [p for p in out.parents if not p.exists()]
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if spec is not None and not merge:
        from safetensors.torch import save_file
        adapters = checkpoint.read([n for n in checkpoint.tensors if is_adapter(n)])
        save_file({f"base_model.model.{n}": t.to(DTYPES[dtype]).contiguous() for n, t in adapters.items()},
                  tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(peft_config(spec, str(base)), indent=2) + "\n")
    else:
        config = AutoConfig.from_pretrained(base if spec is not None else ckpt)
        with torch.device("meta"):  # the names, shapes and ties, allocating nothing
            skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        write_weights(tmp, checkpoint, skeleton, DTYPES[dtype], (spec, base) if spec is not None else None)
        config.use_cache = True  # the training config turns it off (model/build.py)
        config.dtype = str(DTYPES[dtype]).removeprefix("torch.")  # as save_pretrained records it
        config.architectures = [type(skeleton).__name__]
        config.save_pretrained(tmp)
        generation_config(tokenizer, config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _share_with_group(tmp)
    for parent in new_parents:
        _share_with_group(parent, tree=False)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


def _share_with_group(path: Path, tree: bool = True) -> None:
    """Let the group read what export wrote, whatever the umask: files g+r, folders g+rx; others
    get what the umask allows (0644/0755 under the usual 022). safetensors writes its file 0600
    (through a private temporary file) even under umask 022, so one teammate's export was
    unreadable to the rest of the lab on the shared filesystem."""
    umask = os.umask(0)
    os.umask(umask)
    paths = [path, *Path(path).rglob("*")] if tree else [path]
    for p in paths:
        if p.is_symlink():
            continue
        folder = p.is_dir()
        mode = (0o755 if folder else 0o644) & ~umask | (0o750 if folder else 0o640)
        p.chmod(stat.S_IMODE(p.stat().st_mode) | mode)


def generate(model, tokenizer, prompt: str, max_new_tokens: int | None = None,
             temperature: float | None = None, seed: int = 0, chat: bool = False) -> str:
    """Complete `prompt`; what is not given comes from the model's generation config (for a
    folder without one: SAMPLING). chat: the prompt is a user message rendered with the chat
    template (and its generation prompt); the reply alone comes back, up to its end of turn."""
    torch.manual_seed(seed)
    kwargs = {}
    if chat:
        if not tokenizer.chat_template:
            raise UserError(f"--chat: the tokenizer ({tokenizer.name_or_path}) has no chat template; "
                            f"generate without --chat")
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        kwargs["eos_token_id"] = turn_end_ids(tokenizer)
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    gen = model.generation_config
    if max_new_tokens is None and gen.max_new_tokens is None and gen.max_length is None:
        max_new_tokens = SAMPLING["max_new_tokens"]
    if max_new_tokens is not None:
        kwargs["max_new_tokens"] = max_new_tokens
    if temperature is not None:
        sample = temperature > 0
        kwargs.update(do_sample=sample, temperature=temperature if sample else None, top_k=None,
                      top_p=None)
    if gen.pad_token_id is None:
        kwargs["pad_token_id"] = tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    if chat:
        return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    return tokenizer.decode(out[0], skip_special_tokens=True)


def turn_end_ids(tokenizer) -> list[int]:
    """The tokens that end an assistant turn: the special tokens the chat template puts in the
    part of a reply that trains (<|im_end|>, <|eot_id|>, ...), and EOS."""
    from ..data.samples import chat_sample
    ids, trained = chat_sample(tokenizer, [{"role": "user", "content": "Hi"},
                                           {"role": "assistant", "content": "Hello"}], "completion")
    special = set(tokenizer.all_special_ids)
    ends = [i for i, t in zip(ids, trained) if t and i in special]
    return list(dict.fromkeys(ends + [tokenizer.eos_token_id]))


def load_folder(folder: Path):
    folder = Path(folder)
    if not (folder / "config.json").is_file() and (folder / "adapter_config.json").is_file():
        raise UserError(f"--model: {folder} holds LoRA adapters, not a model; generate from the run "
                        f"(--run-dir RUN_DIR), or pass a merged export (llmtrain export --run-dir RUN_DIR --merge)")
    if not (folder / "config.json").is_file():
        raise UserError(f"--model: {folder} is not a Hugging Face model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(folder)
