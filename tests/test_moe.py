"""Mixture-of-Experts models as a user meets them: a Qwen3-MoE or Mixtral saved by transformers
trains from its files with transformers' loss and load-balancing loss at the first step; FSDP on
2 processes gives one process's curve; MFU counts the experts a token uses; the export loads in
transformers and generates what `llmtrain generate` does; Muon orthogonalises each expert's
matrices apart; check-config refuses the families it cannot train."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from conftest import DEMO, assert_same_curve, cli, prepared_home, read_metrics, tiny_config, torchrun
from llmtrain.config import load_config
from llmtrain.data.loader import StepSampler, TokenStream, batch_tokens
from llmtrain.data.run import open_prepared
from llmtrain.model.moe import MoE, Routers, pieces

# A 2-layer Qwen3-MoE: 8 experts of 32 features a layer, 2 per token.
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
             "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128,
             "tie_word_embeddings": False, "router_aux_loss_coef": 0.01}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 48, "num_local_experts": 4,
           "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 128, "tie_word_embeddings": False, "router_aux_loss_coef": 0.02}


def saved(folder, arch: dict):
    """A model transformers made and saved (its experts one tensor per expert in the files)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**arch, "vocab_size": 512})
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(DEMO / "tokenizer").save_pretrained(folder)
    return model


def transformers_first_step(model, c):
    """transformers' forward of `model` on the run's first global batch (8 windows of 64 tokens),
    router logits and aux loss included, and its language-model loss."""
    data = TokenStream(*open_prepared(c), "train")
    batch = torch.from_numpy(batch_tokens(data, StepSampler(data.num_samples(64), 8, c.train.seed, 0, 1).next_step(), 64))
    with torch.no_grad():
        result = model(input_ids=batch[:, :-1], output_router_logits=True)
    return result, torch.nn.functional.cross_entropy(result.logits.flatten(0, 1), batch[:, 1:].flatten())


@pytest.mark.parametrize("arch", [QWEN3_MOE, MIXTRAL], ids=["qwen3_moe", "mixtral"])
def test_a_saved_moe_model_trains_from_its_files_with_transformers_losses(tmp_path, monkeypatch, arch):
    """The first step's loss and load-balancing loss are transformers' on that batch (one
    micro-batch: the aux loss is a micro-batch's), and the files hold one tensor per expert."""
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    model = saved(tmp_path / "model", arch)
    from safetensors import safe_open
    with safe_open(tmp_path / "model" / "model.safetensors", "pt") as f:
        stored = set(f.keys())
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    assert fused not in stored and {k for k, *_ in pieces(arch["model_type"], fused, (4, 2, 64))} <= stored
    cfg = tiny_config(train={"max_steps": 2, "warmup_steps": 0, "eval_every": 0, "global_batch_size": 8,
                             "micro_batch_size": 8}, slurm={"nodes": 1, "procs_per_node": 1})
    cfg["model"] = {"name_or_path": str(tmp_path / "model")}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli("check-config", path).returncode == 0
    cli("prepare", "--config", path, check=True)
    out = cli("train", "--config", path, check=True).stdout

    c = load_config(path)
    result, expected = transformers_first_step(model, c)
    first = read_metrics(c.run_dir)[0]
    assert first["step"] == 1 and abs(first["loss"] - expected.item()) < 1e-5
    assert abs(first["moe_aux_loss"] - result.aux_loss.item()) < 1e-5, (first, result.aux_loss)
    assert first["expert_imbalance"] >= 1.0
    moe = MoE.of(model.config)
    total, active = moe.active_params((n, p.numel()) for n, p in model.named_parameters())
    assert f"model: {total:,} parameters ({active:,} active per token: 2 of {moe.experts} experts a layer" in out


def test_the_load_balancing_loss_leaves_padding_out():
    """A row padded at its end (a last segment with no trained target) counts as transformers
    counts it under an attention mask that hides the padding."""
    from llmtrain.data.loader import Batch
    from llmtrain.model.loss import lm_loss
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**QWEN3_MOE, "vocab_size": 512}))
    tokens = torch.randint(0, 512, (2, 17))
    positions = torch.arange(17).repeat(2, 1)
    positions[0, 11:] = torch.arange(6)  # row 0: a sample of 11 tokens, then 6 of padding; row 1: one sample
    trained = torch.ones(2, 17, dtype=torch.bool)
    trained[0, 11:] = False
    routers = Routers(model, MoE.of(model.config))
    with torch.no_grad():
        lm_loss(model, Batch(tokens, trained, positions), routers=routers)  # no_grad: collected all the same
        aux, counts = routers.take()
        mask = torch.ones(2, 16)
        mask[0, 11:] = 0  # the inputs of row 0's padding
        expected = model(input_ids=tokens[:, :-1], attention_mask=mask.long(), output_router_logits=True)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    hf = load_balancing_loss_func(expected.router_logits, 8, 2, mask)
    assert abs(aux.item() - hf.item()) < 1e-6 and counts.sum().item() == 2 * 2 * (11 + 16)  # layers x top-k x real inputs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A from-scratch Qwen3-MoE with activation checkpointing, trained by one process (2
    micro-batches a step) and by FSDP over 2 (one each), with AdamW and with Muon; by one
    process resumed from the first's step-3 checkpoint; by HSDP in bf16; by a pipeline of 2 stages (a MoE
    layer each, both micro-batches through both)."""
    cfg = tiny_config(model={"architecture": QWEN3_MOE, "activation_checkpointing": True},
                      train={"max_steps": 6, "warmup_steps": 1, "lr_schedule": "constant", "eval_every": 3,
                             "checkpoint_every": 3, "peak_tflops": 1.0})
    with prepared_home(tmp_path_factory, "moe", cfg) as (root, config):
        cli("train", "--config", config, "--set", "run.name=one", check=True)
        torchrun(2, "train", "--config", config, "--set", "run.name=fsdp", "--set", "parallel.strategy=fsdp")
        muon = ("--set", "train.optimizer=muon", "--set", "train.lr=0.02")
        cli("train", "--config", config, "--set", "run.name=muon", *muon, check=True)
        torchrun(2, "train", "--config", config, "--set", "run.name=fsdp_muon", "--set", "parallel.strategy=fsdp", *muon)
        runs = root / "home" / "runs"  # one's step-3 checkpoint (a constant schedule), resumed
        shutil.copytree(runs / "one", runs / "resumed")
        shutil.rmtree(runs / "resumed" / "checkpoints" / "step-00000006")
        (runs / "resumed" / "checkpoints" / "latest").write_text("step-00000003\n")
        cli("train", "--config", config, "--set", "run.name=resumed", check=True)
        assert "resumed from" in (runs / "resumed" / "logs" / "rank-0.log").read_text()
        torchrun(2, "train", "--config", config, "--set", "run.name=hsdp_bf16", "--set", "parallel.strategy=hsdp",
                 "--set", "parallel.shard_size=1", "--set", "train.precision=bf16")
        torchrun(2, "train", "--config", config, "--set", "run.name=pp", "--set", "parallel.pp=2")
        yield root, config


@pytest.mark.slow  # real torchrun runs
@pytest.mark.parametrize("a,b,tol", [("one", "fsdp", 1e-5), ("muon", "fsdp_muon", 1e-5), ("one", "resumed", 0.0),
                                     ("one", "pp", 1e-5)])
def test_fsdp_a_pipeline_and_a_resume_give_one_process_curve(runs, a, b, tol):
    """FSDP over 2 processes (experts sharded with their layer; Muon orthogonalising each rank's
    whole experts where it holds them), a pipeline of 2 stages (the load-balancing loss over both
    stages' layers, its gradient back to each stage's router) and a run stopped and resumed give
    the one-process curve: the loss, the load-balancing loss and the imbalance."""
    root, _ = runs
    a, b = root / "home" / "runs" / a, root / "home" / "runs" / b
    assert_same_curve(a, b, tol)
    for x, y in zip(read_metrics(a), read_metrics(b)):
        if x["kind"] == "train":
            assert abs(x["moe_aux_loss"] - y["moe_aux_loss"]) <= tol
            assert x["expert_imbalance"] == pytest.approx(y["expert_imbalance"], rel=1e-6)


@pytest.mark.slow  # real torchrun runs
def test_hsdp_in_bf16_follows_the_fp32_curve(runs):
    """Two replicas of the experts (HSDP, 1-way shards) computing in bf16: the fp32 curve within
    bf16's rounding, the routing metrics logged from both replicas' tokens."""
    root, _ = runs
    one, hsdp = read_metrics(root / "home" / "runs" / "one"), read_metrics(root / "home" / "runs" / "hsdp_bf16")
    train = [(a, b) for a, b in zip(one, hsdp) if a["kind"] == "train"]
    assert len(train) == 6 and max(abs(a["loss"] - b["loss"]) / a["loss"] for a, b in train) < 0.01, train
    assert all(abs(a["moe_aux_loss"] - b["moe_aux_loss"]) < 0.02 for a, b in train)


@pytest.mark.slow  # real torchrun runs
def test_mfu_counts_the_experts_a_token_uses(runs):
    """FLOPs per token (from the metrics' MFU at train.peak_tflops 1) by hand: 6 per active
    parameter that multiplies, plus attention's 12 x layers x hidden x seq_len."""
    root, _ = runs
    hidden, layers, vocab, seq = 64, 2, 512, 64
    attention = hidden * 64 + 2 * hidden * 32 + 64 * hidden + 2 * 16  # q, k, v (2 kv heads of 16), o; q/k norms
    router = 8 * hidden
    experts_used = 2 * (2 * 32 * hidden + hidden * 32)  # top-2 of 8: gate and up, down
    per_layer = attention + router + experts_used + 2 * hidden  # + the 2 norms
    active = layers * per_layer + hidden + vocab * hidden  # + the final norm, the head (the lookup left out)
    by_hand = 6 * active + 12 * layers * hidden * seq
    record = next(r for r in read_metrics(root / "home" / "runs" / "one") if r["kind"] == "train")
    measured = record["mfu"] * 1e12 / record["tokens_per_sec"]
    assert measured == pytest.approx(by_hand, rel=1e-9)
    dense = 6 * (layers * (per_layer - experts_used + 8 * 3 * 32 * hidden) + hidden + vocab * hidden)
    assert dense > 1.5 * by_hand  # every expert counted: 1.58x the FLOPs, MFU 1.58x too high


@pytest.mark.slow  # real torchrun runs
def test_export_of_an_moe_run_generates_as_llmtrain_generate(runs, tmp_path):
    root, _ = runs
    run = root / "home" / "runs" / "fsdp"
    args = ["--prompt", "Once upon a time, Sam went to the", "--max-new-tokens", "12", "--temperature", "0"]
    ours = cli("generate", "--run-dir", run, *args, check=True).stdout
    cli("export", "--run-dir", run, "--out", tmp_path / "hf", check=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert model.config.model_type == "qwen3_moe" and model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 64, 64)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tokenizer(args[1], return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert ours.strip() == tokenizer.decode(out[0], skip_special_tokens=True).strip()


def test_check_config_refuses_moe_families_it_cannot_train(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    cfg = tiny_config(model={"architecture": {"model_type": "deepseek_v3", "n_routed_experts": 8,
                                              "num_experts_per_tok": 2, "hidden_size": 64,
                                              "num_attention_heads": 4}})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = cli("check-config", path)
    assert proc.returncode == 2
    assert ("model: 'deepseek_v3' is a Mixture-of-Experts family llmtrain does not train yet (its experts' "
            "layout, router or loss differ; families: mixtral, olmoe, qwen2_moe, qwen3_moe); choose one of "
            "those") in proc.stderr.splitlines()


def test_muon_orthogonalises_each_experts_gate_up_and_down_apart_and_the_router_takes_adamw():
    """One Muon step on a Qwen3-MoE: expert e's gate rows move by Muon's update of its gate's
    gradient alone (as a dense model's gate_proj would), its up rows by its up's, its down by its
    down's; the routers are in the AdamW group with the embeddings and head."""
    from types import SimpleNamespace
    from llmtrain.optimizers import build_optimizer, named_groups
    from llmtrain.optimizers.muon import newton_schulz
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**QWEN3_MOE, "vocab_size": 64}))
    train = SimpleNamespace(optimizer="muon", optimizer_args={}, lr=0.02, min_lr=0.0, warmup_steps=0,
                            max_steps=10, lr_schedule="constant", weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8)
    opt = build_optimizer(model, train, torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {k: [names[id(p)] for p in g["params"]] for k, g in named_groups(opt, train).items()}
    assert {n for n in groups["embeddings and head"] if "mlp.gate" in n} == {
        "model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"}
    assert "model.layers.0.mlp.experts.gate_up_proj" in groups["hidden"]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    experts = model.model.layers[0].mlp.experts
    before = {n: p.detach().clone() for n, p in experts.named_parameters()}
    grads = {n: p.grad.clone() for n, p in experts.named_parameters()}
    opt.step()
    hidden, inter = 64, 32
    for e in (0, 5):
        gate, up = grads["gate_up_proj"][e].split(inter)
        moved = experts.gate_up_proj.detach()[e] - before["gate_up_proj"][e]
        scale = 0.02 * 0.2 * max(inter, hidden) ** 0.5
        expected = -scale * torch.cat([newton_schulz(gate[None])[0], newton_schulz(up[None])[0]])
        torch.testing.assert_close(moved, expected, rtol=1e-4, atol=1e-6)
        down = experts.down_proj.detach()[e] - before["down_proj"][e]
        torch.testing.assert_close(down, -scale * newton_schulz(grads["down_proj"][e][None])[0], rtol=1e-4, atol=1e-6)


def test_lora_on_an_moe_model_keeps_the_experts_frozen_and_merges_into_its_layout(tmp_path, monkeypatch):
    """LoRA on the attention of a saved Qwen3-MoE: the experts and routers stay frozen (the
    optimizer holds only adapters); the merged export writes each expert's tensors as the base
    stores them (unchanged) and the targets with B A alpha/rank added; transformers loads it."""
    from safetensors import safe_open
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    saved(tmp_path / "model", QWEN3_MOE)
    cfg = tiny_config(train={"max_steps": 2, "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 2},
                      slurm={"nodes": 1, "procs_per_node": 1})
    cfg["model"] = {"name_or_path": str(tmp_path / "model"),
                    "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli("prepare", "--config", path, check=True)
    out = cli("train", "--config", path, check=True).stdout
    assert "LoRA: 1,792 trainable parameters" in out  # 2 layers x rank 4 x (q 64+64, v 64+32)
    assert "the base is frozen, its experts and routers too (fused expert stacks are not linear layers" in out
    run = load_config(path).run_dir
    cli("export", "--run-dir", run, "--out", tmp_path / "merged", "--merge", check=True)
    cli("export", "--run-dir", run, "--out", tmp_path / "adapter", check=True)
    q = "model.layers.1.self_attn.q_proj"
    with safe_open(tmp_path / "merged" / "model.safetensors", "pt") as merged, \
            safe_open(tmp_path / "model" / "model.safetensors", "pt") as stored, \
            safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as adapter:
        assert set(merged.keys()) == set(stored.keys())
        for key in ("model.layers.1.mlp.experts.7.up_proj.weight", "model.layers.0.mlp.gate.weight"):
            assert torch.equal(merged.get_tensor(key), stored.get_tensor(key))
        a, b = (adapter.get_tensor(f"base_model.model.{q}.lora_{m}.weight") for m in "AB")
        assert b.abs().max() > 0
        torch.testing.assert_close(merged.get_tensor(f"{q}.weight"), stored.get_tensor(f"{q}.weight") + b @ a * 2)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "merged").config.model_type == "qwen3_moe"


@pytest.mark.slow  # real torchrun runs
def test_the_plot_draws_the_routing_in_a_panel_of_its_own(runs):
    from matplotlib.image import imread
    root, _ = runs
    run = root / "home" / "runs" / "one"
    assert cli("plot", run, check=True).returncode == 0
    assert imread(run / "plot.png").shape[:2] == (1040, 1440)  # 3 x 3 panels: the ninth the experts'


def test_check_config_knows_the_experts_layout_of_a_pretrained_folder(tmp_path, monkeypatch):
    """Files that lack the last expert of a layer its config.json describes are refused before the
    queue, in one line, from the safetensors header alone."""
    from safetensors.torch import load_file, save_file
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    saved(tmp_path / "model", QWEN3_MOE)
    cfg = tiny_config(slurm={"nodes": 1, "procs_per_node": 1})
    cfg["model"] = {"name_or_path": str(tmp_path / "model")}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli("check-config", path).returncode == 0
    weights = tmp_path / "model" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.experts.7.gate_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    proc = cli("check-config", path)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"model.name_or_path: {tmp_path / 'model'}'s weight files hold no model.layers.1.mlp.experts.7.gate_proj.weight "
        f"(its config.json has 8 experts in layer 1, stored one tensor per expert or fused as "
        f"model.layers.1.mlp.experts.gate_up_proj); the files and config.json do not match: download the model again"]


@pytest.mark.slow  # real torchrun runs
def test_tensor_parallel_splits_attention_and_routes_each_ranks_slice_through_whole_experts(tmp_path, monkeypatch):
    """tp 2 on a saved Qwen3-MoE: the first loss is transformers'; the load-balancing loss is each
    rank's slice of the sequence's, averaged (transformers' over each half of each micro-batch's
    sequences); the curve stays within 1e-3 of one process's."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    model = saved(tmp_path / "model", QWEN3_MOE)
    cfg = tiny_config(train={"max_steps": 3, "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 0})
    cfg["model"] = {"name_or_path": str(tmp_path / "model")}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli("prepare", "--config", path, check=True)
    torchrun(2, "train", "--config", path, "--set", "parallel.tp=2", "--set", "parallel.strategy=fsdp")
    cli("train", "--config", path, "--set", "run.name=one", check=True)

    c = load_config(path)
    result, expected = transformers_first_step(model, c)
    logits = [layer.view(8, 64, -1) for layer in result.router_logits]
    slices = [tuple(layer[rows, half].reshape(-1, 8) for layer in logits)
              for rows in (slice(0, 4), slice(4, 8)) for half in (slice(0, 32), slice(32, 64))]
    aux = sum(load_balancing_loss_func(s, 8, 2).item() for s in slices) / 4
    tp, one = read_metrics(c.run_dir), read_metrics(c.run_dir.parent / "one")
    assert abs(tp[0]["loss"] - expected.item()) < 1e-5 and abs(tp[0]["moe_aux_loss"] - aux) < 1e-5
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(tp, one)) < 1e-3


@pytest.mark.parametrize("arch", [
    QWEN3_MOE, MIXTRAL,
    {**QWEN3_MOE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 48, "head_dim": None},
    {**QWEN3_MOE, "model_type": "olmoe", "head_dim": None}], ids=["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"])
def test_each_family_loads_its_per_expert_files_into_the_fused_experts(tmp_path, arch):
    """The sliced loader on a meta skeleton gives every parameter transformers' from_pretrained
    gives, the fused expert stacks included, from files saved one tensor per expert."""
    from llmtrain.parallel.weights import load_pretrained
    saved(tmp_path, {k: v for k, v in arch.items() if v is not None})
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(reference.config)
    model.to_empty(device="cpu")
    load_pretrained(model, tmp_path)
    expected = reference.state_dict()
    assert [n for n, p in model.named_parameters() if not torch.equal(p, expected[n])] == []


def test_a_rank_reads_only_the_experts_it_holds(tmp_path, monkeypatch):
    """Rank 1 of 2 holding the second half of each layer's experts (FSDP2's Shard(0) of the
    stacks) reads those experts' file tensors and no other's, and fills its shard with them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from llmtrain.parallel import weights
    reference = saved(tmp_path, QWEN3_MOE)
    read = []

    def recording(path):
        opened = original(path)

        class Recorder:
            def __enter__(self):
                inner = opened.__enter__()

                def read_key(key, slices):
                    read.append(key)
                    return inner(key, slices)
                return read_key

            def __exit__(self, *exc):
                return opened.__exit__(*exc)
        return Recorder()
    original = weights.open_weights
    monkeypatch.setattr(weights, "open_weights", recording)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(reference.config)
        model.to_empty(device="cpu")
        for experts in (layer.mlp.experts for layer in model.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                setattr(experts, name, torch.nn.Parameter(distribute_tensor(getattr(experts, name), mesh, [Shard(0)])))
        weights.load_pretrained(model, tmp_path)
    finally:
        dist.destroy_process_group()
    experts_read = {int(key.split(".")[5]) for key in read if ".experts." in key}
    assert experts_read == {4, 5, 6, 7}
    for ours, theirs in zip(model.model.layers, reference.model.layers):
        assert torch.equal(ours.mlp.experts.gate_up_proj.to_local(), theirs.mlp.experts.gate_up_proj[4:].detach())
        assert torch.equal(ours.mlp.experts.down_proj.to_local(), theirs.mlp.experts.down_proj[4:].detach())


def test_an_moe_config_whose_layers_are_all_dense_trains_without_routers():
    """Qwen3-MoE with every layer in mlp_only_layers: no router to hook, no load-balancing loss."""
    from types import SimpleNamespace
    from llmtrain.training.step import Step
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**QWEN3_MOE, "vocab_size": 64,
                                                                     "mlp_only_layers": [0, 1]}))
    cfg = SimpleNamespace(train=SimpleNamespace(router_aux_loss_coef=None, precision="fp32", optimizer="adamw"))
    step = Step(model, None, torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler(enabled=False), cfg)
    assert step.moe is not None and step.routers is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", [QWEN3_MOE, MIXTRAL], ids=["qwen3_moe", "mixtral"])
def test_the_experts_grouped_matmul_equals_the_per_expert_loop(arch, dtype):
    """Expert parallel's local experts (parallel/experts.py) run as two grouped matmuls where the
    model asks for transformers' grouped_mm: outputs and every gradient equal the per-expert loop's,
    bit for bit on CPU, with uneven groups and an expert that got no token."""
    from llmtrain.parallel.experts import _experts, experts_modules, grouped
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**arch, "vocab_size": 64}), dtype=dtype)
    experts = experts_modules(model)[0]
    sizes = [5, 0, 11, 3] + [2] * (experts.gate_up_proj.shape[0] - 4)
    x = torch.randn(sum(sizes), arch["hidden_size"], dtype=dtype)
    grad = torch.randn_like(x)

    def run(implementation):
        experts.config._experts_implementation = implementation
        leaves = [t.detach().clone().requires_grad_() for t in (x, experts.gate_up_proj, experts.down_proj)]
        assert grouped(experts, leaves[0], leaves[1]) == (implementation == "grouped_mm")
        out = _experts(experts, *leaves, sizes)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]

    for a, b in zip(run("grouped_mm"), run("eager")):
        assert torch.equal(a, b)
