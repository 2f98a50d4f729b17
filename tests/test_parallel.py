"""Wrapping decisions checked on real FSDP2 modules, in a process group of one."""

from __future__ import annotations

import pytest
import torch
import yaml
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import DEMO, prepared_home, read_metrics, tiny_config, torchrun
from llmtrain.config import ConfigError, load_config
from llmtrain.model.build import decoder_layers
from llmtrain.parallel.precision import configure_matmul_precision
from llmtrain.parallel.weights import local_slices
from llmtrain.parallel.wrap import apply_fsdp, checkpoint_layers


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def cfg(tmp_path, monkeypatch, write_config):
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path))
    return load_config(write_config(tiny_config(parallel={"strategy": "fsdp"})), world_size=1)


def test_root_and_last_layer_stay_gathered_after_forward(group, cfg):
    """Backward needs the embeddings, head and last layer at once: resharding them after
    forward would cost an extra all-gather per micro-batch."""
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=3, num_attention_heads=4))
    apply_fsdp(model, cfg)
    model(input_ids=torch.randint(0, 64, (2, 8)))
    layers = model.model.layers
    assert not isinstance(model.model.embed_tokens.weight, DTensor)  # still gathered
    assert not isinstance(model.lm_head.weight, DTensor)
    assert not isinstance(layers[2].mlp.up_proj.weight, DTensor)
    assert isinstance(layers[0].mlp.up_proj.weight, DTensor)  # freed until backward
    assert isinstance(layers[1].mlp.up_proj.weight, DTensor)


def test_fp32_uses_tf32_on_gpus_unless_the_config_says_no(cfg):
    import dataclasses
    before = torch.get_float32_matmul_precision()
    try:
        configure_matmul_precision(cfg, torch.device("cuda"))
        assert torch.get_float32_matmul_precision() == "high"  # TF32 tensor cores
        off = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, tf32=False))
        configure_matmul_precision(off, torch.device("cuda"))
        assert torch.get_float32_matmul_precision() == "highest"
        configure_matmul_precision(cfg, torch.device("cpu"))  # CPUs: left alone
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("rows,parts", [(10, 3), (9, 3), (2, 4), (1024, 8)])
def test_each_rank_reads_the_rows_fsdp2_gives_it(group, rows, parts):
    """local_slices agrees with FSDP2's torch.chunk split for every coordinate, uneven sizes too."""
    from types import SimpleNamespace
    from torch.distributed.tensor import Shard
    for coordinate in range(parts):
        mesh = SimpleNamespace(get_coordinate=lambda c=coordinate: [c], size=lambda dim: parts)
        fake = SimpleNamespace(placements=(Shard(0),), device_mesh=mesh)
        full = torch.arange(rows * 3).reshape(rows, 3)
        chunks = torch.chunk(full, parts)
        expected = chunks[coordinate] if coordinate < len(chunks) else full[:0]
        assert torch.equal(full[local_slices(full.shape, fake)], expected)


@pytest.mark.parametrize("every,recomputed", [(1, [2, 2, 2, 2, 2]), (2, [2, 1, 2, 1, 2]),
                                              (3, [2, 1, 1, 2, 1])])
def test_selective_checkpointing_recomputes_every_kth_layer_and_changes_no_gradient(every, recomputed):
    """A layer that is checkpointed runs its forward twice in a training step (again in
    backward); the others once. The gradients are the plain model's, bit for bit."""
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config)
    model = LlamaForCausalLM(config)
    model.load_state_dict(plain.state_dict())
    assert checkpoint_layers(model, every) == [n == 2 for n in recomputed]
    runs = [0] * 5
    for i, layer in enumerate(decoder_layers(model)):
        # The MLP inside: HF checkpoints the layer's forward, inside the layer's own hooks.
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    ids = torch.randint(0, 128, (2, 16))
    for m in (plain, model):
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
    assert runs == recomputed
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), name


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_bf16_lora_run_keeps_its_frozen_base_in_bf16_and_trains_the_same(group, tmp_path, monkeypatch,
                                                                          write_config, strategy):
    """LoRA in bf16 on a base saved in fp32: the frozen base is stored in bf16 (FSDP2: all of it;
    DDP's autocast: the linear layers' weights), the adapters in fp32, the rank's parameter bytes
    nearly halved; the loss and every adapter gradient equal, bit for bit, those of the same
    model with the base kept in fp32 (what FSDP2's cast and autocast computed with before)."""
    from llmtrain.data.loader import Batch
    from llmtrain.model.build import model_config
    from llmtrain.model.loss import chunk_head, lm_loss
    from llmtrain.parallel import wrap as parallel
    from llmtrain.parallel.dims import ParallelDims
    from llmtrain.parallel.precision import autocast
    from llmtrain.parallel.weights import _local
    from llmtrain.parallel.world import World

    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 tie_word_embeddings=False)).save_pretrained(tmp_path / "base")
    raw = tiny_config(parallel={"strategy": strategy}, train={"precision": "bf16"})
    raw["model"] = {"name_or_path": str(tmp_path / "base"), "tokenizer": str(DEMO / "tokenizer"),
                    "lora": {"rank": 4, "alpha": 8}}
    cfg = load_config(write_config(raw), world_size=1)
    config = model_config(cfg, None)
    world = World(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"),
                  dims=ParallelDims.from_config(cfg, 1))
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))

    def run():
        model = parallel.parallelize(cfg, config, world)
        with torch.no_grad():  # B starts at zero: give A's gradient something to flow through
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    _local(p).fill_(0.01)
        with autocast(cfg, world.device):
            loss = lm_loss(model, Batch(tokens), chunk_head(model, config))
        loss.backward()
        grads = {n: _local(p.grad).clone() for n, p in model.named_parameters() if p.requires_grad}
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
        size = sum(_local(p).numel() * p.element_size() for p in model.parameters())
        return loss.detach(), grads, dtypes, size, {n: p.numel() for n, p in model.named_parameters()}

    loss, grads, dtypes, size, numels = run()
    monkeypatch.setattr(parallel, "store_frozen_base", lambda model, cfg: [])  # the base in fp32
    loss32, grads32, dtypes32, size32, _ = run()

    assert set(dtypes32.values()) == {torch.float32}
    assert all(dtypes[n] == torch.float32 for n in grads) and len(grads) == 2 * 4 * 2  # adapters
    linear = [n for n in dtypes if n.endswith("proj.weight") or n == "lm_head.weight"]
    assert all(dtypes[n] == torch.bfloat16 for n in linear)
    others = ["model.embed_tokens.weight", "model.norm.weight"]
    assert {dtypes[n] for n in others} == ({torch.bfloat16} if strategy == "fsdp" else {torch.float32})
    halved = sum(numels[n] for n, dtype in dtypes.items() if dtype == torch.bfloat16)
    assert size32 - size == 2 * halved  # 2 bytes fewer per parameter stored in bf16
    assert size < (0.55 if strategy == "fsdp" else 0.65) * size32, (size, size32)  # DDP: fp32 embedding
    assert torch.equal(loss, loss32)
    for name, g in grads32.items():
        assert torch.equal(grads[name], g), name


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    """DDP on 2 processes, exact and with each gradient compression; 8 steps, warmup 2."""
    cfg = tiny_config(train={"max_steps": 8, "warmup_steps": 2, "eval_every": 0, "checkpoint_every": 0})
    with prepared_home(tmp_path_factory, "compressed", cfg) as (root, path):
        for how in ("none", "bf16", "powersgd"):
            torchrun(2, "train", "--config", path, "--set", f"run.name={how}", "--set", f"parallel.grad_compression={how}")
        # ZeRO-1 (FSDP2, weights kept gathered, gradients reduced once a step) over 2 micro-batches
        for name, zero, how in (("zero1", 1, "none"), ("zero2-bf16", 2, "bf16")):
            torchrun(2, "train", "--config", path, "--set", f"run.name={name}", "--set", "parallel.strategy=fsdp",
                     "--set", f"parallel.zero={zero}", "--set", "train.micro_batch_size=2",
                     "--set", f"parallel.grad_compression={how}")
        yield root / "home" / "runs"


@pytest.mark.slow  # real torchrun runs
def test_gradient_compression_follows_ddps_curve_within_what_it_rounds_away(compressed):
    """bf16 on the wire: DDP's curve within bf16's rounding of the summed gradients. PowerSGD
    (rank 4): plain all-reduces through the warmup (the same steps as DDP), then an approximation
    the error feedback keeps near DDP's curve; each says so at start-up."""
    exact, bf16, power = (read_metrics(compressed / how) for how in ("none", "bf16", "powersgd"))
    loss = lambda records: [r["loss"] for r in records if r["kind"] == "train"]  # noqa: E731
    assert len(loss(exact)) == 8
    assert max(abs(a - b) / a for a, b in zip(loss(exact), loss(bf16))) < 2e-3
    # steps 1-3 compute their losses before any compressed gradient (step 3's is the first)
    assert loss(power)[:3] == pytest.approx(loss(exact)[:3], abs=1e-6) and abs(loss(power)[3] - loss(exact)[3]) > 1e-5
    assert max(abs(a - b) / a for a, b in zip(loss(exact), loss(power))) < 0.02
    logs = {how: (compressed / how / "logs" / "rank-0.log").read_text() for how in ("bf16", "powersgd")}
    assert "gradients: all-reduced in bf16 (parallel.grad_compression: a DDP communication hook)" in logs["bf16"]
    assert ("gradients: compressed by PowerSGD at rank 4 from step 3, with error feedback "
            "(parallel.grad_compression); plain all-reduces before") in logs["powersgd"]


@pytest.mark.slow  # real torchrun runs
def test_zero_1_gives_ddps_curve_and_bf16_reductions_within_their_rounding(compressed):
    """parallel.zero 1 shards the optimizer state (and the weights between steps) and reduces the
    gradients once a step, over 2 micro-batches here: DDP's curve (one micro-batch) to 1e-4; zero 2
    with grad_compression bf16 (FSDP2's reduce-scatter in bf16, each micro-batch's) within 1e-2."""
    loss = lambda run: [r["loss"] for r in read_metrics(compressed / run) if r["kind"] == "train"]  # noqa: E731
    assert len(loss("zero1")) == 8
    assert loss("zero1") == pytest.approx(loss("none"), rel=1e-4)
    assert loss("zero2-bf16") == pytest.approx(loss("none"), rel=1e-2) and loss("zero2-bf16") != loss("zero1")
    log = (compressed / "zero1" / "logs" / "rank-0.log").read_text()
    assert "fsdp over 2 ranks" in log and "global batch 8 = 2 x 2 ranks x 2 accumulation steps" in log
    assert ("gradients: reduce-scattered in bf16 (parallel.grad_compression: FSDP2's reduce dtype)"
            in (compressed / "zero2-bf16" / "logs" / "rank-0.log").read_text())


def test_zero_stages_are_fsdp2_settings_by_name(tmp_path):
    """parallel.zero N sets the strategy and stage N's FSDP2 keys; a key set otherwise is refused,
    not overridden; pipeline stages have no ZeRO stage."""
    path = tmp_path / "z.yaml"
    cfg = tiny_config()
    del cfg["parallel"]["strategy"]  # implied
    path.write_text(yaml.safe_dump(cfg))
    for n, reshard, each in ((3, True, True), (2, False, True), (1, False, False)):
        par = load_config(path, [f"parallel.zero={n}"], world_size=2).parallel
        assert (par.strategy, par.reshard_after_forward, par.reduce_every_micro_batch) == ("fsdp", reshard, each)
    par = load_config(path, ["parallel.zero=2", "parallel.strategy=hsdp", "parallel.shard_size=2",
                             "train.micro_batch_size=2"], world_size=4).parallel
    assert (par.strategy, par.reshard_after_forward) == ("hsdp", False)  # the stage inside each shard group
    for sets, line in (
            (["parallel.zero=2", "parallel.reshard_after_forward=true"],
             "parallel.reshard_after_forward: parallel.zero 2 sets it to false (got true); remove one of the two"),
            (["parallel.zero=1", "parallel.strategy=ddp"],
             "parallel.strategy: parallel.zero 1 sets it to fsdp (or hsdp) (got ddp); remove one of the two"),
            (["parallel.zero=1", "parallel.grad_compression=bf16", "train.micro_batch_size=2"],
             "parallel.grad_compression: under FSDP2 bf16 is the dtype gradients are reduced and held in: with "
             "parallel.zero 1, 2 micro-batches' gradients would be added up in bf16, not only sent so; use it where "
             "each micro-batch is reduced at once (fsdp without pp, parallel.zero 2 or 3), with one micro-batch a "
             "step, or under ddp"),
            (["parallel.zero=4"], "parallel.zero: must be 1, 2 or 3 (got 4); 3 shards the weights, gradients and "
             "optimizer state, 2 keeps the weights gathered through a layer's backward, 1 also reduces the "
             "gradients once a step"),
            (["parallel.zero=3", "parallel.pp=2"], "parallel.zero: not with parallel.pp (got pp 2): a pipeline stage "
             "keeps its layers gathered over a step's micro-batches and reduces once a step anyway; remove "
             "parallel.zero")):
        with pytest.raises(ConfigError) as e:
            load_config(path, sets, world_size=2)
        assert line in e.value.problems, e.value.problems


def test_powersgd_is_ddps_alone_and_compression_needs_two_data_parallel_ranks(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config(parallel={"strategy": "fsdp", "grad_compression": "powersgd"})))
    with pytest.raises(ConfigError) as e:
        load_config(path, world_size=2)
    assert ("parallel.grad_compression: powersgd compresses DDP's all-reduce of the gradients (got it with "
            "parallel.strategy fsdp); use parallel.strategy ddp, or bf16 (FSDP2 then reduce-scatters the gradients "
            "in bf16)") in e.value.problems
    with pytest.raises(ConfigError) as e:
        load_config(path, ["parallel.strategy=ddp", "train.micro_batch_size=8", "parallel.grad_compression=bf16"],
                    world_size=1)
    assert ("parallel.grad_compression: compresses the gradients' reduction between data-parallel ranks (got bf16 "
            "with one data-parallel rank); set it to none") in e.value.problems
    assert load_config(path, ["parallel.grad_compression=bf16"], world_size=2).parallel.grad_compression == "bf16"
