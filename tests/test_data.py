"""prepare: token counts, formats, idempotence, atomicity; the sampler: disjoint, complete, resumable."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from conftest import DEMO, llmtrain, tiny_config
from llmtrain import prepare as prepare_mod
from llmtrain.config import load_config
from llmtrain.data import StepSampler, TokenStream, open_prepared, prepared_path
from llmtrain.prepare import PrepareError, prepare

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
    manifest = json.loads((prepare(cfg, log=lambda _: None) / "manifest.json").read_text())
    assert manifest["splits"]["train"]["tokens"] == expected_tokens(tokenizer, DOCS)
    assert list(manifest["splits"]) == ["train"]


def test_shards_read_as_one_stream(home, tmp_path, write_config, monkeypatch):
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(DOCS) + "\n")
    cfg = config_for(write_config, src, validation_fraction=0.0)
    whole = TokenStream(*_prepared(cfg), "train")
    monkeypatch.setattr(prepare_mod, "SHARD_TOKENS", 1000)
    folder, manifest = _prepared(config_for(write_config, src, validation_fraction=0.0,
                                            prepared_dir=str(tmp_path / "p2")))
    sharded = TokenStream(folder, manifest, "train")
    assert len(manifest["splits"]["train"]["shards"]) == -(-whole.num_tokens // 1000)
    assert np.array_equal(sharded.read(0, sharded.num_tokens), whole.read(0, whole.num_tokens))
    for i in (0, 14, 15, 16, sharded.num_samples(64) - 1):  # windows across shard boundaries
        assert np.array_equal(sharded.sample(i, 64), whole.sample(i, 64))


def _prepared(cfg):
    prepare(cfg, log=lambda _: None)
    return open_prepared(cfg)


def test_failed_prepare_leaves_nothing(home, tmp_path, write_config, monkeypatch):
    src = tmp_path / "docs.txt"
    src.write_text("\n".join(DOCS) + "\n")
    cfg = config_for(write_config, src)

    def crash(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(prepare_mod, "pack", crash)
    with pytest.raises(RuntimeError):
        prepare(cfg, log=lambda _: None)
    assert not prepared_path(cfg).exists()
    assert not list(prepared_path(cfg).parent.glob("*"))

    with pytest.raises(PrepareError, match="data.text_field: no column 'body'"):
        prepare(config_for(write_config, src, text_field="body"), log=lambda _: None)


def test_training_unprepared_data_says_how_to_prepare(home, write_config):
    path = write_config(tiny_config())
    proc = llmtrain("train", "--config", path)
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
