"""FP8 training (train.fp8): which layers convert and why, the loss against bf16's, an exact
resume, an export that plain transformers loads, and tensor parallel on gloo. The FP8 matmuls
run on CPU (emulated in fp32 by torchao) for their numbers, not for speed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import float8_probe
from conftest import assert_same_curve, cli, llmtrain, losses, prepared_home, run_dir, tiny_config, torchrun
from llmtrain.parallel import float8

# 120 is not a multiple of 16: the MLP's three projections stay in high precision.
ODD_MLP = {"intermediate_size": 120}


def tiny_llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, **overrides}))


@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_conversion_keeps_the_head_and_odd_shapes_and_the_loss(recipe):
    """Converted: every projection whose dims are multiples of 16; not the head (the chunked
    loss uses its weight) nor the MLP of width 120. The parameters keep their names (so
    checkpoints and export do not change) and the first loss is the plain model's within 1%."""
    plain, model = tiny_llama(**ODD_MLP), tiny_llama(**ODD_MLP)
    assert float8.convert(model, recipe, torch.device("cpu"), fsdp=False) == 8
    assert float8.describe(model, recipe, "bf16", "cpu", compiled=True) == (
        f"fp8: 8 of 15 linear layers in float8 ({recipe}); bf16: model.layers.*.mlp.gate_proj, "
        f"model.layers.*.mlp.up_proj, model.layers.*.mlp.down_proj (dims not multiples of 16), "
        f"lm_head (the output head); on cpu the float8 matmuls are emulated (no float8 tensor cores): "
        f"FP8's numbers, not its speed")
    assert list(model.state_dict()) == list(plain.state_dict())
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    loss, reference = (m(input_ids=ids, labels=ids).loss for m in (model, plain))
    loss.backward()
    assert abs(loss.item() - reference.item()) < 0.01 * reference.item()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert model.model.layers[0].self_attn.q_proj.config.emulate  # on a CPU: not _scaled_mm's scalar loop


@pytest.mark.parametrize("device, compiled, said", [
    ("cpu", False, ["on cpu the float8 matmuls are emulated (no float8 tensor cores): FP8's numbers, not its "
                    "speed", "train.compile is off: without it FP8 gains nothing on a GPU either (torchao's "
                    "casts are fused only when compiled)"]),
    ("cuda", False, ["train.compile is off: without it FP8 gains nothing (torchao's casts are fused only when "
                     "compiled)"]),
    ("cuda", True, [])])
def test_the_start_up_line_says_why_fp8_will_not_be_faster(device, compiled, said):
    """What keeps FP8 from gaining, after the layers (doc/overview.md: a GPU of compute capability
    8.9+ and train.compile): emulated matmuls on a CPU, the uncompiled casts anywhere. A compiled
    run on a GPU gets the layers alone (tests/test_gpu.py)."""
    model = tiny_llama()
    float8.convert(model, "tensorwise", torch.device("cpu"), fsdp=False)
    line = float8.describe(model, "tensorwise", "bf16", device, compiled=compiled)
    assert line.split("; ")[2:] == said, line  # after the layers and those kept in bf16 (the head)


def test_on_gpus_matmuls_too_small_to_gain_stay_in_high_precision():
    """On CUDA the size filter leaves out what torchao measured no gain for: a 1024 x 1024
    projection stays, a Llama-8B-sized 4096 x 14336 one converts (whatever the device here)."""
    small, large = torch.nn.Linear(1024, 1024, device="meta"), torch.nn.Linear(4096, 14336, device="meta")
    assert float8.why_not(small, "tensorwise", "cuda") == "too small to gain"
    assert float8.why_not(small, "tensorwise", "cpu") is None  # CPU runs convert it, for the numbers
    assert float8.why_not(large, "tensorwise", "cuda") is None
    assert float8.why_not(large, "rowwise", "cuda") is None


@pytest.mark.parametrize("arch, kept", [
    # q_proj 2048 x 2048, column-parallel: 1024 x 2048 per rank (k and v are too small whole)
    ({"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 16, "num_key_value_heads": 4},
     ["model.layers.0.self_attn.q_proj"]),
    # down_proj 8192 -> 1024, row-parallel: 4096 -> 1024 per rank (gate and up: 1024 -> 4096 per rank, gain)
    ({"hidden_size": 1024, "intermediate_size": 8192, "num_attention_heads": 8, "num_key_value_heads": 8},
     ["model.layers.0.mlp.down_proj"])])
def test_under_tensor_parallel_the_size_filter_judges_each_rank_s_matmul(arch, kept):
    """tp 2 halves a column-parallel layer's output features and a row-parallel one's input
    features: a layer that gains in float8 whole can be too small on each rank, and stays."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=512, num_hidden_layers=1, **arch))
    names = {m: name for name, m in model.named_modules()}

    def too_small(tp):
        return sorted(names[m] for m, why in float8.high_precision(model, "tensorwise", "cuda", tp).items()
                      if why == "too small to gain")

    assert set(too_small(2)) - set(too_small(1)) == set(kept)
    assert float8.high_precision(model, "tensorwise", "cpu", 2) == {model.lm_head: "the output head"}


def test_only_tensorwise_weights_under_fsdp2_on_cuda_gather_in_float8():
    """FSDP2's float8 all-gathers, and so the precomputed scales: tensorwise scaling (torchao
    gathers rowwise weights in high precision), a sharded model, NCCL (CUDA)."""
    cases = [(recipe, fsdp, device) for recipe in float8.RECIPES for fsdp in (True, False)
             for device in ("cuda", "cpu")]
    assert [case for case in cases if float8.gathers_in_float8(*case)] == [("tensorwise", True, "cuda")]


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_float8_gathered_weights_with_precomputed_scales_train_as_scales_per_gather(group, tmp_path):
    """Weights FSDP2 gathers in float8 (as on CUDA) through the trainer's Step, against the same
    model gathered in fp32 and cast in the layer: the same losses bit for bit through an update,
    a step skipped on the device, a reload of earlier weights, a schedule-free evaluation and
    the steps after each (a scale left from other weights rounds them otherwise: 5.7104 for
    5.7141 with no precompute after an update). The first forward, before any update,
    all-reduces each weight's amax at each gather (2 micro-batches x (14 layers forward + the 7
    of the first decoder layer again in backward) = 42); after an update, with the scales
    precomputed, none (tests/float8_probe.py)."""
    figures = float8_probe.curves(torch.device("cpu"), tmp_path)
    gathered, plain = figures["gathered"], figures["plain"]
    assert gathered["precomputes"] and not plain["precomputes"]  # what the trainer's Step decided
    finite = [x for x in gathered["losses"] if x == x]
    assert finite == [x for x in plain["losses"] if x == x] and len(finite) == 6, figures
    assert gathered["losses"][1] != gathered["losses"][1]  # the injected NaN
    assert gathered["losses"][2] == gathered["losses"][3]  # the reloaded step repeats itself
    assert gathered["all_reduces"] == [42, 0, 0, 0, 0, 0] and plain["all_reduces"] == [0] * 6, figures


def test_fp8_with_lora_is_refused_before_the_queue(home, write_config, tmp_path):
    tiny_llama().save_pretrained(tmp_path / "base")
    config = tiny_config(train={"fp8": "tensorwise"})
    config["model"] = {"name_or_path": str(tmp_path / "base"), "tokenizer": config["model"]["tokenizer"],
                       "lora": {"rank": 4}}
    proc = llmtrain("check-config", write_config(config))
    assert proc.returncode == 2
    assert ("train.fp8: not with model.lora yet (FP8 trains whole models; an adapter's matmuls are too "
            "small to gain); set train.fp8: none (got tensorwise)") in proc.stderr.splitlines()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = tiny_config(train={"max_steps": 10, "eval_every": 5, "checkpoint_every": 5})
    cfg["model"]["architecture"].update(ODD_MLP)
    with prepared_home(tmp_path_factory, "fp8", cfg) as home:
        yield home


@pytest.mark.slow
def test_fp8_trains_like_bf16_resumes_exactly_and_exports_a_plain_model(setup):
    """bf16 against fp8 tensorwise (bf16 elsewhere), 10 steps: the losses within 1%; the run
    resumed from its step-5 checkpoint repeats steps 6-10 bit for bit; the export is a plain
    fp32 Llama that transformers loads."""
    bf16 = ["--set", "train.precision=bf16"]
    fp8 = [*bf16, "--set", "train.fp8=tensorwise"]
    cli("train", "--config", setup[1], "--set", "run.name=bf16", *bf16, check=True)
    cli("train", "--config", setup[1], "--set", "run.name=fp8", *fp8, check=True)
    run = run_dir(setup, "fp8")
    reference, curve = losses(run_dir(setup, "bf16")), losses(run)
    assert [x[:2] for x in curve] == [x[:2] for x in reference]
    assert all(abs(a[2] - b[2]) < 0.01 * b[2] for a, b in zip(curve, reference)), (curve, reference)
    assert curve[-1][2] < curve[0][2] - 1  # it learns: 6.25 -> 4.83
    log = (run / "logs" / "rank-0.log").read_text()
    assert "fp8: 8 of 15 linear layers in float8 (tensorwise); bf16: model.layers.*.mlp.gate_proj" in log
    assert ("(the output head); on cpu the float8 matmuls are emulated (no float8 tensor cores): FP8's numbers, "
            "not its speed; train.compile is off: without it FP8 gains nothing on a GPU either" in log), log

    checkpoint = run / "checkpoints" / "step-00000005"
    cli("train", "--config", setup[1], "--set", "run.name=fp8-resumed", *fp8,
        "--set", f"train.resume={checkpoint}", check=True)
    assert losses(run_dir(setup, "fp8-resumed")) == [x for x in curve if x[1] > 5]

    out = setup[0] / "exported"
    for name in ("fp8", "fp8-resumed"):
        cli("export", "--run-dir", run_dir(setup, name), "--out", out / name, check=True)
    weights, resumed = (load_file(out / name / "model.safetensors") for name in ("fp8", "fp8-resumed"))
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)
    model, info = AutoModelForCausalLM.from_pretrained(out / "fp8", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert {w.dtype for w in weights.values()} == {torch.float32}


@pytest.mark.slow
def test_fp8_under_tensor_parallel_on_gloo_gives_one_process_curve(setup):
    """tp 2 against one process, both fp8 tensorwise in fp32: the scales are the whole tensors'
    (DTensor reduces the amax over the ranks), so the first steps agree exactly; later an
    element that rounds to another float8 value lets them drift by a few 1e-4 in 10 steps."""
    fp8 = ["--set", "train.fp8=tensorwise"]
    cli("train", "--config", setup[1], "--set", "run.name=fp8-single", *fp8, check=True)
    proc = torchrun(2, "train", "--config", setup[1], "--set", "run.name=fp8-tp2", "--set", "parallel.tp=2", *fp8)
    assert "Traceback" not in proc.stderr
    assert_same_curve(run_dir(setup, "fp8-tp2"), run_dir(setup, "fp8-single"), tol=1e-3)
    first = [losses(run_dir(setup, name))[0][2] for name in ("fp8-tp2", "fp8-single")]
    assert abs(first[0] - first[1]) < 1e-6
