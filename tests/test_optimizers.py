"""optimizers/ in one process: the schedules, Lion's update, Muon's groups and direction against
torch.optim.Muon, schedule-free AdamW against its authors' package (the skip on the device:
tests/test_step.py); under torchrun (gloo): Lion and Muon on FSDP2 giving DDP's curve, Lion under
tensor parallel and Muon under FSDP2 x tp, bit-exact resumes, schedule-free's evaluated and
exported weights."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from conftest import assert_same_curve, cli, losses, prepared_home, run_dir, tiny_config, torchrun
from llmtrain.config import ConfigError, load_config
from llmtrain.optimizers import lr_at
from llmtrain.optimizers.lion import Lion


def schedule(name: str, **t) -> list[float]:
    train = SimpleNamespace(**{"lr": 1.0, "min_lr": 0.1, "warmup_steps": 2, "max_steps": 10,
                               "lr_schedule": name, "decay_fraction": 0.3, **t})
    return [round(lr_at(step, train), 6) for step in range(10)]


def test_wsd_holds_the_peak_then_decays_linearly_to_min_lr_at_the_last_step():
    assert schedule("wsd") == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7, 0.4, 0.1]
    assert schedule("constant") == [0.5, 1.0] + [1.0] * 8
    cosine = schedule("cosine")
    assert cosine[:3] == [0.5, 1.0, 1.0] and cosine[-1] > 0.1 and all(a > b for a, b in zip(cosine[2:], cosine[3:]))


def test_lion_takes_the_sign_of_its_interpolated_momentum():
    """Two steps by hand: w <- w (1 - lr wd) - lr sign(b1 m + (1 - b1) g); m <- b2 m + (1 - b2) g."""
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = Lion([{"params": [w], "weight_decay": 0.1}], lr=0.01, betas=(0.9, 0.99))
    m = torch.zeros(3)
    expected = w.detach().clone()
    for g in (torch.tensor([0.5, -0.1, 0.0]), torch.tensor([-0.2, -0.3, 0.4])):
        w.grad = g.clone()
        opt.step()
        expected = expected * (1 - 0.01 * 0.1) - 0.01 * torch.sign(0.9 * m + 0.1 * g)
        m = 0.99 * m + 0.01 * g
    torch.testing.assert_close(w.detach(), expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(opt.state[w]["exp_avg"], m, rtol=0, atol=1e-8)


def test_schedule_free_adamw_follows_the_reference_package_and_evaluates_its_average():
    """Ours against `schedulefree.AdamWScheduleFree` (the authors' package) over 6 steps with a
    warmup and weight decay: the training weights (y) after every step, and inside eval_weights()
    the average x that the package's eval() gives; after it, y again exactly."""
    import schedulefree
    from llmtrain.optimizers.schedule_free import AdamWScheduleFree
    torch.manual_seed(0)
    start = torch.randn(5, 3)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt = AdamWScheduleFree([{"params": [ours], "weight_decay": 0.1}], lr=0.01, betas=(0.9, 0.999))
    ref = schedulefree.AdamWScheduleFree([theirs], lr=0.01, betas=(0.9, 0.999), weight_decay=0.1,
                                         warmup_steps=0, foreach=False)
    ref.train()
    for step in range(6):
        lr = 0.01 * min(1.0, (step + 1) / 3)  # our warmup, given to both as the group's lr
        opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"] = lr
        g = torch.randn(5, 3)
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-6)
    y = ours.detach().clone()
    ref.eval()
    with opt.eval_weights():
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-6)
        assert (ours.detach() - y).abs().max() > 1e-3  # x is not y: evaluating y would be wrong
    assert torch.equal(ours.detach(), y)


def test_muon_steps_the_hidden_matrices_along_torchs_muon_and_adamw_the_rest():
    """build_optimizer's groups for Muon: the hidden matrices (q/k/v/o, gate/up/down) in the Muon
    group; embeddings and head with AdamW's weight decay; norms without. One step of the Muon
    group points where torch.optim.Muon's does (its Newton-Schulz runs in bf16, ours in fp32:
    cosine > 0.99), with the same AdamW-matched size; the orthogonalised update's singular values
    lie around 1."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from llmtrain.optimizers import build_optimizer
    from llmtrain.optimizers.muon import newton_schulz
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    train = SimpleNamespace(optimizer="muon", optimizer_args={}, lr=0.02, min_lr=0.0, warmup_steps=0,
                            max_steps=10, lr_schedule="constant", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    opt = build_optimizer(model, train, torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    hidden, ends, vectors = ([names[id(p)].split(".")[-2] for p in g["params"]] for g in opt.param_groups)
    assert sorted(set(hidden)) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert sorted(ends) == ["embed_tokens", "lm_head"] and set(vectors) == {"input_layernorm",
                                                                           "post_attention_layernorm", "norm"}
    assert [g["muon"] for g in opt.param_groups] == [True, False, False]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.1, 0.0]

    w = model.model.layers[0].mlp.gate_proj.weight  # 64 x 32
    reference = torch.nn.Parameter(w.detach().clone())
    torch_muon = torch.optim.Muon([reference], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    g = torch.randn_like(w)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    w.grad, reference.grad = g.clone(), g.clone()
    before = w.detach().clone()
    opt.step()
    torch_muon.step()
    ours, theirs = w.detach() - before, reference.detach() - before
    assert torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0) > 0.99
    assert ours.norm() == pytest.approx(float(theirs.norm()), rel=0.05)
    singular = torch.linalg.svdvals(newton_schulz(torch.randn(1, 64, 32))[0])
    assert 0.5 < float(singular.min()) and float(singular.max()) < 1.5


def test_param_groups_are_a_pattern_table_first_match_wins():
    """The groups of a tied GPT-2 (its own names: wte, wpe, Conv1D's c_attn): AdamW's matrices and
    vectors, Muon's hidden matrices, embeddings (the tied head is wte) and vectors, each group's
    parameters by name; a table with a name pattern ahead of a broader one takes the attention's
    matrices first. The checkpoint's estimate counts Muon's hidden matrices at 4 bytes, the rest at 8."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from llmtrain.optimizers import build_optimizer, held_state_bytes, named_groups
    from llmtrain.optimizers.groups import MATRICES_AND_VECTORS, ParamGroup, labelled, param_groups
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=32))
    names = {id(p): n for n, p in model.named_parameters()}
    train = dict(optimizer_args={}, lr=0.02, min_lr=0.0, warmup_steps=0, max_steps=10, lr_schedule="constant",
                 weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    layer = "transformer.h.0."
    matrices = [f"{layer}attn.c_attn.weight", f"{layer}attn.c_proj.weight", f"{layer}mlp.c_fc.weight",
                f"{layer}mlp.c_proj.weight"]
    vectors = [f"{layer}{m}.{w}" for m in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
               for w in (("weight", "bias") if m.startswith("ln") else ("bias",))] + ["transformer.ln_f.weight",
                                                                                     "transformer.ln_f.bias"]
    ends = ["transformer.wte.weight", "transformer.wpe.weight"]

    def groups(optimizer: str) -> dict[str, list[str]]:
        t = SimpleNamespace(optimizer=optimizer, **train)
        return {name: sorted(names[id(p)] for p in g["params"])
                for name, g in named_groups(build_optimizer(model, t, torch.device("cpu")), t).items()}

    assert groups("adamw") == {"matrices": sorted(ends + matrices), "vectors": sorted(vectors)}
    assert groups("muon") == {"hidden": sorted(matrices), "embeddings and head": sorted(ends),
                              "vectors": sorted(vectors)}
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: one parameter, one group

    table = (ParamGroup("attention", ("matrix:*.attn.*",)), *MATRICES_AND_VECTORS)
    made = param_groups(table, labelled(model))
    assert [sorted(names[id(p)] for p in g["params"]) for g in made] == [
        sorted(matrices[:2]), sorted(ends + matrices[2:]), sorted(vectors)]

    t = SimpleNamespace(optimizer="muon", **train)
    hidden = sum(model.get_parameter(n).numel() for n in matrices)
    rest = sum(p.numel() for p in model.parameters()) - hidden
    assert held_state_bytes(build_optimizer(model, t, torch.device("cpu")), t) == 4 * hidden + 8 * rest


def on_threads(world: int, fn) -> dict:
    """fn(rank) on `world` threads, each a rank of torch's in-process (threaded) process group:
    real collectives, one process, and per-thread dispatch modes to measure each rank."""
    import threading
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import (ProcessLocalGroup, _install_threaded_pg,
                                                                       _uninstall_threaded_pg)
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    store, results, errors = dist.HashStore(), {}, []

    def rank(r: int) -> None:
        dist.init_process_group("threaded", rank=r, world_size=world, store=store)
        try:
            results[r] = fn(r)
        except BaseException as e:  # wake the other ranks waiting in a collective
            errors.append(e)
            ProcessLocalGroup.exception_handle(e)
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise errors[0]
    return results


def test_muon_under_fsdp_x_tp_gives_each_rank_whole_matrices_of_its_share_and_no_gathered_stack():
    """FSDP2 x tp 2 on 4 ranks (threads): a row-parallel weight (o_proj, down_proj: FSDP2's rows x
    tp's columns) and a column-parallel one (tp's rows split again by FSDP2: a _StridedShard, 5
    rows over 2 FSDP2 ranks: 3 and 2), 10 matrices each. Every rank gets its shards of one
    process's Newton-Schulz; the largest tensor any rank makes is at most its share (ceil(10 / 4)
    = 3 matrices) plus one: DTensor's redistribute all-gathered the row-parallel stack over tp
    first (5 matrices under NCCL, the whole stack on CPU). Only all-to-alls, 2 per mesh dimension
    and stack; each rank orthogonalises 5 of the 20 matrices (each stack from rank 0 on: 6 and 4)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode
    from llmtrain.optimizers.muon import newton_schulz, orthogonalised

    class Largest(TorchDispatchMode):
        """The most elements of any tensor an op returns on this rank (thread)."""
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.most = max(self.most, t.numel())
            return out

    dp, tp, k, rows, cols = 2, 2, 10, 10, 12
    torch.manual_seed(0)
    whole = {"row": torch.randn(k, rows, cols), "column": torch.randn(k, rows, cols)}
    expected = {kind: newton_schulz(w, 5) for kind, w in whole.items()}

    def chunk(x, n, dim, i):  # torch.chunk's i-th of n, empty past the end (as FSDP2's shards)
        step = -(-x.shape[dim] // n)
        return x.narrow(dim, min(i * step, x.shape[dim]), max(0, min(step, x.shape[dim] - i * step)))

    def shard(w, kind, d, t):  # FSDP2 splits rows of what tp left: tp's columns, or tp's rows
        return chunk(chunk(w, tp, 1 if kind == "row" else 0, t), dp, 0, d).contiguous()

    def rank(r: int):
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("shard", "tensor"))
        d, t = divmod(r, tp)
        layouts = {"row": (Shard(0), Shard(1)), "column": (_StridedShard(0, split_factor=tp), Shard(0))}
        params = [DTensor.from_local(shard(w, kind, d, t), mesh, layouts[kind], shape=w.shape, stride=w.stride(),
                                     run_check=False) for kind in layouts for w in whole[kind]]
        with CommDebugMode() as comm, Largest() as largest, FlopCounterMode(display=False) as flops:
            out = orthogonalised(params, [p.to_local() for p in params], 5)
        error = max(float((o - shard(e, kind, d, t)).abs().max())
                    for o, (kind, e) in zip(out, [(kind, e) for kind in layouts for e in expected[kind]]))
        dist.barrier()
        return error, largest.most, dict(comm.get_comm_counts()), flops.get_total_flops()

    ranks = on_threads(dp * tp, rank)
    assert max(error for error, *_ in ranks.values()) < 1e-6
    assert max(most for _, most, *_ in ranks.values()) <= (-(-k // (dp * tp)) + 1) * rows * cols
    assert {str(op): n for op, n in ranks[0][2].items()} == {"c10d_functional.all_to_all_single": 8}
    one = FlopCounterMode(display=False)
    with one:
        newton_schulz(whole["row"][:1], 5)
    assert [f for *_, f in ranks.values()] == [2 * k // (dp * tp) * one.get_total_flops()] * (dp * tp)


@pytest.mark.parametrize("train,line", [
    ({"optimizer": "lion", "optimizer_args": {"momentum": 0.9}},
     "train.optimizer_args: lion takes no 'momentum' (takes: betas)"),
    ({"optimizer": "adamw", "optimizer_args": {"momentum": 0.9}},
     "train.optimizer_args: adamw takes no 'momentum' (it takes no optimizer_args: its settings are the train keys "
     "beta1 (the momentum), beta2, eps and weight_decay)"),
    ({"decay_fraction": 0.3},  # tiny_config's schedule is cosine
     "train.decay_fraction: only used with train.lr_schedule: wsd (got 0.3 with cosine); remove it, or set "
     "train.lr_schedule: wsd"),
    ({"optimizer": "lion", "optimizer_args": {"betas": [0.9, 1.5]}},
     "train.optimizer_args: betas must be two numbers in [0, 1) (got [0.9, 1.5])"),
    ({"optimizer": "muon", "optimizer_args": {"momentum": 1.0, "ns_steps": 5}},
     "train.optimizer_args: momentum must be a number in [0, 1) (got 1.0)"),
    ({"optimizer": "adamw_schedulefree"},  # tiny_config's schedule is cosine
     "train.lr_schedule: adamw_schedulefree needs no decay (its evaluated weights are an average of "
     "the iterates): set constant, the warmup stays (got cosine)"),
    ({"lr_schedule": "wsd", "decay_fraction": 0}, "train.decay_fraction: must be in (0, 1] (got 0.0)"),
    ({"lr_schedule": "wsd", "decay_fraction": 0.6, "warmup_steps": 5},  # of tiny_config's 8 steps
     "train.decay_fraction: wsd's decay (5 of 8 steps) would start inside the warmup (5 steps); lower one of them"),
])
def test_a_wrong_optimizer_setting_is_one_line(tmp_path, train, line):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tiny_config(train=train)))
    with pytest.raises(ConfigError) as e:
        load_config(path, world_size=1)
    assert e.value.problems == [line]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    cfg = tiny_config(train={"optimizer": "lion", "lr": 1e-3, "min_lr": 1e-4, "weight_decay": 0.3,
                             "lr_schedule": "wsd", "max_steps": 8, "checkpoint_every": 4, "eval_every": 4})
    with prepared_home(tmp_path_factory, "optimizers", cfg) as home:
        yield home


def single(prepared, name: str, *sets: str) -> Path:
    """One process's run of the module's config with `sets` (in this process; made by the first
    test that asks): the curve every layout must give (one process's is DDP's: test_train.py)."""
    _, config = prepared
    if not run_dir(prepared, name).exists():
        cli("train", "--config", config, "--set", f"run.name={name}", *(x for s in sets for x in ("--set", s)),
            check=True)
    return run_dir(prepared, name)


@pytest.mark.slow
def test_lion_on_fsdp2_gives_one_process_curve_and_resumes_bit_for_bit(prepared):
    """Lion's update is elementwise: FSDP2's shards update as one process's whole tensors do.
    Resumed at step 4 from the FSDP2 run's checkpoint, steps 5-8 repeat its losses exactly."""
    _, config = prepared
    one = single(prepared, "lion-single")
    torchrun(2, "train", "--config", config, "--set", "run.name=fsdp", "--set", "parallel.strategy=fsdp")
    assert_same_curve(run_dir(prepared, "fsdp"), one, tol=1e-4)
    train = [loss for kind, _, loss in losses(one) if kind == "train"]
    assert train[-1] < train[0] - 0.3  # it learns
    ckpt = run_dir(prepared, "fsdp") / "checkpoints" / "step-00000004"
    torchrun(2, "train", "--config", config, "--set", "run.name=resumed", "--set", "parallel.strategy=fsdp",
             "--set", f"train.resume={ckpt}")
    whole = {(k, s): v for k, s, v in losses(run_dir(prepared, "fsdp"))}
    resumed = losses(run_dir(prepared, "resumed"))
    assert [s for _, s, _ in resumed][0] == 5
    assert all(v == whole[k, s] for k, s, v in resumed), (resumed, whole)  # bit for bit
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["step"] == 4


@pytest.mark.slow
def test_lion_under_tensor_parallel_sums_a_replicated_weights_gradient_first(prepared):
    """tp 2 without FSDP2: a norm's weight is on both ranks and each holds part of its gradient
    (a partial sum over its tokens); Lion sums it before the sign, or the two copies drift
    apart and the curve leaves one process's."""
    _, config = prepared
    one = single(prepared, "lion-single")
    torchrun(2, "train", "--config", config, "--set", "run.name=lion-tp2", "--set", "parallel.tp=2")
    assert_same_curve(run_dir(prepared, "lion-tp2"), one, tol=1e-4)



def assert_resumes_bit_for_bit(prepared, whole: str, resumed: str, *sets: str, nproc: int = 2) -> None:
    """A run resumed at step 4 from `whole`'s checkpoint repeats its losses of steps 5-8 exactly."""
    _, config = prepared
    ckpt = run_dir(prepared, whole) / "checkpoints" / "step-00000004"
    torchrun(nproc, "train", "--config", config, "--set", f"run.name={resumed}", "--set", f"train.resume={ckpt}",
             *(x for s in sets for x in ("--set", s)))
    expected = {(k, s): v for k, s, v in losses(run_dir(prepared, whole))}
    got = losses(run_dir(prepared, resumed))
    assert [s for _, s, _ in got][0] == 5
    assert all(v == expected[k, s] for k, s, v in got), (got, expected)


@pytest.mark.slow
def test_muon_gives_one_process_curve_under_fsdp2_and_fsdp_x_tp_and_resumes_bit_for_bit(prepared):
    """Muon orthogonalises whole matrices: under FSDP2 each rank gets whole matrices of a stack of
    shards (all-to-all), under FSDP2 x tp 2 (4 ranks) over both mesh dimensions (FSDP2's strided
    split of the tp shards); both must give one process's curve (which holds every matrix), and
    the loss falls. Resumed at step 4, FSDP2's steps 5-8 repeat exactly."""
    _, config = prepared
    muon = ("train.optimizer=muon", "train.lr=3e-3", "train.weight_decay=0.1", "train.lr_schedule=constant")
    sets = [x for s in muon for x in ("--set", s)]
    one = single(prepared, "muon-single", *muon)
    torchrun(2, "train", "--config", config, "--set", "run.name=muon-fsdp", "--set", "parallel.strategy=fsdp", *sets)
    torchrun(4, "train", "--config", config, "--set", "run.name=muon-fsdp-tp2", "--set", "parallel.strategy=fsdp",
             "--set", "parallel.tp=2", "--set", "slurm.procs_per_node=4", *sets)
    for layout in ("muon-fsdp", "muon-fsdp-tp2"):
        assert_same_curve(run_dir(prepared, layout), one, tol=1e-4)
    train = [loss for kind, _, loss in losses(one) if kind == "train"]
    assert train[-1] < train[0] - 1.0, train  # it learns (6.25 -> 4.88 measured)
    assert_resumes_bit_for_bit(prepared, "muon-fsdp", "muon-resumed", "parallel.strategy=fsdp", *muon)


@pytest.mark.slow
def test_schedule_free_evaluates_and_exports_its_average_and_resumes_bit_for_bit(prepared, monkeypatch):
    """Schedule-free AdamW trains y and evaluates x, an average it keeps implicitly. The run's eval
    loss at step 8 is the loss of the model `llmtrain generate` loads and `llmtrain export`
    writes (x), computed here afresh over the same validation samples; the checkpoint's raw
    weights (y) give another loss, which a run that forgot the switch would log. Resumed at step
    4 under FSDP2, steps 5-8 repeat exactly (the evaluation at step 4 changed nothing); resumed
    with another beta1 (which y's mix of z and x was made with), it is refused in one line."""
    import numpy as np
    from transformers import AutoModelForCausalLM
    from llmtrain.data.loader import open_prepared, open_split
    from llmtrain.model.loss import lm_loss
    from llmtrain.model.shards import Checkpoint
    from llmtrain.training.export import export, load_checkpoint_model

    root, config = prepared
    sf = ("train.optimizer=adamw_schedulefree", "train.lr=3e-3", "train.lr_schedule=constant",
          "parallel.strategy=fsdp")
    torchrun(2, "train", "--config", config, "--set", "run.name=sf", *(x for s in sf for x in ("--set", s)))
    assert_resumes_bit_for_bit(prepared, "sf", "sf-resumed", *sf)

    cfg = load_config(config, world_size=2)
    folder, manifest = open_prepared(cfg)
    batch = open_split(folder, manifest, "validation", cfg).batch(np.arange(cfg.train.eval_samples), cfg.data.seq_len)
    tensors = batch.pinned(torch.device("cpu"))

    def loss_of(model) -> float:
        with torch.no_grad():
            return float(lm_loss(model, tensors, None, normaliser=1.0)) / batch.targets()

    logged = {s: v for k, s, v in losses(run_dir(prepared, "sf")) if k == "eval"}
    model, _ = load_checkpoint_model(run_dir(prepared, "sf"))
    assert loss_of(model) == pytest.approx(logged[8], rel=1e-5)
    out = export(run_dir(prepared, "sf"), root / "sf-export")
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert loss_of(exported) == pytest.approx(logged[8], rel=1e-5)
    raw = Checkpoint(run_dir(prepared, "sf") / "checkpoints" / "step-00000008")
    monkeypatch.delitem(raw.meta, "eval_shift")  # the parameters as trained: y
    model.load_state_dict(raw.read(list(raw.tensors)), strict=False)
    assert abs(loss_of(model) - logged[8]) > 1e-3

    ckpt = run_dir(prepared, "sf") / "checkpoints" / "step-00000004"
    refused = cli("train", "--config", config, "--set", "run.name=sf-beta1", *(x for s in sf[:3] for x in ("--set", s)),
                  "--set", "train.beta1=0.95", "--set", f"train.resume={ckpt}")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert (f"checkpoint {ckpt} does not match this config: optimizer_settings differs (beta1: 0.9 -> 0.95)"
            in refused.stderr), refused.stderr[-2000:]


def test_the_start_up_line_names_the_optimizer_its_parts_and_the_schedule():
    """What a run's log says of its optimizer: Muon's two parts (hidden matrices; AdamW on the
    rest, at its lr scale), the lr, the weight decay and the schedule, by step."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from llmtrain.optimizers import build_optimizer, describe
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    train = dict(optimizer="muon", optimizer_args={"adamw_lr_scale": 0.5}, lr=0.02, min_lr=0.002, warmup_steps=10,
                 max_steps=100, lr_schedule="wsd", decay_fraction=0.2, weight_decay=0.1, beta1=0.9, beta2=0.95,
                 eps=1e-8)
    hidden = 2 * (4 * 32 * 32 - 2 * 32 * 16 + 3 * 32 * 64)  # q, o 32 x 32; k, v 16 x 32; gate, up, down
    rest = sum(p.numel() for p in model.parameters()) - hidden
    assert describe(build_optimizer(model, SimpleNamespace(**train), torch.device("cpu")), SimpleNamespace(**train)) \
        == (f"optimizer: Muon on the hidden matrices ({hidden:,} parameters), AdamW at lr x 0.5 on the embeddings, "
            f"head, norms and biases ({rest:,}); lr 0.02, weight decay 0.1; schedule: 10 warmup steps, then wsd: "
            f"0.02 until step 80, linear to 0.002 at step 100")
    train.update(optimizer="lion", optimizer_args={}, lr_schedule="cosine", warmup_steps=0)
    assert describe(build_optimizer(model, SimpleNamespace(**train), torch.device("cpu")), SimpleNamespace(**train)) \
        == (f"optimizer: Lion on {hidden + rest:,} trainable parameters; lr 0.02, weight decay 0.1; schedule: cosine "
            f"to 0.002 at step 100")
