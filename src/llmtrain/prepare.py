"""`llmtrain prepare --config FILE`: dataset -> tokens -> packed memory-mapped shards.

Loads the source with `datasets` (a hub snapshot folder of parquet/jsonl/txt, a save_to_disk
folder, or plain files; plain text is one document per line), holds out a share of documents
for validation, tokenizes with the model's fast tokenizer in parallel, appends EOS after every
document and packs each split into one contiguous token stream cut into shards. Everything is
written into `<final>.tmp-<pid>` and renamed at the end, so a crash never leaves a folder
that looks prepared; a folder whose manifest exists is reused.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from .config import Config, UserError, local_path, tokenizer_source
from .data import FORMAT_VERSION, MANIFEST, fingerprint, prepared_path, read_manifest

SHARD_TOKENS = 1 << 28  # 256M tokens: 512 MiB of uint16 per shard file
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet",
            ".csv": "csv", ".arrow": "arrow"}


class PrepareError(UserError):
    pass


def prepare(cfg: Config, log=print) -> Path:
    fp = fingerprint(cfg)
    final = prepared_path(cfg, fp)
    if read_manifest(final) is not None:
        log(f"prepared data is up to date: {final}")
        return final

    from .model import load_tokenizer

    tok_dir = local_path(tokenizer_source(cfg), "models")
    tokenizer = load_tokenizer(cfg)
    if not tokenizer.is_fast:
        raise PrepareError(f"model.tokenizer: {tok_dir} has no fast tokenizer (tokenizer.json)")
    if tokenizer.eos_token_id is None:
        raise PrepareError(f"model.tokenizer: {tok_dir} defines no eos_token")

    t0 = time.time()
    splits = load_splits(cfg)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise PrepareError(f"data.prepared_dir: cannot create {tmp.parent} ({e.strerror}); "
                           f"choose a writable folder") from None
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32
    manifest = {
        "format": FORMAT_VERSION,
        "fingerprint": fp,
        "source": {"dataset": cfg.data.dataset, "split": cfg.data.split,
                   "text_field": cfg.data.text_field,
                   "validation_fraction": cfg.data.validation_fraction},
        "tokenizer": {"path": str(tok_dir), "vocab_size": len(tokenizer),
                      "eos_token_id": tokenizer.eos_token_id},
        "dtype": np.dtype(dtype).name,
        "splits": {},
    }
    try:
        for split, ds in splits.items():
            tokens = tokenize(ds, tokenizer, cfg)
            manifest["splits"][split] = pack(tokens, tmp, split, dtype)
            manifest["splits"][split]["dataset_fingerprint"] = ds._fingerprint
        manifest["seconds"] = round(time.time() - t0, 1)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        try:
            tmp.rename(final)
        except OSError:  # a concurrent prepare finished first: keep its folder
            if read_manifest(final) is None:
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if manifest["splits"]["train"]["tokens"] == 0:
        shutil.rmtree(final, ignore_errors=True)
        raise PrepareError(f"data.dataset: {cfg.data.dataset} has no text in column "
                           f"{cfg.data.text_field!r}")
    counts = ", ".join(f"{s} {m['tokens']:,} tokens" for s, m in manifest["splits"].items())
    log(f"prepared {final} ({counts}) in {time.time() - t0:.1f}s")
    return final


def load_splits(cfg: Config) -> dict:
    """The source dataset split into train and (if asked for) validation documents."""
    import datasets

    src = local_path(cfg.data.dataset, "datasets")
    if not src.exists():
        raise PrepareError(f"data.dataset: {src} does not exist; for a hub dataset run "
                           f"bash download_data_model.sh first")
    if src.is_file() and src.stat().st_size == 0:
        raise PrepareError(f"data.dataset: {src} is empty; point it at a file with documents")
    # We report a load failure ourselves, in one line; the library would log it a second time.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        ds = _load(src, cfg, datasets)
    except (datasets.exceptions.DatasetGenerationError, ValueError, OSError) as e:
        cause = e.__cause__ or e
        raise PrepareError(f"data.dataset: cannot read {src} with the datasets library "
                           f"({type(cause).__name__}: {str(cause).splitlines()[0][:200]})") from None
    if len(ds) == 0:
        raise PrepareError(f"data.dataset: {src} holds no documents (split {cfg.data.split!r})")
    if cfg.data.text_field not in ds.column_names:
        raise PrepareError(f"data.text_field: no column {cfg.data.text_field!r} in "
                           f"{src} (columns: {', '.join(ds.column_names)})")
    ds = ds.select_columns([cfg.data.text_field])
    frac = cfg.data.validation_fraction
    if frac == 0:
        return {"train": ds}
    n_val = max(1, round(frac * len(ds)))
    if n_val >= len(ds):
        raise PrepareError(f"data.validation_fraction: leaves no training documents "
                           f"({len(ds)} documents)")
    parts = ds.train_test_split(test_size=n_val, shuffle=True, seed=0)
    return {"train": parts["train"], "validation": parts["test"]}


def _load(src: Path, cfg: Config, datasets):
    if src.is_dir() and any((src / f).exists() for f in
                            ("state.json", "dataset_info.json", "dataset_dict.json")):
        ds = datasets.load_from_disk(str(src))
        if isinstance(ds, datasets.DatasetDict):
            if cfg.data.split not in ds:
                raise PrepareError(f"data.split: {cfg.data.split!r} not in {sorted(ds)}")
            ds = ds[cfg.data.split]
        return ds
    if src.is_file():
        builder = BUILDERS.get(src.suffix)
        if builder is None:
            raise PrepareError(f"data.dataset: unknown file type {src.suffix!r}; "
                               f"use one of {', '.join(BUILDERS)}")
        return datasets.load_dataset(builder, data_files=str(src), split="train")
    return datasets.load_dataset(str(src), split=cfg.data.split)


def tokenize(ds, tokenizer, cfg: Config):
    field, eos = cfg.data.text_field, tokenizer.eos_token_id

    def encode(batch):
        texts = [t or "" for t in batch[field]]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return {"ids": [x + [eos] for x in ids]}

    num_proc = cfg.data.num_proc or min(16, os.cpu_count() or 1)
    num_proc = max(1, min(num_proc, len(ds) // 1000 or 1))  # tiny datasets: no worker pool
    return ds.map(encode, batched=True, num_proc=num_proc if num_proc > 1 else None,
                  remove_columns=[field], desc="tokenize")


def pack(ds, folder: Path, split: str, dtype) -> dict:
    """Concatenate every document's ids into shards of SHARD_TOKENS; return their manifest part."""
    from tqdm.auto import tqdm

    shards, total, buf, filled = [], 0, np.empty(SHARD_TOKENS, dtype=dtype), 0

    def flush():
        nonlocal filled
        if filled:
            name = f"{split}-{len(shards):05d}.bin"
            buf[:filled].tofile(folder / name)
            shards.append({"file": name, "tokens": int(filled)})
            filled = 0

    for batch in tqdm(ds.iter(batch_size=4096), total=-(-len(ds) // 4096), desc=f"pack {split}",
                      unit="batch"):
        ids = np.fromiter((t for doc in batch["ids"] for t in doc), dtype=dtype)
        while len(ids):
            take = min(len(ids), SHARD_TOKENS - filled)
            buf[filled:filled + take] = ids[:take]
            filled, total, ids = filled + take, total + take, ids[take:]
            if filled == SHARD_TOKENS:
                flush()
    flush()
    return {"documents": len(ds), "tokens": total, "shards": shards}
