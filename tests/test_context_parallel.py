"""Context parallel (parallel.cp): each rank of a group takes a head and a tail chunk of every
sequence and attends over the whole sequence's keys and values, gathered. The chunks' arithmetic
in one process; then under torchrun (gloo) the same losses as one process, with document masking,
packed fine-tuning rows, and with tensor parallel and FSDP2 on top."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import assert_same_curve, cli, losses, prepared_home, reference_run, run_dir, tiny_config, torchrun
from llmtrain.data.loader import Batch
from llmtrain.model.attention import (_gathered_order, causal_attention, causal_chunks, context_chunks, context_mask,
                                      context_parallel_attention)
from llmtrain.model.loss import lm_loss
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


def test_a_window_and_documents_mask_each_ranks_queries_as_the_whole_sequences_mask():
    """Rank r's rows of the [seq, seq] mask one process uses (causal, within documents, within 3
    tokens back) are its context mask, for every rank of cp 2 and 4."""
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1]])
    document = (positions == 0).cumsum(dim=1)[0]
    place = torch.arange(16)
    whole = (place[:, None] >= place) & (place[:, None] - place < 3) & (document[:, None] == document)
    for cp in (2, 4):
        for rank in range(cp):
            places = context_chunks(16, rank, cp)
            assert torch.equal(context_mask(places, 16, positions, window=3)[0, 0], whole[places])


@pytest.mark.parametrize("cp", [2, 4])
def test_each_ranks_chunks_attend_causally_to_the_keys_before_them_with_no_mask(cp):
    """causal_chunks (no document masking, no window): a rank's head and tail chunk, each over
    the prefix of the whole sequence's keys up to its end, aligned bottom-right, with the
    key/value heads as they are (GQA), give the rows and the gradients of whole-sequence causal
    attention."""
    seq = 8 * cp  # chunks of 4 tokens
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, seq, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, seq, 8, generator=g, requires_grad=True) for _ in range(2))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    weights = torch.randn(whole.shape, generator=g)
    expected = torch.autograd.grad((whole * weights).sum(), (q, k, v))
    got = [torch.zeros_like(x) for x in (q, k, v)]
    for rank in range(cp):
        places = context_chunks(seq, rank, cp)
        out = causal_chunks(q[:, :, places], k, v, rank, cp)
        assert (out - whole[:, places]).abs().max() < 1e-6
        for total, grad in zip(got, torch.autograd.grad((out * weights[:, places]).sum(), (q, k, v))):
            total += grad  # k and v: each rank's share (reduce-scattered in a real run)
    assert all((a - b).abs().max() < 1e-5 for a, b in zip(got, expected))


def test_plain_causal_context_parallel_builds_no_mask_and_loses_what_one_process_loses(monkeypatch):
    """Without documents or windows lm_loss passes context parallel's attention no mask at all:
    context_mask (the [batch, 1, local, seq] boolean one) is never called and every layer attends
    through causal_chunks, in one process with a context-parallel mesh of 1 (its two chunks are
    the halves of each sequence, lm_loss's whole sequence in order): the loss and the gradients of
    plain causal attention."""
    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    chunked = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float32)
    chunked.load_state_dict(plain.state_dict())  # its own config: the attention is set there
    causal_attention(plain)
    batch = Batch(tokens=torch.randint(0, 64, (2, 65), generator=torch.Generator().manual_seed(1)))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        context_parallel_attention(chunked, DeviceMesh.from_group(dist.group.WORLD, "cpu"))

        def no_mask(*args, **kwargs):
            raise AssertionError("context parallel built a mask for plain causal attention")
        monkeypatch.setattr("llmtrain.model.attention.context_mask", no_mask)
        calls = []

        def counted(*args, **kwargs):
            calls.append(args[0].shape)
            return causal_chunks(*args, **kwargs)
        monkeypatch.setattr("llmtrain.model.attention.causal_chunks", counted)
        loss = lm_loss(chunked, batch)
        loss.backward()
    finally:
        dist.destroy_process_group()
    expected = lm_loss(plain, batch)
    expected.backward()
    assert abs(loss.item() - expected.item()) < 1e-6
    assert max((a.grad - b.grad).abs().max().item() for a, b in zip(chunked.parameters(), plain.parameters())) < 1e-6
    assert calls == [(2, 4, 64, 8)] * 2  # each layer: [batch, heads, 2 chunks of 32, head dim]
    assert plain.config._attn_implementation == "llmtrain_causal_sdpa"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with prepared_home(tmp_path_factory, "cp", tiny_config(train={"max_steps": 10, "eval_every": 5,
                                                                  "checkpoint_every": 0})) as home:
        yield home


def single(tmp_path_factory, *sets: str):
    """One process's curve of this module's config (with `sets`): test_tensor_parallel.py's
    reference run, whose checkpoints every 5 steps change no loss; made once per pytest run."""
    config = tiny_config(train={"max_steps": 10, "eval_every": 5, "checkpoint_every": 5})
    return reference_run(tmp_path_factory, "single", config, *sets)


@pytest.mark.slow
def test_cp2_gives_one_process_curve_with_and_without_document_masking(setup, tmp_path_factory):
    """2 ranks, each half of every sequence (with accumulation: 2 micro-batches a step), under DDP
    (over the world: the context-parallel ranks hold the same weights). A checkpoint the cp 2 run
    wrote at step 5 resumes in one process (cp 1): steps 6-10 are one process's."""
    _, config = setup
    for name, extra in (("plain", []), ("documents", ["data.document_masking=true"])):
        torchrun(2, "train", "--config", config, "--set", f"run.name={name}-cp2", "--set", "parallel.cp=2",
                 "--set", "train.checkpoint_every=5", *(x for s in extra for x in ("--set", s)))
        assert_same_curve(run_dir(setup, f"{name}-cp2"), single(tmp_path_factory, *extra), tol=1e-4)
    log = (run_dir(setup, "plain-cp2") / "logs" / "rank-0.log").read_text()
    assert "ddp over 2 ranks (mesh: cp 2)" in log and "global batch 8 = 4 x 1 ranks x 2 accumulation steps" in log
    ckpt = run_dir(setup, "plain-cp2") / "checkpoints" / "step-00000005"
    cli("train", "--config", config, "--set", "run.name=cp2-then-single", "--set", f"train.resume={ckpt}", check=True)
    single_losses = {(k, s): v for k, s, v in losses(single(tmp_path_factory))}
    resumed = losses(run_dir(setup, "cp2-then-single"))
    assert [s for _, s, _ in resumed][0] == 6 and resumed[-1][1] == 10
    assert max(abs(v - single_losses[k, s]) for k, s, v in resumed) <= 1e-4, (resumed, single_losses)


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
def test_fsdp_over_cp2_x_tp2_on_four_processes_gives_one_process_curve(setup, tmp_path_factory):
    """4 ranks, one data-parallel rank: 2 context-parallel halves of each sequence, each split by
    tensor parallel; FSDP2 shards the weights over the context-parallel pair."""
    _, config = setup
    torchrun(4, "train", "--config", config, "--set", "run.name=cp2-tp2", "--set", "parallel.cp=2",
             "--set", "parallel.tp=2", "--set", "parallel.strategy=fsdp")
    d = run_dir(setup, "cp2-tp2")
    assert_same_curve(d, single(tmp_path_factory), tol=1e-4)
    assert "fsdp over 4 ranks (mesh: cp 2 x tp 2)" in (d / "logs" / "rank-0.log").read_text()
