"""The optimizers a run can use (`train.optimizer`), and the learning-rate schedule.

    optimizer = build_optimizer(model, cfg.train, device)      # the table's entry, checked
    OPTIMIZERS[cfg.train.optimizer].state_bytes                # what the estimator counts
    held_state_bytes(optimizer, cfg.train)                     # what a checkpoint writes of it
    checkpoint_meta(cfg.train)                                 # what it adds to a checkpoint's meta.json
    to_eval_weights(meta, tensors, read_state)                 # a checkpoint's weights to evaluate

Everything the rest of llmtrain knows of an optimizer it asks here: its param groups, their
settings and the flags its own step reads stay inside this package.

To add an optimizer: write its builder (param groups, the train section, the device -> a
torch.optim.Optimizer) and add one entry to OPTIMIZERS. The entry declares two things:
- skips_on_device: whether its step() leaves every parameter and state untouched when the
  optimizer's `found_inf` attribute is a 0-dim device tensor holding 1, as torch's fused
  kernels do for the loss scaler. The trainer sets it on a non-finite step, so skipping costs
  no wait for the device. An optimizer that ignores `found_inf` declares False, and the step
  then reads the flag on the host and skips step() (training/step.py): one wait per step.
  A True declaration is checked when the optimizer is built (`_check_skips`), so a wrong one
  stops the run instead of applying a step it should have skipped.
- state_bytes: the optimizer's state per trainable parameter (AdamW: two fp32 moments, 8),
  for llmtrain estimate and the checkpoint's size.
It may declare more: its param groups (groups.py: a table of name patterns; matrices and
vectors unless it says, Muon's its own), and eval_shift (the parameters are not the weights to
evaluate: how to make those from the parameters and a state tensor, for exports from a
checkpoint, recorded in its meta.json; schedule-free AdamW's, whose optimizer also has an
eval_weights() context for evaluation in the run), with constant_lr (why its lr must not decay).

The optimizers themselves live beside this file (lion.py, muon.py, schedule_free.py), imported
only when built: this module imports no torch, as the login node's commands need it.

This package imports nothing else of llmtrain (config/rules.py checks names against the table);
`t` below is a config's train section.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .groups import MATRICES_AND_VECTORS, ParamGroup, labelled, param_groups

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class OptimizerKind:
    build: Callable[[list, Any, "torch.device"], "torch.optim.Optimizer"]
    settings: Callable[["torch.optim.Optimizer", Any], None]  # the config's, after a resume
    skips_on_device: bool  # step() honours a 0-dim `found_inf` on the device (see above)
    state_bytes: int  # optimizer state per trainable parameter
    about: str = ""  # the state, in llmtrain estimate's breakdown
    title: str = ""  # its name in the start-up log line
    args: tuple[str, ...] = ()  # the keys train.optimizer_args may set
    groups: tuple[ParamGroup, ...] = MATRICES_AND_VECTORS  # its param groups, in order (groups.py)
    eval_shift: Callable[[Any], dict] | None = None  # train section -> {"state", "weight"}: to_eval_weights
    constant_lr: str = ""  # why its lr must not decay, where it must not (config/rules.py's check)
    must_match: tuple[str, ...] = ()  # train keys its state was made under, that a resume must keep


def _adamw(groups: list, t, device: "torch.device") -> "torch.optim.Optimizer":
    import torch
    # The fused kernel exists for CUDA and CPU, and reads found_inf; foreach is the fallback
    # elsewhere, and ignores it (_check_skips catches that).
    return torch.optim.AdamW(groups, lr=lr_at(0, t), fused=device.type in ("cuda", "cpu"))


def _adamw_settings(optimizer: "torch.optim.Optimizer", t) -> None:
    for group in optimizer.param_groups:
        group["betas"], group["eps"] = (t.beta1, t.beta2), t.eps


def _lion(groups: list, t, device: "torch.device") -> "torch.optim.Optimizer":
    from .lion import Lion
    return Lion(groups, lr=lr_at(0, t))


def _lion_settings(optimizer: "torch.optim.Optimizer", t) -> None:
    betas = tuple(t.optimizer_args.get("betas", (0.9, 0.99)))  # the paper's
    for group in optimizer.param_groups:
        group["betas"] = betas


def _muon(groups: list, t, device: "torch.device") -> "torch.optim.Optimizer":
    from .muon import Muon
    return Muon(groups, lr=lr_at(0, t))


# Muon orthogonalises the hidden matrices' updates (each expert's apart); AdamW steps the
# embeddings, head and MoE routers (the standard split: with the matrices' weight decay) and the vectors.
MUON_GROUPS = (ParamGroup("hidden", ("matrix:*",), state_bytes=4),  # 1 fp32 momentum
               ParamGroup("embeddings and head", ("embedding:*", "head:*", "router:*")),
               ParamGroup("vectors", ("*",)))


def _muon_settings(optimizer: "torch.optim.Optimizer", t) -> None:
    args = t.optimizer_args
    for name, group in named_groups(optimizer, t).items():
        group["muon"] = name == "hidden"  # muon.py's step: orthogonalised, or AdamW's
        group["lr_scale"] = 1.0 if group["muon"] else float(args.get("adamw_lr_scale", 1.0))
        group["momentum"] = float(args.get("momentum", 0.95))
        group["ns_steps"] = int(args.get("ns_steps", 5))
        group["betas"], group["eps"] = (t.beta1, t.beta2), t.eps


def _schedulefree(groups: list, t, device: "torch.device") -> "torch.optim.Optimizer":
    from .schedule_free import AdamWScheduleFree
    return AdamWScheduleFree(groups, lr=lr_at(0, t))


def _schedulefree_shift(t) -> dict:
    # x = lerp(y, z, 1 - 1/beta1): the parameters (y) towards the state's z
    return {"state": "z", "weight": 1 - 1 / t.beta1}


OPTIMIZERS: dict[str, OptimizerKind] = {
    "adamw": OptimizerKind(_adamw, _adamw_settings, skips_on_device=True, state_bytes=8, title="AdamW",
                           about="AdamW: 2 fp32 moments per trainable parameter"),
    "lion": OptimizerKind(_lion, _lion_settings, skips_on_device=True, state_bytes=4, title="Lion",
                          about="Lion: 1 fp32 momentum per trainable parameter", args=("betas",)),
    "muon": OptimizerKind(_muon, _muon_settings, skips_on_device=True, state_bytes=8, title="Muon",
                          about="Muon: 1 fp32 momentum per hidden-matrix parameter, AdamW's 2 moments "
                                "on embeddings, head and norms",
                          args=("momentum", "ns_steps", "adamw_lr_scale"), groups=MUON_GROUPS),
    "adamw_schedulefree": OptimizerKind(
        _schedulefree, _adamw_settings, skips_on_device=True, state_bytes=8, title="schedule-free AdamW",
        about="schedule-free AdamW: z and the second moment, fp32, per trainable parameter",
        eval_shift=_schedulefree_shift, constant_lr="its evaluated weights are an average of the iterates",
        must_match=("beta1",)),  # y mixes z and x by beta1
}


def build_optimizer(model: "torch.nn.Module", t, device: "torch.device") -> "torch.optim.Optimizer":
    """train.optimizer over the model's trainable parameters, in its entry's groups: weight decay
    on matrices only."""
    kind = OPTIMIZERS[t.optimizer]
    if kind.skips_on_device:
        _check_skips(t, device)
    optimizer = kind.build(param_groups(kind.groups, labelled(model)), t, device)
    apply_settings(optimizer, t)
    return optimizer


def named_groups(optimizer: "torch.optim.Optimizer", t) -> dict[str, dict]:
    """The optimizer's param groups by their names in its entry's table (build_optimizer made them
    in the table's order; a resume keeps it: groups.py)."""
    names = [group.name for group in OPTIMIZERS[t.optimizer].groups]
    assert len(names) == len(optimizer.param_groups), (names, len(optimizer.param_groups))
    return dict(zip(names, optimizer.param_groups))


def _bytes_per_param(kind: OptimizerKind, group: ParamGroup) -> int:
    return group.state_bytes if group.state_bytes is not None else kind.state_bytes


def state_bytes(name: str, trainable: int, hidden_matrices: int) -> float:
    """The optimizer state of `trainable` parameters, `hidden_matrices` of them in the hidden
    matrices (what Muon orthogonalises; the rest: embeddings, head, norms, biases): for the
    estimator, which knows the model's shape, not its parameters."""
    kind = OPTIMIZERS[name]
    hidden = next(group for group in kind.groups if group.takes("matrix:"))  # any hidden matrix's label
    return _bytes_per_param(kind, hidden) * hidden_matrices + kind.state_bytes * (trainable - hidden_matrices)


def held_state_bytes(optimizer: "torch.optim.Optimizer", t) -> int:
    """The state a built optimizer holds once it has stepped (what a checkpoint writes of it):
    each group's parameters at that group's bytes."""
    kind = OPTIMIZERS[t.optimizer]
    by_name = {group.name: group for group in kind.groups}
    return sum(_bytes_per_param(kind, by_name[name]) * p.numel()
               for name, group in named_groups(optimizer, t).items() for p in group["params"])


def apply_settings(optimizer: "torch.optim.Optimizer", t) -> None:
    """The config's weight decay and the optimizer's own settings, on a new optimizer and after
    a resume: loading a checkpoint restores the saved param_groups, and the config must win.
    Matrices decay, vectors (biases, norms) do not."""
    for group in optimizer.param_groups:
        group["weight_decay"] = t.weight_decay if group["params"] and group["params"][0].ndim >= 2 else 0.0
    OPTIMIZERS[t.optimizer].settings(optimizer, t)


@contextlib.contextmanager
def eval_weights(optimizer: "torch.optim.Optimizer"):
    """The weights to evaluate in the parameters inside (schedule-free's average); for the
    others the parameters are those weights, and nothing changes."""
    with getattr(optimizer, "eval_weights", contextlib.nullcontext)():
        yield


def checkpoint_meta(t) -> dict:
    """What the optimizer adds to a checkpoint's meta.json: where the parameters are not the
    weights to evaluate, its entry's eval_shift (read back by to_eval_weights)."""
    shift = OPTIMIZERS[t.optimizer].eval_shift
    return {} if shift is None else {"eval_shift": shift(t)}


def to_eval_weights(meta: dict, tensors: dict, read_state: Callable[[str], dict]) -> dict:
    """`tensors` (parameters by name, read from a checkpoint whose meta.json is `meta`; changed in
    place) as the weights to evaluate, as the optimizer's eval_weights() makes them in the run:
    schedule-free's x, each parameter (y) moved towards its state's z. read_state(key): the
    optimizer state tensor `key` of each of `tensors` that has one, by name; called only where
    the checkpoint's optimizer needs it."""
    shift = meta.get("eval_shift")
    if shift is None:
        return tensors
    import torch
    with torch.no_grad():
        for name, state in read_state(shift["state"]).items():
            tensors[name].lerp_(state.to(tensors[name].dtype), shift["weight"])
    return tensors


def _check_skips(t, device: "torch.device") -> None:
    """One step of the optimizer over a scratch matrix and vector with `found_inf` set: it must
    leave both as they were, as its entry declares (Muon: the matrix is its own part, the vector
    its AdamW part)."""
    import torch
    params = [torch.nn.Parameter(torch.ones(4, 4, device=device)), torch.nn.Parameter(torch.ones(4, device=device))]
    for param in params:
        param.grad = torch.ones_like(param)
    groups = param_groups(OPTIMIZERS[t.optimizer].groups, [("matrix:probe.weight", params[0]),
                                                           ("vector:probe.bias", params[1])])
    probe = OPTIMIZERS[t.optimizer].build(groups, t, device)
    apply_settings(probe, t)
    probe.found_inf = torch.ones((), device=device)
    probe.step()
    if not all(torch.equal(p.detach(), torch.ones_like(p)) for p in params):
        raise RuntimeError(f"optimizer {t.optimizer!r} applied a step that found_inf marked to skip, on "
                           f"{device.type}; its OPTIMIZERS entry must declare skips_on_device=False")


def lr_at(step: int, t) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then train.lr_schedule:
    cosine to min_lr over the remaining steps; wsd (warmup-stable-decay) lr until the last
    decay_fraction of max_steps, then linear to min_lr at the last step; constant lr."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    schedule = getattr(t, "lr_schedule", "cosine")
    if schedule == "constant":
        return t.lr
    if schedule == "wsd":
        decay = max(1, round(t.decay_fraction * t.max_steps))
        start = t.max_steps - decay  # the first decaying step
        if step < start:
            return t.lr
        return t.lr + (t.min_lr - t.lr) * min(1.0, (step - start + 1) / decay)
    progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def describe(optimizer: "torch.optim.Optimizer", t) -> str:
    """The start-up log line: the optimizer, which parameters each of its parts takes, the lr and
    the schedule, e.g. 'optimizer: Muon on the hidden matrices (12,582,912 parameters), AdamW at
    lr x 1 on the embeddings, head, norms and biases (1,050,624); lr 0.003, weight decay 0.1;
    schedule: 100 warmup steps, then wsd: 0.003 until step 800, linear to 0.0003 at step 1000'."""
    groups, title = named_groups(optimizer, t), OPTIMIZERS[t.optimizer].title
    count = lambda names: f"{sum(p.numel() for n in names for p in groups[n]['params']):,}"  # noqa: E731
    if "hidden" in groups:  # Muon's: its own step on the hidden matrices, AdamW's on the rest
        parts = (f"{title} on the hidden matrices ({count(['hidden'])} parameters), AdamW at lr x "
                 f"{groups['vectors'].get('lr_scale', 1.0):g} on the embeddings, head, norms and biases "
                 f"({count(['embeddings and head', 'vectors'])})")
    else:
        parts = f"{title} on {count(groups)} trainable parameters"
    return f"optimizer: {parts}; lr {t.lr:g}, weight decay {t.weight_decay:g}; schedule: {describe_schedule(t)}"


def describe_schedule(t) -> str:
    """lr_at's schedule in words, by optimizer step (1-based: as the log counts them)."""
    warmup = f"{t.warmup_steps} warmup steps, then " if t.warmup_steps else ""
    schedule = getattr(t, "lr_schedule", "cosine")
    if schedule == "constant":
        return f"{warmup}constant"
    if schedule == "wsd":
        decay = max(1, round(t.decay_fraction * t.max_steps))
        return (f"{warmup}wsd: {t.lr:g} until step {t.max_steps - decay}, linear to {t.min_lr:g} at step "
                f"{t.max_steps}")
    return f"{warmup}cosine to {t.min_lr:g} at step {t.max_steps}"


def set_lr(optimizer: "torch.optim.Optimizer", lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
