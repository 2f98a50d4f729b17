"""check-config as a user meets it: exit codes, one line per problem naming the key, no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from conftest import DEMO, REPO, cli, llmtrain, tiny_config
from llmtrain.config import ConfigError, load_config


@pytest.mark.parametrize("path", ["config.yaml", "configs/demo.yaml", "configs/llama3-70b.yaml"])
def test_shipped_configs_are_valid(home, path):
    proc = llmtrain("check-config", REPO / path)
    assert proc.returncode == 0, proc.stderr
    assert "OK" in proc.stdout and f"run_dir: {home}/runs/" in proc.stdout


def test_check_config_does_not_import_torch(home):
    code = ("import sys; from llmtrain.cli import main; rc = main(['check-config', "
            f"{str(REPO / 'config.yaml')!r}]); assert 'torch' not in sys.modules, 'torch imported'; "
            "sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


BROKEN = [
    # (what the user wrote, the exact line check-config must print)
    ({"train": {"max_step": 10}},
     "train.max_step: unknown key (did you mean 'max_steps'?)"),
    ({"trian": {"max_steps": 10}},
     "trian: unknown section (did you mean 'train'?)"),
    ({"train": {"max_steps": "ten"}},
     "train.max_steps: must be an integer (got 'ten')"),
    ({"train": {"lr": "fast"}},
     "train.lr: must be a number (got 'fast')"),
    ({"model": {"activation_checkpointing": "maybe"}},
     "model.activation_checkpointing: must be true or false (got 'maybe')"),
    ({"parallel": {"strategy": "zero3"}},
     "parallel.strategy: must be one of ddp, fsdp, hsdp (got 'zero3')"),
    ({"train": {"precision": "fp8"}},
     "train.precision: must be one of bf16, fp16, fp32 (got 'fp8')"),
    ({"train": {"global_batch_size": 12}},
     "train.global_batch_size: must be divisible by micro_batch_size x world size = 4 x 2 = 8 (got 12)"),
    # a relative path: the line shows it as written and as resolved against the config's folder
    ({"data": {"dataset": "./no/such/corpus.txt"}},
     "data.dataset: no such file or folder (got './no/such/corpus.txt', resolved to "
     "{tmp}/no/such/corpus.txt)"),
    ({"model": {"tokenizer": "../no-tokenizer"}},
     "model.tokenizer: no such folder (got '../no-tokenizer', resolved to {tmp_parent}/no-tokenizer)"),
    ({"model": {"tokenizer": "."}},  # a folder, without a tokenizer in it
     "model.tokenizer: no fast tokenizer (tokenizer.json) in the folder (got '.', resolved to {tmp})"),
    ({"model": {"name_or_path": "./base", "architecture": None}},
     "model.name_or_path: no Hugging Face model folder with a config.json (got './base', "
     "resolved to {tmp}/base)"),
    ({"train": {"resume": "ckpt/step-00000004"}},
     "train.resume: must be auto, none, or a checkpoint folder (got 'ckpt/step-00000004', "
     "resolved to {tmp}/ckpt/step-00000004)"),
    ({"train": {"warmup_steps": 8}},
     "train.warmup_steps: must be < train.max_steps (got 8 >= 8)"),
    # train.epochs instead of max_steps: exactly one of them
    ({"train": {"max_steps": None}},
     "train.max_steps: set exactly one of train.max_steps and train.epochs (got neither)"),
    ({"train": {"epochs": 2}},
     "train.max_steps: set exactly one of train.max_steps and train.epochs (got max_steps 8 and epochs 2)"),
    ({"train": {"max_steps": -1}},
     "train.max_steps: must be >= 0 (got -1)"),
    ({"train": {"max_steps": None, "epochs": 0}},
     "train.epochs: must be > 0 (got 0)"),
    # data sources: globs, a validation source of their own, text units, BOS
    ({"data": {"dataset": "./shards/*.jsonl.gz"}},
     "data.dataset: no file matches the pattern (got './shards/*.jsonl.gz', resolved to "
     "{tmp}/shards/*.jsonl.gz)"),
    ({"data": {"validation": "./val.txt", "validation_fraction": None}},
     "data.validation: no such file or folder (got './val.txt', resolved to {tmp}/val.txt)"),
    ({"data": {"validation": "validation", "validation_fraction": None}},
     "data.validation: a split name, but data.dataset is a file with no splits; give the "
     "validation file's path instead (got 'validation')"),
    ({"data": {"validation": str(DEMO / "stories.txt")}},
     "data.validation_fraction: set only one of data.validation and data.validation_fraction "
     f"(got '{DEMO / 'stories.txt'}' and 0.02)"),
    ({"data": {"text_unit": "page"}},
     "data.text_unit: must be one of line, file (got 'page')"),
    ({"data": {"add_bos": 1}},
     "data.add_bos: must be one of auto, true, false (got 1)"),
    ({"train": {"min_lr": 0.1}},
     "train.min_lr: must be <= train.lr (got 0.1 > 0.003)"),
    ({"data": {"seq_len": 4096}},
     "data.seq_len: must be <= the model's max_position_embeddings (got 4096 > 128)"),
    ({"data": {"validation_fraction": 0.7}},
     "data.validation_fraction: must be in [0, 0.5) (got 0.7)"),
    ({"slurm": {"procs_per_node": None}},
     "slurm.procs_per_node: set it on CPU-only nodes (slurm.gpus_per_node is 0)"),
    ({"slurm": {"slow_node_ratio": 1.5}},
     "slurm.slow_node_ratio: must be in (0, 1) (got 1.5)"),
    ({"slurm": {"exclude_slow_nodes": True, "preflight": False}},
     "slurm.exclude_slow_nodes: needs slurm.preflight: true, which finds the slow nodes"),
    ({"slurm": {"exclude_slow_nodes": True, "max_requeues": 0}},
     "slurm.exclude_slow_nodes: the job comes back without a slow node as a requeue, and "
     "slurm.max_requeues is 0; allow at least 1, or turn exclude_slow_nodes off"),
    ({"train": {"micro_batch_size": 0}},
     "train.micro_batch_size: must be > 0 (got 0)"),
    # every launch would stop after a step or two and requeue until out of requeues
    ({"slurm": {"time": "00:01:00"}},
     "slurm.time: each launch saves and stops at least slurm.signal_lead_s = 120 s before its end, "
     "which leaves too little of 00:01:00 to train; ask for more than 240 s, or lower "
     "slurm.signal_lead_s"),
    ({"parallel": {"strategy": "hsdp", "shard_size": 3}},
     "parallel.shard_size: must divide the world size 2 (got 3); hsdp shards within groups of "
     "shard_size ranks and replicates across them"),
    ({"parallel": {"shard_size": 2}},
     "parallel.shard_size: only used with parallel.strategy: hsdp (got strategy ddp)"),
    ({"parallel": {"startup_timeout_s": 5}},
     "parallel.startup_timeout_s: must be >= 10 (got 5)"),
    ({"profile": {"ranks": [0, -1]}},
     "profile.ranks: must be all or ranks >= 0, like [0, 8] (got [0, -1])"),
    ({"model": {"name_or_path": "/models/llama"}},
     "model.name_or_path: set exactly one of model.name_or_path (pretrained) and "
     "model.architecture (from scratch)"),
    # other trainers' names: difflib finds nothing, or a misleading key (batch_size -> micro_batch_size)
    ({"train": {"learning_rate": 3e-4}}, "train.learning_rate: unknown key (did you mean 'lr'?)"),
    ({"train": {"batch_size": 8}},
     "train.batch_size: unknown key (llmtrain's are global_batch_size and micro_batch_size)"),
    ({"train": {"gradient_accumulation_steps": 4}},
     "train.gradient_accumulation_steps: unknown key (accumulation follows from global_batch_size / "
     "(micro_batch_size x world size))"),
    ({"train": {"num_train_epochs": 3}}, "train.num_train_epochs: unknown key (did you mean 'epochs'?)"),
    ({"train": {"warmup_ratio": 0.1}},
     "train.warmup_ratio: unknown key (llmtrain counts warmup in steps: warmup_steps)"),
    ({"train": {"max_grad_norm": 1.0}}, "train.max_grad_norm: unknown key (did you mean 'grad_clip'?)"),
]


@pytest.mark.parametrize("change,line", BROKEN, ids=[b[1].split(":")[0] for b in BROKEN])
def test_broken_config_names_the_key(home, tmp_path, write_config, change, line):
    path = write_config(tiny_config(**change))
    proc = llmtrain("check-config", path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [line.format(tmp=tmp_path, tmp_parent=tmp_path.parent)]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_required_keys_are_reported(home, write_config):
    cfg = tiny_config()
    del cfg["run"]["name"], cfg["train"]["global_batch_size"]
    proc = llmtrain("check-config", write_config(cfg))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["run.name: required, no default",
                                        "train.global_batch_size: required, no default"]


def test_epochs_and_data_options_load(home, write_config):
    cfg = load_config(write_config(tiny_config()), ["train.max_steps=null", "train.epochs=3",
                                                    "data.add_bos=true", "data.text_unit=file"])
    assert (cfg.train.max_steps, cfg.train.epochs) == (None, 3)
    assert (cfg.data.add_bos, cfg.data.text_unit, cfg.data.holdout_fraction) == (True, "file", 0.02)


def test_every_problem_is_reported_at_once(home, write_config):
    cfg = tiny_config(train={"max_steps": -5, "lr": -1.0, "checkpoint_every": -1, "bogus": 1},
                      parallel={"strategy": "zero"}, data={"seq_len": 4096})
    proc = llmtrain("check-config", write_config(cfg))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "train.bogus: unknown key",  # and the checks of the rest still run
        "parallel.strategy: must be one of ddp, fsdp, hsdp (got 'zero')",
        "train.max_steps: must be >= 0 (got -5)",
        "train.lr: must be > 0 (got -1.0)",
        "train.checkpoint_every: must be >= 0 (got -1)",
        "data.seq_len: must be <= the model's max_position_embeddings (got 4096 > 128)",
    ]


def test_a_time_is_a_time_in_the_file_and_in_set(home, write_config):
    """YAML 1.1 reads 12:00:00 as the base-60 integer 43200; a config means the time."""
    cfg = tiny_config()
    cfg["slurm"] = {"time": "TIME", "procs_per_node": 2}
    path = write_config(cfg)
    path.write_text(path.read_text().replace("TIME", "12:00:00"))  # unquoted in the file
    assert "time: '12:00:00'" not in path.read_text() and load_config(path).slurm.time == "12:00:00"
    assert load_config(path, ["slurm.time=36:00:00"]).slurm.time == "36:00:00"
    assert load_config(path, ["train.lr=1e-3", "train.max_steps=20"]).train.max_steps == 20


def test_tokenizer_larger_than_model_vocab(home, write_config):
    arch = {**tiny_config()["model"]["architecture"], "vocab_size": 100}
    proc = llmtrain("check-config", write_config(tiny_config(model={"architecture": arch})))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "model.tokenizer: vocabulary of 479 tokens does not fit the model's vocab_size 100"]


def test_set_overrides_are_typed_like_the_file(home, write_config):
    path = write_config(tiny_config())
    cfg = load_config(path, ["train.lr=1e-3", "train.max_steps=20", "parallel.strategy=fsdp",
                             "model.architecture.hidden_size=32"])
    assert (cfg.train.lr, cfg.train.max_steps, cfg.parallel.strategy) == (1e-3, 20, "fsdp")
    assert cfg.model.architecture["hidden_size"] == 32
    proc = llmtrain("check-config", path, "--set", "train.max_steps=abc", "--set", "nonsense")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["--set nonsense: expected section.key=value",
                                        "train.max_steps: must be an integer (got 'abc')"]


def test_world_size_flag_checks_the_batch_split(home, write_config):
    path = write_config(tiny_config())
    assert llmtrain("check-config", path, "--world-size", "1").returncode == 0
    proc = llmtrain("check-config", path, "--world-size", "3")
    assert proc.stderr.splitlines() == ["train.global_batch_size: must be divisible by "
                                        "micro_batch_size x world size = 4 x 3 = 12 (got 8)"]


def test_invalid_yaml_is_one_line(home, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  max_steps: [1, 2\n")
    proc = llmtrain("check-config", path)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith(f"{path}: line ") and "not valid YAML" in proc.stderr


def test_unset_home_variable_is_named(tmp_path, monkeypatch, write_config):
    monkeypatch.delenv("LLMTRAIN_HOME", raising=False)
    with pytest.raises(ConfigError) as e:
        load_config(write_config(tiny_config()))
    assert e.value.problems[0] == ("run.dir: environment variable LLMTRAIN_HOME is not set (source "
                                   "the env.sh that setup.sh wrote) (got '${LLMTRAIN_HOME}/runs')")


def test_paths_resolve_against_the_config_folder(home, tmp_path):
    cfg_dir = tmp_path / "sub"
    cfg_dir.mkdir()
    (cfg_dir / "c.yaml").write_text(yaml.safe_dump(tiny_config(
        data={"dataset": "../corpus.txt"}, model={"tokenizer": str(DEMO / "tokenizer")})))
    (tmp_path / "corpus.txt").write_text("hello\n")
    cfg = load_config(cfg_dir / "c.yaml")
    assert cfg.data.dataset == str(tmp_path / "corpus.txt")
    assert cfg.run_dir == home / "runs" / "test"
    hub = load_config(cfg_dir / "c.yaml", ["model.tokenizer=org/some-model"])
    assert hub.model.tokenizer == "org/some-model"  # a hub id, looked up under $LLMTRAIN_HOME
    # Keys that are never hub ids resolve even without ./ (they used to stay relative to the cwd).
    local = load_config(cfg_dir / "c.yaml", ["run.dir=runs", "data.prepared_dir=prepared"])
    assert local.run_dir == cfg_dir / "runs" / "test"
    assert local.data.prepared_dir == str(cfg_dir / "prepared")


def test_check_config_takes_the_config_as_option_or_argument(home, write_config):
    path = write_config(tiny_config())
    as_option = llmtrain("check-config", "--config", path)
    as_argument = llmtrain("check-config", path)
    assert as_option.returncode == as_argument.returncode == 0, as_option.stderr
    assert as_option.stdout == as_argument.stdout and "OK" in as_option.stdout
    both = f"FILE {path} and --config {path}"
    for args, got in ([], "neither"), ([path, "--config", path], both):
        proc = llmtrain("check-config", *args)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.splitlines() == [f"check-config: give the config once, as --config FILE "
                                            f"or FILE (got {got})"]


@pytest.mark.parametrize("record,line", [
    ({"txt": "hello"}, "data.text_field: no column 'text' in {path} (columns: txt)"),
    ({"text": [{"role": "user", "content": "hi"}]},
     "data.text_field: column 'text' of {path} holds list, not text; choose a column of strings"),
])
def test_a_wrong_text_column_is_caught_before_the_queue(home, tmp_path, write_config, record, line):
    """check-config (which submit.sh runs) reads the first record: no prepare job fails later."""
    import gzip
    with gzip.open(tmp_path / "docs.jsonl.gz", "wt") as f:
        f.write(json.dumps(record) + "\n")
    proc = llmtrain("check-config", write_config(tiny_config(data={"dataset": "docs.jsonl.gz"})))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [line.format(path=tmp_path / "docs.jsonl.gz")]


@pytest.mark.parametrize("data,rows", [
    ({"document_masking": True}, "the documents of a row (data.document_masking)"),
    ({"format": "prompt_completion", "dataset": "pc.jsonl"}, "the samples packed in a row (data.packing)"),
])
def test_flash_attention_with_packed_rows_needs_micro_batches_of_one(home, tmp_path, write_config, data, rows):
    """transformers' flash path separates packed sequences by their position ids only in a batch
    of one row; in a larger one it would attend across them: refused before the queue."""
    (tmp_path / "pc.jsonl").write_text(json.dumps({"prompt": "Where is Anna?", "completion": "Home."}) + "\n")
    path = write_config(tiny_config(model={"attn_implementation": "flash_attention_2"}, data=data))
    line = (f"model.attn_implementation: flash_attention_2 lets {rows} attend to each other when "
            f"train.micro_batch_size > 1 (got 4; it separates them only in batches of one row); "
            f"set train.micro_batch_size: 1, or use sdpa")
    proc = cli("check-config", path)  # (and, without flash-attn installed, a line saying so)
    assert proc.returncode == 2 and line in proc.stderr.splitlines() and "Traceback" not in proc.stderr
    for fix in ("train.micro_batch_size=1", "model.attn_implementation=sdpa"):
        assert line not in cli("check-config", path, "--set", fix).stderr.splitlines()
    if data.get("format"):  # one sample a row: causal attention over the row is exact
        assert line not in cli("check-config", path, "--set", "data.packing=false").stderr.splitlines()
