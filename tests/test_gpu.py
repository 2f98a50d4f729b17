"""The CUDA paths on one GPU, end to end through the CLI: nccl, bf16/fp16, async saves, MFU, loading.

    bash tests/gpu.sh run          # on a machine with a GPU (see the script for carried wheels)
    python -m pytest -m gpu -v tests/test_gpu.py

Skipped where torch sees no CUDA device, so CI (CPU only) stays green. The model is wider than
tiny_config's (256 wide, 4 layers, 128 tokens) so that the GPU kernels (SDPA, fused AdamW,
autocast matmuls) do real work, and small enough that each test stays under a minute.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from conftest import (DEMO, REPO, assert_same_curve, env_with, imported_first, llmtrain,
                      prepared_home, read_metrics, run_dir, tiny_config, torchrun, torchrun_unchecked)
from llmtrain.metrics import peak_tflops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs CUDA: torch.cuda.is_available() is false on this machine"),
]

STEPS = 12


def small_config(**sections) -> dict:
    """tiny_config widened for a GPU: 256 wide, 4 layers, 128-token samples, 16 per step."""
    wider = {"data": {"seq_len": 128},
             "train": {"max_steps": STEPS, "global_batch_size": 16, "micro_batch_size": 8,
                       "eval_every": 6, "checkpoint_every": 6},
             "slurm": {"gpus_per_node": 1, "procs_per_node": 1}}
    for name, values in sections.items():
        wider[name] = {**wider.get(name, {}), **values}
    cfg = tiny_config(**wider)
    cfg["model"]["architecture"].update(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                        max_position_embeddings=128)
    return cfg


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with prepared_home(tmp_path_factory, "gpu", small_config()) as home:
        yield home


def rank0_log(run_dir) -> str:
    return (run_dir / "logs" / "rank-0.log").read_text()


def assert_trains(run_dir, steps: int = STEPS) -> list[dict]:
    """Every step logged, finite losses, clearly falling from ~ln(479) = 6.2; the train lines."""
    train = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    curve = [r["loss"] for r in train]
    assert all(math.isfinite(x) for x in curve), curve
    assert curve[0] > 5.5 and curve[-1] < curve[0] - 1.0, curve
    return train


def test_nccl_world_of_one_trains_on_cuda(setup):
    _, config = setup
    torchrun(1, "train", "--config", config, "--set", "run.name=nccl", "--set", "parallel.backend=nccl")
    d = run_dir(setup, "nccl")
    train = assert_trains(d)
    assert all(r["peak_mem_gib"] > 0 for r in train)
    assert [r["step"] for r in read_metrics(d) if r["kind"] == "eval"] == [6, 12]
    assert re.search(r"\bon cuda\b", rank0_log(d)), rank0_log(d)
    assert json.loads((d / "provenance.json").read_text())["world_size"] == 1


def test_a_worker_forked_from_its_agent_trains_on_cuda(setup, tmp_path):
    """training/workers.py: the agent's imports leave CUDA untouched, so its worker is forked (a
    marker from the agent's sitecustomize as the fork becomes the worker) and trains on the GPU."""
    _, config = setup
    marker = tmp_path / "forked"
    env = imported_first(tmp_path, "import os\nif 'RANK' not in os.environ:\n"
                                   "    import llmtrain.training.workers as w\n    become = w.become_worker\n"
                                   f"    def observed(*a):\n        become(*a)\n        open({str(marker)!r}, 'w').close()\n"
                                   "    w.become_worker = observed\n")
    env["LLMTRAIN_FORK_WORKERS"] = "1"
    proc = torchrun_unchecked(1, "train", "--config", config, "--set", "run.name=forked", "--set",
                              "parallel.backend=nccl", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.exists()
    assert_trains(run_dir(setup, "forked"))
    assert re.search(r"\bon cuda\b", rank0_log(run_dir(setup, "forked")))


def test_fsdp_bf16_trains_and_matches_fp32_at_the_start(setup):
    _, config = setup
    fsdp = ("--set", "parallel.strategy=fsdp")
    torchrun(1, "train", "--config", config, *fsdp, "--set", "run.name=fsdp-bf16",
             "--set", "train.precision=bf16")
    # Three steps: the losses of steps 1-3 come before the cosine part of the schedule, so they
    # do not depend on max_steps; at initialisation any weights give ~ln(vocab), so steps 2 and
    # 3 are what show that bf16 trains the same weights with the same gradients.
    torchrun(1, "train", "--config", config, *fsdp, "--set", "run.name=fsdp-fp32",
             "--set", "train.precision=fp32", "--set", "train.tf32=false", "--set", "train.max_steps=3",
             "--set", "train.eval_every=0")
    bf16 = [r["loss"] for r in assert_trains(run_dir(setup, "fsdp-bf16"))]
    fp32 = [r["loss"] for r in read_metrics(run_dir(setup, "fsdp-fp32")) if r["kind"] == "train"]
    assert len(fp32) == 3 and max(abs(a - b) for a, b in zip(bf16, fp32)) < 2e-2, (bf16[:3], fp32)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_step_that_does_not_log_never_waits_for_the_gpu(setup, strategy):
    """tests/sync_probe.py on CUDA (nccl, bf16, batches prefetched into pinned memory, compiled
    off): a step that neither logs, evaluates nor saves reads nothing from the GPU but the
    previous step's flags, from pinned memory behind an event, and makes one collective."""
    root, config = setup
    out = root / f"probe-{strategy}"
    cmd = [sys.executable, "-m", "llmtrain.training.torchrun", "--standalone", "--nproc-per-node", "1",
           str(REPO / "tests" / "sync_probe.py"), str(out), "train", "--config", str(config),
           "--set", f"run.name=probe-{strategy}", "--set", f"parallel.strategy={strategy}",
           "--set", "train.precision=bf16", "--set", "train.log_every=6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = {int(k): v for k, v in json.loads((out / "rank-0.json").read_text()).items()}
    due = {6, 12}  # logged, evaluated and saved
    for step in sorted(set(range(1, STEPS + 1)) - due):
        # the flags: stop, save, non-finite, profile steps, and a tracing flag for the one rank
        lagged = [] if step == 1 or step - 1 in due else ["read:tolist (5,)"]
        assert events[step] == ["collective:all_reduce"] + lagged, (step, events[step])


def test_compiled_fsdp_bf16_matches_eager(setup):
    """train.compile on CUDA (inductor, Triton kernels) with FSDP2 and activation checkpointing:
    the curve of the eager bf16 FSDP run within bf16's noise, and the compile time logged."""
    _, config = setup
    common = ("--set", "parallel.strategy=fsdp", "--set", "train.precision=bf16",
              "--set", "model.activation_checkpointing=true")
    torchrun(1, "train", "--config", config, *common, "--set", "run.name=eager-ac")
    torchrun(1, "train", "--config", config, *common, "--set", "run.name=compiled-ac",
             "--set", "train.compile=true")
    assert_trains(run_dir(setup, "compiled-ac"))
    assert_same_curve(run_dir(setup, "eager-ac"), run_dir(setup, "compiled-ac"), tol=3e-2)
    assert "torch.compile: " in rank0_log(run_dir(setup, "compiled-ac"))


def test_fp16_survives_an_overflow_with_the_loss_scaler(setup):
    _, config = setup
    proc = llmtrain("train", "--config", config, "--set", "run.name=fp16", "--set", "train.precision=fp16",
                    env=env_with(LLMTRAIN_INJECT_NAN_STEPS="3"))
    assert proc.returncode == 0, proc.stderr
    d = run_dir(setup, "fp16")
    train = [r for r in read_metrics(d) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert [r["skipped_steps"] for r in train] == [0, 0] + [1] * (STEPS - 2)
    assert "warning: step 3: non-finite loss or gradient norm" in rank0_log(d)
    curve = [r["loss"] for r in train if r["step"] != 3]
    assert all(math.isfinite(x) for x in curve), curve
    assert curve[-1] < curve[0] - 1.0, curve


def test_async_checkpoints_from_pinned_memory_resume_exactly(setup):
    _, config = setup
    # A constant learning rate (min_lr = lr, no warmup), so that raising max_steps on resume
    # changes no step's lr; eager attention, so that backward is deterministic on CUDA.
    common = ["--set", "parallel.strategy=fsdp", "--set", "train.async_checkpoint=true",
              "--set", "train.checkpoint_every=3", "--set", "train.eval_every=3",
              "--set", "train.warmup_steps=0", "--set", "train.min_lr=3e-3",
              "--set", "model.attn_implementation=eager"]
    torchrun(1, "train", "--config", config, *common, "--set", "run.name=async-ref")
    torchrun(1, "train", "--config", config, *common, "--set", "run.name=async", "--set", "train.max_steps=6")

    d = run_dir(setup, "async")
    ckpts = d / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-00000006"
    for name in ("step-00000003", "step-00000006"):
        assert json.loads((ckpts / name / "meta.json").read_text())["step"] == int(name[len("step-"):])
    assert not list(ckpts.glob(".tmp-*"))

    torchrun(1, "train", "--config", config, *common, "--set", "run.name=async")
    assert "resumed from" in rank0_log(d) and "step-00000006 (step 6" in rank0_log(d)
    assert (ckpts / "latest").read_text().strip() == "step-00000012"
    assert (ckpts / "step-00000012" / "meta.json").is_file()
    assert_same_curve(d, run_dir(setup, "async-ref"), tol=1e-6)  # train and eval, steps 1-12


def test_mfu_is_in_the_metrics_on_a_known_gpu(setup):
    _, config = setup
    name = torch.cuda.get_device_name(0)
    if peak_tflops(name, "bf16", True) is None:
        pytest.skip(f"no peak FLOP/s known for {name!r} in llmtrain.gpus.GPUS")
    llmtrain("train", "--config", config, "--set", "run.name=mfu", "--set", "train.precision=bf16",
             "--set", "train.log_every=3", check=True)
    train = [r for r in read_metrics(run_dir(setup, "mfu")) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [3, 6, 9, 12]
    assert all(0 < r["mfu"] < 1 for r in train), [r.get("mfu") for r in train]


def sharded_pretrained(folder) -> LlamaForCausalLM:
    """A seeded Llama saved in bf16 as several safetensors files with an index, and its tokenizer."""
    torch.manual_seed(0)
    # initializer_range 0.1, not 0.02: near-zero logits give ~ln(vocab) whatever the weights,
    # while these give a loss that moves by ~4e-2 with the seed, 40x the test's tolerance.
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, initializer_range=0.1)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="2MB")  # ~5 MB of bf16: 3 or more files
    tokenizer = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    assert len(tokenizer) <= config.vocab_size
    tokenizer.save_pretrained(folder)
    return model


def test_sharded_bf16_pretrained_folder_starts_as_on_cpu(tmp_path, monkeypatch):
    """First-step loss from a multi-file bf16 folder under FSDP2 on the GPU equals a CPU run's."""
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    model_dir = tmp_path / "model"
    sharded_pretrained(model_dir)
    shards = sorted(model_dir.glob("model-*-of-*.safetensors"))
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(shards) >= 2 and set(index["weight_map"].values()) == {p.name for p in shards}

    # tf32 off: compare fp32 with fp32, not with TF32 matmuls (~1e-3 relative error)
    train = {"max_steps": 2, "warmup_steps": 0, "eval_every": 0, "precision": "fp32", "tf32": False}
    cfg = small_config(train=train, parallel={"strategy": "fsdp"},
                       slurm={"gpus_per_node": 0, "procs_per_node": 1})
    cfg["model"] = {"name_or_path": str(model_dir)}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    llmtrain("prepare", "--config", path, check=True)

    runs = tmp_path / "home" / "runs"
    torchrun(1, "train", "--config", path, "--set", "run.name=gpu", "--set", "slurm.gpus_per_node=1")
    llmtrain("train", "--config", path, "--set", "run.name=cpu", check=True,
             env=env_with(CUDA_VISIBLE_DEVICES=""))
    assert re.search(r"\bon cuda\b", rank0_log(runs / "gpu"))
    assert re.search(r"\bon cpu\b", rank0_log(runs / "cpu"))  # the reference really ran on CPU
    gpu, cpu = read_metrics(runs / "gpu")[0], read_metrics(runs / "cpu")[0]
    assert gpu["step"] == cpu["step"] == 1
    assert abs(gpu["loss"] - cpu["loss"]) < 1e-3, (gpu["loss"], cpu["loss"])


def test_packed_samples_attend_within_themselves_with_flex_attention_on_cuda():
    """On a GPU, packed rows attend through flex attention's block mask (model/attention.py):
    a sample loses the same alone or packed with others, forward and backward, in bf16."""
    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.model.attention import causal_attention, document_mask

    config = AutoConfig.for_model("llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda()
    causal_attention(model)
    rng = np.random.default_rng(0)
    a, b, c = (torch.as_tensor(rng.integers(1, 512, n)) for n in (100, 300, 112))
    packed = torch.cat([b, a, c])[None].cuda()
    alone = torch.cat([a, torch.zeros(412, dtype=a.dtype)])[None].cuda()
    pos = lambda *ns: torch.cat([torch.arange(n) for n in ns])[None].cuda()  # noqa: E731

    def losses(tokens, positions):
        mask = document_mask(model, positions[:, :-1])
        assert not isinstance(mask, torch.Tensor)  # a BlockMask: the flex path
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=tokens[:, :-1], position_ids=positions[:, :-1], attention_mask=mask).logits
        return torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), tokens[:, 1:], reduction="none")

    in_row = losses(packed, pos(300, 100, 112))[0, 300:399]
    by_itself = losses(alone, pos(100, 412))[0, :99]
    assert torch.allclose(in_row, by_itself, atol=2e-2, rtol=0)  # bf16 matmuls in other block orders
    in_row.sum().backward()  # flex attention's backward runs
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


# Imported by the trainer (PYTHONPATH): caps this process's CUDA memory at ~300 MB, so a big
# micro batch runs out of memory the way a too-large model does.
CAP_MEMORY = """
import torch
torch.cuda.set_per_process_memory_fraction(0.3e9 / torch.cuda.get_device_properties(0).total_memory)
"""


def test_out_of_memory_is_one_line_and_leaves_a_memory_snapshot(setup, tmp_path):
    import pickle

    _, config = setup
    proc = llmtrain("train", "--config", config, "--set", "run.name=oom", "--set", "train.micro_batch_size=256",
                    "--set", "train.global_batch_size=256", "--set", "profile.memory_history=true",
                    env=imported_first(tmp_path, CAP_MEMORY))
    d = run_dir(setup, "oom")
    snapshot = d / "logs" / "oom-snapshot-rank-0.pickle"
    assert proc.returncode == 1, proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-4000:]
    (line,) = errors
    assert line.startswith("error: out of memory on rank 0 (") and f"memory snapshot: {snapshot} " in line, line
    assert "Traceback" not in proc.stderr
    state = pickle.loads(snapshot.read_bytes())
    assert state["segments"] and state["device_traces"][0], "no allocation history recorded"


def test_the_memory_estimate_is_within_15_percent_of_max_memory_allocated(tmp_path, monkeypatch):
    """llmtrain estimate's total per GPU against torch.cuda.max_memory_allocated of a real bf16
    step (tests/memory_probe.py: the trainer's own parallelize, chunked loss, AdamW and step) on
    one GPU, for DDP and FSDP2, with and without activation checkpointing. The model (170M
    parameters, 4 x 1024 tokens a micro-batch) is large enough that the CUDA kernels' own
    workspaces are small beside it."""
    from llmtrain.config import load_config
    from llmtrain.login.estimate import estimate
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    arch = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
            "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 1024,
            "vocab_size": 32000, "tie_word_embeddings": False}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(
        model={"architecture": arch}, data={"seq_len": 1024},
        train={"micro_batch_size": 4, "global_batch_size": 4, "precision": "bf16"},
        slurm={"gpus_per_node": 1, "procs_per_node": 1})))
    cases = {"ddp": ["parallel.strategy=ddp"],
             "ddp-checkpointed": ["parallel.strategy=ddp", "model.activation_checkpointing=true"],
             "fsdp": ["parallel.strategy=fsdp"],
             "fsdp-checkpointed": ["parallel.strategy=fsdp", "model.activation_checkpointing=true"]}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           str(REPO / "tests" / "memory_probe.py"), str(config), str(tmp_path),
                           *(f"{name}={','.join(o)}" for name, o in cases.items())],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    measured = json.loads((tmp_path / "rank-0.json").read_text())
    ratios = {}
    for name, overrides in cases.items():
        est = estimate(load_config(config, overrides, world_size=1), world_size=1).total
        ratios[name] = est / measured[name]["cuda_max_allocated"]
    print("estimated / max_memory_allocated:", {k: round(v, 3) for k, v in ratios.items()})
    print("measured:", json.dumps(measured))
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), ratios


def test_the_preflight_times_a_bf16_matmul_and_leaves_no_memory_behind(tmp_path, monkeypatch):
    """On the GPU: the 8192^2 bf16 product at a credible speed, the record written, and the
    preflight's matrices gone from the allocator's peak before the model is built."""
    from llmtrain.config import load_config
    from llmtrain.rundir import Log
    from llmtrain.training import distributed, preflight
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # the preflight runs in Slurm jobs only
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(small_config(run={"dir": str(tmp_path / "runs")})))
    cfg = load_config(config, world_size=1)
    world = distributed.init(cfg)
    try:
        assert preflight.run(cfg, world, Log(0)) == "go"
        # not the 3 x 128 MiB of its matrices; cuBLAS's workspace (64 MiB on an H100) stays
        assert torch.cuda.max_memory_allocated() < 160 << 20
    finally:
        distributed.teardown(world, True)
    record = json.loads((cfg.run_dir / "preflight" / "77-0.json").read_text())
    assert record["device"] == "cuda" and record["matmul"] == {"size": 8192, "dtype": "bfloat16", "seconds": 0.1}
    tflops = record["ranks"][0]["matmul_tflops"]
    assert 20 < tflops < 2000, tflops  # any data-centre GPU's bf16 tensor cores, not a CPU's


# Wide enough that the size filter converts most projections on the GPU: q, o, gate, up and down
# (2048 x 2048 and up) in float8; k and v (2048 -> 512) too small to gain; the head in bf16.
FP8_ARCH = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 2,
            "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 128,
            "tie_word_embeddings": False}


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 needs a GPU of compute capability 8.9 or newer")
def test_fp8_compiled_under_fsdp_trains_like_bf16_resumes_exactly_and_exports(setup):
    """train.fp8: tensorwise, compiled, FSDP2 on NCCL (weights all-gathered in float8, their
    scales precomputed after each update and after the resume's load): every loss within 3% of
    the bf16 run's, the start-up line, a resume from step 6 that repeats steps 7-12 (eager
    attention: a deterministic backward), and an export plain transformers loads."""
    root, config = setup
    common = ["--set", "parallel.strategy=fsdp", "--set", "train.precision=bf16", "--set", "train.lr=1e-3",
              "--set", "train.min_lr=1e-4", "--set", "model.attn_implementation=eager",
              "--set", f"model.architecture={json.dumps(FP8_ARCH)}"]
    fp8 = [*common, "--set", "train.fp8=tensorwise", "--set", "train.compile=true"]
    torchrun(1, "train", "--config", config, *common, "--set", "run.name=wide-bf16")
    torchrun(1, "train", "--config", config, *fp8, "--set", "run.name=wide-fp8")
    bf16 = [r["loss"] for r in read_metrics(run_dir(setup, "wide-bf16")) if r["kind"] == "train"]
    curve = [r["loss"] for r in read_metrics(run_dir(setup, "wide-fp8")) if r["kind"] == "train"]
    assert len(curve) == STEPS and all(abs(a - b) < 0.03 * b for a, b in zip(curve, bf16)), \
        f"fp8  {[round(x, 4) for x in curve]}\nbf16 {[round(x, 4) for x in bf16]}"  # a string: shown whole
    assert ("fp8: 10 of 15 linear layers in float8 (tensorwise, weights all-gathered in float8); bf16: "
            "model.layers.*.self_attn.k_proj, model.layers.*.self_attn.v_proj (too small to gain), "
            "lm_head (the output head)" in rank0_log(run_dir(setup, "wide-fp8")))

    step6 = run_dir(setup, "wide-fp8") / "checkpoints" / "step-00000006"
    torchrun(1, "train", "--config", config, *fp8, "--set", "run.name=wide-fp8-resumed",
             "--set", f"train.resume={step6}")
    resumed = [r["loss"] for r in read_metrics(run_dir(setup, "wide-fp8-resumed")) if r["kind"] == "train"]
    assert max(abs(a - b) for a, b in zip(resumed, curve[6:])) < 1e-6, (resumed, curve[6:])

    out = root / "wide-fp8-export"
    llmtrain("export", "--run-dir", run_dir(setup, "wide-fp8"), "--out", out, check=True)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()) and type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 needs a GPU of compute capability 8.9 or newer")
def test_fp8_on_cuda_multiplies_on_the_float8_tensor_cores():
    """On a CPU the float8 matmuls are torchao's fp32 emulation (parallel/float8.py); on a GPU
    of compute capability 8.9+ they stay torch._scaled_mm, the float8 tensor cores."""
    from llmtrain.parallel import float8
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in FP8_ARCH.items() if k != "model_type"}))
    assert float8.convert(model, "tensorwise", torch.device("cuda"), fsdp=False) == 10
    assert not model.model.layers[0].mlp.up_proj.config.emulate


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 needs a GPU of compute capability 8.9 or newer")
def test_fp8_precomputed_scales_on_cuda_train_as_scales_computed_at_each_gather(tmp_path):
    """tests/float8_probe.py on the GPU (a world of one on NCCL): weights FSDP2 gathers in
    float8 with their scales precomputed by the trainer's Step, against the model gathered in
    fp32 and cast in the layer, through an update, a skipped step, a reload, a schedule-free
    evaluation and the steps after: the same losses; the amax all-reduces of each gather in the
    first forward only, none once the scales are precomputed; precomputing them makes the host
    wait for nothing."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "float8_probe.py"), "cuda", "nccl", str(port),
                           str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=env_with(LLMTRAIN_HOME=str(tmp_path / "home")))  # its config's run.dir
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.splitlines()[-1])
    gathered, plain = figures["gathered"], figures["plain"]
    assert gathered["precomputes"] and not plain["precomputes"], figures
    finite = [(a, b) for a, b in zip(gathered["losses"], plain["losses"]) if math.isfinite(b)]
    assert len(finite) == 6 and all(a == pytest.approx(b, rel=1e-6) for a, b in finite), figures
    assert gathered["all_reduces"][0] > 0 and gathered["all_reduces"][1:] == [0] * 5, figures
    assert plain["all_reduces"] == [0] * 6, figures
    assert gathered["host_syncs"] == 0, figures  # the precompute: no wait for the GPU


# A world of one (the GPU machine has one GPU) on the given backend, in a process of its own: context
# parallel's attention (its keys and values gathered by DTensor over the group, SDPA under the
# boolean [local, whole] mask) and the vocabulary-parallel chunked loss (its all-reduces) run their
# kernels on the device; both are compared with the plain paths in the same precision.
CP_AND_VOCAB_PARALLEL = """
import functools, sys
import torch, torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM
from llmtrain.data.loader import Batch
from torch.distributed.device_mesh import DeviceMesh
from llmtrain.model.attention import causal_attention, context_chunks, context_masks, context_parallel_attention
from llmtrain.model.loss import _vocab_parallel_chunk, chunked_cross_entropy, lm_loss

device, backend = torch.device(sys.argv[1]), sys.argv[2]
dist.init_process_group(backend, init_method="tcp://127.0.0.1:" + sys.argv[3], rank=0, world_size=1)
group = dist.new_group([0])
config = AutoConfig.for_model("llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=512)
torch.manual_seed(0)
models = [AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device) for _ in range(2)]
models[1].load_state_dict(models[0].state_dict())
for model in models:
    causal_attention(model)
context_parallel_attention(models[1], DeviceMesh.from_group(group, device.type))


def cp_loss(model, batch):  # lm_loss's context-parallel path, for a group of 1: its chunks, their mask
    inputs, targets = batch.tokens[:, :-1], batch.tokens[:, 1:]
    places = context_chunks(inputs.shape[1], 0, 1, device)
    positions = batch.positions[:, :-1] if batch.positions is not None else None
    logits = model(input_ids=inputs[:, places], position_ids=positions[:, places] if positions is not None
                   else places[None], attention_mask=context_masks(model.config, places, inputs.shape[1],
                                                                   positions)).logits
    return F.cross_entropy(logits.float().flatten(0, 1), targets[:, places].flatten())
tokens = torch.randint(1, 512, (2, 257), device=device)
positions = torch.cat([torch.arange(100), torch.arange(157)]).repeat(2, 1).to(device)  # two documents a row
for name, batch in (("cp", Batch(tokens, positions=positions)), ("cp_plain", Batch(tokens))):  # mask; none
    losses = []
    for model, loss_of in zip(models, (lm_loss, cp_loss)):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(model, batch)
        loss.backward()
        losses.append(loss.detach().float())
    grads = [torch.cat([p.grad.flatten().float() for p in m.parameters()]) for m in models]
    print(name, float(losses[0]), float(losses[1]), float((grads[0] - grads[1]).abs().max() / grads[0].abs().max()))

hidden = torch.randn(300, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
weight = torch.randn(512, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
targets = torch.randint(0, 512, (300,), device=device)
targets[::7] = -100
parallel = chunked_cross_entropy(hidden, weight, targets, chunk=64,
                                 chunk_fn=functools.partial(_vocab_parallel_chunk, start=0, group=group))
parallel.backward()
got = (hidden.grad.float(), weight.grad.float())
hidden.grad = weight.grad = None
plain = F.cross_entropy((hidden @ weight.t()).float(), targets, ignore_index=-100)
plain.backward()
with torch.no_grad():
    evaluated = chunked_cross_entropy(hidden, weight, targets, chunk=64,
                                      chunk_fn=functools.partial(_vocab_parallel_chunk, start=0, group=group))
print("vocab", float(plain), float(parallel), float(evaluated),
      max(float((a - b.grad.float()).abs().max() / b.grad.float().abs().max()) for a, b in zip(got, (hidden, weight))))
dist.destroy_process_group()
"""


def cp_and_vocab_parallel_figures(device: str, backend: str) -> dict[str, list[float]]:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", CP_AND_VOCAB_PARALLEL, device, backend, str(port)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {line.split()[0]: [float(x) for x in line.split()[1:]] for line in proc.stdout.splitlines()}


def test_context_parallel_attention_and_the_vocabulary_parallel_loss_on_cuda():
    """Issue 28's kernels on the GPU (a world of one on NCCL: several ranks need several GPUs, and
    stay proven on gloo): context parallel's attention (gathered keys and values, SDPA under the
    boolean mask of two packed documents; and with no documents, no mask: each chunk over its
    keys' prefix, bottom-right causal, on SDPA's fast kernels) gives the loss and gradients of
    the plain causal attention (flex's block mask on CUDA) in bf16; the vocabulary-parallel chunked loss gives
    F.cross_entropy's loss and gradients, in training and in evaluation."""
    figures = cp_and_vocab_parallel_figures("cuda", "nccl")
    for name in ("cp", "cp_plain"):  # documents: SDPA under the mask; none: causal_chunks, no mask
        plain, cp, grad_gap = figures[name]
        assert cp == pytest.approx(plain, abs=2e-2) and grad_gap < 5e-2, figures
    plain, parallel, evaluated, grad_gap = figures["vocab"]
    assert parallel == pytest.approx(plain, rel=1e-3) and evaluated == pytest.approx(plain, rel=1e-3), figures
    assert grad_gap < 2e-2, figures
