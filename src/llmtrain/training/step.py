"""One optimizer step's arithmetic, apart from the loop that schedules it.

    step = Step(model, head, optimizer, scaler, cfg)
    loss, grad_norm = step.forward_backward(micro_batches, normaliser)   # gradients reduced
    agreement = control.agree(n, step.finite(loss, grad_norm))           # one all-reduce
    step.update(agreement.nonfinite, lambda: agreement.read().nonfinite) # update, or skip it

A non-finite step is skipped on every rank without the host waiting for the device where it
can be: the optimizer reads the step's agreed flag (`found_inf`, a 0-dim device tensor) in its
own kernel (optimizers/: skips_on_device). Where it cannot (an optimizer that ignores the flag;
fp16, whose loss scaler decides on the host), the host reads the flag and skips step() itself.
Whatever changes the weights (an update, a load, the evaluation weights) calls weights_changed:
FP8 weights gathered in float8 get their scales for the new weights there (parallel/float8.py).
Runs in one process without torchrun (tests/test_step.py).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..config import Config
from ..model.build import unwrap
from ..model.loss import lm_loss
from ..model.moe import MoE, Routers, moe_layers
from ..parallel import float8
from ..parallel.pipeline import Pipeline
from ..parallel.tensor import sum_partial_grads
from ..parallel.precision import autocast
from ..parallel.wrap import gradient_sync, reshard
from ..optimizers import OPTIMIZERS, eval_weights


def no_phase(name: str):
    return contextlib.nullcontext()


def by_mesh(params) -> dict:
    """The parameters with gradients, by the DeviceMesh their gradients live on (None: plain
    tensors). One mesh, but for an MoE model under tensor parallel: its MoE layers' weights are
    FSDP2's alone (parallel/tensor.py leaves them whole over the tp group), the rest FSDP2 x tp's;
    torch's norm and clip stack a list's norms, which DTensor refuses across meshes."""
    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return groups


def total_grad_norm(params) -> torch.Tensor:
    """The global 2-norm of the gradients (FSDP2's, DTensors: their norm's full_tensor)."""
    norms = []
    for group in by_mesh(params).values():
        n = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


class Step:
    def __init__(self, model, head, optimizer, scaler: torch.amp.GradScaler, cfg: Config, layout=None):
        self.model, self.head, self.optimizer, self.scaler, self.cfg = model, head, optimizer, scaler, cfg
        self.layout = layout  # parallel/dims.Layout: which part of every sequence this rank computes (lm_loss)
        # Who decides a skip: the device (the optimizer reads the flag), or the host.
        self.host_decides = scaler.is_enabled() or not OPTIMIZERS[cfg.train.optimizer].skips_on_device
        self.float8_scales = float8.precomputes_scales(model)  # FSDP2 gathers weights in float8
        # A Mixture-of-Experts model's routers: the load-balancing loss joins the training loss
        config = unwrap(model).config
        self.moe = MoE.of(config, cfg.train.router_aux_loss_coef)
        self.routers = Routers(unwrap(model), self.moe) if self.moe is not None else None
        pipelined = layout is not None and layout.dims.pipeline > 1
        # every layer dense (mlp_only_layers), or, under a pipeline, every layer of the model's
        if self.routers is not None and not (moe_layers(config.to_dict()) if pipelined else self.routers.layers):
            self.routers.remove()
            self.routers = None
        self.routing = None  # the last step's (load-balancing loss, tokens per expert [layers, E])
        self.pipeline = None  # parallel/pipeline.py: this rank's stage and the schedule, where pp > 1
        if pipelined:
            self.pipeline = Pipeline(model, head, cfg, layout, scaler, next(model.parameters()).device, self.routers)

    def forward_backward(self, micro_batches, normaliser: float, loss_factor: float = 1.0, norm: bool = True,
                         phase=no_phase) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's micro-batches (on the device) and their gradients, reduced across ranks (see
        gradient_sync); returns (this rank's part of the step's loss, global gradient norm before
        clipping). The norm is computed where it is used: to clip, or to log (`norm`); else None.

        The step's loss is the mean over all its trained targets, every rank's and micro-batch's:
        each micro-batch's summed loss is divided by `normaliser`, the step's count of trained
        targets over the data-parallel degree times the context-parallel one (the gradient reduction
        averages over those ranks: ParallelDims.loss_ranks).
        So neither the micro-batch size, the accumulation nor the world size changes it, however
        unevenly the trained tokens fall; the mean over ranks of what this returns is that loss.
        `phase`: the profiler's labels (training/profiling.py)."""
        model, cfg, total = self.model, self.cfg, None
        self.routing = None
        if self.pipeline is not None:
            return self._pipelined(micro_batches, normaliser, loss_factor, norm, phase)
        for i, batch in enumerate(micro_batches):
            with gradient_sync(model, i == len(micro_batches) - 1, cfg):
                with phase("forward"), autocast(cfg, batch.tokens.device):
                    loss = lm_loss(model, batch, self.head, max(normaliser, 1e-9), self.layout,
                                   self.routers) * loss_factor
                    objective = loss if self.routers is None else loss + self._balancing(len(micro_batches), loss_factor)
                with phase("backward"):
                    self.scaler.scale(objective).backward()
            total = loss.detach() if total is None else total + loss.detach()
        with phase("optimizer"):
            if self.routers is not None and self.layout is not None and self.layout.dims.tensor > 1:
                sum_partial_grads(unwrap(model), self.layout.mesh("tp"))  # the MoE layers', from each rank's tokens
            self.scaler.unscale_(self.optimizer)
            grad_norm = None
            if cfg.train.grad_clip > 0 or norm:
                grad_norm = total_grad_norm(model.parameters())
            if cfg.train.grad_clip > 0:
                for params in by_mesh(model.parameters()).values():
                    torch.nn.utils.clip_grads_with_norm_(params, cfg.train.grad_clip, grad_norm)
        return total, grad_norm

    def _balancing(self, micro_batches: int, loss_factor: float) -> torch.Tensor:
        """The micro-batch's load-balancing loss at its weight, a share of the step's: the mean over
        micro-batches (and, by the gradient reduction, ranks). Its value and the tokens per expert
        add up in self.routing, on the device."""
        aux, counts = self.routers.take()
        share = aux.detach() / micro_batches
        self.routing = (share, counts) if self.routing is None else (self.routing[0] + share, self.routing[1] + counts)
        # under tensor parallel each rank of the group routes its slice of the sequence, and the
        # group's gradients are summed (parallel/tensor.sum_partial_grads): each slice's loss, a mean
        tp = self.layout.dims.tensor if self.layout is not None else 1
        return aux * (self.moe.aux_coef * loss_factor / micro_batches / tp)

    def _pipelined(self, micro_batches, normaliser: float, loss_factor: float, norm: bool, phase):
        """forward_backward under the pipeline's schedule: the loss from the last stage, on every
        stage; the gradient norm over every stage's parameters, clipped with it."""
        cfg, params = self.cfg, list(self.model.parameters())
        with phase("forward"), autocast(cfg, micro_batches[0].tokens.device):  # and backward: the schedule's
            total = self.pipeline.forward_backward(micro_batches, normaliser, loss_factor)
            self.routing = self.pipeline.routing
        with phase("optimizer"):
            self.scaler.unscale_(self.optimizer)
            grad_norm = None
            if cfg.train.grad_clip > 0 or norm:
                grad_norm = self.pipeline.over_stages(total_grad_norm(params))
            if cfg.train.grad_clip > 0:
                for group in by_mesh(params).values():
                    torch.nn.utils.clip_grads_with_norm_(group, cfg.train.grad_clip, grad_norm)
        return total, grad_norm

    def finite(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor:
        """False when the loss or the gradient norm is NaN/inf. Under fp16 an infinite norm is the
        loss scaler's business (it skips that step and lowers the scale), so only the loss counts;
        with clipping off, steps that do not log have no norm and the loss alone counts."""
        ok = torch.isfinite(loss)
        if self.cfg.train.precision == "fp16" or grad_norm is None:
            return ok
        return ok & torch.isfinite(grad_norm.to(loss.device))

    def update(self, nonfinite: torch.Tensor, read_nonfinite: Callable[[], bool]) -> bool:
        """The optimizer step, or none where the step was non-finite on some rank. `nonfinite`:
        the agreed flag, a 0-dim tensor on the device; `read_nonfinite`: reads it on the host (a
        wait for the device). The device decides where the optimizer can (no wait); else the host
        does. Returns whether the host read the flag."""
        if not self.host_decides:
            self.apply(skip=nonfinite)
            return False
        if read_nonfinite():
            self.skip()
        else:
            self.apply()
        return True

    def apply(self, skip: torch.Tensor | None = None) -> None:
        """One update, or none where `skip` (a 0-dim flag on the device) is 1: the optimizer reads
        it in its kernel (`found_inf`, as the loss scaler uses it), so skipping costs no host wait,
        and neither does weights_changed, which runs either way (the host does not know which)."""
        if skip is not None:
            self.optimizer.found_inf = skip
        self.scaler.step(self.optimizer)
        self.optimizer.found_inf = None
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.weights_changed()

    def skip(self) -> None:
        """The host's skip: no step(), so the weights and what follows them stay; fp16's scaler
        ends the step too (unscale_ ran), with a lower scale."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler.is_enabled():
            self.scaler.update(self.scaler.get_scale() * self.scaler.get_backoff_factor())

    def weights_changed(self) -> None:
        """After the weights change: the scales of the weights FSDP2 gathers in float8, for the
        new weights (one all-reduce, no host wait), where the model has such weights. A scale
        left from other weights would cast the new ones with it silently (clipping those above
        its range); none at all costs one amax all-reduce per weight and all-gather
        (parallel/float8.py)."""
        if self.float8_scales:
            float8.precompute_scales(self.model)

    @contextlib.contextmanager
    def eval_weights(self):
        """The weights to evaluate in the parameters inside (optimizers.eval_weights: schedule-
        free's average; the others' parameters are those weights), the trained ones after, each
        with their own float8 scales; FSDP2 lets go of the evaluated weights it holds gathered
        (a schedule-free FSDP2 run that evaluated trained its next step partly on them: loss
        5.711 for 5.720 without the evaluation, a 2-layer Llama on CPU)."""
        with eval_weights(self.optimizer):
            self.weights_changed()
            yield
            reshard(self.model)
        self.weights_changed()
