"""Expert parallel (`parallel.ep`, parallel/experts.py): a Qwen3-MoE and a Mixtral with their
experts split over 2 ranks give one process's curve; ep 2 x 2-way expert shards on 4 processes
gives the same, as does ep 2 in each of 2 pipeline stages; ep 2 over the context-parallel ranks
gives cp 2's; compiled, checkpointed and in bf16 it follows the fp32 curve; a checkpoint written
at ep 2 resumes at ep 1 and exports as transformers loads it; the layout's rules in one line
each."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import assert_same_curve, cli, prepared_home, read_metrics, tiny_config, torchrun
from llmtrain.config import ConfigError, load_config
from test_moe import MIXTRAL, QWEN3_MOE as MOE_ARCH

pytestmark = pytest.mark.slow  # real torchrun runs

QWEN3_MOE = {**MOE_ARCH, "num_experts": 4}  # 4 experts, 2 a token: 2 a rank at ep 2


def config(arch: dict) -> dict:
    return tiny_config(model={"architecture": arch},
                       train={"max_steps": 6, "warmup_steps": 1, "lr_schedule": "constant", "eval_every": 3,
                              "checkpoint_every": 3, "micro_batch_size": 2},
                       parallel={"strategy": "fsdp"})


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """One process (4 micro-batches of 2 a step), ep 2 on 2 (2 each), ep 2 x 2-way shards on 4
    (1 each), and ep 2's step-3 checkpoint resumed by one process."""
    with prepared_home(tmp_path_factory, "ep", config(QWEN3_MOE)) as (root, path):
        cli("train", "--config", path, "--set", "run.name=one", check=True)
        torchrun(2, "train", "--config", path, "--set", "run.name=ep2", "--set", "parallel.ep=2")
        # ep 2's run as its step-3 checkpoint left it (the schedule is constant: what a run
        # stopped at step 3 saves), resumed by one process
        runs = root / "home" / "runs"
        shutil.copytree(runs / "ep2", runs / "moved")
        shutil.rmtree(runs / "moved" / "checkpoints" / "step-00000006")
        (runs / "moved" / "checkpoints" / "latest").write_text("step-00000003\n")
        cli("train", "--config", path, "--set", "run.name=moved", check=True)
        assert "resumed from" in (runs / "moved" / "logs" / "rank-0.log").read_text()
        yield root, path


def runs(root) -> dict:
    return {p.name: p for p in (root / "home" / "runs").iterdir()}


def test_ep2_gives_one_process_curve_with_the_routing_metrics(qwen):
    root, _ = qwen
    assert_same_curve(runs(root)["one"], runs(root)["ep2"], 1e-4)
    one, ep2 = (read_metrics(runs(root)[name]) for name in ("one", "ep2"))
    for a, b in zip(one, ep2):
        if a["kind"] == "train":
            assert abs(a["moe_aux_loss"] - b["moe_aux_loss"]) < 1e-4
            assert a["expert_imbalance"] == pytest.approx(b["expert_imbalance"], rel=1e-6)
    log = (runs(root)["ep2"] / "logs" / "rank-0.log").read_text()
    assert "fsdp over 2 ranks; experts over ep 2 x 1-way shards" in log


def test_a_checkpoint_written_at_ep2_resumes_at_ep1_and_exports(qwen, tmp_path):
    root, _ = qwen
    assert_same_curve(runs(root)["one"], runs(root)["moved"], 1e-4)
    run = runs(root)["ep2"]
    args = ["--prompt", "Once upon a time, Sam went to the", "--max-new-tokens", "12", "--temperature", "0"]
    ours = cli("generate", "--run-dir", run, *args, check=True).stdout
    cli("export", "--run-dir", run, "--out", tmp_path / "hf", check=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    out = model.generate(tokenizer(args[1], return_tensors="pt").input_ids, max_new_tokens=12, do_sample=False)
    assert ours.strip() == tokenizer.decode(out[0], skip_special_tokens=True).strip()


def test_mixtral_with_ep2_gives_one_process_curve(tmp_path_factory):
    with prepared_home(tmp_path_factory, "ep-mixtral", config(MIXTRAL)) as (root, path):
        cli("train", "--config", path, "--set", "run.name=one", "--set", "train.max_steps=3", check=True)
        torchrun(2, "train", "--config", path, "--set", "run.name=ep2", "--set", "parallel.ep=2",
                 "--set", "train.max_steps=3")
        assert_same_curve(runs(root)["one"], runs(root)["ep2"], 1e-4)


def test_ep2_over_two_expert_shards_on_four_processes_gives_the_curve(qwen):
    """4 ranks: dense weights 4-way sharded, experts split over ep 2 and each sharded 2-way."""
    root, path = qwen
    torchrun(4, "train", "--config", path, "--set", "run.name=ep2x2", "--set", "parallel.ep=2",
             "--set", "slurm.procs_per_node=4", timeout=600)
    assert_same_curve(runs(root)["one"], runs(root)["ep2x2"], 1e-4)
    assert "experts over ep 2 x 2-way shards" in (runs(root)["ep2x2"] / "logs" / "rank-0.log").read_text()


@pytest.mark.parametrize("sets,line", [
    (["parallel.ep=3"], "parallel.ep: must divide the shard x context-parallel ranks 2 (got 3); experts are "
                        "spread over ranks that hold the same dense weights"),
    (["parallel.ep=2", "parallel.strategy=ddp"], "parallel.ep: expert parallel runs with parallel.strategy fsdp or hsdp "
                                                 "(got ddp); set parallel.ep: 1"),
])
def test_the_layout_rules_for_ep_are_one_line_each(tmp_path, monkeypatch, sets, line):
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config(QWEN3_MOE)))
    with pytest.raises(ConfigError) as e:
        load_config(path, sets)
    assert line in e.value.problems


def test_ep_must_divide_the_experts(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config({**QWEN3_MOE, "num_experts": 3})))
    proc = cli("check-config", path, "--set", "parallel.ep=2")
    assert proc.returncode == 2 and "parallel.ep: must divide the model's 3 experts a layer (got 2)" in proc.stderr


def test_ep2_in_each_of_two_pipeline_stages_gives_the_curve(qwen):
    """4 ranks: a pipeline of 2 stages, each stage's layer 2-way sharded with its experts split over
    ep 2; the load-balancing loss over both stages, the gradient norm over both meshes and both
    stages (clipping at 1.0 acts: the norms are 1.3-2.0), the routing metrics."""
    root, path = qwen
    torchrun(4, "train", "--config", path, "--set", "run.name=ep2pp2", "--set", "parallel.ep=2",
             "--set", "parallel.pp=2", "--set", "slurm.procs_per_node=4", timeout=600)
    assert_same_curve(runs(root)["one"], runs(root)["ep2pp2"], 1e-4)
    one, both = (read_metrics(runs(root)[name]) for name in ("one", "ep2pp2"))
    train = [(a, b) for a, b in zip(one, both) if a["kind"] == "train"]
    assert len(train) == 6 and max(a["grad_norm"] for a, _ in train) > 1.0
    for a, b in train:
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 and abs(a["moe_aux_loss"] - b["moe_aux_loss"]) < 1e-4
        assert a["expert_imbalance"] == pytest.approx(b["expert_imbalance"], rel=1e-6)
    log = (runs(root)["ep2pp2"] / "logs" / "rank-0.log").read_text()
    assert "pipeline of 2 stages over 4 ranks, each fsdp over 2 ranks; experts over ep 2 x 1-way shards" in log


def test_ep2_over_context_parallel_ranks_gives_the_cp_curve(qwen):
    """ep 2 borrowing the context-parallel ranks (each holding half of every sequence): the curve,
    gradient norm and routing metrics of cp 2 without ep (each rank's slice routed on its own)."""
    root, path = qwen
    for name, ep in (("cp2", "1"), ("cp2ep2", "2")):
        torchrun(2, "train", "--config", path, "--set", f"run.name={name}", "--set", "parallel.cp=2",
                 "--set", f"parallel.ep={ep}")
    assert_same_curve(runs(root)["cp2"], runs(root)["cp2ep2"], 1e-5)
    for a, b in zip(*(read_metrics(runs(root)[name]) for name in ("cp2", "cp2ep2"))):
        if a["kind"] == "train":
            assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-5 and abs(a["moe_aux_loss"] - b["moe_aux_loss"]) < 1e-5
            assert a["expert_imbalance"] == b["expert_imbalance"]
    assert "fsdp over 2 ranks (mesh: cp 2); experts over ep 2 x 1-way shards" in (
        runs(root)["cp2ep2"] / "logs" / "rank-0.log").read_text()


def test_ep2_compiled_checkpointed_in_bf16_follows_the_fp32_curve(qwen):
    """train.compile (the dispatch eager, the rest of each layer compiled), activation
    checkpointing (the recompute reads the splits again) and bf16 at ep 2: one process's fp32
    curve within bf16's rounding (4e-4 of the loss when written), the routing metrics too."""
    root, path = qwen
    torchrun(2, "train", "--config", path, "--set", "run.name=ep2_compiled", "--set", "parallel.ep=2",
             "--set", "train.compile=true", "--set", "model.activation_checkpointing=true",
             "--set", "train.precision=bf16", timeout=600)
    one, ep2 = (read_metrics(runs(root)[name]) for name in ("one", "ep2_compiled"))
    train = [(a, b) for a, b in zip(one, ep2) if a["kind"] == "train"]
    assert len(train) == 6
    for a, b in train:
        assert abs(a["loss"] - b["loss"]) < 0.003 * a["loss"] and abs(a["grad_norm"] - b["grad_norm"]) < 0.02 * a["grad_norm"]
        assert abs(a["moe_aux_loss"] - b["moe_aux_loss"]) < 0.01
