"""Checkpoints under real kills: exact resume, resharding, crash consistency, export, generation."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import (DEMO, cli, imported_first, launch_training, losses, prepared_home, read_metrics,
                      tiny_config, torchrun, torchrun_unchecked)
from llmtrain.config import load_config
from llmtrain.data.loader import StepSampler, TokenStream, open_prepared

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # 16 steps of 8 samples; the corpus has ~3,700 samples of 64 tokens, so every kill falls
    # mid-epoch; micro batch 2 gives gradient accumulation (2 per rank on 2 ranks).
    cfg = tiny_config(train={"max_steps": 16, "micro_batch_size": 2, "checkpoint_every": 5,
                             "eval_every": 8})
    with prepared_home(tmp_path_factory, "ckpt", cfg) as home:
        yield home


def kill_when(proc: subprocess.Popen, ready, timeout: float = 240, per_line: bool = False) -> None:
    """SIGKILL the whole launcher group as soon as `ready()` holds. per_line: test it after each
    line the run prints (a step's progress line), blocking on its output instead of polling;
    otherwise poll every 20 ms (for a moment inside a save, which prints nothing)."""
    deadline = time.monotonic() + timeout
    if per_line:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if ready():
                break
        else:
            raise AssertionError("run ended before the kill:\n" + "".join(seen))
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"run ended before the kill:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("the kill point never came")
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def logged_step(run_dir: Path) -> int:
    try:
        return max((r["step"] for r in read_metrics(run_dir)), default=0)
    except (OSError, ValueError):
        return 0


def reference(setup, strategy: str) -> Path:
    """The uninterrupted 2-process run of `strategy` (16 steps, saved every 5), made by the first
    test that asks."""
    root, config = setup
    ref_dir = root / "home" / "runs" / f"ref-{strategy}"
    if not ref_dir.exists():
        torchrun(2, "train", "--config", config, "--set", f"run.name=ref-{strategy}",
                 "--set", f"parallel.strategy={strategy}")
    return ref_dir


@pytest.mark.parametrize("strategy,async_save", [("ddp", False), ("fsdp", True)])
def test_killed_and_restarted_run_is_bit_identical(setup, strategy, async_save):
    """A synchronous save (DDP) and an async one (FSDP2 DTensor shards). FSDP2 with a synchronous
    save is killed and restarted in test_finetune.py (LoRA), and resumed on other world sizes below."""
    root, config = setup
    ref_dir = reference(setup, strategy)

    name = f"killed-{strategy}-{async_save}"
    run_dir = root / "home" / "runs" / name
    sets = (f"run.name={name}", f"parallel.strategy={strategy}",
            f"train.async_checkpoint={str(async_save).lower()}")
    latest = run_dir / "checkpoints" / "latest"
    kill_when(launch_training(2, config, *sets), lambda: latest.exists() and logged_step(run_dir) >= 7,
              per_line=True)
    assert logged_step(run_dir) < 16
    torchrun(2, "train", "--config", config, *(x for s in sets for x in ("--set", s)))

    assert losses(run_dir) == losses(ref_dir)  # every step, train and eval, bit for bit
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert "resumed from" in log and "step-00000005" in log


# Every rank but the first is refused DCP's .metadata (pathlib opens with io.open).
METADATA_ON_RANK_0_ONLY = """
import builtins, io, os
_open = io.open
def _open_all_but_the_index(file, *args, **kwargs):
    if os.environ.get("RANK", "0") != "0" and str(file).endswith(".metadata"):
        raise PermissionError(13, "this test lets only rank 0 read it", str(file))
    return _open(file, *args, **kwargs)
io.open = builtins.open = _open_all_but_the_index
"""


def test_a_resume_reads_the_checkpoint_index_on_one_rank(setup, tmp_path):
    """DCP's .metadata lists every rank's chunks (1.15 GB for a 405B saved by 2048 ranks:
    bench/dcp_metadata.py); rank 0 reads it and broadcasts it, and each rank plans its own reads.
    With rank 1 unable to open it, the resume from step 10 trains the uninterrupted curve bit
    for bit."""
    root, config = setup
    ref_dir = reference(setup, "fsdp")
    copy = root / "home" / "runs" / "index-once"
    shutil.copytree(ref_dir, copy)
    for later in ("step-00000015", "step-00000016"):
        shutil.rmtree(copy / "checkpoints" / later)
    (copy / "checkpoints" / "latest").write_text("step-00000010\n")
    proc = torchrun_unchecked(2, "train", "--config", config, "--set", "run.name=index-once",
                              "--set", "parallel.strategy=fsdp",
                              env=imported_first(tmp_path, METADATA_ON_RANK_0_ONLY))
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (copy / "logs" / "rank-0.log").read_text()
    assert "resumed from" in log and "(step 10, saved by 2 ranks)" in log
    assert losses(copy) == losses(ref_dir)  # steps 11-16 trained again, bit for bit


# torch 2.11's DefaultStager, reproduced on the torch here: it closes its state-dict stager at
# the end of every stage (pytorch#183413), which empties its copy table.
STAGER_CLOSES_ITSELF = """
from torch.distributed.checkpoint.staging import DefaultStager
_stage = DefaultStager._stage
def _stage_then_close(self, state_dict, **kwargs):
    try:
        return _stage(self, state_dict, **kwargs)
    finally:
        self._state_dict_stager.close()
DefaultStager._stage = _stage_then_close
"""


def test_async_saves_go_on_with_a_stager_that_closes_itself(setup, tmp_path):
    """On the GPU machine (torch 2.11) the second async save of a run died with KeyError:
    <class 'type'>: its DefaultStager closes itself after each save. Each save after such a
    close stages with a fresh one: all four checkpoints of the run are written, and it ends 0."""
    root, config = setup
    name = "stager-closes"
    proc = torchrun_unchecked(1, "train", "--config", config, "--set", f"run.name={name}",
                              "--set", "parallel.strategy=fsdp", "--set", "train.async_checkpoint=true",
                              "--set", "train.keep_checkpoints=4", env=imported_first(tmp_path, STAGER_CLOSES_ITSELF))
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoints = root / "home" / "runs" / name / "checkpoints"
    assert sorted(p.parent.name for p in checkpoints.glob("step-*/meta.json")) == [
        "step-00000005", "step-00000010", "step-00000015", "step-00000016"]


@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)])
def test_resume_on_another_world_size_skips_and_repeats_nothing(setup, first, second):
    root, config = setup
    name = f"reshard-{first}-{second}"
    common = ["--set", f"run.name={name}", "--set", "parallel.strategy=fsdp",
              "--set", "train.log_samples=true"]
    for nproc, sets in ((first, ["--set", "train.max_steps=5"]), (second, [])):  # then 16, from 5
        if nproc == 1:  # a world of one: the plain command, in this process
            cli("train", "--config", config, *common, *sets, check=True)
        else:
            torchrun(nproc, "train", "--config", config, *common, *sets)

    run_dir = root / "home" / "runs" / name
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"] == list(range(1, 17))
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert f"saved by {first} ranks" in log and "changed since the checkpoint: train.max_steps 5 -> 16" in log

    # Count what every rank of both jobs trained on: 16 steps x 8 samples, each exactly once,
    # and exactly the first 128 entries of the epoch's permutation (nothing skipped).
    trained = [i for f in sorted((run_dir / "logs").glob("samples-rank-*.jsonl"))
               for line in f.read_text().splitlines() for i in json.loads(line)["samples"]]
    cfg = load_config(config, world_size=1)
    folder, manifest = open_prepared(cfg)
    n = TokenStream(folder, manifest, "train").num_samples(64)
    assert n > 128  # the run stayed inside epoch 0
    assert sorted(trained) == sorted(StepSampler(n, 8, cfg.train.seed, 0, 1).permutation(0)[:128])


def test_incompatible_resume_names_the_difference(setup):
    root, config = setup
    name = "compat"
    cli("train", "--config", config, "--set", f"run.name={name}", "--set", "train.max_steps=5",
             check=True)
    run_dir = root / "home" / "runs" / name
    # What check-config can know (seq_len, global batch) is refused before any job is queued...
    check = cli("check-config", config, "--set", f"run.name={name}",
                     "--set", "train.global_batch_size=16")
    assert check.returncode == 2 and check.stderr.splitlines() == [
        f"train.resume: checkpoint {run_dir}/checkpoints/step-00000005 does not match this config: "
        f"global_batch_size differs (8 -> 16); use a new run.name, or set train.resume: none to "
        f"start over"]
    data = cli("check-config", config, "--set", f"run.name={name}",
                    "--set", "data.validation_fraction=0.05")
    assert data.returncode == 2 and data.stderr.splitlines() == [
        f"train.resume: checkpoint {run_dir}/checkpoints/step-00000005 was trained on other data "
        f"(the dataset's files, the tokenizer or the data options changed); use a new run.name, "
        f"or set train.resume: none to start over"]
    # ... and the rest (the model's architecture) when the trainer starts.
    proc = cli("train", "--config", config, "--set", f"run.name={name}",
                    "--set", "model.architecture.intermediate_size=96")
    assert proc.returncode == 1
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "does not match this config: model differs (intermediate_size: 128 -> 96)" in line
    assert "Traceback" not in proc.stderr
    # A checkpoint a newer llmtrain wrote (meta.json's format) is refused, not misread.
    meta_path = run_dir / "checkpoints" / "step-00000005" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["format"] == 1
    meta_path.write_text(json.dumps({**meta, "format": 2}))
    proc = cli("train", "--config", config, "--set", f"run.name={name}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert [x for x in proc.stderr.splitlines() if x.startswith("error:")] == [
        f"error: checkpoint {run_dir}/checkpoints/step-00000005 has format 2, newer than this "
        f"llmtrain reads (1); update llmtrain (git pull, then bash setup.sh)"]


def test_a_refused_start_leaves_the_run_files_as_they_were(setup):
    root, config = setup
    run_dir = root / "home" / "runs" / "refused"
    cli("train", "--config", config, "--set", "run.name=refused", "--set", "train.max_steps=5",
             check=True)
    before = {name: (run_dir / name).read_bytes() for name in ("config.yaml", "provenance.json",
                                                               "metrics.jsonl")}
    proc = cli("train", "--config", config, "--set", "run.name=refused",
                    "--set", "model.architecture.intermediate_size=96")
    assert proc.returncode == 1 and "model differs (intermediate_size: 128 -> 96)" in proc.stderr
    assert {name: (run_dir / name).read_bytes() for name in before} == before


def test_a_resume_takes_the_configs_optimizer_settings(setup):
    """weight_decay/betas/eps changed for a resume are used, not the checkpoint's."""
    root, config = setup
    first = ["--set", "train.max_steps=8", "--set", "train.checkpoint_every=4"]
    runs = root / "home" / "runs"
    cli("train", "--config", config, "--set", "run.name=wd-same", *first, "--set", "train.eval_every=0", check=True)
    shutil.rmtree(runs / "wd-same" / "checkpoints" / "step-00000008")
    (runs / "wd-same" / "checkpoints" / "latest").write_text("step-00000004\n")
    shutil.copytree(runs / "wd-same", runs / "wd-changed")  # two resumes of one checkpoint
    cli("train", "--config", config, "--set", "run.name=wd-same", *first,
             "--set", "train.eval_every=0", check=True)
    proc = cli("train", "--config", config, "--set", "run.name=wd-changed", *first,
                    "--set", "train.eval_every=0", "--set", "train.weight_decay=20.0",
                    "--set", "train.beta2=0.5", check=True)
    assert "changed since the checkpoint: train.weight_decay 0.1 -> 20.0" in proc.stdout
    same, changed = (losses(root / "home" / "runs" / n) for n in ("wd-same", "wd-changed"))
    assert same[:4] == changed[:4]  # the steps before the checkpoint
    # Decay of 20 x lr shrinks every matrix by ~6% a step: steps 6-8 must show it.
    assert all(abs(a[2] - b[2]) > 1e-3 for a, b in zip(same[5:], changed[5:])), (same, changed)


def test_an_error_with_an_async_save_in_flight_lets_the_save_complete(setup):
    """The step after an async checkpoint fails: the checkpoint still completes (meta.json,
    `latest`) before the process group goes, and the error is one line."""
    root, config = setup
    proc = torchrun_unchecked(2, "train", "--config", config, "--set", "run.name=async-error",
                              "--set", "parallel.strategy=fsdp", "--set", "train.async_checkpoint=true",
                              "--set", "train.max_bad_steps=0", "--set", "train.eval_every=0",
                              env={"LLMTRAIN_INJECT_NAN_STEPS": "6"}, timeout=240)
    assert proc.returncode != 0
    errors = {x for x in proc.stderr.splitlines() if x.startswith("error:")}
    assert errors == {"error: training stopped at step 6: 1 step in a row had a non-finite loss "
                      "or gradient norm (train.max_bad_steps is 0); lower train.lr, check the "
                      "data (logs/rank-*.log name the samples), or resume from an earlier "
                      "checkpoint with train.resume"}
    ckpts = root / "home" / "runs" / "async-error" / "checkpoints"
    assert (ckpts / "step-00000005" / "meta.json").is_file()
    assert (ckpts / "latest").read_text() == "step-00000005\n"
    assert not list(ckpts.glob(".tmp-*"))
    assert "terminate called" not in proc.stderr


def test_kill_during_save_never_leaves_a_bad_latest(setup):
    """SIGKILL at several instants of checkpoint writing; each restart resumes cleanly."""
    root, config = setup
    name = "savekill"
    run_dir = root / "home" / "runs" / name
    ckpts = run_dir / "checkpoints"
    sets = (f"run.name={name}", "train.checkpoint_every=1", "train.max_steps=40", "train.eval_every=0")
    for delay in (0.0, 0.02, 0.06):
        proc = launch_training(2, config, *sets)
        # Killed while a save is under way, after at least one completed (so `latest` exists).
        kill_when(proc, lambda: (ckpts / "latest").exists() and any(ckpts.glob(".tmp-step-*"))
                  and (time.sleep(delay) or True))
        # Whatever the instant, `latest` names a complete checkpoint.
        assert (ckpts / (ckpts / "latest").read_text().strip() / "meta.json").is_file()
    torchrun(2, "train", "--config", config, *(x for s in sets for x in ("--set", s)))
    steps = [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert steps == list(range(1, 41))


def test_damaged_newest_checkpoint_falls_back_to_the_previous(setup):
    root, config = setup
    name = "damaged"
    run_dir = root / "home" / "runs" / name
    common = ["--set", f"run.name={name}", "--set", "train.eval_every=0"]
    cli("train", "--config", config, *common, "--set", "train.max_steps=10", check=True)
    newest = run_dir / "checkpoints" / "step-00000010"
    for shard in newest.glob("*.distcp"):
        shard.write_bytes(b"garbage")
    proc = cli("train", "--config", config, *common, "--set", "train.max_steps=12")
    assert proc.returncode == 0, proc.stderr
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert f"warning: skipping checkpoint {newest}: cannot load it" in log
    assert "resumed from" in log and "step-00000005 (step 5" in log
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"] == list(range(1, 13))


def test_export_loads_in_plain_transformers_with_identical_logits(setup, tmp_path):
    run_dir = reference(setup, "fsdp")  # its DTensor shards, saved by 2 ranks
    out = tmp_path / "hf"
    cli("export", "--run-dir", run_dir, "--out", out, check=True)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}

    code = ("import sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer; "
            f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}); "
            f"t = AutoTokenizer.from_pretrained({str(out)!r}); "
            "ids = t('Once upon a time, Tom had a red ball.', return_tensors='pt').input_ids; "
            "torch.save(m(input_ids=ids).logits, sys.argv[1])")
    logits_file = tmp_path / "logits.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-I", "-c", code, str(logits_file)], check=True, env=env,
                   cwd=tmp_path)  # -I: no llmtrain on the path

    from llmtrain.training.export import load_checkpoint_model
    model, tokenizer = load_checkpoint_model(run_dir)
    ids = tokenizer("Once upon a time, Tom had a red ball.", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    assert torch.equal(torch.load(logits_file), expected)


def test_generate_from_a_run_and_from_an_exported_folder(setup, tmp_path):
    root, config = setup
    run_dir = root / "home" / "runs" / "gen"
    cli("train", "--config", config, "--set", "run.name=gen", "--set", "train.max_steps=40",
             "--set", "train.eval_every=0", check=True)
    # Mid-sentence: after "Once upon a time," this 40-step model samples its EOS (which ends the
    # text) for 2 seeds in 8; here for none.
    prompt = "Once upon a time, Sam went to the"
    args = ["--prompt", prompt, "--max-new-tokens", "30", "--seed", "1"]
    a = cli("generate", "--run-dir", run_dir, *args, check=True).stdout
    cli("export", "--run-dir", run_dir, "--out", tmp_path / "hf", check=True)
    b = cli("generate", "--model", tmp_path / "hf", *args, check=True).stdout
    assert a == b and a.startswith(prompt) and len(a) > len(prompt) + 20
    # It reads like the training stories: nearly every generated word is one of the corpus's.
    import re
    corpus = set(re.findall(r"[A-Za-z]+", (DEMO / "stories.txt").read_text()))
    words = re.findall(r"[A-Za-z]+", a[len(prompt):])
    assert len(words) >= 5 and sum(w in corpus for w in words) >= 0.8 * len(words), a


def test_a_resume_that_moves_the_learning_rate_says_so_and_points_to_wsd():
    """A cosine run of 300 steps resumed at step 300 with max_steps 400: its lr climbs from the
    floor back to 7.1e-4 (cosine at 290 of 390 steps), which the log says in one line with the
    way out; a wsd run extended in its stable phase, or a resume that changes nothing of the
    schedule, says nothing."""
    from llmtrain.training.checkpoint import lr_jump
    cosine = {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 10, "max_steps": 300, "lr_schedule": "cosine",
              "decay_fraction": 0.2, "eval_every": 100}
    assert lr_jump(300, cosine, {**cosine, "max_steps": 400}) == (
        "warning: the learning rate of step 301 jumps from 0.0003 (the checkpoint's schedule) to 0.000715 "
        "(max_steps 300 -> 400); a cosine schedule decays over max_steps, so extending it raises the lr again: for "
        "a run you may extend, use train.lr_schedule: wsd (it decays only at the end), or keep max_steps")
    assert lr_jump(120, cosine, {**cosine, "eval_every": 50}) is None
    wsd = {**cosine, "lr_schedule": "wsd"}
    assert lr_jump(200, wsd, {**wsd, "max_steps": 400}) is None  # still at its peak lr either way
    assert lr_jump(200, wsd, {**wsd, "lr": 1e-3}).startswith(
        "warning: the learning rate of step 201 jumps from 0.003 (the checkpoint's schedule) to 0.001 (lr 0.003 -> "
        "0.001)")
