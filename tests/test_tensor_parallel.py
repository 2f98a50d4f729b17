"""Tensor + sequence parallel (parallel.tp) under torchrun (gloo): the same losses as one process,
with FSDP2 on top, a tied head, and checkpoints that change layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import assert_same_curve, cli, losses, prepared_home, reference_run, run_dir, tiny_config, torchrun

pytestmark = pytest.mark.slow

# Qwen3: its q_norm and k_norm work on each head's features (each rank normalises its own heads),
# and its head is tied to the embedding.
QWEN3_TIED = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128,
              "tie_word_embeddings": True}


# 10 steps, 2 evaluations; test_context_parallel.py holds its layouts to this config's single process too.
CONFIG = tiny_config(train={"max_steps": 10, "eval_every": 5, "checkpoint_every": 5})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with prepared_home(tmp_path_factory, "tp", CONFIG) as home:
        yield home


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process (micro batch 4, 2 accumulation steps): the curve every layout must give
    (made once per pytest run: conftest.reference_run)."""
    return reference_run(tmp_path_factory, "single", CONFIG)


def test_tp2_gives_one_process_curve_and_splits_the_model(setup, single):
    proc = torchrun(2, "train", "--config", setup[1], "--set", "run.name=tp2", "--set", "parallel.tp=2")
    tp2 = run_dir(setup, "tp2")
    assert_same_curve(tp2, single, tol=1e-4)  # fp32, 10 steps, 2 evaluations
    log = (tp2 / "logs" / "rank-0.log").read_text()
    assert "tensor parallel over 2 ranks (mesh: tp 2; no data parallelism)" in log
    assert "global batch 8 = 4 x 1 ranks x 2 accumulation steps" in log  # one data-parallel rank
    assert "Traceback" not in proc.stderr


def test_compiled_and_checkpointed_tp2_layers_train_as_one_process(setup, single):
    """torch.compile per layer and activation checkpointing under tp 2: the embedding's output
    (an asynchronous reduce-scatter's) reached the first compiled layer without its gradient,
    so the embedding never trained (FSDP2) or backward failed (tp alone); now the curve is one
    process's."""
    torchrun(2, "train", "--config", setup[1], "--set", "run.name=tp2-compiled", "--set", "parallel.tp=2",
             "--set", "train.compile=true", "--set", "model.activation_checkpointing=true")
    assert_same_curve(run_dir(setup, "tp2-compiled"), single, tol=1e-4)


def test_a_tied_qwen3_stays_tied_under_tp2(setup):
    """The head is the embedding's sharded parameter: one parameter count, one process's curve
    (an untied copy would train two matrices apart and drift); Qwen3's per-head norms too."""
    tied = ["--set", f"model.architecture={json.dumps(QWEN3_TIED)}"]
    cli("train", "--config", setup[1], "--set", "run.name=tied-single", *tied, check=True)
    torchrun(2, "train", "--config", setup[1], "--set", "run.name=tied-tp2", "--set", "parallel.tp=2", *tied)
    assert_same_curve(run_dir(setup, "tied-tp2"), run_dir(setup, "tied-single"), tol=1e-4)
    log = (run_dir(setup, "tied-tp2") / "logs" / "rank-0.log").read_text()
    assert "model: 106,880 parameters" in log  # 139,648 untied: the 512 x 64 head counted once


def test_fsdp_x_tp_on_four_processes_gives_one_process_curve(setup, single):
    """2-D: FSDP2 over 2 data-parallel ranks, each a tensor-parallel pair; they read 2 samples
    each (the pair the same ones). No rank warns of the gradient norm's "2 sequential
    all_reduce operations" (its mesh dimensions are flattened: parallel/dims.py)."""
    proc = torchrun(4, "train", "--config", setup[1], "--set", "run.name=fsdp-tp", "--set", "parallel.tp=2",
                    "--set", "parallel.strategy=fsdp", "--set", "train.micro_batch_size=2")
    assert "sequential all_reduce" not in proc.stderr, proc.stderr
    d = run_dir(setup, "fsdp-tp")
    assert_same_curve(d, single, tol=1e-4)
    log = (d / "logs" / "rank-0.log").read_text()
    assert "fsdp over 4 ranks (mesh: dp_shard 2 x tp 2)" in log
    assert "global batch 8 = 2 x 2 ranks x 2 accumulation steps" in log


def test_a_tp_checkpoint_resumes_under_fsdp_and_exports_the_same_model(setup, single):
    """Written at tp 2, read at fsdp (no tensor parallel): the curve goes on as one process's.
    And the model a tp 2 run exports is the one a single process exports."""
    tp2 = run_dir(setup, "tp2")
    if not (tp2 / "checkpoints" / "step-00000005").is_dir():  # run alone (-k): make it
        torchrun(2, "train", "--config", setup[1], "--set", "run.name=tp2", "--set", "parallel.tp=2")
    torchrun(2, "train", "--config", setup[1], "--set", "run.name=from-tp", "--set", "parallel.strategy=fsdp",
             "--set", f"train.resume={tp2 / 'checkpoints' / 'step-00000005'}")
    resumed = run_dir(setup, "from-tp")
    log = (resumed / "logs" / "rank-0.log").read_text()
    assert f"resumed from {tp2}/checkpoints/step-00000005 (step 5, saved by 2 ranks)" in log
    reference = {(kind, step): loss for kind, step, loss in losses(single)}
    curve = losses(resumed)
    assert [step for _, step, _ in curve][0] == 6
    assert max(abs(loss - reference[kind, step]) for kind, step, loss in curve) <= 1e-4

    out = setup[0] / "exported"
    for name, run in (("tp2", tp2), ("single", single)):
        cli("export", "--run-dir", run, "--out", out / name, check=True)
    a, b = (load_file(out / name / "model.safetensors") for name in ("tp2", "single"))
    assert sorted(a) == sorted(b) and all(a[k].shape == b[k].shape for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    assert all(a[k].dtype == torch.float32 for k in a)


def test_lora_adapters_split_with_their_layers_under_fsdp_x_tp2(setup, tmp_path):
    """LoRA on every projection of a pretrained (tied) model: at tp 2 each adapter is split as
    its layer (B's rows on q/k/v/gate/up, A's columns on o/down), under FSDP2; the curve is one
    process's and only the adapters train (the base's weights are where they started)."""
    from test_train import tiny_pretrained
    base = tiny_pretrained(tmp_path / "base")
    lora = ["--set", f"model.name_or_path={tmp_path / 'base'}", "--set", "model.architecture=null",
            "--set", "model.tokenizer=null", "--set",
            "model.lora={rank: 4, alpha: 8, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
            "down_proj]}", "--set", "train.lr=1e-2"]
    cli("prepare", "--config", setup[1], *lora, check=True)  # with the base's own tokenizer folder
    cli("train", "--config", setup[1], "--set", "run.name=lora-single", *lora, check=True)
    torchrun(2, "train", "--config", setup[1], "--set", "run.name=lora-tp2", "--set", "parallel.tp=2",
             "--set", "parallel.strategy=fsdp", *lora)
    assert_same_curve(run_dir(setup, "lora-tp2"), run_dir(setup, "lora-single"), tol=1e-4)
    train = [loss for kind, _, loss in losses(run_dir(setup, "lora-tp2")) if kind == "train"]
    assert train[-1] < train[0] - 0.1  # the adapters learn (6.22 -> 6.03 in 10 steps)
    log = (run_dir(setup, "lora-tp2") / "logs" / "rank-0.log").read_text()
    assert "LoRA: 8,192 trainable parameters" in log  # rank 4 x (in + out) of 7 projections, 2 layers
    out = tmp_path / "merged"
    cli("export", "--run-dir", run_dir(setup, "lora-tp2"), "--out", out, "--merge", check=True)
    merged = load_file(out / "model.safetensors")
    start = base.state_dict()
    assert torch.equal(merged["model.norm.weight"], start["model.norm.weight"])  # frozen
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           start["model.layers.0.self_attn.q_proj.weight"])  # the adapter merged in



@pytest.mark.parametrize("model_type,line", [
    ("mistral", "parallel.tp: must divide the model's num_key_value_heads 8 (got 3); each rank holds "
                "num_key_value_heads / tp of them"),
    ("qwen3", "parallel.tp: must divide the model's num_key_value_heads 32 (got 3); each rank holds "
              "num_key_value_heads / tp of them"),
    ("llama", None),  # its kv heads default to its heads: 12
])
def test_the_tp_check_sees_the_sizes_an_inline_architecture_leaves_to_its_family(model_type, line):
    """An inline architecture without num_key_value_heads gets its config class's default: a
    Mistral has 8 kv heads, a Qwen3 32, a Llama one per head. tp 3 with 12 heads must be refused
    where the model will have 8 or 32 kv heads (check-config passed it, and the start failed)."""
    from llmtrain.parallel.tensor import problems
    config = {"model_type": model_type, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072,
              "vocab_size": 480}
    assert problems(model_type, config, 3) == ([line] if line else [])
