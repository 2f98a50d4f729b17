"""The memory estimator (`llmtrain estimate`): exact parameter counts, the table a user reads, and
its figures against the peaks torch's memory tracker measures in the trainer's own steps."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
import yaml
from transformers import LlamaConfig

from conftest import DEMO, REPO, cli, tiny_config, torchrun_command
from llmtrain.config import load_config
from llmtrain.login.estimate import GIB, estimate, model_shape

LLAMA_3_8B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "max_position_embeddings": 8192, "tie_word_embeddings": False}
LLAMA_3_70B = {**LLAMA_3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
               "num_attention_heads": 64}


def llama(arch: dict, gpus: int = 8, **sections) -> dict:
    """A pretraining config of `arch` as a cluster run has it: FSDP over `gpus` H100s, bf16, one
    sample of 8192 tokens per micro-batch, activation checkpointing; `sections` override keys."""
    cfg = {"model": {"architecture": arch, "activation_checkpointing": True}, "data": {"seq_len": 8192},
           "train": {"precision": "bf16", "micro_batch_size": 1, "global_batch_size": 2 * gpus,
                     "eval_samples": gpus},
           "parallel": {"strategy": "fsdp"},
           "slurm": {"nodes": gpus // 8, "gpus_per_node": 8, "procs_per_node": None,
                     "extra_args": ["--gres=gpu:h100:8"]}}
    names = {*cfg, *sections}
    return tiny_config(**{name: {**cfg.get(name, {}), **sections.get(name, {})} for name in names})


@pytest.mark.parametrize("arch,gpus,count", [(LLAMA_3_8B, 8, 8_030_261_248),
                                             (LLAMA_3_70B, 64, 70_553_706_496)])
def test_the_parameter_count_is_the_published_one(home, write_config, arch, gpus, count):
    """Llama 3 8B and 70B (Meta's model cards: 8.03B, 70.6B), counted on the meta skeleton the
    trainer builds; every parameter trains."""
    shape = model_shape(load_config(write_config(llama(arch, gpus))))
    assert (shape.params, shape.trainable) == (count, count)


@pytest.mark.parametrize("inner,width", [(None, 4 * 64), (96, 96)])
def test_a_gpt2_shape_reads_its_mlp_width_activation_and_dropouts(home, write_config, inner, width):
    """GPT-2 names its MLP's width n_inner (None: 4 x hidden); its tanh GELU keeps 12 bytes a
    feature besides its input and output, and its two residual-stream dropouts a mask each (its
    attention's dropout runs in SDPA's kernel); without dropout, none."""
    arch = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64, "n_inner": inner}
    shape = model_shape(load_config(write_config(tiny_config(model={"architecture": arch}))))
    assert (shape.intermediate, shape.activation_extra, shape.dropout_masks) == (width, 12, 2)
    arch.update(resid_pdrop=0.0, activation_function="gelu_pytorch_tanh")  # one fused operation
    shape = model_shape(load_config(write_config(tiny_config(model={"architecture": arch}))))
    assert (shape.activation_extra, shape.dropout_masks) == (0, 0)


def test_lora_on_a_model_folder_keeps_gradients_and_state_for_the_adapters_only(home, write_config, tmp_path):
    """A Hugging Face folder (config.json only: no weights are read) with rank-16 adapters on
    q, k, v, o: 13,631,488 trainable parameters, as peft counts them for Llama 3 8B; the
    gradients and AdamW's state are theirs alone (4 and 8 bytes each, sharded over 8 GPUs). In
    bf16 the frozen base is held in bf16 (FSDP2: all of it; DDP: its linear layers' weights),
    and the chunked loss keeps no gradient for the frozen head."""
    folder = tmp_path / "llama-3-8b"
    LlamaConfig(**{k: v for k, v in LLAMA_3_8B.items() if k != "model_type"}).save_pretrained(folder)

    def config(lora=True, **sections):
        model = {"name_or_path": str(folder), "architecture": None, "tokenizer": str(DEMO / "tokenizer"),
                 "lora": {"rank": 16} if lora else None}
        return load_config(write_config(llama(LLAMA_3_8B, model=model, **sections)))
    est = estimate(config())
    frozen, trained = 8_030_261_248, 13_631_488
    assert (est.params, est.trainable) == (frozen + trained, trained)
    assert est.optimizer == 8 * trained // 8
    assert est.parameters == pytest.approx((2 * frozen + 4 * trained) / 8, rel=1e-3)  # sharded
    assert estimate(config(train={"precision": "fp32"})).parameters == pytest.approx(4 * est.params / 8, rel=1e-3)
    embedding, norms = 128256 * 4096, (2 * 32 + 1) * 4096  # fp32 under DDP's autocast
    ddp = estimate(config(parallel={"strategy": "ddp"}))
    assert ddp.parameters == 4 * (embedding + norms + trained) + 2 * (frozen - embedding - norms)
    # The loss's own bytes (it is not the peak's moment here): full training keeps the head's fp32
    # gradient and a bf16 product per chunk; the frozen head neither.
    from llmtrain.login.estimate import _loss_bytes
    full, lora = (_loss_bytes(model_shape(config(lora=lora)), 8192, 2, 2, False) for lora in (False, True))
    assert full - lora == (4 + 2) * 128256 * 4096


@pytest.mark.parametrize("head_trains", [True, False])
def test_the_loss_row_is_the_chunked_losss_measured_peak_forward_and_backward(
        home, write_config, monkeypatch, head_trains):
    """The loss row against torch's memory tracker over the chunked loss's forward and backward
    (fp32, 4096 tokens x 256 wide, a 4096-token vocabulary, 64-token chunks): the hidden states'
    gradient, 4 MiB, and with a trained head its fp32 gradient and a chunk's product, 4 MiB each,
    and one chunk's logits, 1 MiB. The backward scales the saved gradients in place: a copy of
    each (the old `grad_hidden * grad_out`) made it the peak, 8 and 16 MiB."""
    import dataclasses

    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from llmtrain.login.estimate import _loss_bytes
    from llmtrain.model import loss

    monkeypatch.setattr(loss, "CHUNK_LOGIT_BYTES", 2**20)  # 64 tokens of 4096 fp32 logits
    shape = model_shape(load_config(write_config(tiny_config(model={"architecture": PROBED},
                                                             train={"precision": "fp32"}))))
    if not head_trains:  # LoRA's frozen head
        shape = dataclasses.replace(shape, head_trainable=0)
    tokens, width, vocab = 4096, shape.hidden, shape.vocab
    torch.manual_seed(0)
    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=head_trains)
    targets = torch.randint(0, vocab, (tokens,))
    tracker = MemTracker()
    tracker.track_external(hidden, weight)
    with tracker:
        loss.chunked_cross_entropy(hidden, weight, targets).backward()
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - 4 * (tokens + vocab) * width
    estimated = _loss_bytes(shape, tokens, 4, 4, False)
    assert estimated == 4 * tokens * width + 8 * shape.head_trainable + 4 * 64 * vocab
    assert 0.95 <= measured / estimated <= 1.05, (measured / 2**20, estimated / 2**20)


def test_muons_step_is_a_moment_of_its_own_counted_as_measured(home, write_config):
    """Muon's optimizer step holds every gradient, an fp32 update and result per hidden-matrix
    parameter and Newton-Schulz's work on the largest matrix (one process: one at a time),
    against torch's memory tracker over a real step of the PROBED Llama (0.96 measured). At 405B
    on 512 GPUs (fsdp x tp 8) that step is the peak: a rank orthogonalises one whole down_proj,
    16384 x 53248 in fp32, 3.25 GiB, with 4 of it and 2 of its Gram matrices in flight."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import LlamaForCausalLM

    from llmtrain.login.estimate import MUON_STEP, _muon_step
    from llmtrain.optimizers import build_optimizer

    cfg = load_config(write_config(tiny_config(model={"architecture": PROBED},
                                               train={"precision": "fp32", "optimizer": "muon"})))
    shape = model_shape(cfg)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in PROBED.items() if k != "model_type"}))
    optimizer = build_optimizer(model, cfg.train, torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # its state made
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        before = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        optimizer.step()
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - before
    estimated = _muon_step(shape, 1, False, 1, shape.layers * shape.layer_matrix_params)
    assert 0.9 <= measured / estimated <= 1.05, (measured / 2**20, estimated / 2**20)

    big = {**LLAMA_3_70B, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
           "num_attention_heads": 128}
    adamw, muon = (estimate(load_config(write_config(llama(big, 512, train={"optimizer": optimizer},
                                                          parallel={"tp": 8}))))
                   for optimizer in ("adamw", "muon"))
    assert muon.phase == MUON_STEP and muon.total > adamw.total
    whole_down_proj = 4 * 16384 * 53248
    assert muon.comm > 4 * whole_down_proj + 8 * 16384**2  # and the updates: 8 bytes a parameter


@pytest.mark.parametrize("attn,per_row", [("sdpa", 16 * 64 * 65 + 8 * 8192), ("eager", 4 * 8192**2)])
def test_the_document_mask_of_each_micro_batch_is_counted(home, write_config, attn, per_row):
    """data.document_masking, 2 rows of 8192 tokens a micro-batch: flex attention's BlockMask
    (sdpa on GPUs: 64 x 64 tiles' indices and the document ids, 130 KiB a row, as
    tests/test_attention.py measures it) or eager's fp32 8192 x 8192 additive mask (256 MiB a row)."""
    def config(masking):
        return load_config(write_config(llama(LLAMA_3_8B, model={"attn_implementation": attn},
                                              data={"document_masking": masking},
                                              train={"micro_batch_size": 2, "global_batch_size": 16})))
    shape = model_shape(config(False))
    masked, plain = (estimate(config(masking), shape=shape) for masking in (True, False))
    assert masked.activations - plain.activations == 2 * per_row


def table(stdout: str) -> dict[str, float]:
    """The estimate's rows as {row: GiB}."""
    return {m.group(1): float(m.group(2)) for line in stdout.splitlines()
            if (m := re.match(r"(\w[\w ]*?)\s+(\d+\.\d\d)  ", line))}


def test_the_cli_prints_the_table_and_the_verdict_for_8b_in_seconds(home, write_config):
    """What a user reads before queueing Llama 3 8B on a node of 8 H100s: the run, a GiB per
    component row, the total at its peak, whether it fits the GPU the config names, and the
    largest micro batch that would (the next valid one would not)."""
    config = write_config(llama(LLAMA_3_8B, train={"global_batch_size": 64}))
    start = time.monotonic()
    proc = cli("estimate", "--config", config)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == ("llama: 8,030,261,248 parameters (8,030,261,248 trainable); fsdp on 8 GPUs, bf16, "
                        "micro batch 1 x 8192 tokens, activation checkpointing every layer")
    rows = table(proc.stdout)
    assert list(rows) == ["parameters", "gradients", "optimizer state", "param copies", "activations",
                          "loss", "comm buffers", "total"]
    assert rows["parameters"] == pytest.approx(8_030_261_248 * 4 / 8 / GIB, abs=0.01)  # fp32, 1/8 each
    assert rows["optimizer state"] == pytest.approx(2 * rows["parameters"], abs=0.01)
    assert rows["total"] == pytest.approx(sum(v for k, v in rows.items() if k != "total"), abs=0.03)
    assert lines[-2].startswith(f"fits: {rows['total']:.2f} GiB <= 72.0 GiB usable of 80 GiB (H100, named "
                                f"in the slurm section; 10% kept"), lines[-2]
    m = re.fullmatch(r"largest micro batch that fits: (\d+) \(train.micro_batch_size is 1; it must "
                     r"divide the global batch per GPU, 64 / 8 = 8\)", lines[-1])
    assert m, lines[-1]
    assert seconds < 30, f"llmtrain estimate took {seconds:.0f} s"
    cfg = load_config(config)
    shape = model_shape(cfg)
    best = int(m.group(1))
    assert estimate(cfg, micro_batch=best, shape=shape).total <= 72 * GIB
    assert best == 8 or estimate(cfg, micro_batch=2 * best, shape=shape).total > 72 * GIB

    # The other choices at the same world size: the config's own is the total above; DDP keeps
    # 16 bytes a parameter on every GPU (120 GiB before any activation) and cannot fit.
    others = {m[0]: (float(m[1]), m[2]) for m in re.findall(
        r"^  (\w[\w +()-]*?) +(\d+\.\d\d) GiB (fits|too big)$", proc.stdout, re.MULTILINE)}
    assert list(others) == ["ddp", "ddp + checkpointing", "fsdp", "fsdp + checkpointing",
                            "hsdp (8-way shards)", "hsdp + checkpointing (8-way shards)",
                            *(f"fsdp x tp {tp}{ac}" for tp in (2, 4, 8) for ac in ("", " + checkpointing")),
                            "pp 2 (1f1b) x fsdp", "pp 4 (1f1b) x fsdp", "pp 8 (1f1b) x ddp"], proc.stdout
    assert others["fsdp + checkpointing"] == (rows["total"], "fits")
    assert others["ddp"][1] == "too big" and others["ddp"][0] > 120
    assert others["hsdp + checkpointing (8-way shards)"] == others["fsdp + checkpointing"]  # one node
    assert others["fsdp"][0] > others["fsdp + checkpointing"][0]

    small = cli("estimate", "--config", config, "--gpu-mem", "16")  # 14.4 GiB usable
    assert small.returncode == 1, small.stderr  # `llmtrain estimate && bash submit.sh` stops here
    assert small.stdout.splitlines()[-1] == (
        f"does not fit: {rows['total']:.2f} GiB > 14.4 GiB usable of 16 GiB (--gpu-mem; 10% kept for the CUDA "
        f"context, NCCL and fragmentation), even at micro batch 1; split the layers over more GPUs (parallel.tp), "
        f"or shorten data.seq_len"), small.stdout  # fsdp and checkpointing every layer: already on


def test_tensor_parallel_8_halves_what_70b_needs_per_gpu_and_tp_3_is_refused(home, write_config):
    """Llama 3 70B on 64 H100s with checkpointing: fsdp x tp 8 holds the same weights, gradients
    and optimizer state per GPU (sharded over 64 either way) but an eighth of the gathered
    copies and of the activations; without checkpointing only tp 8 fits."""
    config = write_config(llama(LLAMA_3_70B, 64))
    proc = cli("estimate", "--config", config, "--set", "parallel.tp=8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("llama: 70,553,706,496 parameters (70,553,706,496 trainable); fsdp x tp 8 on "
                                  "64 GPUs, bf16, micro batch 1 x 8192 tokens"), proc.stdout
    fsdp, tp8 = table(cli("estimate", "--config", config).stdout), table(proc.stdout)
    for row in ("parameters", "optimizer state"):
        assert tp8[row] == pytest.approx(fsdp[row], rel=0.01)  # 1/64 of the model either way
    assert tp8["param copies"] == pytest.approx(fsdp["param copies"] / 8, rel=0.01)
    assert tp8["activations"] < fsdp["activations"] / 4 and tp8["total"] < fsdp["total"] / 2
    others = dict(re.findall(r"^  (\w[\w +()-]*?) +\d+\.\d\d GiB (fits|too big)$", proc.stdout, re.MULTILINE))
    assert (others["fsdp"], others["fsdp x tp 8"], others["fsdp + checkpointing"]) == ("too big", "fits", "fits")
    assert "largest micro batch that fits: " in proc.stdout and "global batch per data-parallel rank, 128 / 8 = 16" \
        in proc.stdout

    three = cli("estimate", "--config", config, "--set", "parallel.tp=3")
    assert (three.returncode, three.stdout, three.stderr) == (
        2, "", "parallel.tp: must divide the world size 64 (got 3)\n")
    six_gpus = cli("estimate", "--config", config, "--set", "parallel.tp=3", "--set", "slurm.gpus_per_node=6",
                   "--set", "slurm.nodes=8", "--set", "train.global_batch_size=32", "--set", "train.eval_samples=16",
                   "--set", "data.seq_len=8190")  # a layout tp 3 fits: only the model refuses it
    assert (six_gpus.returncode, six_gpus.stderr) == (
        2, "parallel.tp: must divide the model's num_attention_heads 64 (got 3); each rank holds "
           "num_attention_heads / tp of them\n")


def test_hsdp_x_tp_8_on_70b_states_its_shard_group_or_asks_for_one(home, write_config):
    """Llama 3 70B, hsdp x tp 8 on 8 nodes of 8 H100s: a node holds one data-parallel rank, so the
    default shard group (a node's) would replicate the whole optimizer state on every GPU, 135.6 GiB;
    the estimate refuses in one line. A set shard_size is stated and its memory is the model's
    share: 1/8 of it per tp rank at shard_size 1 (the replicated memory, shown as it is), half that at 2."""
    config = write_config(llama(LLAMA_3_70B, 64, parallel={"strategy": "hsdp", "tp": 8}))
    unset = cli("estimate", "--config", config)
    assert (unset.returncode, unset.stdout, unset.stderr) == (2, "", (
        "parallel.shard_size: must be set for hsdp when a node holds fewer than 2 data-parallel ranks (its 8 "
        "processes / (tp 8 x cp 1) = 1; not set); set a divisor of the 8 data-parallel ranks: 2, 4 or 8 shard "
        "across nodes (8: as fsdp), 1 replicates the whole model on every GPU\n"))

    two = cli("estimate", "--config", config, "--set", "parallel.shard_size=2")
    assert two.returncode == 0, two.stderr
    assert "; hsdp x tp 8 (2-way shards) on 64 GPUs, bf16" in two.stdout.splitlines()[0]
    rows = table(two.stdout)
    assert "fp32, sharded over 2 GPUs after tp 8's split, 4 replicas" in two.stdout
    assert rows["parameters"] == pytest.approx(70_553_706_496 * 4 / 8 / 2 / GIB, rel=0.01)
    assert rows["optimizer state"] == pytest.approx(2 * rows["parameters"], abs=0.01)
    assert rows["total"] < 72 < 135

    cfg = load_config(config, ["parallel.shard_size=1"])
    one = estimate(cfg, shape=model_shape(cfg))
    assert one.parameters / GIB == pytest.approx(70_553_706_496 * 4 / 8 / GIB, rel=0.01)  # no sharding
    assert one.optimizer / GIB == pytest.approx(2 * rows["optimizer state"], rel=0.01)
    assert one.total / GIB > 130  # the replicated layout the default used to pick silently


def test_context_parallel_2_on_top_of_tp_8_fits_32k_tokens_in_less(home, write_config):
    """70B at 32k tokens a sequence (rope scaled to 128k) on 64 H100s: fsdp alone does not fit
    even with checkpointing; x tp 8 does, and x cp 2 halves each rank's tokens again (a quarter
    of the weights' shards' neighbours: FSDP2 shards over the cp pair too)."""
    config = write_config(llama({**LLAMA_3_70B, "max_position_embeddings": 131072}, 64, data={"seq_len": 32768}))
    proc = cli("estimate", "--config", config, "--set", "parallel.tp=8", "--set", "parallel.cp=2")
    assert proc.returncode == 0, proc.stderr
    assert "; fsdp x cp 2 x tp 8 on 64 GPUs" in proc.stdout.splitlines()[0]
    assert "fp32, sharded over 8 GPUs after tp 8's split" in proc.stdout
    totals = {m[0]: float(m[1]) for m in re.findall(r"^  (\w[\w +()-]*?) +(\d+\.\d\d) GiB (?:fits|too big)$",
                                                    proc.stdout, re.MULTILINE)}
    assert totals["fsdp + checkpointing"] > 80 > 72 > totals["fsdp x tp 8 + checkpointing"]
    assert totals["fsdp x cp 2 x tp 8 + checkpointing"] < totals["fsdp x tp 8 + checkpointing"]
    assert totals["fsdp x cp 2 x tp 8"] < totals["fsdp x tp 8"] / 1.5
    assert table(proc.stdout)["total"] == totals["fsdp x cp 2 x tp 8 + checkpointing"]


@pytest.mark.parametrize("args,code,line", [
    (["--gpu-mem", "-1"], 1, "error: --gpu-mem: must be a GPU's memory in GiB, > 0 (got -1.0)"),
    (["--world-size", "0"], 1, "error: --world-size: must be >= 1 (got 0)"),
    (["--set", "parallel.strategy=zero"], 2,
     "parallel.strategy: must be one of ddp, fsdp, hsdp (got 'zero')"),
])
def test_a_bad_value_is_one_line_and_a_non_zero_exit(home, write_config, args, code, line):
    proc = cli("estimate", "--config", write_config(tiny_config()), *args)
    assert (proc.returncode, proc.stderr, proc.stdout) == (code, f"{line}\n", "")


# Measured: a 5.2M-parameter Llama (4 layers x 256 wide, 4096-token vocabulary, 256 tokens per
# micro-batch) in fp32 (bf16 matmuls are 30x slower on these CPUs; bf16 was checked by hand,
# doc/benchmarks.md) on 2 ranks. Sized so that each term is a large share of some case's
# estimated peak: the fp32 weights, gradients and AdamW state (DDP: 18%, 18%, 35%), the kept
# activations (DDP 19%, FSDP 30% without checkpointing), the loss (DDP 11-13%), FSDP2's
# gathered copies (14-18%): leaving one out, or counting it twice, moves a total by about 15%.
PROBED = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "vocab_size": 4096, "tie_word_embeddings": False}
CASES = {"ddp": ["parallel.strategy=ddp"],
         "ddp-checkpointed": ["parallel.strategy=ddp", "model.activation_checkpointing=true"],
         "fsdp": ["parallel.strategy=fsdp"],
         "fsdp-checkpointed": ["parallel.strategy=fsdp", "model.activation_checkpointing=true"]}


# Tensor, context and pipeline parallel on the 2 ranks: a rank's 2 micro-batches of the step
# (the data-parallel degree is 1), under pp both in flight on the first stage.
LAYOUT_CASES = {"fsdp-tp": ["parallel.strategy=fsdp", "parallel.tp=2"],
                "fsdp-cp": ["parallel.strategy=fsdp", "parallel.cp=2"],
                "pp": ["parallel.strategy=ddp", "parallel.pp=2"]}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """(config, {case: the larger of the two ranks' peaks in bytes}) from one torchrun of
    tests/memory_probe.py over all the cases: the four dense ones, tensor, context and pipeline
    parallel, the MoE ones (their overrides make the model PROBED_MOE, below) and GPT-2's."""
    root = tmp_path_factory.mktemp("estimate")
    cases = {**CASES, **LAYOUT_CASES, **MOE_CASES, **GPT2_CASES}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMTRAIN_HOME", str(root / "home"))
        config = root / "config.yaml"
        config.write_text(yaml.safe_dump(tiny_config(
            model={"architecture": PROBED}, data={"seq_len": 256},
            train={"micro_batch_size": 1, "global_batch_size": 2, "precision": "fp32"})))
        cmd = torchrun_command(2)
        cmd[-2:] = [str(REPO / "tests" / "memory_probe.py"), str(config), str(root),
                    *(f"{name}={','.join(overrides)}" for name, overrides in cases.items())]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ranks = [json.loads((root / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
        yield config, {case: max(r[case]["peak"] for r in ranks) for case in cases}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_the_estimate_is_within_15_percent_of_the_measured_peak(probed, case):
    """DDP and FSDP2, with and without activation checkpointing: the estimated total against
    the peak tensor memory of a real step (the trainer's parallelize, chunked loss, AdamW,
    forward_backward and optimizer step; tests/memory_probe.py)."""
    config, peaks = probed
    est = estimate(load_config(config, CASES[case], world_size=2), world_size=2)
    ratio = est.total / peaks[case]
    assert 0.85 <= ratio <= 1.15, (f"{case}: estimated {est.total / 2**20:.1f} MiB, measured "
                                   f"{peaks[case] / 2**20:.1f} MiB ({ratio:.2f}x); {est}")


@pytest.mark.slow
@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_under_tp_cp_and_pp_the_estimate_is_never_below_the_measured_peak(probed, case):
    """fsdp x tp 2, fsdp x cp 2 and pp 2 (1F1B), each a rank's 2 micro-batches: the estimate is at
    or above the peak of the trainer's own step (under pp the first stage's two forwards in flight,
    their outputs and the gradient it receives), by no more than 15%."""
    config, peaks = probed
    est = estimate(load_config(config, LAYOUT_CASES[case], world_size=2), world_size=2)
    ratio = est.total / peaks[case]
    assert 1.0 <= ratio <= 1.15, (f"{case}: estimated {est.total / 2**20:.2f} MiB, measured "
                                  f"{peaks[case] / 2**20:.2f} MiB ({ratio:.3f}x); {est}")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_context_parallel_counts_the_mask_its_attention_keeps_only_where_it_needs_one(home, write_config,
                                                                                       checkpointing):
    """70B at 32k tokens on fsdp x cp 2 x tp 8 (64 H100s). Plain causal attention takes no mask
    (model/attention.causal_chunks): each layer keeps the gathered keys and values at the 8 / 8
    key/value heads a rank holds. With documents, SDPA attends under the boolean mask of the
    rank's 16k queries by the 32k keys (512 MiB, held by the step), and each layer keeps the keys
    and values repeated to its 64 / 8 query heads and the mask made a bf16 bias (1 GiB) for its
    backward: every layer without checkpointing, the recomputed one with it."""
    seq, layers = 32768, 80

    def config(documents):
        return load_config(write_config(llama(
            {**LLAMA_3_70B, "max_position_embeddings": 131072}, 64, data={"seq_len": seq, "document_masking": documents},
            model={"activation_checkpointing": checkpointing}, parallel={"strategy": "fsdp", "tp": 8, "cp": 2})))
    shape = model_shape(config(False))
    plain, masked = (estimate(config(documents), shape=shape) for documents in (False, True))
    per_layer = seq * 2 * (64 - 8) // 8 * 128 * 2 + 2 * seq * seq // 2  # repeated heads + the bias
    mask = seq * seq // 2
    kept = per_layer if checkpointing else layers * per_layer
    assert masked.activations - plain.activations == kept + mask
    if not checkpointing:
        assert (masked.total - plain.total) / GIB > 80  # what the estimate used to leave out


def test_with_fp8_the_table_says_it_counts_memory_as_without(home, write_config):
    """train.fp8 leaves every figure as it is (the estimate does not model FP8's float8 copies):
    the table says so under its total, and only then (doc/overview.md, FP8)."""
    out = {fp8: cli("estimate", "--config", write_config(tiny_config(train={"fp8": fp8}), f"{fp8}.yaml"))
           for fp8 in ("none", "tensorwise")}
    assert [p.returncode for p in out.values()] == [0, 0], [p.stderr for p in out.values()]
    note = ("train.fp8 (tensorwise) is not counted: the figures are memory as without FP8 (its float8 copies "
            "of activations and weights are not in them)")
    lines = out["tensorwise"].stdout.splitlines()
    assert lines[lines.index(note) - 1].startswith("total "), out["tensorwise"].stdout
    assert "train.fp8" not in out["none"].stdout
    assert table(out["tensorwise"].stdout) == table(out["none"].stdout)


# Qwen3-30B-A3B's config.json (Hugging Face, Qwen/Qwen3-30B-A3B): 128 experts a layer, 8 per token.
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                 "norm_topk_prob": True, "max_position_embeddings": 40960, "tie_word_embeddings": False}


def test_qwen3_30b_a3b_counts_its_experts_and_what_a_token_uses_on_8_and_16_gpus(home, write_config):
    """30.5B parameters, 3.3B active (Qwen's model card); the experts' weights, gradients and
    AdamW state sharded by FSDP2 with their layer: 16 GPUs hold half of what 8 do of each."""
    cfg = llama(QWEN3_30B_A3B, 8, data={"seq_len": 4096})
    shape = model_shape(load_config(write_config(cfg)))
    assert (shape.params, shape.active, shape.experts, shape.top_k) == (30_532_122_624, 3_353_032_704, 128, 8)
    out = cli("estimate", "--config", write_config(cfg), check=True).stdout
    assert out.startswith("qwen3_moe: 30,532,122,624 parameters (30,532,122,624 trainable, 3,353,032,704 active "
                          "per token (8 of 128 experts a layer)); fsdp on 8 GPUs")
    eight, sixteen = (estimate(load_config(write_config(llama(QWEN3_30B_A3B, n, data={"seq_len": 4096}))))
                      for n in (8, 16))
    for row in ("parameters", "optimizer"):
        assert getattr(sixteen, row) == pytest.approx(getattr(eight, row) / 2, rel=0.01)
    assert 60 * GIB < eight.total < 72 * GIB and sixteen.total < 0.6 * eight.total  # 66.0 and 35.3 GiB
    # pipeline stages hold MoE layers too: 8 stages of 6 layers, each 1 / 8 of every expert's state
    assert re.search(r"pp 8 \(1f1b\) x ddp +6\d\.\d\d GiB fits", out)
    # expert parallel: a rank gathers its 1 / ep of a layer's experts, not all 128
    by_ep = {int(m[1]): float(m[2]) for m in re.finditer(r"fsdp x ep (\d+) \+ checkpointing +([\d.]+) GiB fits", out)}
    assert sorted(by_ep) == [2, 4, 8] and by_ep[8] < by_ep[2] < eight.total / GIB


# A Qwen3-MoE of 8 experts (2 per token) of 256 features, 4 layers x 256 wide, 4 x 256 tokens per
# micro-batch, fp32 on 2 ranks: the experts' activations (each used expert's input, gate and up,
# their product, its output) are 42% of DDP's estimated peak.
PROBED_MOE = {"model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 256,
              "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 256, "vocab_size": 4096,
              "tie_word_embeddings": False}
_AS_MOE = [f"model.architecture.{key}={value}" for key, value in PROBED_MOE.items()] + [  # PROBED's keys too
    "train.micro_batch_size=4", "train.global_batch_size=8"]
MOE_CASES = {"moe-ddp": [*_AS_MOE, "parallel.strategy=ddp"],
             "moe-fsdp-checkpointed": [*_AS_MOE, "parallel.strategy=fsdp", "model.activation_checkpointing=true"]}


@pytest.mark.slow
def test_an_moe_estimate_is_within_15_percent_of_the_measured_peak(probed):
    """The trainer's own step (its router hooks and load-balancing loss included) under torch's
    memory tracker (tests/memory_probe.py), against the estimate: 0.99-1.01 when written."""
    config, peaks = probed
    for case, overrides in MOE_CASES.items():
        cfg = load_config(config, overrides, world_size=2)
        assert cfg.model.architecture == PROBED_MOE  # the case is the MoE model, whole
        est = estimate(cfg, world_size=2)
        assert 0.85 <= est.total / peaks[case] <= 1.15, (case, est.total / peaks[case], est)


# PROBED made a GPT-2 (LayerNorm, an MLP of 768 without a gate, GPT-2's tanh GELU written out in
# eager operations, dropout 0.1 on the residual stream): before the activation's saved tensors and
# the dropouts' masks were counted, DDP's estimate read 0.79 of the measured peak. Attention's
# dropout is off: on a CPU SDPA's math kernel keeps the probabilities for it (GPUs' kernels do not).
_AS_GPT2 = [f"model.architecture.{key}={value}" for key, value in {
    "model_type": "gpt2", "n_inner": 768, "num_key_value_heads": 4, "attn_pdrop": 0.0}.items()]
GPT2_CASES = {"gpt2-ddp": [*_AS_GPT2, "parallel.strategy=ddp"],
              "gpt2-fsdp-checkpointed": [*_AS_GPT2, "parallel.strategy=fsdp", "model.activation_checkpointing=true"]}


@pytest.mark.slow
def test_a_gpt2_estimate_counts_its_activation_and_dropouts(probed):
    """The estimate of a model whose layers are not Llama's, against the trainer's measured step:
    never below it by more than 5%."""
    config, peaks = probed
    for case, overrides in GPT2_CASES.items():
        cfg = load_config(config, overrides, world_size=2)
        shape = model_shape(cfg)
        assert (shape.model_type, shape.intermediate, shape.activation_extra, shape.dropout_masks) == ("gpt2", 768, 12, 2)
        est = estimate(cfg, world_size=2, shape=shape)
        assert 0.95 <= est.total / peaks[case] <= 1.15, (case, est.total / peaks[case], est)
