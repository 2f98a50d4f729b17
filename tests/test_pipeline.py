"""Pipeline parallel (parallel.pp) under torchrun (gloo): one process's losses under 1F1B and
GPipe, with FSDP2, with document masks; checkpoints that change pp; a failing stage; the rules."""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml

from conftest import (assert_same_curve, cli, imported_first, losses, prepared_home, reference_run, run_dir,
                      tiny_config, torchrun, torchrun_unchecked)
from llmtrain.config import ConfigError, load_config
from llmtrain.parallel.dims import ParallelDims
from llmtrain.parallel.pipeline import stage_bounds

MISTRAL_WINDOW = {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                  "sliding_window": 16, "tie_word_embeddings": False}
# The tensor-parallel tests' config (10 steps, 2 evaluations, 2 layers): its one-process run is shared.
CONFIG = tiny_config(train={"max_steps": 10, "eval_every": 5, "checkpoint_every": 5})


def test_stages_are_cut_by_cost_with_the_embedding_and_head_as_layers():
    assert stage_bounds(2, 2) == [(0, 1), (1, 2)]  # embedding + layer 0 | layer 1 + head
    assert stage_bounds(4, 2) == [(0, 2), (2, 4)]  # 6 units: 3 and 3
    assert stage_bounds(6, 4) == [(0, 1), (1, 3), (3, 5), (5, 6)]  # 8 units: 2 each
    # 70B: 82 units, 10 a stage and the first two 11
    assert stage_bounds(80, 8) == [(0, 10), (10, 21), (21, 31), (31, 41), (41, 51), (51, 61), (61, 71), (71, 80)]
    bounds = stage_bounds(126, 16)  # 405B: 128 units, 8 a stage
    assert [end - start for start, end in bounds] == [7] + [8] * 14 + [7]


def _problems(tmp_path, world: int = 2, **parallel) -> list[str]:
    """What loading a config with these parallel keys on `world` ranks finds, one line each."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config(parallel=parallel)))
    try:
        load_config(path, world_size=world)
    except ConfigError as e:
        return e.problems
    return []


def test_the_layout_refuses_what_the_pipeline_does_not_do_yet_in_one_line_each(tmp_path):
    assert _problems(tmp_path, pp=2) == []
    assert _problems(tmp_path, 4, pp=2, strategy="fsdp") == []
    assert _problems(tmp_path, pp=3) == ["parallel.pp: must divide the world size / parallel.tp = 2 (got 3)"]
    assert _problems(tmp_path, pp=2, pp_schedule="zbv") == [
        "parallel.pp_schedule: zbv splits each backward in two passes, which llmtrain's loss does not support "
        "yet; use 1f1b, gpipe, interleaved_1f1b"]
    assert _problems(tmp_path, pp=2, pp_schedule="interleaved_1f1b") == []  # 2 stages a rank by default
    assert _problems(tmp_path, pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=1) == [
        "parallel.pp_stages_per_rank: interleaved_1f1b holds at least 2 stages a rank (got 1); set 2 or more, "
        "or parallel.pp_schedule: 1f1b"]
    assert _problems(tmp_path, pp=2, pp_stages_per_rank=2)[0].startswith(
        "parallel.pp_stages_per_rank: 1f1b holds one stage a rank (got 2)")

    assert _problems(tmp_path, 4, pp=2, strategy="ddp") == [
        "parallel.strategy: with parallel.pp 2 and 2 data-parallel ranks, use fsdp or hsdp (each stage's weights "
        "gathered once a step); ddp pipelines a single replica only"]
    assert _problems(tmp_path, 4, pp=2, tp=2, strategy="fsdp") == []
    assert _problems(tmp_path, 4, pp=2, cp=2, strategy="fsdp")[0].startswith(
        "parallel.pp: not with parallel.cp yet (got cp 2)")


def test_a_tied_head_and_an_unknown_family_are_refused_by_check_config(tmp_path):
    cfg = tiny_config(parallel={"pp": 2})
    cfg["model"]["architecture"]["tie_word_embeddings"] = True
    path = tmp_path / "tied.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = cli("check-config", "--config", path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert ("parallel.pp: the model ties its input and output embeddings (tie_word_embeddings), which live on "
            "the first and the last stage; untie them") in proc.stdout + proc.stderr
    path.write_text(yaml.safe_dump(tiny_config(parallel={"pp": 2})))
    dims = ParallelDims.from_config(load_config(path, world_size=2), 2)
    assert dims.model_problems("gpt2", {"n_layer": 4})[0].startswith(
        "parallel.pp: model type 'gpt2' has no pipeline stages in llmtrain yet")
    assert dims.model_problems("llama", {"num_hidden_layers": 1}) == []  # 3 units over 2 stages
    assert "4 stages need at least 2 decoder layers" in ParallelDims.from_config(
        load_config(path, ["parallel.pp=4"], world_size=4), 4).model_problems("llama", {"num_hidden_layers": 1})[0]
    moe = {"num_hidden_layers": 2, "num_experts": 8}
    assert dims.model_problems("qwen3_moe", moe) == []  # the load-balancing loss over the stages: test_moe.py
    assert ParallelDims.from_config(load_config(path, ["parallel.tp=2"], world_size=4), 4).model_problems(
        "qwen3_moe", moe) == ["parallel.pp: not with parallel.tp for a Mixture-of-Experts model yet (got tp 2); use "
                              "pipeline with fsdp, hsdp or ddp"]


def test_fewer_micro_batches_than_stages_is_a_warning(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config(parallel={"pp": 2}, train={"global_batch_size": 4})))
    dims = ParallelDims.from_config(load_config(path, world_size=2), 2)
    (line,) = dims.pipeline_warnings(load_config(path, world_size=2))
    assert line.startswith("warning: parallel.pp 2 with 1 micro-batch a step")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with prepared_home(tmp_path_factory, "pp", CONFIG) as home:
        yield home


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return reference_run(tmp_path_factory, "single", CONFIG)


@pytest.mark.slow
def test_pp2_1f1b_gives_one_process_curve_resumes_in_one_process_and_exports(setup, single, tmp_path):
    proc = torchrun(2, "train", "--config", setup[1], "--set", "run.name=pp2", "--set", "parallel.pp=2")
    pp2 = run_dir(setup, "pp2")
    assert_same_curve(pp2, single, tol=1e-4)  # fp32, 10 steps, 2 evaluations
    assert "Traceback" not in proc.stderr
    log0, log1 = ((pp2 / "logs" / f"rank-{r}.log").read_text() for r in (0, 1))
    assert ("pipeline: stage 0 of 2 (the embedding, layers 0-0); schedule 1f1b, 2 micro-batches of 4 a step"
            in log0)
    # the whole model's count on every stage, as one process states it (and the FLOPs per token from it)
    assert "model: 139,584 parameters, pipeline of 2 stages over 2 ranks" in log0
    assert "pipeline: stage 1 of 2 (layers 1-1, the final norm and head)" in log1
    assert "a step (bubble 33% of a step on paper)" in log1  # (p - 1) / (m + p - 1), 2 micro-batches
    assert re.search(r"pipeline: idle share of step 2 by pipeline rank \(measured, .*\): rank 0 \d+%, "
                     r"rank 1 \d+%; 33% on paper", log0), log0
    # The step-5 checkpoint (saved by 2 stages) resumes in one process: steps 6-10 as the uninterrupted run.
    cli("train", "--config", setup[1], "--set", "run.name=pp2-then-1", "--set", "slurm.procs_per_node=1",
        "--set", f"train.resume={pp2 / 'checkpoints' / 'step-00000005'}", check=True)
    resumed = run_dir(setup, "pp2-then-1")
    assert "(step 5, saved by 2 ranks)" in (resumed / "logs" / "rank-0.log").read_text()
    later = [x for x in losses(single) if x[1] > 5]
    assert [x[:2] for x in losses(resumed)] == [x[:2] for x in later]
    assert max(abs(a[2] - b[2]) for a, b in zip(losses(resumed), later)) <= 1e-4
    # One HF folder, every layer in it, generating what `llmtrain generate` does from the run.
    cli("export", "--run-dir", pp2, "--out", tmp_path / "hf", check=True)
    index = tmp_path / "hf" / "model.safetensors"
    assert index.exists()
    args = ["--prompt", "Once upon a time, Sam went to the", "--max-new-tokens", "12", "--seed", "1"]
    a = cli("generate", "--run-dir", pp2, *args, check=True).stdout
    b = cli("generate", "--model", tmp_path / "hf", *args, check=True).stdout
    assert a == b and len(a) > len(args[1])


@pytest.mark.slow
def test_gpipe_document_masks_and_sliding_windows_under_pp2_give_one_process_curves(setup, single, tmp_path_factory):
    torchrun(2, "train", "--config", setup[1], "--set", "run.name=gpipe", "--set", "parallel.pp=2",
             "--set", "parallel.pp_schedule=gpipe")
    assert_same_curve(run_dir(setup, "gpipe"), single, tol=1e-4)
    # Positions restart at each document: every stage builds the block-diagonal mask from them.
    masked = reference_run(tmp_path_factory, "single", CONFIG, "data.document_masking=true")  # test_context_parallel's too
    torchrun(2, "train", "--config", setup[1], "--set", "run.name=pp2-docs", "--set", "parallel.pp=2",
             "--set", "data.document_masking=true")
    assert_same_curve(run_dir(setup, "pp2-docs"), masked, tol=1e-4)
    assert abs(losses(masked)[-1][2] - losses(single)[-1][2]) > 1e-3  # the masks made a difference
    # Mistral's sliding window (16 of 64 tokens): each stage's layers attend within it
    mistral = [f"model.architecture={json.dumps(MISTRAL_WINDOW)}"]
    windowed = reference_run(tmp_path_factory, "single-mistral-window", CONFIG, *mistral)
    torchrun(2, "train", "--config", setup[1], "--set", "run.name=pp2-window", "--set", "parallel.pp=2",
             "--set", mistral[0])
    assert_same_curve(run_dir(setup, "pp2-window"), windowed, tol=1e-4)


@pytest.mark.slow
def test_packed_and_unpacked_fine_tuning_rows_under_pp2_give_one_process_curves(tmp_path, monkeypatch):
    """Chat samples: packed rows (each sample its own document: every stage masks by the positions)
    and unpacked rows (cut to their batch's longest sample; under pp padded back to seq_len with
    untrained tokens, since a stage's shapes are fixed once inferred)."""
    from test_finetune import sft_config
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    cfg = sft_config(tmp_path)
    cfg["train"].update(global_batch_size=8, micro_batch_size=2, max_steps=4, eval_every=2)
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump(cfg))
    runs = tmp_path / "home" / "runs"
    for packing in ("true", "false"):  # packing is a setting of the prepared data
        common = ["--config", config, "--set", f"data.packing={packing}"]
        cli("prepare", *common, check=True)
        cli("train", *common, "--set", f"run.name=one-{packing}", "--set", "slurm.procs_per_node=1", check=True)
        torchrun(2, "train", *common, "--set", f"run.name=pp2-{packing}", "--set", "parallel.pp=2")
        assert_same_curve(runs / f"pp2-{packing}", runs / f"one-{packing}", tol=1e-4)
    assert losses(runs / "one-true") != losses(runs / "one-false")  # different rows, different batches


@pytest.mark.slow
def test_interleaved_1f1b_two_stages_a_rank_gives_one_process_curve(setup, tmp_path_factory):
    """4 layers as 4 stages over 2 ranks: rank 0 stages 0 and 2, rank 1 stages 1 and 3."""
    deeper = ["model.architecture.num_hidden_layers=4"]
    single4 = reference_run(tmp_path_factory, "single-4-layers", CONFIG, *deeper)
    torchrun(2, "train", "--config", setup[1], "--set", "run.name=interleaved", "--set", "parallel.pp=2",
             "--set", "parallel.pp_schedule=interleaved_1f1b", "--set", deeper[0])
    d = run_dir(setup, "interleaved")
    assert_same_curve(d, single4, tol=1e-4)
    assert ("pipeline: stage 1 of 4 (layers 1-2); stage 3 of 4 (the final norm and head); schedule "
            "interleaved_1f1b") in (d / "logs" / "rank-1.log").read_text()


@pytest.mark.slow
def test_pp2_x_fsdp2_and_pp2_x_tp2_on_four_processes_give_one_process_curve(setup, single):
    """2 stages x 2 FSDP2 shards: each stage's weights gathered once a step (not per micro-batch),
    its gradients reduce-scattered at the last micro-batch; one process's curve."""
    torchrun(4, "train", "--config", setup[1], "--set", "run.name=pp2-fsdp", "--set", "parallel.pp=2",
             "--set", "parallel.strategy=fsdp", "--set", "train.micro_batch_size=2")
    d = run_dir(setup, "pp2-fsdp")
    assert_same_curve(d, single, tol=1e-4)
    assert "global batch 8 = 2 x 2 ranks x 2 accumulation steps" in (d / "logs" / "rank-0.log").read_text()
    # 2 stages x tensor parallel 2: hidden states sent as each rank's slice of the sequence, the
    # last stage's loss from its slice of the vocabulary
    torchrun(4, "train", "--config", setup[1], "--set", "run.name=pp2-tp2", "--set", "parallel.pp=2",
             "--set", "parallel.tp=2")
    assert_same_curve(run_dir(setup, "pp2-tp2"), single, tol=1e-4)
    # its step-5 checkpoint (4 ranks: 2 stages, each weight split over 2) in one process: steps 6-10
    cli("train", "--config", setup[1], "--set", "run.name=pp2-tp2-then-1", "--set", "slurm.procs_per_node=1",
        "--set", f"train.resume={run_dir(setup, 'pp2-tp2') / 'checkpoints' / 'step-00000005'}", check=True)
    later = [x for x in losses(single) if x[1] > 5]
    resumed = losses(run_dir(setup, "pp2-tp2-then-1"))
    assert [x[:2] for x in resumed] == [x[:2] for x in later]
    assert max(abs(a[2] - b[2]) for a, b in zip(resumed, later)) <= 1e-4


STAGE_1_FAILS = """
import os
if os.environ.get("RANK") == "1":
    import torch.nn.functional as F
    real, calls = F.silu, []
    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) > 6:
            raise RuntimeError("injected failure in stage 1")
        return real(*args, **kwargs)
    F.silu = failing
"""


@pytest.mark.slow
def test_an_exception_in_stage_1_ends_both_processes_within_seconds(setup, tmp_path):
    start = time.monotonic()
    proc = torchrun_unchecked(2, "train", "--config", setup[1], "--set", "run.name=pp2-fails",
                              "--set", "parallel.pp=2", env=imported_first(tmp_path, STAGE_1_FAILS))
    took = time.monotonic() - start
    assert proc.returncode != 0
    assert proc.stderr.count("RuntimeError: injected failure in stage 1") == 1, proc.stderr[-3000:]
    assert took < 60, took  # the start-up included; stage 0 is not left waiting for the collective timeout
    metrics = [json.loads(x) for x in (run_dir(setup, "pp2-fails") / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if r["kind"] == "train"] == [1, 2]


def test_the_estimate_holds_a_stages_gathered_weights_unsharded_gradients_and_forwards_in_flight(tmp_path):
    """The first rank of 1F1B holds pp forwards' activations, of GPipe every micro-batch's; under
    FSDP2 a stage's weights stay gathered and, with accumulation, its gradients unsharded in fp32
    until the last micro-batch (torch's pipelining defers the reduce-scatter)."""
    from llmtrain.login.estimate import estimate, in_flight
    assert [in_flight("1f1b", 4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("gpipe", 4, 0, 8) == 8 and in_flight("1f1b", 4, 0, 2) == 2
    assert [in_flight("interleaved_1f1b", 4, r, 8, 2) for r in (0, 3)] == [11, 5]  # torch's warm-up, plus one
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config(parallel={"pp": 2, "strategy": "fsdp"},
                                               train={"global_batch_size": 16, "micro_batch_size": 2})))
    one_step = estimate(load_config(path, ["train.global_batch_size=4"], world_size=4), 4)  # 1 micro-batch
    accumulating = estimate(load_config(path, world_size=4), 4)  # 4 micro-batches
    gpipe = estimate(load_config(path, ["parallel.pp_schedule=gpipe"], world_size=4), 4)
    assert "pipeline rank" in accumulating.phase and "2 micro-batch forwards in flight" in accumulating.phase
    assert "4 micro-batch forwards in flight" in gpipe.phase and gpipe.activations > accumulating.activations
    # the stage's whole fp32 gradient (about half the model) on top of its shard
    assert accumulating.gradients - one_step.gradients >= 4 * 0.4 * accumulating.params
    assert accumulating.param_copies >= 4 * 0.4 * accumulating.params  # fp32 run: the gathered stage


@pytest.mark.slow
def test_a_stuck_stage_is_named_with_its_rank(setup):
    """The last stage stops after its backward of step 4 (the fault injector's hang): stage 0
    finishes the step and waits in the step's agreement; the diagnosis names rank 1 and its stage."""
    proc = torchrun_unchecked(2, "train", "--config", setup[1], "--set", "run.name=pp2-hang", "--set", "parallel.pp=2",
                              "--set", "parallel.collective_timeout_s=10", env={"LLMTRAIN_INJECT_HANG_STEP": "4"},
                              timeout=120)
    assert proc.returncode != 0
    lines = {x for x in proc.stderr.splitlines() if x.startswith("error: a collective did not complete")}
    assert any("rank 1 (pipeline stage 1 of 2) on " in x and "stopped participating" in x for x in lines), \
        proc.stderr[-3000:]
