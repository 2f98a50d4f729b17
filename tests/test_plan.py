"""`llmtrain plan` as a user meets it: Llama-3-70B on 8 nodes of 8 H100s at 8192 tokens gets
ranked layouts, each within the memory the estimator gives and each passing check-config when
applied; `--apply` writes a config check-config accepts; a GPU it does not know is one line. The
cost model's terms (login/plan.py) where a user would check them: the pipeline's bubble, the
links a group crosses."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from conftest import REPO, cli
from llmtrain.config import load_config
from llmtrain.login.estimate import GIB, estimate, model_shape
from llmtrain.login.plan import Candidate, best_of_each, cost, gpu_in, gpu_named, plan
from llmtrain.parallel.dims import ParallelDims, gradients_held
from test_estimate import LLAMA_3_70B, llama

CLUSTER = ["slurm.nodes=8", "slurm.gpus_per_node=8", "slurm.procs_per_node=null"]


@pytest.fixture
def config_70b(home, write_config):
    cfg = llama(LLAMA_3_70B, 8, data={"seq_len": 8192}, train={"global_batch_size": 128, "eval_samples": 64})
    return write_config(cfg)


def test_plan_ranks_70b_layouts_on_64_h100s_each_fitting_and_valid(config_70b, tmp_path):
    proc = cli("plan", "--config", config_70b, "--nodes", "8", "--gpus-per-node", "8", "--gpu", "h100",
               "--apply", tmp_path / "best.yaml")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("plan: a llama from model.architecture on 8 nodes x 8 H100 (80 GiB, 989 bf16 TFLOP/s; "
                          "datasheet figures), seq_len 8192")
    rows = re.findall(r"^ +(\d) +(.+?) +(\d+) +([\d.]+) +([\d,]+) +(\d+)%  (.+)$", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5]
    speeds = [int(r[4].replace(",", "")) for r in rows]
    assert speeds == sorted(speeds, reverse=True) and all(float(r[3]) <= 72.0 for r in rows)

    # the library behind it: each shown layout, applied with its --set arguments, passes
    # check-config's loading and needs what the estimator says, within the GPU's 72 GiB usable
    cfg = load_config(config_70b, [*CLUSTER, "parallel.strategy=fsdp"], world_size=64)
    shape = model_shape(cfg)
    shown = best_of_each(plan(cfg, shape, 64, 8, gpu_named("h100")))[:5]
    for (cand, c), row in zip(shown, rows):
        applied = load_config(config_70b, [*CLUSTER, *cand.overrides()], world_size=64)
        assert estimate(applied, 64, shape=shape).total == c.memory <= 72 * GIB
        assert row[1].startswith(cand.describe()) and f"{c.memory / GIB:.1f}" == row[3]
    use = re.search(r"^use it: (.*)$", out, re.M)[1]
    assert use == " ".join(f"--set {s}" for s in shown[0][0].overrides())
    check = cli("check-config", tmp_path / "best.yaml")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "wrote " in out


def test_a_gpu_the_planner_does_not_know_is_one_line(config_70b):
    proc = cli("plan", "--config", config_70b, "--gpu", "k80")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: --gpu: 'k80' is not a GPU the planner knows (H100 NVL, H100 PCIe, GH200, H200 NVL, H200, H100, B200")


def test_the_cost_model_charges_the_bubble_and_the_links_a_group_crosses(config_70b):
    """More micro-batches shrink a pipeline's idle share as (p - 1) / (m + p - 1) says; an FSDP
    group inside a node gathers at NVLink's speed, one across nodes at the network's."""
    cfg = load_config(config_70b, [*CLUSTER, "parallel.strategy=fsdp"], world_size=64)
    shape, gpu = model_shape(cfg), gpu_named("h100")

    def predicted(cand: Candidate, per_node: int = 8):
        alt = cand.config(cfg)
        return cost(alt, ParallelDims.from_config(alt, 64, per_node), shape, gpu, per_node, 0)

    for micro, m in ((4, 8), (1, 32)):  # 32 sequences a replica in micro-batches of 4 or 1
        c = predicted(Candidate("fsdp", tp=8, pp=2, micro_batch=micro))
        work = c.seconds - c.parts["bubble"] - c.parts["p2p"]
        assert c.parts["bubble"] == pytest.approx(work * (1 / (m + 1)) / (1 - 1 / (m + 1)), rel=1e-9)
    node, cluster = (predicted(Candidate("fsdp", tp=8), per_node) for per_node in (64, 8))
    assert node.parts["fsdp"] < cluster.parts["fsdp"] and "bubble" not in node.parts
    assert cluster.parts["tp"] == pytest.approx(node.parts["tp"])  # tp stays inside a node either way


def test_the_cost_model_charges_the_hosts_work_where_it_outlasts_the_kernels(home, write_config):
    """Llama-3-8B on one node of 8 H100s, 2048 tokens a micro-batch: a layer's kernels at tp 8
    (~1 ms) are far shorter than eager DTensor's and FSDP2's dispatch of them (bench/host.py's
    figures), and the step waits for the host; compiled, the host has less to do; under DDP
    without tp (~6 ms of kernels a layer) the host keeps ahead and costs nothing. On a CPU, whose
    host is its device, every layer pass's dispatch is charged (twice over where two processes
    share a core)."""
    import dataclasses

    from llmtrain.login.plan import HOST_FSDP_LAYER_S, HOST_LAYER_S, HOST_TP_LAYER_S
    from test_estimate import LLAMA_3_8B
    path = write_config(llama(LLAMA_3_8B, 8, data={"seq_len": 2048}, train={"global_batch_size": 64}))

    def predicted(tp: int, compile: bool = False, gpu=gpu_named("h100"), strategy: str = "fsdp"):
        cfg = load_config(path, [f"parallel.strategy={strategy}", f"parallel.tp={tp}",
                                 "model.activation_checkpointing=false", f"train.compile={str(compile).lower()}"],
                          world_size=8)
        return cost(cfg, ParallelDims.from_config(cfg, 8, 8), model_shape(cfg), gpu, 8, 0)

    eager, compiled, plain = predicted(8), predicted(8, compile=True), predicted(1, strategy="ddp")
    passes = 32 * 64  # layers x micro-batches of the one data-parallel rank
    host = passes * (HOST_LAYER_S + HOST_TP_LAYER_S[False] + HOST_FSDP_LAYER_S)
    assert eager.parts["host"] == pytest.approx(host - (eager.seconds - eager.parts["host"]), rel=1e-9)
    assert eager.main.startswith("host ") and eager.seconds == pytest.approx(host, rel=1e-9)
    assert 0 < compiled.parts["host"] < eager.parts["host"] and compiled.seconds < eager.seconds / 2
    assert plain.parts["host"] == 0
    cpu = dataclasses.replace(gpu_named("h100"), host_serial=True)
    assert predicted(8, gpu=cpu).parts["host"] == pytest.approx(host, rel=1e-9)
    shared = dataclasses.replace(cpu, host_scale=2.0)  # two processes to a core
    assert predicted(8, gpu=shared).parts["host"] == pytest.approx(2 * host, rel=1e-9)


def test_on_a_cpu_the_data_parallel_collectives_overlap_nothing(home, write_config):
    """A GPU hides FSDP's gathers and reductions behind compute but for one layer's; a CPU
    (host serial: bench/plan.py's record) pays them whole, its cores doing both; and its
    all-gathers and reduce-scatters run at gather_scale of the all-reduce's rate."""
    import dataclasses

    from test_estimate import LLAMA_3_8B
    path = write_config(llama(LLAMA_3_8B, 8, data={"seq_len": 2048}, train={"global_batch_size": 64}))
    cfg = load_config(path, ["parallel.strategy=fsdp"], world_size=8)

    def predicted(gpu):
        return cost(cfg, ParallelDims.from_config(cfg, 8, 8), model_shape(cfg), gpu, 8, 0)

    gpu = gpu_named("h100")
    cpu = dataclasses.replace(gpu, host_serial=True)
    whole, hidden = predicted(cpu).parts["fsdp"], predicted(gpu)
    assert whole > hidden.parts["fsdp"] > 0
    assert hidden.parts["fsdp"] == pytest.approx(max(0, whole - hidden.parts["compute"]) + whole / 32, rel=1e-9)
    slower = predicted(dataclasses.replace(cpu, gather_scale=0.4)).parts["fsdp"]
    assert slower == pytest.approx(whole / 0.4, rel=1e-9)


def test_the_dry_runs_verdict_names_a_faster_layout_and_never_changes_the_config(config_70b):
    """submit.sh --dry-run's planner line (login/plan.verdict) for 70B under plain fsdp with
    checkpointing on 64 H100s: it fits; the planner's best is faster by the ratio of the two
    predicted steps; the config on disk is untouched."""
    from llmtrain.login.plan import candidate_of, verdict
    before = config_70b.read_text()
    cfg = load_config(config_70b, [*CLUSTER, "parallel.strategy=fsdp", "train.micro_batch_size=1"], world_size=64)
    line = verdict(cfg)  # the GPU named in slurm.extra_args: --gres=gpu:h100:8
    shape, gpu = model_shape(cfg), gpu_named("h100")
    mine = cost(cfg, ParallelDims.from_config(cfg, 64, 8), shape, gpu, 8, estimate(cfg, 64, shape=shape).total)
    best, c = plan(cfg, shape, 64, 8, gpu)[0]
    assert best != candidate_of(cfg) and c.seconds < mine.seconds
    assert line.startswith(f"fits ({mine.memory / GIB:.1f} GiB a H100), predicted {mine.tokens_per_s:,.0f} tokens/s a GPU; "
                           f"the planner's best is {mine.seconds / c.seconds:.2f}x faster: {best.describe()}, micro batch "
                           f"{best.micro_batch} (llmtrain plan --config {config_70b}")
    assert config_70b.read_text() == before
    tight = load_config(config_70b, [*CLUSTER, "parallel.strategy=ddp"], world_size=64)
    assert verdict(tight).startswith("does not fit (")


LLAMA_405B = {**LLAMA_3_70B, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
              "num_attention_heads": 128}
PRESET_MODELS = {"meta-llama/Meta-Llama-3-8B": "8b", "meta-llama/Meta-Llama-3-8B-Instruct": "8b",
                 "meta-llama/Meta-Llama-3-70B": "70b", "meta-llama/Meta-Llama-3-70B-Instruct": "70b",
                 "meta-llama/Llama-3.1-405B": "405b", "Qwen/Qwen3-30B-A3B": "30b-a3b"}


@pytest.mark.slow  # the planner over each preset's cluster: ~8 s each
@pytest.mark.parametrize("name", ["llama3-8b", "llama3-8b-lora", "llama3-70b", "llama3-70b-lora", "llama3.1-405b",
                                  "qwen3-30b-a3b"])
def test_each_preset_passes_check_config_fits_and_is_the_planners_best(home, name):
    """The model's config.json stands in for the download (`--config-only` fetches it); the
    preset passes check-config, the estimator says it fits its stated GPUs, and its layout is the
    planner's best (without FP8) for its cluster."""
    import json

    from test_estimate import LLAMA_3_8B, QWEN3_30B_A3B
    from llmtrain import preset
    from llmtrain.login.plan import candidate_of
    shapes = {"8b": LLAMA_3_8B, "70b": LLAMA_3_70B, "405b": LLAMA_405B, "30b-a3b": QWEN3_30B_A3B}
    for model, size in PRESET_MODELS.items():
        (home / "models" / model).mkdir(parents=True)
        (home / "models" / model / "config.json").write_text(json.dumps(shapes[size]))
    path = preset(name)
    check = cli("check-config", path)
    assert check.returncode == 0, check.stdout + check.stderr
    est = cli("estimate", "--config", path)
    assert est.returncode == 0 and re.search(r"^fits: [\d.]+ GiB <= 72.0 GiB usable of 80 GiB \(H100", est.stdout, re.M)
    cfg = load_config(path)
    per_node = cfg.slurm.gpus_per_node
    best, _ = plan(cfg, model_shape(cfg), cfg.world_size, per_node, gpu_named("h100"), fp8=False)[0]
    assert candidate_of(cfg) == best


def test_a_preset_that_does_not_exist_is_one_line():
    from llmtrain import preset
    from llmtrain.config import UserError
    with pytest.raises(UserError, match=r"^preset: no preset named llama5 \(.*configs/presets: llama3-70b, "):
        preset("llama5")
    proc = subprocess.run(["bash", str(REPO / "submit.sh"), "--preset", "llama5"], capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.startswith(
        "submit.sh: --preset: no preset named llama5 (configs/presets: llama3-70b-lora, llama3-70b, ")


@pytest.mark.slow  # a real local run
def test_the_tiny_preset_trains_on_this_machine(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "submit.sh"), "--preset", "tiny-llama", "--local", "--set",
                           "train.max_steps=4", "--set", "train.warmup_steps=1", "--set", "train.eval_every=0", "--set",
                           "train.checkpoint_every=0", "--set", "train.log_every=1", "--set", f"run.dir={tmp_path}"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "tiny-llama" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]


def test_a_preflight_record_of_the_cluster_replaces_the_datasheet(config_70b, home):
    """A job's preflight on this cluster's H100s measured a GEMM at half the datasheet's
    expectation and 10 GB/s across nodes: the planner states it, compute takes twice as long, and
    an FSDP group across nodes waits on the measured network."""
    record = {"device_name": "NVIDIA H100 80GB HBM3", "job_id": "4242", "time": 1.8e9, "nodes": 8,
              "ranks_per_node": 8, "matmul": {"size": 8192, "dtype": "bfloat16"},
              "matmul_tflops": 0.36 * 989, "intra_node_busbw_gbps": 300.0, "inter_node_busbw_gbps": 10.0}
    (home / "cluster").mkdir()
    (home / "cluster" / "NVIDIA-H100-80GB-HBM3.json").write_text(json.dumps(record))
    cfg = load_config(config_70b, [*CLUSTER, "parallel.strategy=fsdp"], world_size=64)
    shape, sheet, cluster = model_shape(cfg), gpu_named("h100"), gpu_in("h100", cfg)
    assert cluster.measured.startswith("measured by job 4242's preflight on 8 nodes")
    alt = Candidate("fsdp", micro_batch=1).config(cfg)
    dims = ParallelDims.from_config(alt, 64, 8)
    a, b = (cost(alt, dims, shape, gpu, 8, 0) for gpu in (sheet, cluster))
    assert b.parts["compute"] == pytest.approx(2 * a.parts["compute"])
    assert b.parts["fsdp"] > a.parts["fsdp"]  # 10 GB/s against 40 (50 at 80%)
    out = cli("plan", "--config", config_70b, "--nodes", "8", "--gpus-per-node", "8", "--gpu", "h100", "--top", "1")
    assert ("(80 GiB, 989 bf16 TFLOP/s; measured by job 4242's preflight on 8 nodes, 2027-01-15: a 356 TFLOP/s bf16 "
            "GEMM, all-reduce 300 GB/s inside a node, 10 across)") in out.stdout


def test_gradient_compression_is_known_to_the_estimator_and_the_planner(config_70b):
    """A 1B Llama (Llama-3.2-1B's shape) under DDP on 8 nodes of 8 H100s: PowerSGD's error
    feedback costs 4 bytes a parameter in the estimate; on the wire bf16 halves DDP's all-reduce
    and PowerSGD (rank 4) moves its factors only; the planner keeps the user's choice on its DDP
    rows and never picks one unasked."""
    sets = [*CLUSTER, "parallel.strategy=ddp", "model.architecture.hidden_size=2048",
            "model.architecture.intermediate_size=8192", "model.architecture.num_hidden_layers=16",
            "model.architecture.num_attention_heads=32", "train.micro_batch_size=2"]
    path = config_70b
    runs = {how: load_config(path, [*sets, f"parallel.grad_compression={how}"], world_size=64)
            for how in ("none", "bf16", "powersgd")}
    shape, gpu = model_shape(runs["none"]), gpu_named("h100")
    est = {how: estimate(c, 64, shape=shape) for how, c in runs.items()}
    assert est["powersgd"].comm - est["none"].comm == 4 * shape.trainable and est["bf16"].total == est["none"].total
    wire = {how: cost(c, ParallelDims.from_config(c, 64, 8), shape, gpu, 8, 0).parts["ddp"] for how, c in runs.items()}
    assert wire["bf16"] < wire["none"] and wire["powersgd"] < 0.1 * wire["bf16"]
    ranked = plan(runs["bf16"], shape, 64, 8, gpu)

    def reduces(c: Candidate) -> bool:  # over several data-parallel ranks (DDP's all-reduce, FSDP2's reduce-scatter)
        return ParallelDims.from_config(c.config(runs["bf16"]), 64, 8).loss_ranks > 1
    assert any(reduces(c) and c.strategy == "ddp" for c, _ in ranked) and any(reduces(c) and c.strategy == "fsdp"
                                                                             for c, _ in ranked)
    def held(c: Candidate) -> bool:  # FSDP2 holding gradients over micro-batches: in bf16 they would add up in bf16
        dims = ParallelDims.from_config(c.config(runs["bf16"]), 64, 8)
        return gradients_held(c.strategy, c.pp, c.reduce_each, dims.accumulation(128, c.micro_batch))
    assert all(c.compression == ("bf16" if reduces(c) and not held(c) else "none") for c, _ in ranked)
    assert any(held(c) for c, _ in ranked)
    assert all(c.compression == "none" for c, _ in plan(runs["none"], shape, 64, 8, gpu))
    powersgd = plan(runs["powersgd"], shape, 64, 8, gpu)  # DDP's hook alone: FSDP2 rows go without
    assert {c.compression for c, _ in powersgd if c.strategy != "ddp"} == {"none"}
    assert any(c.compression == "powersgd" for c, _ in powersgd)
    # FSDP2 reduce-scatters in bf16: half the bytes of its gradients on the wire
    sharded = {how: load_config(path, [*sets, "parallel.strategy=fsdp", f"parallel.grad_compression={how}"],
                                world_size=64) for how in ("none", "bf16")}
    wire = {how: cost(c, ParallelDims.from_config(c, 64, 8), shape, gpu, 8, 0).parts["fsdp"] for how, c in sharded.items()}
    assert wire["bf16"] < wire["none"]


def test_zero_stages_are_known_to_the_estimator_and_the_planner(config_70b):
    """Llama-3-70B, fsdp x tp 8 on 64 H100s, 16 micro-batches a step: ZeRO-2 holds every layer
    gathered (more memory, fewer gathers), ZeRO-1 also every layer's gradients until the step's
    end (one reduce-scatter a step); the planner names the stage of a layout and its --set
    arguments say it, consistently with the keys it sets."""
    runs = {n: load_config(config_70b, [*CLUSTER, "parallel.strategy=fsdp", "parallel.tp=8", f"parallel.zero={n}"],
                           world_size=64) for n in (1, 2, 3)}
    shape, gpu = model_shape(runs[3]), gpu_named("h100")
    est = {n: estimate(c, 64, shape=shape) for n, c in runs.items()}
    assert est[3].total < est[2].total < est[1].total
    assert est[1].gradients - est[2].gradients >= 4 * shape.trainable // 8  # the whole fp32 gradients / tp
    fsdp = {n: cost(c, ParallelDims.from_config(c, 64, 8), shape, gpu, 8, 0).parts["fsdp"] for n, c in runs.items()}
    assert fsdp[1] < fsdp[2] < fsdp[3]
    for n, (reshard, each) in {1: (False, False), 2: (False, True), 3: (True, True)}.items():
        cand = Candidate("fsdp", tp=8, reshard=reshard, reduce_each=each)
        assert cand.zero == n and f"parallel.zero={n}" in cand.overrides()
        assert (f"ZeRO-{n}" in cand.describe()) == (n != 3)  # fsdp is ZeRO-3 itself
        applied = load_config(config_70b, [*CLUSTER, *cand.overrides()], world_size=64)
        assert applied.parallel == runs[n].parallel
    assert Candidate("fsdp", reduce_each=False).zero is None and Candidate("ddp").overrides()[-1] == "parallel.zero=null"


def test_nothing_fits_and_a_model_not_on_disk_are_one_line_each(home, write_config):
    """Llama-3.1-405B on one node of 8 H100s: no layout fits (exit 1, the line says what to
    change); a hub model whose config files are not downloaded: the command that fetches them."""
    cfg = llama(LLAMA_405B, 8, data={"seq_len": 8192}, train={"global_batch_size": 16})
    proc = cli("plan", "--config", write_config(cfg), "--gpu", "h100")
    assert proc.returncode == 1 and proc.stdout.splitlines()[-1] == (
        "no layout fits: every candidate needs more than 72.0 GiB a GPU; add nodes or lower data.seq_len")
    hub = llama(LLAMA_3_70B, 8)
    hub["model"] = {"name_or_path": "meta-llama/Meta-Llama-3-70B"}
    path = write_config(hub, "hub.yaml")
    proc = cli("plan", "--config", path, "--gpu", "h100")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith(f"the planner needs only its config files, not the weights: bash "
                                        f"download_data_model.sh --config {path} --config-only")
