"""The big-model path, proven on the largest models this machine holds: start-up memory per rank,
sharded pretrained loading, gradient accumulation under FSDP2, HSDP."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import (DEMO, REPO, assert_same_curve, cli, losses, prepared_home, read_metrics,
                      run_dir, tiny_config, torchrun, torchrun_command)

pytestmark = pytest.mark.slow

# 24 layers x 1024 wide: 309M parameters, 1.2 GB in fp32.
BIG = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
       "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
       "max_position_embeddings": 128, "tie_word_embeddings": False}
START_ONLY = ["--set", "train.max_steps=0", "--set", "train.warmup_steps=0"]  # build, load, stop


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with prepared_home(tmp_path_factory, "bigmodel", tiny_config(
            data={"seq_len": 16}, train={"global_batch_size": 3, "micro_batch_size": 1})) as home:
        yield home


def startup_peaks(run: str, setup) -> list[tuple[float, float]]:
    """Each rank's peak memory once its model is ready (before the first step), and before
    the model was built (the runtime's own: imports, process group), in GiB."""
    peaks = []
    for log in sorted((run_dir(setup, run) / "logs").glob("rank-*.log")):
        [line] = [x for x in log.read_text().splitlines() if "model ready: peak memory" in x]
        m = re.search(r"peak memory ([\d.]+) GiB on this rank \(([\d.]+) GiB before the model\)", line)
        peaks.append((float(m.group(1)), float(m.group(2))))
    return peaks


def test_a_309m_model_starts_without_a_full_copy_on_any_rank(setup, tmp_path):
    """From scratch and from a multi-file bf16 pretrained folder, FSDP2 on 3 ranks: no rank
    (rank 0 included) holds more than its shard plus one module at start-up. The runs only start
    (train.max_steps 0): that the loaded weights are the right ones is proven on a small model
    (tests/test_train.py: the first loss, from scratch on 1 and 2 ranks and from a multi-file
    bf16 folder)."""
    _, config = setup
    torchrun(3, "train", "--config", config, "--set", "run.name=scratch3", "--set",
             "parallel.strategy=fsdp", "--set", f"model.architecture={BIG}", *START_ONLY, timeout=600)

    gib = 309e6 * 4 / 2**30  # the model in fp32
    scratch = startup_peaks("scratch3", setup)
    assert len(scratch) == 3
    # Before: every rank peaked at ~1.17 x the model above a tiny model's run (full tensors
    # arrived through the broadcast), rank 0 more (it built the whole model). Now: a third plus
    # a module above what the rank held before the model.
    assert max(ready - before for ready, before in scratch) < 0.55 * gib, scratch
    assert scratch[0][0] - min(ready for ready, _ in scratch) < 0.1 * gib, scratch
    log = (run_dir(setup, "scratch3") / "logs" / "rank-0.log").read_text()
    assert "model: 309," in log and "nothing to train: the run is at step 0 of 0" in log
    assert not read_metrics(run_dir(setup, "scratch3")), "max_steps 0 trained"

    # A pretrained folder of several safetensors files (+ index), stored in bf16.
    folder = tmp_path / "pretrained"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in BIG.items() if k != "model_type"},
                                         vocab_size=512))
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="200MB")
    del model
    assert len(list(folder.glob("model-*-of-*.safetensors"))) >= 3
    assert (folder / "model.safetensors.index.json").is_file()
    source = ["--set", f"model.name_or_path={folder}", "--set", "model.architecture=null",
              "--set", f"model.tokenizer={DEMO / 'tokenizer'}"]
    torchrun(3, "train", "--config", config, "--set", "run.name=pre3", "--set",
             "parallel.strategy=fsdp", *source, *START_ONLY, timeout=600)
    pre = startup_peaks("pre3", setup)
    assert max(ready - before for ready, before in pre) < 0.55 * gib, pre
    assert pre[0][0] - min(ready for ready, _ in pre) < 0.1 * gib, pre
    assert "loaded pretrained weights from " + str(folder) in (
        run_dir(setup, "pre3") / "logs" / "rank-0.log").read_text()


# 8 layers x 512 wide: 29M parameters; its fp32 gradients are 110 MiB.
MID = {**BIG, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
       "num_attention_heads": 8, "num_key_value_heads": 8}


def test_fsdp_accumulation_keeps_only_gradient_shards(setup, monkeypatch):
    """Accumulation 4 costs the same per-rank memory as accumulation 1, and the no-sync option
    costs what its comment says; losses equal those without accumulation (FSDP equals DDP:
    tests/test_train.py)."""
    _, config = setup
    # Large blocks are mmapped and returned at free, so a process's peak RSS follows its live
    # tensors (glibc's heap otherwise keeps freed memory and blurs the comparison).
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    common = ["--set", f"model.architecture={MID}", "--set", "train.max_steps=2", "--set", "train.warmup_steps=0",
              "--set", "train.eval_every=0", "--set", "train.global_batch_size=8",
              "--set", "train.checkpoint_every=0"]
    torchrun(2, "train", "--config", config, "--set", "run.name=acc1", "--set",
             "parallel.strategy=fsdp", "--set", "train.micro_batch_size=4", *common)
    torchrun(2, "train", "--config", config, "--set", "run.name=acc4", "--set",
             "parallel.strategy=fsdp", "--set", "train.micro_batch_size=1", *common)
    torchrun(2, "train", "--config", config, "--set", "run.name=acc4-nosync", "--set",
             "parallel.strategy=fsdp", "--set", "train.micro_batch_size=1",
             "--set", "parallel.reduce_every_micro_batch=false", *common)

    def peak(run):
        return max(r["peak_mem_gib"] for r in read_metrics(run_dir(setup, run)) if r["kind"] == "train")

    grads = 29.4e6 * 4 / 2**30  # the model's full fp32 gradients (= its size in fp32)
    peaks = {run: peak(run) for run in ("acc1", "acc4", "acc4-nosync")}
    # Accumulating must hold this rank's gradient shard (grads / world) through the later
    # micro-batches' forwards, less the activations micro-batches of 1 save: at most 1/world of
    # the model (1/64 on 64 GPUs), where the full gradients were held before.
    assert peaks["acc4"] - peaks["acc1"] < grads / 2, peaks
    # Deferred reduction holds the full gradients: the other rank's half on top of the shard.
    assert peaks["acc4-nosync"] - peaks["acc4"] > grads / 4, peaks
    assert_same_curve(run_dir(setup, "acc4"), run_dir(setup, "acc1"), tol=1e-5)
    assert_same_curve(run_dir(setup, "acc4-nosync"), run_dir(setup, "acc1"), tol=1e-5)


def test_hsdp_matches_ddp_and_resumes_on_two_and_one_ranks(setup):
    """HSDP on 4 ranks (2 replicas x 2-way shards), 2 micro-batches a step, counted by
    tests/sync_probe.py: the gradients cross between replicas (between nodes, on a cluster) once a
    step, not once per micro-batch; the curve is DDP's. Then it resumes on 2 ranks and on 1: on 2
    (2 replicas of 1), only the first replica reads the checkpoint, the other gets it by
    broadcast (its weights are not initialised at all when resuming: a wrong broadcast would
    show in the losses)."""
    root, config = setup
    common = ["--set", "train.global_batch_size=8", "--set", "train.micro_batch_size=1",
              "--set", "train.max_steps=8", "--set", "train.checkpoint_every=4"]
    cmd = torchrun_command(4, "train", "--config", config, "--set", "run.name=hsdp", "--set",
                           "parallel.strategy=hsdp", "--set", "parallel.shard_size=2", *common)
    at = cmd.index("-m", 2)  # the probe takes torchrun's -m llmtrain's place
    cmd[at:at + 2] = [str(REPO / "tests" / "sync_probe.py"), str(root / "hsdp-probe")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    torchrun(2, "train", "--config", config, "--set", "run.name=hsdp-ddp", *common)
    hsdp = run_dir(setup, "hsdp")
    log = (hsdp / "logs" / "rank-0.log").read_text()
    assert "hsdp over 4 ranks (2 replicas x 2-way shards)" in log and "x 2 accumulation steps" in log
    for rank in range(4):
        events = json.loads((root / "hsdp-probe" / f"rank-{rank}.json").read_text())
        # One all-reduce of the gradient shards per FSDP2 unit (2 layers and the root) per step;
        # it was one per unit and micro-batch (6).
        across = {int(step): e.count("collective:all_reduce over 2 of 4 ranks")
                  for step, e in events.items() if step != "0"}  # 0: start-up
        assert across == {step: 3 for step in range(1, 9)}, (rank, across)
    assert_same_curve(hsdp, run_dir(setup, "hsdp-ddp"), tol=1e-5)

    # Resume the HSDP run from its step-4 checkpoint on 2 ranks (hsdp 2 replicas x 1) and on 1.
    for name, launch in (("hsdp-on2", lambda *a: torchrun(2, *a)),
                         ("hsdp-on1", lambda *a: cli(*a, check=True))):
        copy = run_dir(setup, name)
        shutil.copytree(hsdp, copy)
        shutil.rmtree(copy / "checkpoints" / "step-00000008")
        (copy / "checkpoints" / "latest").write_text("step-00000004\n")
        extra = ["--set", "parallel.strategy=hsdp", "--set", "parallel.shard_size=1"] if name == "hsdp-on2" else []
        launch("train", "--config", config, "--set", f"run.name={name}", *common, *extra)
        log = (copy / "logs" / "rank-0.log").read_text()
        assert "resumed from" in log and "(step 4, saved by 4 ranks)" in log
        if name == "hsdp-on2":  # the second replica's weights and moments came by broadcast
            assert ("the checkpoint was read by the first replica's 1 rank(s) and broadcast to "
                    "the other 1 replica(s)") in log
        assert [s for _, s, _ in losses(copy)] == [s for _, s, _ in losses(hsdp)]
        assert_same_curve(copy, hsdp, tol=1e-5)
