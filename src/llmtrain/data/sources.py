"""A dataset's and a model's sources on disk, and the prepared folder a source's fingerprint
names: path helpers (a hub id's download folder, globs, format suffixes) and the fingerprint,
for the config's checks, prepare and the loader. Imports nothing else of llmtrain: `cfg` below
is a config.Config.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Literal

HOME_VAR = "LLMTRAIN_HOME"
FORMAT_VERSION = 2  # 2: held-out documents and the rest in source order (1: shuffled)
MANIFEST = "manifest.json"


# ---------------------------------------------------------------------------------------------
# Local folders and downloaded hub ids


def is_hub_id(value: str) -> bool:
    return not os.path.isabs(value)


def local_path(value: str, kind: Literal["models", "datasets"]) -> Path:
    """Where a model/dataset lives on disk: the path itself, or the hub id's download folder."""
    if not is_hub_id(value):
        return Path(value)
    home = os.environ.get(HOME_VAR)
    root = Path(home) if home else Path("$" + HOME_VAR)
    return root / kind / value


def tokenizer_source(cfg) -> str | None:
    return cfg.model.tokenizer or cfg.model.name_or_path


# Data files by format suffix: the datasets library's builder that reads them.
FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet",
                 ".csv": "csv", ".arrow": "arrow"}
COMPRESSED = (".gz", ".bz2", ".xz")  # the datasets library decompresses these as it reads


def is_glob(value: str) -> bool:
    return any(c in value for c in "*?[")


def source_files(value: str) -> list[Path] | None:
    """The files of a local dataset given as a file or a glob (sorted; `**` recurses); None
    for a folder or a hub id, which the datasets library lists itself."""
    if is_glob(value):
        return sorted(Path(p) for p in glob.glob(value, recursive=True) if os.path.isfile(p))
    path = Path(value)
    return [path] if path.is_file() else None


def on_disk(value: str, kind: Literal["models", "datasets"]) -> bool:
    """Whether a model/dataset is on this machine: its path or download folder exists, or
    its glob matches files."""
    path = local_path(value, kind)
    return bool(source_files(str(path))) if is_glob(str(path)) else path.exists()


# A model folder's weights as training reads them (model/weight_files.py): one file or an index
# of shards, safetensors first.
WEIGHT_FILES = (("model.safetensors", "model.safetensors.index.json"),
                ("pytorch_model.bin", "pytorch_model.bin.index.json"))


def has_weights(folder: Path) -> bool:
    """Whether a model folder holds weights to train from: one with its config and tokenizer
    files alone (download_data_model.sh --config-only, for the estimate) does not."""
    return any((folder / name).is_file() for pair in WEIGHT_FILES for name in pair)


def file_suffix(path: Path) -> str:
    """The format suffix of a data file, under its compression: docs.jsonl.gz -> .jsonl."""
    inner = Path(path.stem).suffix if path.suffix in COMPRESSED else ""
    return inner or path.suffix


def is_split_name(value: str) -> bool:
    """data.validation: `validation` names a split; `val.jsonl`, `./val` and globs are paths."""
    return (not os.path.isabs(value) and not is_glob(value) and "/" not in value
            and file_suffix(Path(value)) not in (*FILE_BUILDERS, *COMPRESSED))


# ---------------------------------------------------------------------------------------------
# Where prepared data lives: a source's fingerprint names its folder


def source_listing(path: Path) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime) of every file of a dataset source (a file, a glob's matches,
    or a folder): its cheap fingerprint."""
    files = source_files(str(path))
    if files is None:
        base, files = path, sorted(p for p in path.rglob("*") if p.is_file())
    else:
        base = _glob_root(path) if is_glob(str(path)) else path.parent
    return [(str(p.relative_to(base)), p.stat().st_size, p.stat().st_mtime_ns) for p in files
            if ".cache" not in p.relative_to(base).parts]


def _glob_root(pattern: Path) -> Path:
    """The folder above a glob's first wildcard: /data/c4/*/*.json.gz -> /data/c4."""
    parts = pattern.parts
    return Path(*parts[:next(i for i, part in enumerate(parts) if is_glob(part))])


def fingerprint(cfg) -> str:
    d = cfg.data
    tok_dir = local_path(tokenizer_source(cfg), "models")
    validation = d.validation
    if validation is not None and not is_split_name(validation):
        validation = source_listing(Path(validation))
    recipe = {
        "format": FORMAT_VERSION,
        "source": source_listing(local_path(d.dataset, "datasets")),
        "split": d.split,
        "text_field": d.text_field,
        "text_unit": d.text_unit,
        # only when set: the folders prepared before the option keep their fingerprint
        **({"encoding_errors": d.encoding_errors} if d.encoding_errors != "strict" else {}),
        **({"data_format": d.format, "columns": d.columns, "train_on": d.train_on, "truncation": d.truncation,
            "packing": d.packing, "seq_len": d.seq_len} if d.samples else {}),
        "add_bos": d.add_bos,  # auto decides by the tokenizer, whose files are hashed below
        "validation": validation,
        "validation_fraction": d.holdout_fraction,
        "tokenizer": tokenizer_sha256(tok_dir),
        "tokenizer_config": _sha256(tok_dir / "tokenizer_config.json"),
        **({"chat_template": _sha256(tok_dir / "chat_template.jinja")} if d.format == "chat" else {}),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def prepared_path(cfg, fp: str | None = None) -> Path:
    """The config's prepared folder: data.prepared, or the one the source's fingerprint names
    under data.prepared_dir; with `fp`, the folder that fingerprint names."""
    if fp is None and cfg.data.prepared:
        return Path(cfg.data.prepared)
    return Path(cfg.data.prepared_dir) / f"{source_name(cfg.data.dataset)}-{fp or fingerprint(cfg)}"


def source_name(dataset: str) -> str:
    """A dataset's short name: its file or folder name (a glob's folder: /data/shakespeare/*.txt
    -> shakespeare), less .txt and compression suffixes. Names its prepared folder, and a
    mixture's source where the entry gives no name."""
    source = Path(dataset)
    if is_glob(dataset):
        source = _glob_root(source)
    name = source.name
    for suffix in (*COMPRESSED, ".txt"):
        name = name.removesuffix(suffix)
    return re.sub(r"[^\w.-]+", "_", name) or "data"


def mixture_name(dataset: str) -> str:
    """A mixture source's name where its entry gives none: its dataset's short name less a
    format suffix (web.jsonl -> web)."""
    name = source_name(dataset)
    return name.removesuffix(file_suffix(Path(name))) or name


def by_source(values: dict):
    """A value of each source ({source name: value}) as manifests and checkpoints record it:
    data.dataset's (its one source has no name) as it is, a mixture's by name."""
    return values[None] if None in values else values


def source_record(cfg) -> dict:
    """The data options a prepared folder was made with, as its manifest records them."""
    d = cfg.data
    return {"dataset": d.dataset, "split": d.split, "format": d.format, **d.columns,
            "text_unit": d.text_unit, "validation": d.validation, "validation_fraction": d.holdout_fraction}


def given_prepared(cfg) -> dict | None:
    """The manifest of data.prepared, when it is set and prepared: then nothing reads the source."""
    return read_manifest(Path(cfg.data.prepared)) if cfg.data.prepared else None


def tokenizer_sha256(tok_dir: Path) -> str | None:
    """The tokenizer's vocabulary and merges, hashed: what decides the token ids."""
    return _sha256(tok_dir / "tokenizer.json")


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def read_manifest(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
