"""Checks against the disk and the environment: the model folder, the tokenizer, the data's
files and columns, a prepared folder, the checkpoint a run resumes from, installed extras."""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

from ..data.sources import (by_source, file_suffix, fingerprint, given_prepared, is_glob, is_hub_id, is_split_name,
                            local_path, on_disk, source_files, source_record, tokenizer_sha256, tokenizer_source)
from ..errors import UserError
from ..files import read_json
from ..model.moe import problems as moe_problems, stored_problems
from ..optimizers import OPTIMIZERS
from ..parallel.tensor import CONFIG_DEFAULTS
from ..parallel.dims import ParallelDims
from ..rundir import CHECKPOINTS, META, latest_checkpoint
from .schema import NOT_PATHS, Config, DataConfig, LoraSpec


def check_environment(cfg: Config, written: dict | None = None) -> list[str]:
    """Problems the disk or the environment shows; [] when the run finds what it needs.
    written: path keys as the file (or --set) wrote them, for messages that show both forms."""
    p, t = [], cfg.train
    if t.resume not in NOT_PATHS and not Path(t.resume).is_dir():
        p.append(f"train.resume: must be auto, none, or a checkpoint folder "
                 f"({_got('train.resume', t.resume, written)})")
    p += _check_tracking(cfg)
    p += _check_model(cfg, written)
    p += _check_attention(cfg)
    p += _check_fp8(cfg)
    p += _check_resume(cfg)
    for source in cfg.data.sources:  # each as a data section of its own, its lines named by its keys
        one = cfg.for_source(source)
        manifest = given_prepared(one)
        # The path keys it takes from the data section show as written (data.dataset: all of them).
        inherited = {k: raw for k, raw in (written or {}).items() if source.key(k.removeprefix("data.")) == k}
        lines = _check_prepared(one, manifest) if manifest else _check_data(one.data, Path(cfg.path).parent, inherited)
        for line in lines:
            key, _, rest = line.partition(":")
            rest = rest.replace("data.prepared:", f"{source.key('prepared')}:")  # the fix names this source's
            line = f"{source.key(key.removeprefix('data.'))}:{rest}" if key.startswith("data.") else line
            p += [line] if line not in p else []
    return p


def _check_prepared(cfg: Config, manifest: dict) -> list[str]:
    """A prepared folder to train from (data.prepared) instead of the source: its tokenizer and
    its kind of data."""
    d, made, source = cfg.data, manifest.get("samples"), tokenizer_source(cfg)
    tok_dir = local_path(source, "models") if source else None
    made_with = manifest["tokenizer"].get("sha256")  # None: a folder from before it was recorded
    if made_with and tok_dir and (tok_dir / "tokenizer.json").exists() and tokenizer_sha256(tok_dir) != made_with:
        return [f"data.prepared: {d.prepared} was tokenized by {manifest['tokenizer']['path']}, another "
                f"tokenizer than this model's ({tok_dir}); set data.prepared: null to prepare the "
                f"data with this one"]
    if made is None and d.samples:
        return [f"data.prepared: {d.prepared} holds a text stream, not {d.format} samples; prepare "
                f"the samples (set data.prepared: null) or set data.format: text"]
    if made is not None and not d.samples:
        return [f"data.prepared: {d.prepared} holds fine-tuning samples, not a text stream "
                f"(got data.format text); set data.format to the samples' format"]
    if made is not None and made["seq_len"] != d.seq_len:
        return [f"data.seq_len: {d.prepared} holds samples in rows of {made['seq_len']} tokens "
                f"(got {d.seq_len}); set data.seq_len: {made['seq_len']}, or data.prepared: null "
                f"to prepare them again"]
    recorded, now = manifest.get("source", {}), source_record(cfg)
    differ = [f"{key} {recorded[key]!r} -> {now[key]!r}" for key in recorded if key in now and recorded[key] != now[key]]
    if differ:  # an option (a --set, a sweep's grid) the given folder was not made with
        return [f"data.prepared: {d.prepared} was prepared with other data options ({', '.join(differ)}); "
                f"set them as the folder has them, or data.prepared: null to prepare the data anew"]
    return []


def _check_data(d: DataConfig, base: Path, written: dict | None = None) -> list[str]:
    """The dataset and validation sources, as far as their names and files tell."""
    p, files = [], {}
    for key in ("dataset", "validation"):
        value = getattr(d, key)
        if value is None or (key == "validation" and is_split_name(value)):
            continue
        if is_glob(value):
            files[key] = source_files(value)
            if not files[key]:
                p.append(f"data.{key}: no file matches the pattern "
                         f"({_got(f'data.{key}', value, written)})")
        elif key == "dataset" and is_hub_id(value):
            continue  # a hub id: download_data_model.sh fetches it, check-config notes it
        elif not Path(base, value).exists():  # relative: a missing path read as a hub id
            p.append(f"data.{key}: no such file or folder "
                     f"({_got(f'data.{key}', str(Path(base, value)), written)})")
        else:
            files[key] = source_files(value)
        other = [f.name for f in files.get(key) or [] if file_suffix(f) != ".txt"]
        if d.text_unit != "line" and other:
            p.append(f"data.text_unit: only for .txt files (got {d.text_unit} for {other[0]})")
        if files.get(key):
            p += _check_columns(files[key][0], d)
    if d.validation and is_split_name(d.validation):
        if files.get("dataset"):
            p.append(f"data.validation: a split name, but data.dataset is a file with no splits; "
                     f"give the validation file's path instead (got {d.validation!r})")
        elif d.validation == d.split:
            p.append(f"data.validation: must differ from data.split, or evaluation reads training "
                     f"documents (got {d.validation!r})")
    return p


def _check_columns(path: Path, d: DataConfig) -> list[str]:
    """The format's columns in the first record of a jsonl or csv file (plain or compressed): a
    wrong data.text_field (messages_field, ...) fails here, before any job is queued, not in the
    prepare job."""
    import bz2
    import csv
    import gzip
    import lzma
    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(path.suffix, open)
    kind = file_suffix(path)
    if kind not in (".jsonl", ".csv"):
        return []  # txt has no columns; json, parquet and folders are checked by prepare
    try:
        # Bytes that are not UTF-8 are prepare's to name (file and line) or replace
        # (data.encoding_errors): here, only the first record's columns count.
        with opener(path, "rt", encoding="utf-8", errors="replace", newline="") as f:
            if kind == ".csv":
                columns = next(csv.reader(f), [])
                first = None
            else:
                line = next((x for x in f if x.strip()), "")
                first = json.loads(line) if line else None
                columns = list(first) if isinstance(first, dict) else []
    except (OSError, ValueError, EOFError, UnicodeDecodeError, lzma.LZMAError) as e:
        return [f"data.dataset: cannot read {path} as {kind[1:]} ({type(e).__name__})"]
    for key, column in d.columns.items():
        if columns and column not in columns:
            return [f"data.{key}: no column {column!r} in {path} (columns: "
                    f"{', '.join(map(str, columns[:10]))})"]
        want = list if key == "messages_field" else str
        if isinstance(first, dict) and column in first and not isinstance(first[column], want):
            return [f"data.{key}: column {column!r} of {path} holds {type(first[column]).__name__}, "
                    f"not {'a list of messages' if want is list else 'text'}; choose a column of "
                    f"{'{role, content} lists' if want is list else 'strings'}"]
    return []


def _check_attention(cfg: Config) -> list[str]:
    """flash_attention_2 needs the flash-attn package: a job would fail on its first forward.
    And it keeps the samples (documents) of a packed row apart only in a batch of one row:
    transformers finds them from the position ids where the batch size is 1 (the varlen kernel;
    _is_packed_sequence in modeling_flash_attention_utils.py is False for any other), and
    otherwise attends causally over the whole row, across them."""
    d, t, p = cfg.data, cfg.train, []
    if cfg.model.attn_implementation != "flash_attention_2":
        return p
    if find_spec("flash_attn") is None:
        p.append("model.attn_implementation: flash_attention_2 needs the flash-attn package, which is "
                 "not installed in this environment; install it (pip install flash-attn) or use sdpa")
    packed = ("the samples packed in a row (data.packing)" if d.samples and d.packing else
              "the documents of a row (data.document_masking)" if not d.samples and d.document_masking
              else None)
    if packed and t.micro_batch_size > 1:
        p.append(f"model.attn_implementation: flash_attention_2 lets {packed} attend to each other "
                 f"when train.micro_batch_size > 1 (got {t.micro_batch_size}; it separates them only "
                 f"in batches of one row); set train.micro_batch_size: 1, or use sdpa")
    return p


def _check_fp8(cfg: Config) -> list[str]:
    """train.fp8 needs torchao (an optional extra): found missing here, not at the job's start."""
    if cfg.train.fp8 == "none" or find_spec("torchao") is not None:
        return []
    return ["train.fp8: needs torchao, which is not installed in this environment; install it with: "
            "pip install 'llmtrain[fp8]' (or bash setup.sh --extras fp8), or set train.fp8: none"]


def _check_tracking(cfg: Config) -> list[str]:
    """Tracking packages are optional extras: a config that asks for one must find it installed
    (here, on the login node, rather than an hour into the queue)."""
    p, mc, pc = [], cfg.metrics, cfg.profile
    try:
        wandb = mc.wandb_spec
    except UserError as e:
        p.append(str(e))
        wandb = None
    for key, wanted, package in (("tensorboard", mc.tensorboard, "tensorboard"),
                                 ("wandb", wandb is not None, "wandb")):
        if wanted and find_spec(package) is None:
            p.append(f"metrics.{key}: the {package} package is not installed in this environment; "
                     f"install it with: pip install 'llmtrain[{package}]' (or bash setup.sh --extras "
                     f"{package}), or turn metrics.{key} off")
    if pc.start_step is not None and pc.start_step < 1:
        p.append(f"profile.start_step: must be >= 1 (got {pc.start_step})")
    if pc.steps < 1:
        p.append(f"profile.steps: must be >= 1 (got {pc.steps})")
    try:
        pc.rank_set
    except ValueError as e:
        p.append(f"profile.ranks: {e}, like [0, 8] (got {pc.ranks!r})")
    return p


def _check_resume(cfg: Config) -> list[str]:
    """The run's newest checkpoint must fit the config, or the job would be refused at start."""
    if cfg.train.resume != "auto":
        return []
    folder = cfg.run_dir / CHECKPOINTS
    pointer = latest_checkpoint(folder)
    try:
        meta = json.loads((folder / pointer / META).read_text()) if pointer else {}
    except (OSError, ValueError):
        return []  # no checkpoint yet (or a damaged one: the trainer falls back and says so)
    saved = meta.get("compat", {})
    now = {"seq_len": cfg.data.seq_len, "global_batch_size": cfg.train.global_batch_size,
           "lora": cfg.model.lora, "optimizer": cfg.train.optimizer}
    if cfg.train.optimizer not in OPTIMIZERS:  # config/rules.py names it; a mismatch would be noise
        del now["optimizer"]
    fix = "use a new run.name, or set train.resume: none to start over"
    p = [f"train.resume: checkpoint {folder / pointer} does not match this config: {key} differs "
         f"({saved[key]!r} -> {value!r}); {fix}" for key, value in now.items()
         if key in saved and saved[key] != value]
    if "data_fingerprint" in saved:
        prints = {s.name: _fingerprint(cfg.for_source(s)) for s in cfg.data.sources}
        now = None if None in prints.values() else by_source(prints)
        if now not in (None, saved["data_fingerprint"]):
            p.append(f"train.resume: checkpoint {folder / pointer} was trained on other data (the "
                     f"dataset's files, the tokenizer or the data options changed); {fix}")
    return p


def _fingerprint(cfg: Config) -> str | None:
    """The fingerprint of the data a run reads (data.prepared's, else its source's); None where
    the source is not on disk."""
    if manifest := given_prepared(cfg):
        return manifest["fingerprint"]
    return fingerprint(cfg) if on_disk(cfg.data.dataset, "datasets") else None


def _check_model(cfg: Config, written: dict | None = None) -> list[str]:
    m, p = cfg.model, []
    if m.lora is not None:
        try:
            LoraSpec.parse(m.lora)
        except UserError as e:
            p.append(str(e))
        if m.name_or_path is None:
            p.append("model.lora: adapters train on a pretrained model: set model.name_or_path "
                     "(got model.architecture, a model from scratch)")
    if (m.name_or_path is None) == (m.architecture is None):
        p.append("model.name_or_path: set exactly one of model.name_or_path (pretrained) "
                 "and model.architecture (from scratch)")
        return p
    if m.architecture is not None:
        if not isinstance(m.architecture.get("model_type"), str):
            p.append("model.architecture.model_type: required, e.g. llama (got "
                     f"{m.architecture.get('model_type')!r})")
        if m.tokenizer is None:
            p.append("model.tokenizer: required when training from model.architecture")
        model_cfg = m.architecture
    else:
        model_cfg = read_json(local_path(m.name_or_path, "models") / "config.json")
        if model_cfg is None and not is_hub_id(m.name_or_path):
            p.append(f"model.name_or_path: no Hugging Face model folder with a config.json "
                     f"({_got('model.name_or_path', m.name_or_path, written)})")

    tok_src = tokenizer_source(cfg)
    tok_file = local_path(tok_src, "models") / "tokenizer.json" if tok_src else None
    tok = read_json(tok_file) if tok_file else None
    if tok_src and tok is None and not is_hub_id(tok_src):
        key = "model.tokenizer" if m.tokenizer else "model.name_or_path"
        missing = "no such folder" if not tok_file.parent.is_dir() else "no fast tokenizer (tokenizer.json) in the folder"
        p.append(f"model.tokenizer: {missing} ({_got(key, tok_src, written)})")

    if model_cfg:
        p += _check_heads(model_cfg, "model.architecture" if m.architecture is not None else "model.name_or_path")
        p += ParallelDims.from_config(cfg, cfg.world_size).model_problems(model_cfg.get("model_type"), model_cfg)
        p += moe_problems(model_cfg.get("model_type"), model_cfg)
        if m.name_or_path is not None:
            folder = local_path(m.name_or_path, "models")
            p += stored_problems(model_cfg.get("model_type"), model_cfg, _stored_names(folder), folder)
        p += _check_layer_kinds(model_cfg, "model.architecture.layer_types" if m.architecture is not None
                                else "model.name_or_path")
        max_pos = model_cfg.get("max_position_embeddings")
        if isinstance(max_pos, int) and cfg.data.seq_len > max_pos:
            p.append(f"data.seq_len: must be <= the model's max_position_embeddings "
                     f"(got {cfg.data.seq_len} > {max_pos})")
        vocab = model_cfg.get("vocab_size")
        if tok and isinstance(vocab, int) and tokenizer_vocab_size(tok) > vocab:
            p.append(f"model.tokenizer: vocabulary of {tokenizer_vocab_size(tok)} tokens does not fit "
                     f"the model's vocab_size {vocab}")
    return p


def _stored_names(folder: Path) -> set[str]:
    """The tensor names of a model folder's safetensors weights, from the index or the file's
    header (8 bytes of length, then JSON): no torch, no tensor read. Empty where neither is."""
    index = read_json(folder / "model.safetensors.index.json")
    if index is not None:
        return set(index.get("weight_map", {}))
    try:
        with open(folder / "model.safetensors", "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (OSError, ValueError):
        return set()
    return set(header) - {"__metadata__"}


def _check_heads(model_cfg: dict, key: str) -> list[str]:
    """Attention's heads must split the hidden size (unless head_dim says their width) and be
    grouped evenly over the key/value heads: transformers builds such a model and fails on its
    first forward, an hour into the queue, with 86 lines of traceback."""
    given = {**CONFIG_DEFAULTS.get(model_cfg.get("model_type"), {}), **model_cfg}
    heads, kv, hidden = (given.get(k) for k in ("num_attention_heads", "num_key_value_heads", "hidden_size"))
    if not isinstance(heads, int) or isinstance(heads, bool):
        return []
    if heads < 1:
        return [f"{key}: num_attention_heads must be >= 1 (got {heads})"]
    if isinstance(hidden, int) and given.get("head_dim") is None and hidden % heads:
        return [f"{key}: hidden_size must be a multiple of num_attention_heads (got {hidden} and {heads}); "
                f"each head takes hidden_size / num_attention_heads features, or set head_dim"]
    if isinstance(kv, int) and (kv < 1 or heads % kv):
        return [f"{key}: num_key_value_heads must divide num_attention_heads (got {kv} and {heads})"]
    return []


def _check_layer_kinds(model_cfg: dict, key: str) -> list[str]:
    """Training attends as transformers does for causal layers, whole or within a sliding window
    (model/attention.layer_windows); a layer of another kind (Llama 4's chunked_attention) would
    silently attend over the whole window."""
    kinds = model_cfg.get("layer_types") or []
    unknown = sorted({str(kind) for kind in kinds} - {"full_attention", "sliding_attention"})
    if not unknown:
        return []
    return [f"{key}: layers of kind {', '.join(unknown)}, which llmtrain's attention cannot honour (it attends "
            f"as full_attention and sliding_attention layers do); choose a model without them"]


def tokenizer_vocab_size(tokenizer_json: dict) -> int:
    """len(tokenizer) computed from tokenizer.json: the model vocab plus added tokens."""
    vocab = tokenizer_json.get("model", {}).get("vocab", {})
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
    ids |= {t["id"] for t in tokenizer_json.get("added_tokens", [])}
    return max(ids) + 1 if ids else 0


def _got(key: str, value: str, written: dict | None) -> str:
    """`got '/abs/x.txt'`, or for a path written otherwise (relative to the config's folder,
    ~, ${VAR}) both forms: `got './x.txt', resolved to /abs/x.txt`."""
    raw = (written or {}).get(key)
    if raw is None or raw == value:
        return f"got {value!r}"
    return f"got {raw!r}, resolved to {value}"
