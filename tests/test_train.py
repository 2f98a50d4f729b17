"""Real training runs under torchrun (gloo, 2 processes): equivalences, run directory, loading."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import yaml
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from conftest import (DEMO, REPO, assert_same_curve, cli, imported_first, llmtrain, losses,
                      prepared_home, read_metrics, run_dir, tiny_config, torchrun, torchrun_command)
from llmtrain.config import load_config
from llmtrain.data.loader import StepSampler, TokenStream, batch_tokens, open_prepared

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """One LLMTRAIN_HOME with the demo data prepared, shared by this module's runs."""
    with prepared_home(tmp_path_factory, "train", tiny_config()) as home:
        yield home


@pytest.fixture(scope="module")
def ddp(setup):
    """The module's 2-rank DDP run of the config as it is: the reference the other strategies
    must match, and the run directory a user looks at. The finished torchrun process."""
    return torchrun(2, "train", "--config", setup[1], "--set", "run.name=ddp")


def test_ddp_fsdp_single_process_and_accumulation_agree(setup, ddp):
    _, config = setup
    # FSDP with the plain loss (full logits) against DDP with the chunked one (the default)
    torchrun(2, "train", "--config", config, "--set", "run.name=fsdp", "--set", "parallel.strategy=fsdp",
             "--set", "train.chunked_loss=false")
    torchrun(2, "train", "--config", config, "--set", "run.name=ddp-mb2", "--set", "train.micro_batch_size=2")
    cli("train", "--config", config, "--set", "run.name=single", check=True)

    ddp = run_dir(setup, "ddp")
    assert_same_curve(ddp, run_dir(setup, "fsdp"), tol=1e-5)
    assert_same_curve(ddp, run_dir(setup, "single"), tol=1e-4)  # 1 rank x 2 accumulation steps
    assert_same_curve(ddp, run_dir(setup, "ddp-mb2"), tol=1e-5)  # micro 2 x accumulation 2
    curve = losses(ddp)
    assert [k for k, *_ in curve].count("eval") == 2
    train = [loss for kind, _, loss in curve if kind == "train"]
    assert train[0] > 5.5 and train[-1] < train[0] - 1.0  # from ~ln(479) = 6.2, clearly falling


def test_run_directory_holds_what_a_user_looks_for(setup, ddp):
    proc, d = ddp, run_dir(setup, "ddp")
    assert load_config(d / "config.yaml").run.name == "ddp"  # the resolved config (--set), loadable
    prov = json.loads((d / "provenance.json").read_text())
    assert prov["world_size"] == 2 and len(prov["hostnames"]) == 2
    assert prov["packages"]["torch"].startswith(torch.__version__.split("+")[0])
    assert set(prov["git"]) == {"commit", "dirty"}
    for rank in (0, 1):
        assert "done: 8 steps" in (d / "logs" / f"rank-{rank}.log").read_text()

    records = read_metrics(d)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))  # log_every 1
    assert {"loss", "lr", "tokens_per_sec", "elapsed_s", "peak_mem_gib", "tokens"} <= set(train[0])
    assert train[-1]["tokens"] == 8 * 8 * 64 and train[0]["tokens_per_sec"] > 0
    assert [(r["step"], "eval_loss" in r) for r in records if r["kind"] == "eval"] == [(4, True), (8, True)]
    # The rank that uses the most memory, and how much; each rank's own peak at the end.
    own = {}
    for rank in (0, 1):
        [line] = [x for x in (d / "logs" / f"rank-{rank}.log").read_text().splitlines()
                  if "peak memory: " in x and f"on rank {rank}" in x]
        own[rank] = float(re.search(r"peak memory: ([\d.]+) GiB", line).group(1))
    assert all(r["peak_mem_rank"] in (0, 1) for r in train)
    last = train[-1]
    # a high-water mark; the log line rounds to 0.01 GiB
    assert 0.1 < last["peak_mem_gib"] <= own[last["peak_mem_rank"]] + 0.006

    # Rank 0 prints whole progress lines; no rank's line is ever cut by another's.
    progress = [line for line in proc.stdout.splitlines() if "[rank" in line]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[rank \d\] .+", line) for line in progress)
    assert any(re.search(r"\[rank 0\] step 8/8 \| loss \d+\.\d{4} \| lr .+ tok/s \| eta", line)
               for line in progress)


@pytest.mark.parametrize("strategy,prefetch", [("ddp", 2), ("fsdp", 0)])
def test_a_step_that_does_not_log_never_waits_for_the_device(setup, ddp, strategy, prefetch):
    """Counted step by step (tests/sync_probe.py): host reads of tensor values (each a wait for
    the device on a GPU) and Python-level collectives. A step that neither logs, evaluates nor
    saves has one collective, the agreement, and at most one read: the previous step's
    flags, long done. The losses equal the reference run's (every step logged, batches read on
    the training thread, the CPU default; DDP reading two steps ahead: exactly): the lag and the
    prefetch change when the host looks, not what trains."""
    root, config = setup
    name, out = f"probe-{strategy}-{prefetch}", root / f"probe-{strategy}-{prefetch}"
    cmd = torchrun_command(2, "train", "--config", config, "--set", f"run.name={name}",
                           "--set", f"parallel.strategy={strategy}", "--set", "train.log_every=4",
                           "--set", f"data.prefetch_steps={prefetch}")
    at = cmd.index("-m", 2)  # the script takes torchrun's -m llmtrain's place
    cmd[at:at + 2] = [str(REPO / "tests" / "sync_probe.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    due = {4, 8}  # logged, evaluated and saved (eval_every and checkpoint_every are 4)
    for rank in (0, 1):
        events = {int(k): v for k, v in json.loads((out / f"rank-{rank}.json").read_text()).items()}
        for step in sorted(set(range(1, 9)) - due):
            # the flags: stop, save, non-finite, profile steps, and a tracing flag per rank (2)
            lagged = [] if step == 1 or step - 1 in due else ["read:tolist (6,)"]
            assert events[step] == ["collective:all_reduce"] + lagged, (rank, step, events[step])
        assert all("read:item ()" in events[step] for step in due)  # the log line's loss

    reference = {(r["kind"], r["step"]): r for r in read_metrics(run_dir(setup, "ddp"))}
    probed = read_metrics(run_dir(setup, name))
    assert [(r["kind"], r["step"]) for r in probed] == [("train", 4), ("eval", 4), ("train", 8), ("eval", 8)]
    for r in probed:
        key = "loss" if r["kind"] == "train" else "eval_loss"
        want = reference[(r["kind"], r["step"])][key]
        if strategy == "ddp":
            assert r[key] == want, (r, want)
        else:
            assert abs(r[key] - want) <= 1e-5, (r, want)


def test_compiled_layers_with_fsdp_and_activation_checkpointing_train_as_eager(setup, ddp, tmp_path):
    """train.compile: each decoder layer and the loss's chunks compiled (inductor, on the CPU
    here), inside FSDP2's hooks and activation checkpointing: the same curve as the eager DDP
    reference within 1e-4 (one process, 2 accumulation steps), and the compile time logged with
    the caches (a cache folder set by the user is kept)."""
    _, config = setup
    cache = tmp_path / "inductor"
    # Each checkpointed forward calls torch.utils.checkpoint.checkpoint: counted, written at exit.
    # (Compiled whole, FSDP2's swapped class made transformers' checkpointing skip every layer.)
    calls = tmp_path / "checkpoint-calls"
    env = imported_first(tmp_path, "import atexit, torch.utils.checkpoint as c\n"
                                   "real, calls = c.checkpoint, []\n"
                                   "c.checkpoint = lambda *a, **k: calls.append(1) or real(*a, **k)\n"
                                   f"atexit.register(lambda: open({str(calls)!r}, 'w').write(str(len(calls))))\n")
    llmtrain("train", "--config", config, "--set", "run.name=compiled", "--set", "train.compile=true",
             "--set", "parallel.strategy=fsdp", "--set", "model.activation_checkpointing=true",
             check=True, env={**env, "TORCHINDUCTOR_CACHE_DIR": str(cache)})
    assert_same_curve(run_dir(setup, "ddp"), run_dir(setup, "compiled"), tol=1e-4)
    assert calls.read_text() == str(2 * 2 * 8)  # 2 layers x 2 micro-batches x 8 steps (evaluation: none)
    log = (run_dir(setup, "compiled") / "logs" / "rank-0.log").read_text()
    assert re.search(rf"torch\.compile: \d+\.\ds compiling in the first step \(caches: {cache}, \S+triton_", log)
    assert any(cache.iterdir())


FREED_AND_TAKEN_AGAIN = """
import resource, torch
from llmtrain.training.distributed import keep_freed_heap
keep_freed_heap()

def step():  # a CPU step's pattern: activations taken one after another, all freed at its end
    kept = [torch.ones(1 << 20) for _ in range(8)]  # 8 x 4 MiB
    del kept

step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_cpu_rank_keeps_a_steps_freed_memory_for_the_next_unless_malloc_is_tuned_already():
    """glibc's malloc, as it comes, hands the freed top of its heap back to the system and faults
    it in again the next step (page faults per step: ~7,000 on bench/throughput.py's model, ~60
    kept); a rank on a CPU keeps it (training/distributed.py), except where the environment tunes
    malloc itself (MALLOC_ARENA_MAX here: glibc's defaults then stand)."""
    runs = [subprocess.Popen([sys.executable, "-c", FREED_AND_TAKEN_AGAIN], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, **extra}) for extra in ({}, {"MALLOC_ARENA_MAX": "4"})]
    kept, glibc = (int(run.communicate()[0]) for run in runs)
    assert kept * 4 < glibc, (kept, glibc)  # 10 steps of 32 MiB: ~1,000 page faults kept, ~9,000 glibc's way


def test_rerun_with_the_same_name_keeps_metrics_consistent(setup):
    _, config = setup
    cli("train", "--config", config, "--set", "run.name=again", "--set", "train.max_steps=4",
             "--set", "train.warmup_steps=1", check=True)
    again = cli("train", "--config", config, "--set", "run.name=again", "--set", "train.max_steps=4",
                "--set", "train.warmup_steps=1", check=True)
    # It resumes at its last step: nothing trains again, and the log says so.
    assert "nothing to train: the run is at step 4 of 4 already" in again.stdout
    steps = [r["step"] for r in read_metrics(run_dir(setup, "again")) if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4]


def tiny_pretrained(folder, tokenizer_dir=DEMO / "tokenizer"):
    """A tied-embedding Llama saved as a Hugging Face folder with its tokenizer."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return model


@pytest.mark.parametrize("nproc,strategy,weights", [(1, "ddp", "safetensors"), (2, "fsdp", "bf16-shards"),
                                                    (2, "fsdp", "bin")])
def test_pretrained_weights_are_what_training_starts_from(tmp_path, monkeypatch, nproc, strategy,
                                                          weights):
    """The first step's loss equals plain transformers' loss of the saved model on that batch.
    "bf16-shards": stored in bf16 in several safetensors files named by an index, as large
    models are (each rank reads its slices from whichever file holds them, and upcasts);
    "bin": an older folder, pytorch_model.bin only, keys saved without the base model's prefix."""
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    model = tiny_pretrained(tmp_path / "model")
    if weights == "bf16-shards":
        (tmp_path / "model" / "model.safetensors").unlink()
        model.to(torch.bfloat16).save_pretrained(tmp_path / "model", max_shard_size="50KB")
        assert len(list((tmp_path / "model").glob("model-*-of-*.safetensors"))) >= 3
        model = LlamaForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    if weights == "bin":
        (tmp_path / "model" / "model.safetensors").unlink()
        torch.save({k.removeprefix("model."): v for k, v in model.state_dict().items()
                    if k != "lm_head.weight"}, tmp_path / "model" / "pytorch_model.bin")
    cfg = tiny_config(train={"max_steps": 2, "warmup_steps": 0, "eval_every": 0},
                      parallel={"strategy": strategy})
    cfg["model"] = {"name_or_path": str(tmp_path / "model")}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli("prepare", "--config", path, check=True)
    if nproc == 1:  # a world of one: the plain command, in this process
        cli("train", "--config", path, check=True)
    else:
        torchrun(nproc, "train", "--config", path)

    c = load_config(path)
    folder, manifest = open_prepared(c)
    data = TokenStream(folder, manifest, "train")
    indices = StepSampler(data.num_samples(64), 8, c.train.seed, 0, 1).next_step()
    batch = torch.from_numpy(batch_tokens(data, indices, 64))
    with torch.no_grad():
        logits = model(input_ids=batch[:, :-1]).logits
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    first = read_metrics(c.run_dir)[0]
    assert first["step"] == 1 and abs(first["loss"] - expected.item()) < 1e-5
    if weights == "safetensors":
        # A resume takes every weight from the checkpoint: the pretrained file is not read again
        # (here it could not be: it is garbage now).
        (tmp_path / "model" / "model.safetensors").write_bytes(b"\0" * 64)
        out = cli("train", "--config", path, "--set", "train.max_steps=3", check=True).stdout
        assert f"pretrained weights not read from {tmp_path / 'model'}: the checkpoint to resume" in out
        assert [r["step"] for r in read_metrics(c.run_dir) if r["kind"] == "train"][-1] == 3


def test_bf16_fsdp_with_activation_checkpointing_trains(setup):
    """Selective: layer 0 of 2 recomputes, layer 1 keeps its activations (which layers do, and
    that it changes no gradient: tests/test_parallel.py)."""
    _, config = setup
    torchrun(2, "train", "--config", config, "--set", "run.name=bf16", "--set", "parallel.strategy=fsdp",
             "--set", "train.precision=bf16", "--set", "model.activation_checkpointing=true",
             "--set", "model.activation_checkpointing_every=2")
    train = [loss for kind, _, loss in losses(run_dir(setup, "bf16")) if kind == "train"]
    assert all(x == x for x in train) and train[-1] < train[0] - 1.0


def test_model_not_on_disk_names_the_download_script(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    cfg = tiny_config()
    cfg["model"] = {"name_or_path": "org/not-downloaded"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    check = cli("check-config", path)
    assert check.returncode == 0
    assert "note: model.name_or_path: org/not-downloaded is not downloaded yet" in check.stderr
    offline = cli("check-config", path, "--offline")
    assert offline.returncode == 2 and offline.stderr.splitlines()[0].startswith(
        "model.name_or_path: org/not-downloaded is not downloaded yet (looked in ")
    proc = cli("prepare", "--config", path)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"error: model.tokenizer: org/not-downloaded is not on disk (looked in "
        f"{tmp_path}/home/models/org/not-downloaded); download it on the login node with: "
        f"bash download_data_model.sh"]


def test_fp16_survives_an_overflow_step(setup):
    """A non-finite fp16 step is skipped and the loss scale lowered; training goes on."""
    _, config = setup
    proc = cli("train", "--config", config, "--set", "run.name=fp16", "--set",
               "train.precision=fp16", env={"LLMTRAIN_INJECT_NAN_STEPS": "3"})
    assert proc.returncode == 0, proc.stderr
    train = [r for r in read_metrics(run_dir(setup, "fp16")) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert train[-1]["skipped_steps"] == 1 and train[-1]["loss"] < train[0]["loss"] - 0.5
    scales = [r["loss_scale"] for r in train]
    assert scales[2] <= scales[1] / 2  # the skipped step lowered the scale (65536 at the start)
    assert "warning: step 3: non-finite loss or gradient norm on some rank; step skipped" in proc.stdout


def test_gpus_asked_for_where_cuda_is_unusable_stop_with_one_line(setup):
    _, config = setup
    proc = cli("train", "--config", config, "--set", "run.name=nogpu",
                    "--set", "slurm.gpus_per_node=4")
    assert proc.returncode == 1
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: slurm.gpus_per_node is 4 but CUDA is unusable on ")
    assert line.endswith("to train on CPUs set slurm.gpus_per_node: 0 and slurm.procs_per_node")
    assert not (run_dir(setup, "nogpu") / "metrics.jsonl").exists()


def test_an_eval_set_smaller_than_the_world_is_refused(setup):
    _, config = setup
    check = cli("check-config", config, "--set", "train.eval_samples=1")
    assert check.returncode == 2
    assert check.stderr.splitlines() == ["train.eval_samples: must be >= the world size 2, so "
                                         "every rank evaluates at least one sample (got 1)"]


def test_a_model_folder_without_weights_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    tiny_pretrained(tmp_path / "model")
    (tmp_path / "model" / "model.safetensors").unlink()
    cfg = tiny_config(train={"max_steps": 2, "warmup_steps": 0, "eval_every": 0})
    cfg["model"] = {"name_or_path": str(tmp_path / "model")}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli("prepare", "--config", path, check=True)
    proc = cli("train", "--config", path)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"error: model.name_or_path: no model.safetensors, pytorch_model.bin or index of either in "
        f"{tmp_path / 'model'}; download the model's weights (bash download_data_model.sh)"]


def test_a_run_directory_has_one_writer_and_a_dead_ones_lock_does_not_block(setup):
    import signal
    import subprocess

    from conftest import launch_training
    from test_checkpoint import kill_when, logged_step
    _, config = setup
    d = run_dir(setup, "locked")
    first = launch_training(2, config, "run.name=locked", "train.max_steps=400", "train.eval_every=0")
    try:
        seen = []
        for line in first.stdout:  # its progress lines, as they come: no polling
            seen.append(line)
            if logged_step(d) >= 2:
                break
        assert logged_step(d) >= 2, "".join(seen)
        second = cli("train", "--config", config, "--set", "run.name=locked")
        assert second.returncode == 1
        [line] = second.stderr.splitlines()
        assert line.startswith(f"error: run.name: {d} is in use by a live run (host ")
        assert line.endswith(f"stop it with: llmtrain control {d} stop, or choose another run.name")
        assert f"pid {first.pid}" not in line  # rank 0's pid, not the launcher's
    finally:  # SIGKILL the workers (torchrun starts them in sessions of their own) and torchrun
        workers = subprocess.run(["pgrep", "-P", str(first.pid)], capture_output=True, text=True)
        for pid in workers.stdout.split():
            os.kill(int(pid), signal.SIGKILL)
        kill_when(first, lambda: True)
    # A killed process exists until the kernel has torn it down (longer on a loaded machine):
    # until then its lock is a live run's. Wait for that, not for a fixed time.
    from llmtrain.rundir import pid_alive
    deadline = time.monotonic() + 60
    while any(pid_alive(pid) for pid in workers.stdout.split()):
        assert time.monotonic() < deadline, "the killed workers never ended"
        time.sleep(0.05)
    assert (d / "run.lock").exists()  # left behind, its owner dead
    cli("train", "--config", config, "--set", "run.name=locked", "--set", "train.max_steps=6",
             "--set", "train.eval_every=0", check=True)
    assert not (d / "run.lock").exists()


def test_too_few_validation_samples_name_the_mixture_source_they_are_short_in(tmp_path, write_config):
    """A mixture evaluates each source on train.eval_samples of its own: the warning for a short
    validation split names the source and says the count applies to each; the refusal too."""
    from types import SimpleNamespace
    from llmtrain.config import UserError
    from llmtrain.rundir import Log
    from llmtrain.training.loop import check_eval_split
    cfg = load_config(write_config(tiny_config(train={"eval_samples": 16})), world_size=2)
    world = SimpleNamespace(dims=SimpleNamespace(dp=2), is_main=True)
    short = SimpleNamespace(num_samples=lambda seq_len: 5)  # what a TokenStream answers
    check_eval_split(cfg, short, world, Log(0, tmp_path), source="code")
    assert (tmp_path / "rank-0.log").read_text().split("] ", 1)[1] == (
        "warning: train.eval_samples is 16 (a mixture evaluates each source on as many) but the validation split of "
        "source 'code' has 5 samples of 64 tokens: evaluating on 4\n")
    with pytest.raises(UserError, match=r"the validation split of source 'web' has 1 samples of 64 tokens"):
        check_eval_split(cfg, SimpleNamespace(num_samples=lambda seq_len: 1), world, Log(0), source="web")
