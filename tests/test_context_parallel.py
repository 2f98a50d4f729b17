"""Context parallel (parallel.cp): each rank of a group takes a head and a tail chunk of every
sequence and attends over the whole sequence's keys and values, gathered. The chunks' arithmetic
in one process; then under torchrun (gloo) the same losses as one process, with document masking,
packed fine-tuning rows, and with tensor parallel and FSDP2 on top."""

from __future__ import annotations

import pytest
import torch
import yaml

from conftest import assert_same_curve, cli, losses, prepared_home, run_dir, tiny_config, torchrun
from llmtrain.model.attention import _gathered_order, context_chunks, context_mask
from test_finetune import sft_config


def test_each_rank_takes_a_head_and_a_tail_chunk_and_the_gather_puts_them_back_in_order():
    seq, cp = 16, 4  # 8 chunks of 2 tokens
    places = [context_chunks(seq, rank, cp) for rank in range(cp)]
    assert places[0].tolist() == [0, 1, 14, 15] and places[3].tolist() == [6, 7, 8, 9]
    assert sorted(torch.cat(places).tolist()) == list(range(seq))  # every token once
    gathered = torch.cat(places)  # what an all-gather of the ranks' keys holds, rank by rank
    assert gathered[_gathered_order(cp, 2, "cpu")].tolist() == list(range(seq))
    # causal over the whole sequence: the same number of (query, key) pairs on every rank
    assert {int(context_mask(p, seq).sum()) for p in places} == {34}


def test_the_mask_keeps_documents_apart_across_chunks():
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])  # documents of 3 and 5 tokens
    places = context_chunks(8, 1, 2)  # rank 1 of 2: chunks 1 and 2, tokens 2, 3, 4, 5
    mask = context_mask(places, 8, positions)[0, 0]
    whole = torch.ones(8, 8, dtype=torch.bool).tril() & ((positions.T == 0).cumsum(0) == (positions == 0).cumsum(1))
    assert torch.equal(mask, whole[places])
    assert mask[1].tolist() == [False, False, False, True, False, False, False, False]  # token 3 starts one


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with prepared_home(tmp_path_factory, "cp", tiny_config(train={"max_steps": 10, "eval_every": 5,
                                                                  "checkpoint_every": 0})) as home:
        yield home


@pytest.mark.slow
def test_cp2_gives_one_process_curve_with_and_without_document_masking(setup):
    """2 ranks, each half of every sequence (with accumulation: 2 micro-batches a step), under DDP
    (over the world: the context-parallel ranks hold the same weights). A checkpoint the cp 2 run
    wrote at step 5 resumes in one process (cp 1): steps 6-10 are one process's."""
    _, config = setup
    for name, extra in (("plain", []), ("documents", ["--set", "data.document_masking=true"])):
        cli("train", "--config", config, "--set", f"run.name={name}-single", *extra, check=True)
        torchrun(2, "train", "--config", config, "--set", f"run.name={name}-cp2", "--set", "parallel.cp=2",
                 "--set", "train.checkpoint_every=5", *extra)
        assert_same_curve(run_dir(setup, f"{name}-cp2"), run_dir(setup, f"{name}-single"), tol=1e-4)
    log = (run_dir(setup, "plain-cp2") / "logs" / "rank-0.log").read_text()
    assert "ddp over 2 ranks (mesh: cp 2)" in log and "global batch 8 = 4 x 1 ranks x 2 accumulation steps" in log
    ckpt = run_dir(setup, "plain-cp2") / "checkpoints" / "step-00000005"
    cli("train", "--config", config, "--set", "run.name=cp2-then-single", "--set", f"train.resume={ckpt}", check=True)
    single = {(k, s): v for k, s, v in losses(run_dir(setup, "plain-single"))}
    resumed = losses(run_dir(setup, "cp2-then-single"))
    assert [s for _, s, _ in resumed][0] == 6 and resumed[-1][1] == 10
    assert max(abs(v - single[k, s]) for k, s, v in resumed) <= 1e-4, (resumed, single)


@pytest.mark.slow
def test_packed_fine_tuning_rows_under_cp2_lose_what_one_process_loses(tmp_path, monkeypatch):
    """Chat samples packed into rows: each rank's chunks carry their samples' positions and
    trained flags; a sample never attends to another, whichever rank holds its tokens."""
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    cfg = sft_config(tmp_path)
    cfg["train"].update(max_steps=4, log_every=1, eval_every=2, eval_samples=4)
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli("prepare", "--config", path, check=True)
    cli("train", "--config", path, "--set", "run.name=single", check=True)
    torchrun(2, "train", "--config", path, "--set", "run.name=cp2", "--set", "parallel.cp=2")
    runs = tmp_path / "home" / "runs"
    assert_same_curve(runs / "cp2", runs / "single", tol=1e-4)


@pytest.mark.slow
def test_fsdp_over_cp2_x_tp2_on_four_processes_gives_one_process_curve(setup):
    """4 ranks, one data-parallel rank: 2 context-parallel halves of each sequence, each split by
    tensor parallel; FSDP2 shards the weights over the context-parallel pair."""
    _, config = setup
    if not (run_dir(setup, "plain-single") / "metrics.jsonl").exists():  # run alone (-k): make it
        cli("train", "--config", config, "--set", "run.name=plain-single", check=True)
    torchrun(4, "train", "--config", config, "--set", "run.name=cp2-tp2", "--set", "parallel.cp=2",
             "--set", "parallel.tp=2", "--set", "parallel.strategy=fsdp")
    d = run_dir(setup, "cp2-tp2")
    assert_same_curve(d, run_dir(setup, "plain-single"), tol=1e-4)
    assert "fsdp over 4 ranks (mesh: cp 2 x tp 2)" in (d / "logs" / "rank-0.log").read_text()
