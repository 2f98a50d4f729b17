"""`llmtrain prepare --config FILE`: dataset -> tokens -> packed memory-mapped shards.

Loads the source with `datasets` (a hub snapshot folder of parquet/jsonl/txt, a save_to_disk
folder, or files: one, or a glob's matches, compressed or not; plain text is one document per
line, or per file with data.text_unit: file; one .txt file's lines are split by Arrow's CSV
reader, text_lines, into the documents the library's builder gives), takes the validation
documents from data.validation (a split or files) or holds out a share of the documents, and
writes each split as one contiguous token stream cut into shards: worker processes tokenize
contiguous chunks of documents with the model's fast tokenizer, BOS before (data.add_bos) and
EOS after every document, each chunk straight into its shard file (fine-tuning samples:
data/samples.py lays them out in rows). For plain text the tokenizer is loaded in a forked
process while the source is read (tokenizer.TokenizerLoad: transformers' import, ~0.7 s without
torch: on 2 cores, what the tokenizing waits for). Everything
is written into `<final>.tmp-<host>-<pid>` and renamed at the end, so a crash never leaves a
folder that looks prepared; a folder whose manifest exists is reused. The datasets library's
own files (its Arrow copy of the source, the held-out indices, tokenized samples) go to
`scratch/` inside the temporary folder and are removed with it: a 100B-token corpus leaves no
terabyte in the datasets cache.

A prepare killed with no cleanup (SIGKILL: the out-of-memory killer, a time limit) leaves its
temporary folder. The next prepare of the same data continues it where its process is certainly
gone (on this host, or a requeued incarnation of the same Slurm job): a text split's finished
chunks are kept (each chunk's file is complete once its `.done.json` names the same documents),
the rest written again; other abandoned folders on this host are removed. A 100B-token prepare
killed at 90% no longer starts from zero.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import socket
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from ..config import Config, UserError
from .sources import (FILE_BUILDERS, file_suffix, is_glob, is_split_name, local_path, source_files,
                      tokenizer_source)
from . import samples
from ..rundir import job_alive, pid_alive
from .sources import (FORMAT_VERSION, MANIFEST, fingerprint, prepared_path, read_manifest, source_record,
                      tokenizer_sha256)

SHARD_TOKENS = 1 << 28  # 256M tokens: 512 MiB of uint16 per shard file
READ_DOCS = 1024  # documents a tokenizing process takes out of Arrow at a time
# Text per call of the batch encoder, about: its Encodings (~100 bytes a token) then stay in the
# core's cache. 1,000 documents of ~220 characters a call ran 10-15% slower (doc/benchmarks.md).
ENCODE_CHARS = 16 << 10
CHUNK_BYTES = 256 << 20  # text per shard file of a text split (~64M tokens)
DEFAULT_MAX_PROC = 64  # tokenizer processes by default, at most (data.num_proc: any)
# Text per tokenizing process by default, at least (~2M tokens, a second or two of one): starting
# a pool costs ~0.3 s, more than a small validation split takes in the process that has it.
PROC_BYTES = 8 << 20


class PrepareError(UserError):
    pass


def prepare(cfg: Config, log=print) -> Path:
    if cfg.data.prepared and read_manifest(Path(cfg.data.prepared)) is not None:
        log(f"prepared data is up to date: {cfg.data.prepared}")
        return Path(cfg.data.prepared)
    fp = fingerprint(cfg)
    final = prepared_path(cfg, fp)
    if cfg.data.prepared and Path(cfg.data.prepared) != final:  # the source changed since submit
        raise PrepareError(f"data.prepared: {cfg.data.prepared} is not prepared, and data.dataset's "
                           f"files with these data options make {final} instead; submit again")
    if read_manifest(final) is not None:
        log(f"prepared data is up to date: {final}")
        return final

    from .tokenizer import TokenizerLoad, load_tokenizer

    tok_dir = local_path(tokenizer_source(cfg), "models")
    # Fine-tuning samples need transformers' tokenizer (its chat template); plain text needs only
    # its backend, loaded in a forked process while this one reads the source (TokenizerLoad).
    tokenizer = checked(load_tokenizer(cfg), tok_dir) if cfg.data.samples else None
    # Started before anything is written: a tokenizer folder that is not there is one line and
    # leaves nothing behind.
    load = TokenizerLoad(cfg) if tokenizer is None else None
    t0 = time.time()
    adopted = abandoned(final, log)
    tmp = final.with_name(f"{final.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if adopted is not None:
            os.rename(adopted, tmp)
            shutil.rmtree(tmp / "scratch", ignore_errors=True)
            finished = {r.name.removesuffix(DONE) for r in tmp.glob(f"*{DONE}")}
            for path in tmp.iterdir():  # all but the finished chunks and their records
                if path.name not in finished and not path.name.endswith(DONE):
                    path.unlink()
            kept = len(list(tmp.glob(f"*{DONE}")))
            log(f"continuing the prepare killed in {adopted}: {kept} finished chunk(s) kept")
        else:
            tmp.mkdir(parents=True)
        (tmp / OWNER).write_text(json.dumps({"job_id": os.environ.get("SLURM_JOB_ID")}) + "\n")
    except OSError as e:
        if load is not None:
            load.cancel()
        if disk_full(e, tmp.parent):
            shutil.rmtree(tmp, ignore_errors=True)
            raise full_disk_error(tmp.parent) from None
        raise PrepareError(f"data.prepared_dir: cannot create {tmp.parent} ({e.strerror}); "
                           f"choose a writable folder") from None
    # The datasets library's files (the source's Arrow copy, the held-out split's indices,
    # tokenized samples) go here and with it, not into its cache or next to a saved dataset,
    # where they would stay on the shared filesystem for good.
    scratch = tmp / "scratch"
    scratch.mkdir()
    try:
        splits = load_splits(cfg, scratch)
        if load is not None:
            tokenizer = checked(load.result(), tok_dir)
        bos = bos_to_add(cfg, tokenizer, tok_dir)
        dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32
        manifest = {
            "format": FORMAT_VERSION,
            "fingerprint": fp,
            "source": source_record(cfg),
            "tokenizer": {"path": str(tok_dir), "vocab_size": len(tokenizer),
                          "eos_token_id": tokenizer.eos_token_id, "added_bos_token_id": bos,
                          "sha256": tokenizer_sha256(tok_dir)},
            "dtype": np.dtype(dtype).name,
            "splits": {},
        }
        log(describe_layout(cfg, tokenizer, bos))
        if cfg.data.samples:
            manifest["samples"] = {"train_on": cfg.data.train_on, "truncation": cfg.data.truncation,
                                   "packing": cfg.data.packing, "seq_len": cfg.data.seq_len}
            encode = samples.encoder(cfg, tokenizer, bos)
            for split, ds in splits.items():
                ids, trained, offsets = samples.flatten(tokenize(ds, cfg, scratch / split, encode))
                manifest["splits"][split] = samples.write_rows(
                    ids, trained, offsets, tmp, split, dtype, cfg.data.seq_len + 1, pad_id(tokenizer),
                    cfg.data.packing, cfg.data.truncation, SHARD_TOKENS)
                log(samples.summary(split, manifest["splits"][split], cfg.data.seq_len, cfg.data.truncation))
        else:
            manifest["splits"] = write_streams(splits, tokenizer, cfg, tmp, dtype, tokenizer.eos_token_id, bos)
            for split, part in manifest["splits"].items():
                if n := part.get("no_text"):
                    log(f"{split}: {n:,} record{'s' if n != 1 else ''} with no text skipped "
                        f"(no {cfg.data.text_field!r} field, or null)")
        shutil.rmtree(scratch)  # the datasets above map its files: unlinked, still readable
        used = {s["file"] for part in manifest["splits"].values() for s in part.get("shards", [])}
        for record in tmp.glob(f"*{DONE}"):  # a continuation's records, and its unused chunks
            if (chunk := record.name.removesuffix(DONE)) not in used:
                (tmp / chunk).unlink(missing_ok=True)
            record.unlink()
        (tmp / OWNER).unlink()
        manifest["seconds"] = round(time.time() - t0, 1)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        try:
            tmp.rename(final)
        except OSError:  # a concurrent prepare finished first: keep its folder
            if read_manifest(final) is None:
                raise
            shutil.rmtree(tmp)
    except BaseException as e:
        if load is not None:
            load.cancel()
        # Measured before the cleanup frees the space: a short write's error may not say why.
        full = isinstance(e, Exception) and not isinstance(e, UserError) and disk_full(e, tmp.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise full_disk_error(tmp.parent) from None
        raise
    if manifest["splits"]["train"]["tokens"] == 0:
        shutil.rmtree(final, ignore_errors=True)
        if cfg.data.samples:
            raise PrepareError(f"data.dataset: {cfg.data.dataset} has no sample with a token to train "
                               f"(data.train_on: {cfg.data.train_on}, data.truncation: {cfg.data.truncation})")
        raise PrepareError(f"data.dataset: {cfg.data.dataset} has no text in column "
                           f"{cfg.data.text_field!r}")
    counts = ", ".join(f"{s} {m['tokens']:,} tokens" for s, m in manifest["splits"].items())
    log(f"prepared {final} ({counts}) in {time.time() - t0:.1f}s")
    return final


def checked(tokenizer, tok_dir: Path):
    """The tokenizer, if prepare can tokenize with it: a fast one that defines an EOS."""
    if not tokenizer.is_fast:
        raise PrepareError(f"model.tokenizer: {tok_dir} has no fast tokenizer (tokenizer.json)")
    if tokenizer.eos_token_id is None:
        raise PrepareError(f"model.tokenizer: {tok_dir} defines no eos_token")
    return tokenizer


def disk_full(e: BaseException, folder: Path) -> bool:
    """Whether `e` comes from a full filesystem at `folder`: ENOSPC or EDQUOT in its chain (a
    worker's error comes back with its errno), or an OSError without an errno with under 1 MiB
    free there: numpy and pyarrow report a short write so ("60437 requested and 38912 written"),
    and the datasets library wraps its own in a DatasetGenerationError. (A read-only or
    missing folder has an errno of its own: not taken for a full one.)"""
    seen, chain = e, []
    while seen is not None and len(chain) < 20:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if any(isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT) for x in chain):
        return True
    try:
        return (any(isinstance(x, OSError) and x.errno is None for x in chain)
                and shutil.disk_usage(folder).free < 1 << 20)
    except OSError:
        return False


def full_disk_error(folder: Path) -> PrepareError:
    return PrepareError(f"data.prepared_dir: {folder} is full (No space left on device); nothing "
                        f"was kept; free space there, or set data.prepared_dir to a folder with room")


OWNER = "owner.json"  # in a temporary folder: the Slurm job that writes it (null outside Slurm)
DONE = ".done.json"  # next to a finished chunk's file: the documents it holds and its tokens


def abandoned(final: Path, log) -> Path | None:
    """The temporary folder of `final` to continue, if any: one whose prepare was killed (out of
    memory, a time limit: no cleanup runs) and is certainly gone: on this host, its process is
    not alive; on another, its Slurm job is this one (a requeue: the job's earlier run is over)
    or one squeue no longer runs (a prepare job that timed out, submitted again). The one with
    the most finished chunks is taken; the other dead ones on this host are removed. Another
    host's folder outside Slurm, or of a job that runs, may be in use: it is left alone."""
    host, job = socket.gethostname(), os.environ.get("SLURM_JOB_ID")
    dead = []
    for tmp in final.parent.glob(f"{final.name}.tmp-*"):
        owner_host, _, pid = tmp.name.removeprefix(f"{final.name}.tmp-").rpartition("-")
        try:
            owner = json.loads((tmp / OWNER).read_text()).get("job_id")
        except (OSError, ValueError, AttributeError):
            owner = None
        if owner_host == host and pid.isdigit():
            gone = int(pid) != os.getpid() and not pid_alive(pid)
        else:
            gone = bool(owner) and (owner == job or not job_alive(owner))
        if gone:
            dead.append((len(list(tmp.glob(f"*{DONE}"))), tmp))
    dead.sort(key=lambda d: d[0], reverse=True)
    for _, tmp in dead[1:]:
        if tmp.name.startswith(f"{final.name}.tmp-{host}-"):
            shutil.rmtree(tmp, ignore_errors=True)
            log(f"removed {tmp}: left by a prepare that was killed")
    return dead[0][1] if dead else None



def load_splits(cfg: Config, scratch: Path) -> dict:
    """Train and (if asked for) validation documents: the validation source's, or a seeded
    share of the dataset's documents held out (index files in `scratch`), in source order."""
    import datasets

    # We report a load failure ourselves, in one line; the library would log it a second time.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    d = cfg.data
    src = local_path(d.dataset, "datasets")
    ds = _read(src, d.split, "dataset", cfg, datasets, scratch)
    if d.validation is not None:
        if is_split_name(d.validation):
            val = _read(src, d.validation, "validation", cfg, datasets, scratch)
        else:
            val = _read(Path(d.validation), "train", "validation", cfg, datasets, scratch)
        return {"train": ds, "validation": val}
    frac = d.holdout_fraction
    if frac == 0:
        return {"train": ds}
    n_val = max(1, round(frac * len(ds)))
    if n_val >= len(ds):
        raise PrepareError(f"data.validation_fraction: leaves no training documents "
                           f"({len(ds)} documents); give the evaluation documents their own "
                           f"file in data.validation, or set validation_fraction: 0")
    # A seeded sample of the documents, and the rest, each in the source's order: both read the
    # source's Arrow copy front to back (a shuffled split would read a 400 GB copy on a shared
    # filesystem one document at a time, at random). The loader draws its windows in a seeded
    # permutation every epoch; a window's neighbouring documents are the source's neighbours
    # (a corpus sorted by domain gives windows of one domain, as nanoGPT-style packing does).
    held = np.zeros(len(ds), dtype=bool)
    held[np.random.default_rng(0).choice(len(ds), n_val, replace=False)] = True
    return {split: ds.select(np.flatnonzero(mask), indices_cache_file_name=str(scratch / f"{split}-indices.arrow"))
            for split, mask in (("train", ~held), ("validation", held))}


def _read(src: Path, split: str, key: str, cfg: Config, datasets, scratch: Path):
    """One source's documents as a dataset with the single column text_field."""
    if is_glob(str(src)):
        if not source_files(str(src)):
            raise PrepareError(f"data.{key}: no file matches {src}")
    elif not src.exists():
        raise PrepareError(f"data.{key}: {src} does not exist; for a hub dataset run "
                           f"bash download_data_model.sh first")
    elif src.is_file() and src.stat().st_size == 0:
        raise PrepareError(f"data.{key}: {src} is empty; point it at a file with documents")
    try:
        ds = _load(src, split, key, cfg, datasets, scratch)
    except (datasets.exceptions.DatasetGenerationError, ValueError, OSError) as e:
        cause = e.__cause__ or e
        if disk_full(e, scratch):  # the library's copy of the source: the source is not to blame
            raise
        if isinstance(cause, UnicodeDecodeError):
            raise not_utf8(src, key, cfg) from None
        if "sample_by" in str(e):  # the builder of a folder of parquet/json files has no such option
            raise PrepareError(f"data.text_unit: only for .txt files, and {src} is not text "
                               f"(got {cfg.data.text_unit})") from None
        if str(e).startswith("Unknown split"):  # "... Should be one of ['train', 'test']."
            raise PrepareError(f"{_split_key(key)}: no split {split!r} in {src} (splits: "
                               f"{str(e).partition('one of ')[2].rstrip('.')})") from None
        raise PrepareError(f"data.{key}: cannot read {src} with the datasets library "
                           f"({type(cause).__name__}: {str(cause).splitlines()[0][:200]})") from None
    if len(ds) == 0:
        raise PrepareError(f"data.{key}: {src} holds no documents (split {split!r})")
    for key, field in cfg.data.columns.items():
        if field not in ds.column_names:
            raise PrepareError(f"data.{key}: no column {field!r} in "
                               f"{src} (columns: {', '.join(ds.column_names)})")
        feature = ds.features[field]
        if key == "messages_field":
            if not _is_message_list(feature, datasets):
                raise PrepareError(f"data.messages_field: column {field!r} of {src} holds "
                                   f"{describe(feature, datasets)}, not conversations; choose a column "
                                   f"of lists of {{role: string, content: string}} "
                                   f"(columns: {', '.join(ds.column_names)})")
        elif not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
            raise PrepareError(f"data.{key}: column {field!r} of {src} holds "
                               f"{describe(feature, datasets)}, not text; choose a column of strings "
                               f"(columns: {', '.join(ds.column_names)})")
        if cfg.data.samples:  # a text record without text is skipped (write_streams counts them)
            _every_record_has(ds, key, field, src)
    return ds.select_columns(list(cfg.data.columns.values()))


def _every_record_has(ds, key: str, field: str, src: Path) -> None:
    """A fine-tuning sample needs each of its columns: a record without one (a jsonl line
    that names it otherwise, or null) is one line naming it, not a tokenizer's traceback. The
    Arrow column's null count is kept with its data: no pass over the records."""
    column = ds.with_format("arrow")[field]
    if column.null_count:
        import pyarrow.compute as pc
        first = pc.index(pc.is_null(column), True).as_py()
        raise PrepareError(f"data.{key}: record {first + 1:,} of {src} has no {field!r} "
                           f"({column.null_count:,} record{'s' if column.null_count != 1 else ''} "
                           f"in all: the field is missing, or null); give every record a {field!r}, "
                           f"or remove those records")


def not_utf8(src: Path, key: str, cfg: Config) -> PrepareError:
    """The first byte of `src`'s files that is not UTF-8, named by file, line and column, and
    data.encoding_errors as the way past it (for the files whose builder takes it)."""
    files = source_files(str(src))
    if files is None:  # a folder: its text files, as the library lists them
        files = sorted(f for f in src.rglob("*") if f.is_file() and file_suffix(f) in DECODED)
    for path in files:
        if (bad := first_bad_utf8(path)) is not None:
            line, column, byte = bad
            where = f"{path} line {line:,} is not valid UTF-8 (byte 0x{byte:02x} at column {column})"
            break
    else:
        where = f"{src} is not valid UTF-8"
    how = (" or set data.encoding_errors: replace (or ignore)"
           if source_files(str(src)) is not None else " or convert it to UTF-8")
    return PrepareError(f"data.{key}: {where}; fix the file,{how}")


def first_bad_utf8(path: Path, block: int = 16 << 20) -> tuple[int, int, int] | None:
    """(line, byte column, byte) of the first invalid UTF-8 in a file (compressed ones read as
    the library reads them), or None. Whole lines at a time: a character is never cut in two."""
    import bz2
    import gzip
    import lzma
    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(path.suffix, open)
    line, rest = 1, b""
    with opener(path, "rb") as f:
        while True:
            more = f.read(block)
            data = rest + more
            cut = data.rfind(b"\n") + 1 if more else len(data)
            try:
                data[:cut].decode("utf-8")
            except UnicodeDecodeError as u:
                start = data.rfind(b"\n", 0, u.start) + 1
                return line + data.count(b"\n", 0, u.start), u.start - start + 1, data[u.start]
            if not more:
                return None
            line += data.count(b"\n", 0, cut)
            rest = data[cut:]


def _is_message_list(feature, datasets) -> bool:
    """A column of conversations: a list of {role: string, content: ...}."""
    inner = getattr(feature, "feature", None)
    return (isinstance(feature, (datasets.List, datasets.LargeList)) and isinstance(inner, dict)
            and {"role", "content"} <= set(inner))


def _load(src: Path, split: str, key: str, cfg: Config, datasets, scratch: Path):
    # text_unit: file reads each .txt file whole, newlines kept (the text builder's sample_by)
    text = {"sample_by": "document"} if cfg.data.text_unit == "file" else {}
    # The builders' Arrow copy of the source goes to the scratch folder, written by as many
    # processes as there are files (and cores): a corpus is converted once per prepare.
    procs = num_proc(cfg)
    build = {"cache_dir": str(scratch / "source")}
    if src.is_dir() and any((src / f).exists() for f in
                            ("state.json", "dataset_info.json", "dataset_dict.json")):
        ds = datasets.load_from_disk(str(src))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise PrepareError(f"{_split_key(key)}: {split!r} not in {sorted(ds)}")
            ds = ds[split]
        elif key == "validation" and src == local_path(cfg.data.dataset, "datasets"):
            raise PrepareError(f"data.validation: {src} is one dataset with no splits (got "
                               f"{split!r}); give the validation documents' path instead")
        return ds
    files = source_files(str(src))
    if files is None:  # a folder (a hub snapshot): the library finds its files and splits
        return datasets.load_dataset(str(src), split=split, **build, **text,
                                     num_proc=procs if procs > 1 else None)
    suffixes = sorted({file_suffix(f) for f in files})
    unknown = [x for x in suffixes if x not in FILE_BUILDERS]
    if unknown:
        raise PrepareError(f"data.{key}: unknown file type {unknown[0]!r}; "
                           f"use one of {', '.join(FILE_BUILDERS)}")
    builders = {FILE_BUILDERS[x] for x in suffixes}
    if len(builders) > 1:
        raise PrepareError(f"data.{key}: {src} matches files of several formats "
                           f"({', '.join(suffixes)}); use one format per source")
    builder = builders.pop()
    if builder == "text" and not text and len(files) == 1:  # a document a line, in one file
        if (ds := text_lines(files[0], scratch, key, datasets)) is not None:
            return ds
    procs = min(procs, len(files))
    options = {**(text if builder == "text" else {}), **decoding(cfg, builder)}
    return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", **build,
                                 num_proc=procs if procs > 1 else None, **options)


DECODED = (".txt", ".csv", ".json", ".jsonl")  # the files a builder decodes (Arrow's are UTF-8)
LINE_BLOCK = 4 << 20  # bytes of a text file Arrow splits into lines at a time (64 MiB: 7x as long)


def text_lines(path: Path, scratch: Path, key: str, datasets):
    """One plain text file's lines as the datasets library's text builder gives them (one
    document a line, universal newlines, empty lines kept, UTF-8), split by Arrow's CSV reader
    with a delimiter that is not in the text: 0.05-0.1 s of CPU for the 50 MiB of
    bench/prepare.py against the builder's 0.35, which makes a Python string of every line (for a
    corpus in one file, one core while the others wait). Written into an Arrow file in `scratch` and
    memory-mapped, as the builder's copy is. None where the reader cannot give the same lines (a
    file that is not UTF-8, a line longer than LINE_BLOCK, the delimiter in a line, a byte order
    mark, which the reader drops and the builder keeps): the builder reads it, or says what is
    wrong."""
    import pyarrow as pa
    import pyarrow.csv as csv
    if path.suffix != ".txt":  # compressed: the builder decompresses it
        return None
    with open(path, "rb") as f:
        if f.read(3) == b"\xef\xbb\xbf":
            return None
    out = scratch / f"{key}-lines.arrow"
    out.parent.mkdir(parents=True, exist_ok=True)
    schema = pa.schema({"text": pa.string()})
    options = {"read_options": csv.ReadOptions(column_names=["text"], block_size=LINE_BLOCK),
               "parse_options": csv.ParseOptions(delimiter="\x1f", quote_char=False, ignore_empty_lines=False),
               "convert_options": csv.ConvertOptions(column_types=schema, strings_can_be_null=False)}
    try:
        with csv.open_csv(path, **options) as lines, pa.OSFile(str(out), "wb") as sink, \
                pa.ipc.new_stream(sink, schema) as writer:
            for batch in lines:
                writer.write_batch(batch)
    except pa.ArrowInvalid:
        out.unlink(missing_ok=True)
        return None
    return datasets.Dataset.from_file(str(out))


def decoding(cfg: Config, builder: str) -> dict:
    """The builder's options for data.encoding_errors (text, csv: strict is their default)."""
    errors = cfg.data.encoding_errors
    if builder == "json":
        # The json builder hands UTF-8 bytes to Arrow unread, and Arrow's JSON reader does not
        # check them: a bad byte surfaced later, as a tokenizing worker's traceback. It decodes
        # each block of whole lines (with encoding_errors) only when the encoding is not spelled
        # "utf-8" (datasets 5.x packaged_modules/json/json.py): the same codec spelled otherwise.
        return {"encoding": "utf_8", "encoding_errors": errors}
    if errors == "strict" or builder not in ("text", "csv"):
        return {}
    return {"encoding_errors": errors}


def _split_key(key: str) -> str:
    """The key that named the split: data.split for the dataset, data.validation for its own."""
    return "data.split" if key == "dataset" else "data.validation"


def describe(feature, datasets) -> str:
    """A column type in words: int64, a list of {role: string, content: string}."""
    if isinstance(feature, datasets.Value):
        return feature.dtype
    if isinstance(feature, (datasets.List, datasets.LargeList, datasets.Sequence)):
        return f"a list of {describe(feature.feature, datasets)}"
    if isinstance(feature, dict):
        return "{" + ", ".join(f"{k}: {describe(v, datasets)}" for k, v in feature.items()) + "}"
    return type(feature).__name__


def bos_to_add(cfg: Config, tokenizer, tok_dir: Path) -> int | None:
    """The token id that data.add_bos puts before every document, or None. auto: the
    tokenizer's bos_token, unless it is also its eos_token (GPT-2 style: the EOS after each
    document already separates them). Documents are tokenized without special tokens, so
    the tokenizer itself never adds one."""
    choice, bos = cfg.data.add_bos, tokenizer.bos_token_id
    if choice is True and bos is None:
        raise PrepareError(f"data.add_bos: {tok_dir} defines no bos_token (got true); set "
                           f"add_bos: auto or false")
    if choice is False or bos is None or (choice == "auto" and bos == tokenizer.eos_token_id):
        return None
    return bos


def num_proc(cfg: Config) -> int:
    """data.num_proc, or the cores this process may run on (a Slurm allocation, taskset), at most
    DEFAULT_MAX_PROC: on a shared login node, prepare should not take every core unasked."""
    if cfg.data.num_proc:
        return cfg.data.num_proc
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return min(DEFAULT_MAX_PROC, cores)


def tokenize(ds, cfg: Config, scratch: Path, encode):
    """`encode`'s columns for every sample (samples.encoder: ids and trained flags), in
    data.num_proc processes (by default one per PROC_BYTES of text, up to the cores). Written as
    Arrow files named after `scratch`."""
    procs = worker_count(ds, cfg)
    environ = os.environ
    try:
        return ds.map(encode, batched=True, num_proc=procs if procs > 1 else None,
                      remove_columns=ds.column_names, desc="tokenize",
                      cache_file_name=f"{scratch}-tokenized.arrow")
    finally:
        # map(num_proc > 1) leaves a copy of os.environ in its place: whoever holds the original
        # object (a notebook's, a test fixture's) would no longer see the environment change.
        if os.environ is not environ:
            current, os.environ = dict(os.environ), environ
            environ.clear()
            environ.update(current)


def worker_count(ds, cfg: Config) -> int:
    """data.num_proc, or one process per PROC_BYTES of text up to the cores (num_proc(cfg))."""
    procs = num_proc(cfg) if cfg.data.num_proc else min(num_proc(cfg), text_bytes(ds) // PROC_BYTES)
    return max(1, min(procs, len(ds)))


def text_bytes(ds) -> int:
    """About how many bytes of text `ds` holds (its share of the Arrow table it selects from)."""
    return ds.data.nbytes * len(ds) // max(1, ds.data.num_rows)


def write_streams(splits: dict, tokenizer, cfg: Config, folder: Path, dtype, eos: int,
                  bos: int | None) -> dict:
    """Each text split as its token stream: every document's ids, BOS before (if given) and EOS
    after each, written straight into the split's shard files, one per chunk of documents. Worker
    processes take the chunks (contiguous runs of documents, in order) as they free up, the
    validation split's after the train split's in the same pool (not one process alone after
    it); a split's files in chunk order are its stream. Nothing in between: no tokenized copy of
    the corpus (4 bytes a token) written and read back, no packing pass in one process. Returns
    each split's manifest part."""
    from tqdm.auto import tqdm
    tasks, done = [], []
    workers = {split: worker_count(ds, cfg) for split, ds in splits.items()}
    procs = max(workers.values())
    for split, ds in splits.items():
        # A split's chunks as its own size sets them (so its shard files): one per CHUNK_BYTES of
        # text, and with several processes at least 4 a process, so that none waits long for the
        # last: shard files of ~64M tokens, and a progress bar that moves on a large corpus. A
        # split small enough for one process still gets one chunk per process of the pool: the
        # validation split, tokenized last, ends on all of them (not on one, the others idle).
        mine = workers[split]
        chunks = max(-(-text_bytes(ds) // CHUNK_BYTES), 4 * mine if mine > 1 else 1, procs)
        bounds = np.linspace(0, len(ds), min(chunks, len(ds)) + 1).astype(int)
        for task in [(i, int(a), int(b), split) for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]:
            if (result := finished_chunk(folder, split, task, dtype)) is not None:
                done.append((split, result))
            else:
                tasks.append(task)
    state = (splits, tokenizer, cfg.data.text_field, folder, dtype, eos, bos)
    bar = tqdm(total=sum(len(ds) for ds in splits.values()), desc=f"tokenize {' + '.join(splits)}"
               + (f" ({procs} processes)" if procs > 1 else ""), unit=" documents",
               initial=sum(r[2] for _, r in done), disable=None)  # None: off unless a terminal
    pool = None
    with bar:
        try:
            if procs == 1:  # here, the tokenizer's own threads on every core
                _set_chunk_state(*state)
                results = ((task[3], _write_chunk(task)) for task in tasks)
            else:
                # Not multiprocessing.Pool: it waits forever for the chunk of a worker that was
                # killed (out of memory); this pool fails at once and ends the other workers.
                from concurrent.futures import ProcessPoolExecutor, as_completed
                pool = ProcessPoolExecutor(procs, initializer=_start_worker, initargs=state)
                split_of = {pool.submit(_write_chunk, task): task[3] for task in tasks}
                results = ((split_of[f], f.result()) for f in as_completed(split_of))
            for split, result in results:
                done.append((split, result))
                bar.update(result[2])
        except BrokenProcessPool:
            raise PrepareError(f"data.num_proc: a tokenizing process of {procs} died (killed: out of "
                               f"memory?); give prepare more memory, or fewer processes") from None
        finally:
            _set_chunk_state()
            if pool is not None:
                pool.shutdown(cancel_futures=True)
    return {split: stream_part(ds, [r for s, r in done if s == split]) for split, ds in splits.items()}


def stream_part(ds, done: list[tuple]) -> dict:
    """A text split's manifest part from its chunks' results. A chunk of records with no text has
    an empty file, which no memmap opens: it is left out (prepare removes it with the other
    chunks the manifest does not name)."""
    shards = [{"file": name, "tokens": tokens} for _, name, _, tokens, _ in sorted(done) if tokens]
    no_text = sum(r[4] for r in done)
    return {"documents": len(ds) - no_text, "tokens": sum(s["tokens"] for s in shards),
            **({"no_text": no_text} if no_text else {}), "shards": shards}


_chunk_state: tuple = ()


def _set_chunk_state(*state) -> None:
    """A worker's share of write_streams: the splits, tokenizer and where to write (the pool's
    initializer: sent once per process, not once per chunk)."""
    global _chunk_state
    _chunk_state = state


def _start_worker(*state) -> None:
    """A pool's worker: one tokenizer thread (the pool has a process per core; the tokenizer's
    own threads would start a thread per core in each of them)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _set_chunk_state(*state)


def _write_chunk(task: tuple[int, int, int, str]) -> tuple[int, str, int, int, int]:
    """A split's documents [start, stop) as one shard file: (index, file name, records, tokens,
    records with no text: skipped, not written as an empty document); once it is complete, its
    `.done.json` says so (a killed prepare's continuation keeps it)."""
    index, start, stop, split = task
    splits, tokenizer, field, folder, dtype, eos, bos = _chunk_state
    ds, backend = splits[split], tokenizer.backend_tokenizer
    name, tokens, no_text = f"{split}-{index:05d}.bin", 0, 0
    with open(folder / name, "wb") as f:
        for at in range(start, stop, READ_DOCS):
            texts = read_texts(ds, field, at, min(at + READ_DOCS, stop))
            if None in texts:  # a record without the field (jsonl), or null
                no_text += len(texts)
                texts = [t for t in texts if t is not None]
                no_text -= len(texts)
            offsets, values = flat_ids([e.ids for batch in batches(texts, ENCODE_CHARS)
                                        for e in backend.encode_batch_fast(batch, add_special_tokens=False)])
            stream = with_bos_eos(offsets, values, bos, eos, dtype)
            stream.tofile(f)
            tokens += len(stream)
    done = folder / f"{name}{DONE}"
    done.with_suffix(".tmp").write_text(json.dumps({"start": start, "stop": stop, "tokens": tokens,
                                                    "no_text": no_text}))
    os.replace(done.with_suffix(".tmp"), done)
    return index, name, stop - start, tokens, no_text


def finished_chunk(folder: Path, split: str, task: tuple[int, int, int, str], dtype) -> tuple | None:
    """_write_chunk's result for a chunk a killed prepare finished: its record names the same
    documents and its file holds the tokens it says; else None (the chunk is written again)."""
    index, start, stop, _ = task
    name = f"{split}-{index:05d}.bin"
    try:
        record = json.loads((folder / f"{name}{DONE}").read_text())
        size = (folder / name).stat().st_size
    except (OSError, ValueError):
        return None
    if (record.get("start"), record.get("stop")) != (start, stop) or size != record.get("tokens", -1) * np.dtype(dtype).itemsize:
        return None
    return index, name, stop - start, record["tokens"], record.get("no_text", 0)


def read_texts(ds, field: str, start: int, stop: int) -> list:
    """Records [start, stop) of `ds`'s column `field` as Python strings (None where missing),
    straight from its Arrow table and row selection: the library's own row access (its formatter,
    a held-out split's selection gathered a row at a time) took 10x as long, 4% of a tokenizing
    process's time."""
    column = ds.data.column(field)
    if ds._indices is None:
        return column.slice(start, stop - start).to_pylist()
    rows = ds._indices.column(0).slice(start, stop - start).to_numpy()
    first = int(rows.min())
    part = column.slice(first, int(rows.max()) + 1 - first)
    if not (rows[0] == first and (np.diff(rows) == 1).all()):  # not one run in order: gathered
        part = part.take(rows - first)
    return part.to_pylist()


def batches(texts: list[str], chars: int):
    """`texts` in consecutive runs, each ending with the text that brings it to `chars`
    characters (the last run: what is left)."""
    start, size = 0, 0
    for i, text in enumerate(texts):
        size += len(text)
        if size >= chars:
            yield texts[start:i + 1]
            start, size = i + 1, 0
    if start < len(texts):
        yield texts[start:]


def flat_ids(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Python lists of ints as (offsets, values), through numpy: np.array or pa.array walk every
    int through their type inference and take 7x longer (10% of a tokenizing process's time)."""
    lengths = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int32, count=int(offsets[-1]))
    return offsets, values


def pad_id(tokenizer) -> int:
    """The token that fills the end of a row of samples (never trained, never attended to)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def describe_layout(cfg: Config, tokenizer, bos: int | None) -> str:
    """prepare's line saying how each document or sample becomes tokens."""
    d = cfg.data
    if d.format == "text":
        return (f"each document is tokenized as: {tokenizer.bos_token + ' ' if bos is not None else ''}"
                f"text {tokenizer.eos_token} (data.add_bos: {str(d.add_bos).lower()})")
    if d.format == "chat":
        how = "each conversation is rendered with the tokenizer's chat template"
        trained = "the assistant turns with their end-of-turn tokens"
    else:
        how = (f"each sample is tokenized as: {tokenizer.bos_token + ' ' if bos is not None else ''}"
               f"prompt completion {tokenizer.eos_token}")
        trained = f"the completion and {tokenizer.eos_token}"
    return (f"{how}; the loss covers {trained if d.train_on == 'completion' else 'every token'} "
            f"(data.train_on: {d.train_on}); "
            f"{'several samples per row' if d.packing else 'one sample per row'} (data.packing)")


def with_bos_eos(offsets: np.ndarray, values: np.ndarray, bos: int | None, eos: int, dtype) -> np.ndarray:
    """Documents given as `values[offsets[i]:offsets[i + 1]]`, as one stream with BOS (unless
    None) before and EOS after each document."""
    n, head = len(offsets) - 1, 0 if bos is None else 1
    lengths = np.diff(offsets)
    out = np.empty(len(values) + n * (head + 1), dtype=dtype)
    shift = np.arange(n) * (head + 1) + head  # how far each document's tokens move right
    out[np.repeat(shift, lengths) + np.arange(len(values))] = values
    starts = offsets[:-1] + shift
    out[starts + lengths] = eos
    if head:
        out[starts - 1] = bos
    return out
