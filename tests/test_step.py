"""training/step.py and the optimizer table (optimizers/), in one process: no torchrun, no
process group. A tiny Llama, a real AdamW and real losses; a non-finite step is made by scaling
the loss by NaN, as LLMTRAIN_INJECT_NAN_STEPS does in a run."""

from __future__ import annotations

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import tiny_config
from llmtrain import optimizers
from llmtrain.config import load_config
from llmtrain.data.loader import Batch
from llmtrain.optimizers import OPTIMIZERS, OptimizerKind, build_optimizer
from llmtrain.model.build import num_params
from llmtrain.training.step import Step

CPU = torch.device("cpu")


def setup(tmp_path, optimizer: str = "adamw", **train):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tiny_config(train={"optimizer": optimizer, **train})))
    cfg = load_config(path, world_size=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                         max_position_embeddings=32))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return Step(model, None, build_optimizer(model, cfg.train, CPU), scaler, cfg)


def batches(n: int = 2) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    return [Batch(torch.randint(0, 64, (2, 17), generator=g)) for _ in range(n)]


def weights(step: Step) -> list[torch.Tensor]:
    return [p.detach().clone() for p in step.model.parameters()]


def optimizer_state(step: Step) -> list[torch.Tensor]:
    return [v.clone() for s in step.optimizer.state.values() for v in s.values()]


def train_step(step: Step, loss_factor: float = 1.0) -> tuple[float, bool]:
    """One step as the loop runs it (one rank): the step's loss, and whether the host read the flag."""
    loss, grad_norm = step.forward_backward(batches(), normaliser=2 * 2 * 16, loss_factor=loss_factor)
    nonfinite = ~step.finite(loss, grad_norm)
    reads = []
    read = step.update(nonfinite.float(), lambda: reads.append(1) or bool(nonfinite))
    assert read == bool(reads)  # it says whether it read, truly
    return float(loss), read


def test_the_loss_is_the_mean_over_every_micro_batch_and_target(tmp_path):
    """Two micro-batches of 2 x 16 targets: the step's loss is their mean cross-entropy, whatever
    the split (the same samples as one micro-batch of 4 give the same loss and gradients)."""
    step = setup(tmp_path)
    two = batches()
    loss, _ = step.forward_backward(two, normaliser=64)
    grads = [p.grad.clone() for p in step.model.parameters()]
    step.optimizer.zero_grad(set_to_none=True)
    one = Batch(torch.cat([b.tokens for b in two]))
    whole, _ = step.forward_backward([one], normaliser=64)
    with torch.no_grad():
        logits = step.model(input_ids=one.tokens[:, :-1]).logits
    mean = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), one.tokens[:, 1:].reshape(-1))
    assert float(loss) == pytest.approx(float(mean), rel=1e-5)
    assert float(whole) == pytest.approx(float(mean), rel=1e-5)
    for a, p in zip(grads, step.model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("optimizer", [name for name, kind in OPTIMIZERS.items() if kind.skips_on_device])
def test_the_optimizers_skip_a_non_finite_step_on_the_device_without_a_host_read(tmp_path, optimizer):
    """Every entry that declares skips_on_device: the NaN step changes no weight and no state
    (step counts, moments, schedule-free's averaging weights), and the host never reads the flag."""
    assert {"adamw", "lion", "muon", "adamw_schedulefree"} <= set(OPTIMIZERS)
    step = setup(tmp_path, optimizer=optimizer, lr=1e-3, lr_schedule="constant")
    assert not step.host_decides
    before = weights(step)
    loss, read = train_step(step)
    assert not read and loss > 0
    trained, state = weights(step), optimizer_state(step)
    assert any(not torch.equal(a, b) for a, b in zip(before, trained))

    loss, read = train_step(step, loss_factor=float("nan"))
    assert not read and loss != loss  # NaN, and still no host read
    assert all(torch.equal(a, b) for a, b in zip(trained, weights(step)))
    assert all(torch.equal(a, b) for a, b in zip(state, optimizer_state(step)))  # step count too
    assert all(p.grad is None for p in step.model.parameters())  # the bad gradients are gone


def toy_sgd(groups, t, device):
    """A non-conforming optimizer: plain SGD that ignores `found_inf`."""
    class Toy(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": t.lr})

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])
    return Toy(groups)


def test_an_optimizer_that_ignores_the_device_flag_is_skipped_by_the_host(tmp_path, monkeypatch):
    """Adding an optimizer is one entry in OPTIMIZERS; one that cannot skip on the device says
    so, and the step then reads the flag and never calls its step() for a non-finite step."""
    monkeypatch.setitem(OPTIMIZERS, "toy", OptimizerKind(toy_sgd, lambda o, t: None, skips_on_device=False,
                                                         state_bytes=0))
    step = setup(tmp_path, optimizer="toy")
    assert step.host_decides
    before = weights(step)
    loss, read = train_step(step)
    assert read
    trained = weights(step)
    assert any(not torch.equal(a, b) for a, b in zip(before, trained))
    loss, read = train_step(step, loss_factor=float("nan"))
    assert read
    assert all(torch.equal(a, b) for a, b in zip(trained, weights(step)))

    # Without the host's skip the same toy would have applied the NaN step: the test can fail.
    step.host_decides = False
    train_step(step, loss_factor=float("nan"))
    assert any(torch.isnan(p).any() for p in step.model.parameters())


def test_a_wrong_claim_to_skip_on_the_device_stops_the_run_at_build(tmp_path, monkeypatch):
    monkeypatch.setitem(OPTIMIZERS, "toy", OptimizerKind(toy_sgd, lambda o, t: None, skips_on_device=True,
                                                         state_bytes=0))
    with pytest.raises(RuntimeError, match="optimizer 'toy' applied a step that found_inf marked to skip, "
                                           "on cpu; its OPTIMIZERS entry must declare skips_on_device=False"):
        setup(tmp_path, optimizer="toy")


def test_an_unknown_optimizer_is_one_line_naming_the_choices(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tiny_config(train={"optimizer": "adamw8bit"})))
    with pytest.raises(Exception, match=r"train.optimizer: unknown 'adamw8bit'; one of: adamw"):
        load_config(path, world_size=1)


def test_the_estimator_counts_the_tables_optimizer_state(tmp_path, monkeypatch):
    from llmtrain.login.estimate import estimate
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    adamw = estimate(load_config(path, world_size=1), world_size=1)
    assert adamw.optimizer == 8 * adamw.trainable
    monkeypatch.setitem(OPTIMIZERS, "toy", OptimizerKind(toy_sgd, lambda o, t: None, skips_on_device=False,
                                                         state_bytes=0))
    path.write_text(yaml.safe_dump(tiny_config(train={"optimizer": "toy"})))
    assert estimate(load_config(path, world_size=1), world_size=1).optimizer == 0
    assert optimizers.OPTIMIZERS["adamw"].state_bytes == 8
    # Muon: 4 bytes on the hidden matrices (the tiny Llama's 2 layers x (4 x 64 x 64 attention, less
    # the kv heads' half, + 3 x 64 x 128 MLP)), AdamW's 8 on embeddings, head and norms; the
    # optimizer the run builds holds exactly that state after a step
    path.write_text(yaml.safe_dump(tiny_config(train={"optimizer": "muon"})))
    cfg = load_config(path, world_size=1)
    muon = estimate(cfg, world_size=1)
    hidden = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128)
    assert muon.optimizer == 4 * hidden + 8 * (muon.trainable - hidden)
    step = setup(tmp_path, optimizer="muon", lr=1e-3)
    train_step(step)
    held = sum(v.numel() * v.element_size() for s in step.optimizer.state.values() for v in s.values() if v.ndim)
    model = step.model
    hidden = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n and "lm_head" not in n)
    assert held == 4 * hidden + 8 * (num_params(model) - hidden)
