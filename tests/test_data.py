"""prepare: token counts, formats, idempotence, atomicity; the sampler: disjoint, complete, resumable."""

from __future__ import annotations

import bz2
import gzip
import json
import multiprocessing
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from transformers import AutoTokenizer

from conftest import DEMO, cli, prepared_home, read_metrics, tiny_config
from llmtrain.data import prepare as prepare_mod
from llmtrain.config import load_config
from llmtrain.data.loader import StepSampler, TokenStream, open_prepared
from llmtrain.data.sources import prepared_path
from llmtrain.data.prepare import PrepareError, prepare

DOCS = [f"Story {i}: " + " ".join(["Anna had a red ball."] * (i % 7 + 1)) for i in range(300)]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO / "tokenizer")


def expected_tokens(tokenizer, docs) -> int:
    return sum(len(ids) + 1 for ids in tokenizer(docs, add_special_tokens=False)["input_ids"])


def config_for(write_config, dataset, **data):
    train = {"eval_every": 0} if data.get("validation_fraction") == 0 else {}
    return load_config(write_config(tiny_config(data={"dataset": str(dataset), **data}, train=train)))


def test_prepare_packs_every_document_with_eos(home, tmp_path, write_config, tokenizer):
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(DOCS) + "\n")
    cfg = config_for(write_config, src, validation_fraction=0.1)
    folder = prepare(cfg, log=lambda _: None)
    prepared_at = time.time()

    manifest = json.loads((folder / "manifest.json").read_text())
    train, val = manifest["splits"]["train"], manifest["splits"]["validation"]
    assert (train["documents"], val["documents"]) == (270, 30)
    assert train["tokens"] + val["tokens"] == expected_tokens(tokenizer, DOCS)
    stream = TokenStream(folder, manifest, "train")
    tokens = stream.read(0, stream.num_tokens)
    assert (tokens == tokenizer.eos_token_id).sum() == 270  # one EOS after every document
    assert tokens[-1] == tokenizer.eos_token_id
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["vocab_size"] == len(tokenizer)
    assert not list(folder.parent.glob("*.tmp-*"))
    # The source's Arrow copy, the held-out split's indices and the tokenized documents (4 bytes
    # a token) are gone with the temporary folder: the datasets cache holds no copy of this
    # source until the test's own load makes one.
    import datasets
    cached = Path(datasets.load_dataset("text", data_files=[str(src)], split="train").cache_files[0]["filename"])
    assert cached.stat().st_mtime > prepared_at
    assert [p.name for p in cached.parent.iterdir() if p.name.startswith("cache-")] == []
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "train-00000.bin", "validation-00000.bin"]


def test_held_out_documents_are_a_seeded_sample_and_both_splits_keep_the_source_order(
        home, tmp_path, write_config, tokenizer, monkeypatch):
    """Both splits read the source front to back (a shuffled split reads a corpus's Arrow copy at
    random): each split's stream is its documents in the source's order, the held-out ones drawn
    from all over the source, the same ones on every prepare."""
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(DOCS) + "\n")
    folder = prepare(config_for(write_config, src, validation_fraction=0.1), log=lambda _: None)

    def documents(split):
        stream = TokenStream(folder, json.loads((folder / "manifest.json").read_text()), split)
        text = tokenizer.decode(stream.read(0, stream.num_tokens))
        return text.split(tokenizer.eos_token)[:-1]

    train, val = documents("train"), documents("validation")
    held = [i for i, doc in enumerate(DOCS) if doc in set(val)]
    assert val == [DOCS[i] for i in held] and len(held) == 30
    assert train == [doc for i, doc in enumerate(DOCS) if i not in held]
    assert held[0] < 30 and held[-1] >= 270  # spread over the source, not its first or last 30
    shutil.rmtree(folder)
    # Another prepare, in two tokenizing processes this time (data.num_proc unset, text enough for
    # two on two cores: 8 chunks of the train split; the validation split, enough for one, in two:
    # it is tokenized last, on both): the same streams.
    monkeypatch.setattr(prepare_mod, "PROC_BYTES", 4000)
    monkeypatch.setattr(prepare_mod, "num_proc", lambda cfg: 2)
    again = prepare(config_for(write_config, src, validation_fraction=0.1), log=lambda _: None)
    shards = {k: len(v["shards"]) for k, v in json.loads((again / "manifest.json").read_text())["splits"].items()}
    assert again == folder and shards == {"train": 8, "validation": 2}
    assert (documents("train"), documents("validation")) == (train, val)


# A prepare (argv: config) with a shard file per ~1000 bytes of text that SIGKILLs itself when
# it starts chunk 5, as the out-of-memory killer or a time limit would: no cleanup runs.
KILLED_AT_CHUNK_5 = """
import os, signal, sys
from llmtrain.config import load_config
from llmtrain.data import prepare as m
m.CHUNK_BYTES = 1000
write = m._write_chunk
def killed(task):
    if task[0] == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return write(task)
m._write_chunk = killed
m.prepare(load_config(sys.argv[1]), log=print)
"""


def test_a_killed_prepare_is_continued_from_its_finished_chunks(home, tmp_path, write_config,
                                                                  monkeypatch):
    """SIGKILL runs no cleanup: the next prepare of the same data continues the folder of a
    process that is gone on this host, writes only the chunks not finished (a 100B-token prepare
    killed at 90% does not start from zero), and makes the same tokens as a prepare never
    killed; it leaves the folder of another host's prepare, which may still run, and removes
    another dead one of this host."""
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(DOCS) + "\n")
    monkeypatch.setattr(prepare_mod, "CHUNK_BYTES", 1000)
    whole = TokenStream(*_prepared(config_for(write_config, src, validation_fraction=0.0,
                                              prepared_dir=str(tmp_path / "ref"))), "train")
    config = write_config(tiny_config(data={"dataset": str(src), "validation_fraction": 0.0},
                                      train={"eval_every": 0}), "killed.yaml")
    cfg = load_config(config)
    final = prepared_path(cfg)
    proc = subprocess.run([sys.executable, "-c", KILLED_AT_CHUNK_5, str(config)], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    [dead] = final.parent.glob(f"{final.name}.tmp-*")
    assert len(list(dead.glob("*.done.json"))) == 5
    gone = subprocess.Popen(["true"])
    gone.wait()
    other_dead = final.with_name(f"{final.name}.tmp-{socket.gethostname()}-{gone.pid}")
    other_host = final.with_name(f"{final.name}.tmp-elsewhere-{gone.pid}")
    for folder in (other_dead, other_host):
        (folder / "scratch").mkdir(parents=True)
        (folder / "train-00000.bin").write_bytes(b"\0" * 64)

    written = []
    write = prepare_mod._write_chunk
    monkeypatch.setattr(prepare_mod, "_write_chunk", lambda task: written.append(task[0]) or write(task))
    lines = []
    assert prepare(cfg, log=lines.append) == final
    assert f"continuing the prepare killed in {dead}: 5 finished chunk(s) kept" in lines
    assert f"removed {other_dead}: left by a prepare that was killed" in lines
    assert min(written) == 5 and not dead.exists() and not other_dead.exists() and other_host.exists()
    again = TokenStream(*open_prepared(cfg), "train")
    assert np.array_equal(again.read(0, again.num_tokens), whole.read(0, whole.num_tokens))
    assert sorted(p.name for p in final.iterdir() if not p.name.endswith(".bin")) == ["manifest.json"]


def test_prepare_is_idempotent_and_keyed_by_its_inputs(home, tmp_path, write_config, capsys):
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(DOCS) + "\n")
    cfg = config_for(write_config, src)
    folder = prepare(cfg, log=print)
    shard = folder / "train-00000.bin"
    mtime = shard.stat().st_mtime_ns
    assert prepare(cfg, log=print) == folder
    assert "prepared data is up to date" in capsys.readouterr().out
    assert shard.stat().st_mtime_ns == mtime

    # Another split of the documents, or changed source text, is another prepared dataset.
    assert prepared_path(config_for(write_config, src, validation_fraction=0.2)) != folder
    # So is every option that changes the tokens: whole files as documents, BOS, a validation file.
    val = tmp_path / "val.txt"
    val.write_text("\n".join(DOCS[:10]) + "\n")
    others = [prepared_path(config_for(write_config, src, **option)) for option in
              ({"text_unit": "file", "validation_fraction": 0.0}, {"add_bos": False},
               {"validation": str(val), "validation_fraction": None})]
    assert len({folder, *others}) == 4
    val.write_text("\n".join(DOCS[:20]) + "\n")  # and a changed validation file
    assert prepared_path(config_for(write_config, src, validation=str(val),
                                    validation_fraction=None)) != others[2]
    src.write_text("\n".join(DOCS[:100]) + "\n")
    assert prepared_path(cfg) != folder


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "save_to_disk", "hub_snapshot"])
def test_prepare_reads_each_source_format(home, tmp_path, write_config, tokenizer, fmt):
    import datasets

    ds = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))})
    if fmt == "jsonl":
        src = tmp_path / "docs.jsonl"
        ds.to_json(src)
    elif fmt == "parquet":
        src = tmp_path / "docs.parquet"
        ds.to_parquet(src)
    elif fmt == "save_to_disk":
        src = tmp_path / "saved"
        datasets.DatasetDict({"train": ds}).save_to_disk(src)
    else:  # what snapshot_download leaves: data/<split>-*.parquet plus a README
        src = home / "datasets" / "org" / "stories"
        (src / "data").mkdir(parents=True)
        ds.to_parquet(src / "data" / "train-00000-of-00001.parquet")
        (src / "README.md").write_text("# stories\n")
    dataset = "org/stories" if fmt == "hub_snapshot" else src
    cfg = config_for(write_config, dataset, validation_fraction=0.0)
    if fmt == "hub_snapshot":
        assert cfg.data.dataset == "org/stories"
    files = sorted(src.rglob("*")) if src.is_dir() else None
    manifest = json.loads((prepare(cfg, log=lambda _: None) / "manifest.json").read_text())
    assert manifest["splits"]["train"]["tokens"] == expected_tokens(tokenizer, DOCS)
    assert list(manifest["splits"]) == ["train"]
    if files is not None:  # nothing written into the dataset's folder (map's cache files went there)
        assert sorted(src.rglob("*")) == files


def test_shards_read_as_one_stream(home, tmp_path, write_config, monkeypatch):
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(DOCS) + "\n")
    cfg = config_for(write_config, src, validation_fraction=0.0)
    whole = TokenStream(*_prepared(cfg), "train")
    monkeypatch.setattr(prepare_mod, "CHUNK_BYTES", 1000)  # a shard file per ~1000 bytes of text
    folder, manifest = _prepared(config_for(write_config, src, validation_fraction=0.0,
                                            prepared_dir=str(tmp_path / "p2")))
    sharded = TokenStream(folder, manifest, "train")
    text = sum(len(d.encode()) for d in DOCS)
    assert len(manifest["splits"]["train"]["shards"]) in range(text // 1000, text // 1000 + 4)
    assert np.array_equal(sharded.read(0, sharded.num_tokens), whole.read(0, whole.num_tokens))
    for i in (0, 14, 15, 16, sharded.num_samples(64) - 1):  # windows across shard boundaries
        assert np.array_equal(sharded.sample(i, 64), whole.sample(i, 64))


def _prepared(cfg):
    prepare(cfg, log=lambda _: None)
    return open_prepared(cfg)


# Every sample of a prepared train split, read in a shuffled order under an open-file limit
# (argv: config, soft, hard), saved in index order: what a rank of a job does, in a process of its own.
READ_UNDER_LIMIT = """
import json, resource, sys
import numpy as np
from llmtrain.config import load_config
from llmtrain.data.loader import open_prepared, open_split
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), int(sys.argv[3])))
cfg = load_config(sys.argv[1])
data = open_split(*open_prepared(cfg), "train", cfg)
n = data.num_samples(cfg.data.seq_len)
order = np.random.default_rng(0).permutation(n)
rows = {}
for at in range(0, n, 4):
    batch = data.batch(order[at:at + 4], cfg.data.seq_len)
    for k, v in batch.fields().items():
        rows.setdefault(k, np.empty((n, v.shape[1]), v.dtype))[order[at:at + 4]] = v
np.savez(sys.argv[4], **rows)
print(json.dumps({"soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "samples": n}))
"""


def read_under_limit(config: Path, soft: int, hard: int, out: Path) -> tuple[dict, dict]:
    """READ_UNDER_LIMIT's arrays and its line (the soft limit after open_split, the sample count)."""
    proc = subprocess.run([sys.executable, "-c", READ_UNDER_LIMIT, str(config), str(soft), str(hard), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return dict(np.load(out)), json.loads(proc.stdout)


def test_more_shards_than_open_files_read_whole_and_the_soft_limit_is_raised(home, tmp_path, write_config,
                                                                            monkeypatch):
    """A split of ~200 shard files under a limit of 64 open files (soft and hard: nothing to
    raise), what a 100B-token corpus (~1,600 files) is under a job's 1024: every window in a
    shuffled order, the same tokens as the split in one file. With the hard limit above the
    soft, the soft is raised to it."""
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(DOCS) + "\n")
    whole = TokenStream(*_prepared(config_for(write_config, src, validation_fraction=0.0)), "train")
    monkeypatch.setattr(prepare_mod, "CHUNK_BYTES", 128)
    config = write_config(tiny_config(data={"dataset": str(src), "validation_fraction": 0.0,
                                            "prepared_dir": str(tmp_path / "p2")}, train={"eval_every": 0}),
                          "sharded.yaml")
    _, manifest = _prepared(load_config(config))
    assert len(manifest["splits"]["train"]["shards"]) >= 200
    rows, line = read_under_limit(config, 64, 64, tmp_path / "rows.npz")
    n = whole.num_samples(64)
    assert line == {"soft": 64, "samples": n}
    assert np.array_equal(rows["tokens"], np.stack([whole.sample(i, 64) for i in range(n)]))

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    _, line = read_under_limit(config, 64, hard, tmp_path / "again.npz")
    assert line["soft"] == hard


def test_failed_prepare_leaves_nothing(home, tmp_path, write_config, monkeypatch):
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(DOCS) + "\n")
    cfg = config_for(write_config, src)

    def crash(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(prepare_mod, "with_bos_eos", crash)  # in the middle of writing a shard
    with pytest.raises(RuntimeError):
        prepare(cfg, log=lambda _: None)
    assert not prepared_path(cfg).exists()
    assert not list(prepared_path(cfg).parent.glob("*"))

    with pytest.raises(PrepareError, match="data.text_field: no column 'body'"):
        prepare(config_for(write_config, src, text_field="body"), log=lambda _: None)


@pytest.mark.skipif(multiprocessing.get_start_method() != "fork",
                    reason="the workers must inherit the test's patch (forked, not spawned)")
def test_a_killed_tokenizing_process_ends_prepare_in_one_line(home, tmp_path, write_config, monkeypatch):
    """The out-of-memory killer takes a worker: prepare ends at once with one line and leaves
    nothing (a multiprocessing.Pool would wait for the dead worker's chunk forever)."""
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(DOCS) + "\n")
    path = write_config(tiny_config(data={"dataset": str(src), "num_proc": 2}))

    def killed(*args):
        os.kill(os.getpid(), signal.SIGKILL)

    monkeypatch.setattr(prepare_mod, "with_bos_eos", killed)  # the forked workers have it too
    proc = cli("prepare", "--config", path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr  # above it: progress bars
    assert proc.stderr.splitlines()[-1] == (
        "error: data.num_proc: a tokenizing process of 2 died (killed: out of memory?); give "
        "prepare more memory, or fewer processes")
    assert not list(prepared_path(load_config(path)).parent.glob("*"))


# ---------------------------------------------------------------------------------------------
# Sources as the ecosystem ships them: compressed, in several files, one document per file


def _write(path, fmt, docs):
    """docs in the format named by path's suffixes: .jsonl/.json/.csv/.txt, maybe compressed."""
    if fmt == "jsonl":
        text = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs))
    elif fmt == "json":
        text = json.dumps([{"text": d} for d in docs])
    elif fmt == "csv":
        text = "id,text\n" + "".join(f"{i},{d}\n" for i, d in enumerate(docs))
    else:
        text = "\n".join(docs) + "\n"
    opener = {".gz": gzip.open, ".bz2": bz2.open}.get(path.suffix)
    if opener:
        with opener(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)


@pytest.mark.parametrize("name", ["docs.jsonl.gz", "docs.json.gz", "docs.csv.gz", "docs.txt.gz",
                                  "docs.jsonl.bz2"])
def test_prepare_reads_compressed_files(home, tmp_path, write_config, tokenizer, name):
    _write(tmp_path / name, name.split(".")[1], DOCS)
    cfg = config_for(write_config, tmp_path / name, validation_fraction=0.0)
    manifest = json.loads((prepare(cfg, log=lambda _: None) / "manifest.json").read_text())
    assert manifest["splits"]["train"]["documents"] == len(DOCS)
    assert manifest["splits"]["train"]["tokens"] == expected_tokens(tokenizer, DOCS)


def test_a_glob_reads_every_file_it_matches(home, tmp_path, write_config, tokenizer):
    (tmp_path / "shards").mkdir()
    for i in range(3):
        _write(tmp_path / "shards" / f"part-{i}.jsonl.gz", "jsonl", DOCS[i * 100:(i + 1) * 100])
    path = write_config(tiny_config(data={"dataset": "./shards/*.jsonl.gz", "validation_fraction": 0.0},
                                    train={"eval_every": 0}))
    proc = cli("check-config", path)  # relative to the config file, and validated
    assert proc.returncode == 0, proc.stderr
    cfg = load_config(path)
    assert cfg.data.dataset == f"{tmp_path}/shards/*.jsonl.gz"
    folder = prepare(cfg, log=lambda _: None)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["splits"]["train"]["documents"] == 300
    assert manifest["splits"]["train"]["tokens"] == expected_tokens(tokenizer, DOCS)
    assert folder.name.startswith("shards-")
    # One more file matching the glob is another prepared dataset.
    _write(tmp_path / "shards" / "part-3.jsonl.gz", "jsonl", DOCS[:5])
    assert prepared_path(load_config(path)) != folder


def test_a_column_that_is_not_text_is_one_line(home, tmp_path, write_config):
    """jsonl/csv: check-config reads the first record (tests/test_config.py); parquet, json and
    hub folders: prepare names the column and its type."""
    from datasets import Dataset
    src = tmp_path / "chats.parquet"
    Dataset.from_list([{"text": d, "n": i, "messages": [{"role": "user", "content": d}]}
                       for i, d in enumerate(DOCS)]).to_parquet(str(src))
    proc = cli("prepare", "--config", write_config(tiny_config(
        data={"dataset": str(src), "text_field": "messages"})))
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        f"error: data.text_field: column 'messages' of {src} holds a list of "
        f"{{role: string, content: string}}, not text; choose a column of strings "
        f"(columns: text, n, messages)")
    assert "Traceback" not in proc.stderr
    with pytest.raises(PrepareError, match=r"^data\.text_field: column 'n' of .* holds int64, not text"):
        prepare(config_for(write_config, src, text_field="n"), log=lambda _: None)



def test_records_with_no_text_are_skipped_and_counted(home, tmp_path, write_config, tokenizer):
    """A jsonl record without the text field and a whole chunk of null ones: skipped and counted
    (were empty documents, an EOS alone each), and no empty shard file for the chunk."""
    records = [{"text": d} for d in DOCS[:150]] + [{"text": None}] * 150
    records[3] = {"body": DOCS[3]}
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    path = write_config(tiny_config(data={"dataset": str(src), "validation_fraction": 0, "num_proc": 2},
                                    train={"eval_every": 0}))
    proc = cli("prepare", "--config", path, check=True)
    assert "train: 151 records with no text skipped (no 'text' field, or null)" in proc.stdout.splitlines()
    folder = prepared_path(load_config(path))
    train = json.loads((folder / "manifest.json").read_text())["splits"]["train"]
    assert train["documents"] == 149 and train["no_text"] == 151
    assert train["tokens"] == expected_tokens(tokenizer, DOCS[:3] + DOCS[4:150])
    assert sorted(p.name for p in folder.iterdir()) == sorted(["manifest.json", *(s["file"] for s in train["shards"])])
    assert all(s["tokens"] > 0 for s in train["shards"]) and len(train["shards"]) < 8  # 8 chunks


@pytest.mark.parametrize("name", ["docs.txt", "docs.jsonl", "docs.csv"])
def test_bytes_that_are_not_utf8_name_the_file_and_line_or_are_replaced(home, tmp_path, write_config,
                                                                         tokenizer, name):
    """Line 12 holds a 0xff byte: strict (the default) names the file, line and column and leaves
    nothing; data.encoding_errors: replace / ignore prepare it as U+FFFD / without the byte, each
    in a folder of its own."""
    src = tmp_path / name
    _write(src, name.split(".")[1], DOCS)
    lines = src.read_bytes().split(b"\n")
    lines[11] = lines[11].replace(b"Anna", b"An\xffna", 1)
    src.write_bytes(b"\n".join(lines))
    doc = 10 if name.endswith(".csv") else 11  # the csv's first line is its header
    column = lines[11].index(b"\xff") + 1
    path = write_config(tiny_config(data={"dataset": str(src), "validation_fraction": 0}, train={"eval_every": 0}))
    proc = cli("prepare", "--config", path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"error: data.dataset: {src} line 12 is not valid UTF-8 (byte 0xff at column "
        f"{column}); fix the file, or set data.encoding_errors: replace (or ignore)")
    assert not list((home / "prepared").iterdir())
    strict = prepared_path(load_config(path))
    for errors, fixed in (("replace", "An\ufffdna"), ("ignore", "Anna")):
        cli("prepare", "--config", path, "--set", f"data.encoding_errors={errors}", check=True)
        folder = prepared_path(load_config(path, [f"data.encoding_errors={errors}"]))
        assert folder != strict
        docs = [d.replace("Anna", fixed, 1) if i == doc else d for i, d in enumerate(DOCS)]
        train = json.loads((folder / "manifest.json").read_text())["splits"]["train"]
        assert train["tokens"] == expected_tokens(tokenizer, docs)


@pytest.mark.parametrize("source", ["saved", "txt"])
def test_a_full_disk_is_one_line_naming_the_folder_and_leaves_nothing(home, tmp_path, write_config, source):
    """A 400 KiB filesystem as data.prepared_dir. txt: the library's copy of the source (1 MB)
    does not fit (was a line blaming the source); saved: a save_to_disk folder, read in place,
    and the shards of 2 tokenizing processes (580 KB) do not (was a worker's traceback)."""
    from datasets import Dataset
    rng = np.random.default_rng(0)
    words = np.array("Anna had a red ball and Tom saw the big blue kite in the park today".split())
    docs = [" ".join(rng.choice(words, 60)) for _ in range(4000)]
    if source == "saved":
        Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "saved"))
    else:
        (tmp_path / "saved.txt").write_text("\n".join(docs) + "\n")
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("mounting a 400 KiB tmpfs needs root (CI runs as root on this machine kind)")
    try:
        path = write_config(tiny_config(data={
            "dataset": str(tmp_path / ("saved" if source == "saved" else "saved.txt")),
            "prepared_dir": str(mount), "num_proc": 2, "validation_fraction": 0}, train={"eval_every": 0}))
        proc = cli("prepare", "--config", path)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert proc.stderr.splitlines()[-1] == (
            f"error: data.prepared_dir: {mount} is full (No space left on device); nothing was kept; "
            f"free space there, or set data.prepared_dir to a folder with room")
        assert not list(mount.iterdir())
    finally:
        # lazily: the datasets this process opened may still map files there until collected
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)

def test_add_bos_auto_adds_a_distinct_bos_to_every_document(home, tmp_path, write_config, tokenizer):
    """A Llama-3 style tokenizer: its own bos_token, not its eos_token, and prepare tokenizes
    without special tokens, so only data.add_bos puts it there."""
    llama3 = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    llama3.add_special_tokens({"bos_token": "<|begin_of_text|>"})
    llama3.save_pretrained(tmp_path / "llama3-tokenizer")
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(DOCS) + "\n")

    def prepared(**data):
        cfg = load_config(write_config(tiny_config(
            model={"tokenizer": str(tmp_path / "llama3-tokenizer")},
            data={"dataset": str(src), "validation_fraction": 0.0, **data}, train={"eval_every": 0})))
        lines = []
        folder = prepare(cfg, log=lines.append)
        manifest = json.loads((folder / "manifest.json").read_text())
        return TokenStream(folder, manifest, "train"), lines

    stream, lines = prepared()
    tokens = stream.read(0, stream.num_tokens)
    bos = llama3.bos_token_id
    assert tokens[0] == bos and (tokens == bos).sum() == len(DOCS)
    eos_at = np.flatnonzero(tokens == llama3.eos_token_id)
    assert np.array_equal(np.flatnonzero(tokens == bos)[1:], eos_at[:-1] + 1)  # right after each EOS
    assert stream.num_tokens == expected_tokens(tokenizer, DOCS) + len(DOCS)
    assert ("each document is tokenized as: <|begin_of_text|> text <|endoftext|> "
            "(data.add_bos: auto)") in lines

    off, lines = prepared(add_bos=False)
    assert off.num_tokens == expected_tokens(tokenizer, DOCS) and bos not in off.read(0, off.num_tokens)
    assert "each document is tokenized as: text <|endoftext|> (data.add_bos: false)" in lines


def test_demo_tokenizer_gets_no_bos_on_auto(home, tmp_path, write_config, tokenizer):
    """GPT-2 style: bos_token is eos_token, and the EOS after each document already separates them."""
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(DOCS) + "\n")
    lines = []
    folder = prepare(config_for(write_config, src, validation_fraction=0.0), log=lines.append)
    assert json.loads((folder / "manifest.json").read_text())["splits"]["train"]["tokens"] == \
        expected_tokens(tokenizer, DOCS)
    assert "each document is tokenized as: text <|endoftext|> (data.add_bos: auto)" in lines


@pytest.mark.parametrize("split_special_tokens", [False, True])
def test_text_gets_the_ids_transformers_gives_from_a_process_that_never_imports_it(
        home, tmp_path, write_config, split_special_tokens):
    """Plain text is tokenized with the tokenizer transformers builds, loaded in a forked process
    and sent as the tokenizers library's JSON: prepare's own process imports neither transformers
    nor torch (~3 s of start-up), the loading process transformers alone (torch is ~1 s more, and
    says nothing of it on stderr), and every id is still AutoTokenizer's (built here with torch
    imported), in the train and the
    validation split (one pool), the text of a special token in a document included, whichever
    way the tokenizer's split_special_tokens (a setting its JSON does not carry) reads it."""
    AutoTokenizer.from_pretrained(DEMO / "tokenizer", split_special_tokens=split_special_tokens) \
        .save_pretrained(tmp_path / "tokenizer")
    reference = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    docs = [d + " <|endoftext|> The end." if i % 3 == 0 else d for i, d in enumerate(DOCS)]
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(docs) + "\n")
    path = write_config(tiny_config(model={"tokenizer": str(tmp_path / "tokenizer")},
                                    data={"dataset": str(src), "num_proc": 2, "validation_fraction": 0.1}))
    run = subprocess.run([sys.executable, "-c", PREPARE_AND_LIST_MODULES, path], capture_output=True,
                         text=True, check=True)
    assert run.stdout.split()[-2:] == ["transformers:False", "torch:False"]
    assert "loader:transformers:True:torch:None" in run.stdout.split()
    assert "PyTorch" not in run.stderr

    folder, manifest = open_prepared(load_config(path))
    held = np.zeros(len(docs), dtype=bool)  # the seeded sample held out (see load_splits)
    held[np.random.default_rng(0).choice(len(docs), 30, replace=False)] = True
    for split, mask in (("train", ~held), ("validation", held)):
        ids = reference([d for d, m in zip(docs, mask) if m], add_special_tokens=False)["input_ids"]
        stream = TokenStream(folder, manifest, split)
        assert stream.read(0, stream.num_tokens).tolist() == [t for x in ids for t in x + [reference.eos_token_id]]


def test_documents_encoded_a_few_at_a_time_keep_every_id_in_order(home, tmp_path, write_config, tokenizer,
                                                                    monkeypatch):
    """The encoder takes about ENCODE_CHARS of text a call (its output then stays in the cache):
    at 300 characters, a few documents a call, the stream is still every document's ids and EOS."""
    monkeypatch.setattr(prepare_mod, "ENCODE_CHARS", 300)
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(DOCS) + "\n")
    cfg = config_for(write_config, src, validation_fraction=0)
    prepare(cfg, log=lambda _: None)
    folder, manifest = open_prepared(cfg)
    ids = tokenizer(DOCS, add_special_tokens=False)["input_ids"]
    stream = TokenStream(folder, manifest, "train")
    assert stream.read(0, stream.num_tokens).tolist() == [t for x in ids for t in x + [tokenizer.eos_token_id]]


def test_a_text_file_is_split_into_the_lines_the_librarys_text_builder_gives(tmp_path, monkeypatch):
    """One .txt file is split into lines by Arrow's CSV reader (4x as fast as the datasets
    library's text builder): the same documents for every way a line ends, blank lines, quotes,
    tabs and Unicode separators; where the reader would differ or fail (a byte order mark, its
    delimiter in a line, a line longer than its block, bytes that are not UTF-8) it gives None
    and the builder reads the file."""
    import datasets
    same = [b"a\r\nb\r\n\r\nc\r\n", b"a\rb\r\rc", b"a\nb\r", b"\n\na\n\n\nb\n\n", b"one\ntwo", b"\n",
            "h\u00e9llo \u2028 sep\u0085nel \u2029 x\n\u4e2d\u6587 \ufeff\n".encode(),
            b'"quoted" text, with, commas\n"unterminated\n\ttab\tline\t\n  spaces  \n',
            b"NA\nnull\n\nN/A\nNaN\n#comment\na\x0cb\x0bc\x1cd\x1ee\n"]
    for i, data in enumerate(same):
        path = tmp_path / f"same-{i}.txt"
        path.write_bytes(data)
        builder = datasets.load_dataset("text", data_files=[str(path)], split="train",
                                        cache_dir=str(tmp_path / f"cache-{i}"))["text"]
        lines = prepare_mod.text_lines(path, tmp_path / "scratch", f"same-{i}", datasets)
        assert lines is not None and lines["text"] == builder, data
    monkeypatch.setattr(prepare_mod, "LINE_BLOCK", 64)
    for i, data in enumerate([b"\xef\xbb\xbfa\nb\n", b"a\x1fb\nc\n", b"short\n" + b"x" * 200 + b"\n",
                              b"ok\nbad \xff here\n"]):
        path = tmp_path / f"other-{i}.txt"
        path.write_bytes(data)
        assert prepare_mod.text_lines(path, tmp_path / "scratch", f"other-{i}", datasets) is None, data


def test_documents_read_straight_from_arrow_are_the_selections_rows_in_its_order(tmp_path):
    """A tokenizing process reads its documents from the split's Arrow table and row selection
    itself: a run in order, one with gaps (a held-out split's), one out of order, none."""
    import datasets
    docs = [f"doc {i}" if i % 5 else None for i in range(40)]
    ds = datasets.Dataset.from_dict({"text": docs, "n": list(range(40))})
    for rows in ([3, 4, 5, 6], [1, 2, 7, 30, 31], [5, 7, 6, 2], list(range(10, 40))):
        part = ds.select(rows, indices_cache_file_name=str(tmp_path / "rows.arrow"))
        for start, stop in ((0, len(rows)), (1, len(rows) - 1), (2, 3)):
            assert prepare_mod.read_texts(part, "text", start, stop) == [docs[r] for r in rows[start:stop]]
    assert prepare_mod.read_texts(ds, "text", 8, 12) == docs[8:12]


def test_a_tokenizer_saved_with_truncation_and_padding_still_gets_every_token(home, tmp_path, write_config):
    """A tokenizer.json that carries truncation and padding (saved from a fine-tune with its
    max_length) tokenizes every document whole: the backend would cut each to 8 tokens."""
    AutoTokenizer.from_pretrained(DEMO / "tokenizer").save_pretrained(tmp_path / "tokenizer")
    spec = json.loads((tmp_path / "tokenizer" / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (tmp_path / "tokenizer" / "tokenizer.json").write_text(json.dumps(spec))
    reference = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(DOCS[:20]) + "\n")
    path = write_config(tiny_config(model={"tokenizer": str(tmp_path / "tokenizer")},
                                    data={"dataset": str(src), "validation_fraction": 0},
                                    train={"eval_every": 0}))
    prepare(load_config(path), log=lambda *_: None)
    folder, manifest = open_prepared(load_config(path))
    ids = reference(DOCS[:20], add_special_tokens=False, truncation=False, padding=False)["input_ids"]
    assert max(len(x) for x in ids) > 8
    stream = TokenStream(folder, manifest, "train")
    assert stream.read(0, stream.num_tokens).tolist() == [t for x in ids for t in x + [reference.eos_token_id]]


PREPARE_AND_LIST_MODULES = """
import sys
from llmtrain.config import load_config
from llmtrain.data import tokenizer
from llmtrain.data.prepare import prepare
load = tokenizer._send_text_tokenizer

def loader(folder, conn):  # the forked process that loads the tokenizer: what it imported
    load(folder, conn)
    print(f"loader:transformers:{'transformers' in sys.modules}:torch:{sys.modules.get('torch')}", flush=True)

tokenizer._send_text_tokenizer = loader
prepare(load_config(sys.argv[1]))
print(*(f"{name}:{name in sys.modules}" for name in ("transformers", "torch")))
"""


# ---------------------------------------------------------------------------------------------
# Data as researchers hold it: a text that is one document, a validation set of its own

BOOKS = ["ACT I.\nSCENE I. Rome.\n\nFirst Citizen:\nBefore we proceed any further, hear me speak.\n",
         "ACT II.\nSCENE I. A street.\n\nMENENIUS:\nWhat work's, my countrymen, in hand?\n",
         "ACT III.\nSCENE I. The Capitol.\n\nCORIOLANUS:\nTullus Aufidius then had made new head?\n"]


def test_text_unit_file_makes_each_file_one_document(home, tmp_path, write_config, tokenizer):
    (tmp_path / "books").mkdir()
    for i, book in enumerate(BOOKS):
        (tmp_path / "books" / f"{i}.txt").write_text(book)
    cfg = config_for(write_config, tmp_path / "books" / "*.txt", text_unit="file",
                     validation_fraction=0.0)
    folder = prepare(cfg, log=lambda _: None)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["splits"]["train"]["documents"] == 3
    assert manifest["splits"]["train"]["tokens"] == expected_tokens(tokenizer, BOOKS)  # newlines kept
    stream = TokenStream(folder, manifest, "train")
    text = tokenizer.decode(stream.read(0, stream.num_tokens))
    assert all(book in text for book in BOOKS)

    # One file, one document: nothing to hold out; the error says what to do instead.
    with pytest.raises(PrepareError) as e:
        prepare(config_for(write_config, tmp_path / "books" / "0.txt", text_unit="file"),
                log=lambda _: None)
    assert str(e.value) == ("data.validation_fraction: leaves no training documents (1 documents); "
                            "give the evaluation documents their own file in data.validation, or "
                            "set validation_fraction: 0")


def test_validation_from_its_own_file(home, tmp_path, write_config, tokenizer):
    train, val = tmp_path / "input.txt", tmp_path / "val.txt"
    train.write_text(BOOKS[0] + BOOKS[1])
    val.write_text(BOOKS[2])
    path = write_config(tiny_config(data={"dataset": "./input.txt", "validation": "./val.txt",
                                          "validation_fraction": None, "text_unit": "file"}))
    cfg = load_config(path)
    assert (cfg.data.validation, cfg.data.holdout_fraction) == (str(val), 0.0)
    manifest = json.loads((prepare(cfg, log=lambda _: None) / "manifest.json").read_text())
    splits = manifest["splits"]
    assert (splits["train"]["documents"], splits["validation"]["documents"]) == (1, 1)
    assert splits["train"]["tokens"] == expected_tokens(tokenizer, [BOOKS[0] + BOOKS[1]])
    assert splits["validation"]["tokens"] == expected_tokens(tokenizer, [BOOKS[2]])


def test_validation_from_the_datasets_own_split(home, write_config, tokenizer):
    """What snapshot_download leaves for a dataset with a validation split."""
    import datasets

    src = home / "datasets" / "org" / "stories"
    (src / "data").mkdir(parents=True)
    for split, docs in (("train", DOCS[:250]), ("validation", DOCS[250:])):
        shard = src / "data" / f"{split}-00000-of-00001.parquet"
        datasets.Dataset.from_dict({"text": docs}).to_parquet(shard)
    cfg = config_for(write_config, "org/stories", validation="validation", validation_fraction=None)
    splits = json.loads((prepare(cfg, log=lambda _: None) / "manifest.json").read_text())["splits"]
    assert (splits["train"]["documents"], splits["validation"]["documents"]) == (250, 50)
    assert splits["validation"]["tokens"] == expected_tokens(tokenizer, DOCS[250:])

    with pytest.raises(PrepareError) as e:
        prepare(config_for(write_config, "org/stories", validation="test", validation_fraction=None),
                log=lambda _: None)
    assert str(e.value) == f"data.validation: no split 'test' in {src} (splits: ['train', 'validation'])"


def test_a_prepared_folder_trains_without_its_source(home, tmp_path, write_config):
    """data.prepared (what submit freezes into a job's config): the run reads that folder and
    never the source's files, which may be deleted once prepared; the kind of data is checked."""
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(DOCS) + "\n")
    folder = prepare(config_for(write_config, src), log=lambda _: None)
    src.unlink()
    given = {"dataset": str(src), "prepared": str(folder)}
    path = write_config(tiny_config(data=given, train={"max_steps": 3, "eval_every": 0,
                                                       "checkpoint_every": 0}))
    assert cli("check-config", "--config", path).returncode == 0
    cli("train", "--config", path, check=True)
    [last] = [r for r in read_metrics(load_config(path).run_dir) if r["kind"] == "train"][-1:]
    assert last["step"] == 3 and np.isfinite(last["loss"])

    proc = cli("check-config", "--config", write_config(tiny_config(data={"dataset": str(src)}), "gone.yaml"))
    assert proc.returncode == 2 and f"data.dataset: no such file or folder (got '{src}')" in proc.stderr
    other = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    other.add_tokens(["<extra>"])
    other.save_pretrained(tmp_path / "other-tokenizer")
    proc = cli("check-config", "--config", write_config(tiny_config(
        data=given, model={"tokenizer": str(tmp_path / "other-tokenizer")}), "other.yaml"))
    assert proc.returncode == 2 and proc.stderr.splitlines()[0] == (
        f"data.prepared: {folder} was tokenized by {DEMO / 'tokenizer'}, another tokenizer than "
        f"this model's ({tmp_path / 'other-tokenizer'}); set data.prepared: null to prepare the "
        f"data with this one")
    # A data option the folder was not made with (a --set, a sweep's grid) is not silently ignored.
    proc = cli("check-config", "--config", path, "--set", "data.validation_fraction=0.05")
    assert proc.returncode == 2 and proc.stderr.splitlines()[0] == (
        f"data.prepared: {folder} was prepared with other data options (validation_fraction 0.02 "
        f"-> 0.05); set them as the folder has them, or data.prepared: null to prepare the data anew")
    # A folder from before manifests recorded the tokenizer's hash is taken as it is.
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["tokenizer"]["sha256"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert cli("check-config", "--config", path).returncode == 0
    chat = write_config(tiny_config(data={**given, "format": "chat"}), "chat.yaml")
    proc = cli("check-config", "--config", chat)
    assert proc.returncode == 2 and proc.stderr.splitlines()[0] == (
        f"data.prepared: {folder} holds a text stream, not chat samples; prepare the samples "
        f"(set data.prepared: null) or set data.format: text")


def test_training_unprepared_data_says_how_to_prepare(home, write_config):
    path = write_config(tiny_config())
    proc = cli("train", "--config", path)
    assert proc.returncode == 1
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: data: ") and f"run: llmtrain prepare --config {path}" in line


# ---------------------------------------------------------------------------------------------
# Sampling


def epoch_of_steps(num_samples, global_batch, world, seed=7):
    """Every rank's sample indices, step by step, for one epoch."""
    samplers = [StepSampler(num_samples, global_batch, seed, r, world) for r in range(world)]
    steps = num_samples // global_batch
    return [[s.next_step() for s in samplers] for _ in range(steps)]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_see_disjoint_samples_and_all_of_them(world):
    seen = [np.concatenate(per_rank) for per_rank in zip(*epoch_of_steps(96, 16, world))]
    everything = np.concatenate(seen)
    assert len(np.unique(everything)) == len(everything) == 96  # disjoint, and all of them
    for a in range(world):
        for b in range(a + 1, world):
            assert not set(seen[a]) & set(seen[b])


def test_a_step_holds_the_same_samples_for_any_world_size():
    one = epoch_of_steps(96, 16, 1)
    four = epoch_of_steps(96, 16, 4)
    for s1, s4 in zip(one, four):
        assert np.array_equal(s1[0], np.concatenate(s4))


def test_sampler_position_restores_exactly():
    a = StepSampler(50, 8, 3, 0, 1)
    for _ in range(9):  # into the second epoch (6 steps each, 2 samples dropped)
        a.next_step()
    assert a.state.state_dict() == {"epoch": 1, "consumed": 24}
    b = StepSampler(50, 8, 3, 0, 1)
    b.state.load_state_dict(a.state.state_dict())
    for _ in range(10):
        assert np.array_equal(a.next_step(), b.next_step())
    assert not np.array_equal(a.permutation(0), a.permutation(1))  # a new order every epoch


# ---------------------------------------------------------------------------------------------
# train.epochs: the steps derived from the prepared data, the epoch in the progress line


@pytest.fixture(scope="module")
def epochs_run(tmp_path_factory):
    """One short run of train.epochs: 2 on a small corpus, from scratch (single process)."""
    root = tmp_path_factory.mktemp("epochs-data")
    src = root / "docs.txt"
    src.write_text("\n".join(DOCS[:120]) + "\n")
    cfg = tiny_config(data={"dataset": str(src), "validation_fraction": 0.0},
                      train={"max_steps": None, "epochs": 2, "log_every": 1, "eval_every": 0,
                             "checkpoint_every": 0})
    with prepared_home(tmp_path_factory, "epochs", cfg) as (home, config):
        proc = cli("train", "--config", config, check=True)
        folder, manifest = open_prepared(load_config(config))
        yield home / "home" / "runs" / "test", proc.stdout, TokenStream(folder, manifest, "train")


@pytest.mark.slow
def test_epochs_set_the_steps_and_the_progress_line_shows_the_epoch(epochs_run):
    run_dir, stdout, stream = epochs_run
    samples = stream.num_samples(64)
    per_epoch = samples // 8
    assert f"train.epochs: 2 x {per_epoch} steps per epoch ({samples:,} samples // global batch 8) " \
           f"= {2 * per_epoch} steps" in stdout
    progress = [line.split("] ", 1)[1] for line in stdout.splitlines() if "] step " in line]
    assert len(progress) == 2 * per_epoch
    assert progress[per_epoch - 1].startswith(f"step {per_epoch}/{2 * per_epoch} | loss")
    assert progress[per_epoch - 1].endswith(" | epoch 1/2")
    assert progress[per_epoch].endswith(" | epoch 2/2") and progress[-1].endswith(" | epoch 2/2")
    epochs = [m["epoch"] for m in read_metrics(run_dir) if m["kind"] == "train"]
    assert (epochs[per_epoch - 1], epochs[-1]) == (1.0, 2.0)
    assert epochs[0] == round(1 / per_epoch, 4)
    # The run directory keeps the config as written: epochs, not the steps derived from it.
    written = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
    assert (written["epochs"], written["max_steps"]) == (2, None)


@pytest.mark.slow
def test_the_log_states_the_vocabulary_padding(epochs_run):
    _, stdout, _ = epochs_run
    assert ("vocab_size 512: the tokenizer's 479 tokens rounded up to a multiple of 64 for faster "
            "matmuls (33 rows no token uses); set model.architecture.vocab_size to choose "
            "another") in stdout


@pytest.mark.parametrize("bos", [None, 1])
def test_packing_puts_bos_and_eos_around_every_document_empty_ones_too(bos):
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(3, 500, size=int(n))) for n in rng.integers(0, 20, size=200)]
    docs[0], docs[57] = [], []
    offsets = np.cumsum([0] + [len(d) for d in docs])
    values = np.array([t for d in docs for t in d], dtype=np.int64)
    expected = [t for d in docs for t in ([] if bos is None else [bos]) + d + [2]]
    out = prepare_mod.with_bos_eos(offsets, values, bos, 2, np.uint16)
    assert out.dtype == np.uint16 and out.tolist() == expected


@pytest.mark.parametrize("squeue,continued", [
    ('echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1', True),  # long gone
    ("echo RUNNING", False),  # it may be writing there now
    ('echo "squeue: fatal: Could not establish a configuration source" >&2; exit 1', False)])
def test_another_hosts_prepare_is_continued_only_when_its_job_is_over(tmp_path, monkeypatch, squeue,
                                                                     continued):
    """A prepare job that timed out on node A, submitted again, runs on node B: squeue says
    whether A's job is over (and cannot tell without a controller: then it is left alone)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(f"#!/bin/sh\n{squeue}\n")
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    final = tmp_path / "prepared" / "docs-0123"
    elsewhere = final.with_name(f"{final.name}.tmp-nodeA-4321")
    elsewhere.mkdir(parents=True)
    (elsewhere / "owner.json").write_text('{"job_id": "4242"}\n')
    assert prepare_mod.abandoned(final, log=print) == (elsewhere if continued else None)
