"""optimizers.py: the schedules and Lion's update in one process (its skip on the device:
tests/test_step.py), and under torchrun (gloo) Lion on FSDP2 giving DDP's curve and resuming bit
for bit, and under tensor parallel one process's."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import yaml

from conftest import assert_same_curve, losses, prepared_home, run_dir, tiny_config, torchrun
from llmtrain.config import ConfigError, load_config
from llmtrain.optimizers import _lion_class, lr_at


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
    opt = _lion_class()([{"params": [w], "weight_decay": 0.1}], lr=0.01, betas=(0.9, 0.99))
    m = torch.zeros(3)
    expected = w.detach().clone()
    for g in (torch.tensor([0.5, -0.1, 0.0]), torch.tensor([-0.2, -0.3, 0.4])):
        w.grad = g.clone()
        opt.step()
        expected = expected * (1 - 0.01 * 0.1) - 0.01 * torch.sign(0.9 * m + 0.1 * g)
        m = 0.99 * m + 0.01 * g
    torch.testing.assert_close(w.detach(), expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(opt.state[w]["exp_avg"], m, rtol=0, atol=1e-8)


@pytest.mark.parametrize("train,line", [
    ({"optimizer": "lion", "optimizer_args": {"momentum": 0.9}},
     "train.optimizer_args: lion takes no 'momentum' (takes: betas)"),
    ({"optimizer": "adamw", "optimizer_args": {"betas": [0.9, 0.99]}},
     "train.optimizer_args: adamw takes no 'betas' (takes: none)"),
    ({"optimizer": "lion", "optimizer_args": {"betas": [0.9, 1.5]}},
     "train.optimizer_args: betas must be two numbers in [0, 1) (got [0.9, 1.5])"),
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


@pytest.mark.slow
def test_lion_on_fsdp2_gives_ddps_curve_and_resumes_bit_for_bit(prepared):
    """Lion's update is elementwise: FSDP2's shards update as DDP's whole tensors do. Resumed at
    step 4 from the FSDP2 run's checkpoint, steps 5-8 repeat its losses exactly."""
    _, config = prepared
    torchrun(2, "train", "--config", config, "--set", "run.name=ddp")
    torchrun(2, "train", "--config", config, "--set", "run.name=fsdp", "--set", "parallel.strategy=fsdp")
    assert_same_curve(run_dir(prepared, "fsdp"), run_dir(prepared, "ddp"), tol=1e-4)
    train = [loss for kind, _, loss in losses(run_dir(prepared, "ddp")) if kind == "train"]
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
    from conftest import cli
    cli("train", "--config", config, "--set", "run.name=lion-single", check=True)
    torchrun(2, "train", "--config", config, "--set", "run.name=lion-tp2", "--set", "parallel.tp=2")
    assert_same_curve(run_dir(prepared, "lion-tp2"), run_dir(prepared, "lion-single"), tol=1e-4)

