"""Pipeline parallel: a Hugging Face decoder cut into stages of consecutive layers, one a rank
(or several: interleaved 1F1B), a step's micro-batches run through them by torch's pipelining
schedules (1F1B, GPipe, interleaved 1F1B).

    keep_stage(model, layout)             # on the meta skeleton: what this rank does not hold goes
    pipe = Pipeline(model, head, cfg, layout, scaler, device)   # once wrapped (FSDP2) and allocated
    pipe.start(log.info)                  # the start-up lines; the measured idle share at step 2
    loss = pipe.forward_backward(micro_batches, normaliser)     # Step's, under the schedule
    norm = pipe.over_stages(total_grad_norm(params))             # over every stage's parameters
    total = pipe.loss_sum(batch)          # evaluation: forward only, the summed loss

A rank keeps the whole model's skeleton and its parameter names: the decoder layers it does not
own are replaced in place by `Absent` (no parameters, passes the hidden states through), as are
the embedding on every rank but the first stage's and the final norm and head on every rank but
the last stage's. So checkpoints (DCP, by parameter name) hold one model whatever pp was, resume
under another pp, and export as one folder. A stage's forward is the model's own: the first stage
takes token ids, the others the hidden states the stage before sent (HF's `inputs_embeds`; under
tensor parallel each rank's slice of the sequence), and each builds its attention mask and rotary
positions from the micro-batch's positions (schedules split every tensor along the batch only, so
document boundaries reach every stage). Where a rank holds several stages, each is a view of its
one model (_Part) with only that stage's layers in place for the call.

Stages are cut by cost: the embedding and the head count as one layer each, and the n + 2 units are
split as evenly as consecutive runs allow (stage_bounds).

The loss stays exact: the schedule sums the micro-batches' losses without scaling them
(scale_grads=False), each micro-batch's loss being its summed cross-entropy over the step's
normaliser, as without a pipeline (training/step.py). The last stage computes it; one all-reduce
over the pipeline's group gives every stage the step's loss and the gradient norm summed over
stages (before the clip), so the non-finite skip and the logged loss agree on every rank.

A Mixture-of-Experts model's load-balancing loss is one formula over every layer's routing
(transformers'), so no stage can compute its share: each stage adds its layers' router
statistics to a small vector sent on beside the hidden states, and the last stage's loss takes
the whole model's (Pipeline._routed).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..model.attention import attention_mask
from ..model.build import Absent, unwrap
from ..model.loss import IGNORE, hidden_loss, lm_targets, real_tokens
from ..model.moe import balancing_loss
from .dims import PIPELINE_SCHEDULES, Layout

SCHEDULE_CLASSES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved_1f1b": "Interleaved1F1B"}  # -> torch's name
assert set(SCHEDULE_CLASSES) == set(PIPELINE_SCHEDULES)


def stage_bounds(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """Each stage's decoder layers [start, end), by cost: the embedding (first stage) and the head
    (last) weigh one layer each, and the n_layers + 2 units are cut into `stages` consecutive runs
    whose sizes differ by at most one (the earlier stages take the larger: they hold more
    micro-batches' activations under 1F1B, but the head's logits weigh on the last)."""
    units, bounds, start = n_layers + 2, [], 0
    for s in range(stages):
        size = units // stages + (1 if s < units % stages else 0)
        end = start + size
        bounds.append((max(0, start - 1), min(n_layers, end - 1)))  # unit u is layer u - 1
        start = end
    return bounds


def stages_of(layout: Layout) -> list[int]:
    """The stages this rank holds: its pipeline coordinate r, and with v stages a rank (interleaved
    schedules) r + pp, r + 2 pp, ... (looped placement)."""
    r, pp = layout.coordinate("pp"), layout.dims.pipeline
    return [r + k * pp for k in range(layout.dims.stages_per_rank)]


def keep_stage(model: torch.nn.Module, layout: Layout) -> list[tuple[int, int]]:
    """Replace, in place on the (meta) skeleton, what this rank's stages do not hold by Absent:
    the other stages' decoder layers, the embedding unless it holds the first stage, the final
    norm and the head unless the last. Returns its stages' layers [start, end). Refuses a model
    the layout cannot pipeline (its family, too few layers, a tied head) in one line each."""
    config = model.config
    problems = layout.dims.model_problems(config.model_type, config.to_dict())
    problems = [line for line in problems if line.startswith("parallel.pp")]
    if problems:
        raise ConfigError(problems)
    mine, total = stages_of(layout), layout.dims.pipeline * layout.dims.stages_per_rank
    bounds = [stage_bounds(config.num_hidden_layers, total)[s] for s in mine]
    inner = model.model
    for i in range(len(inner.layers)):
        if not any(start <= i < end for start, end in bounds):
            inner.layers[i] = Absent()
    if 0 not in mine:
        inner.embed_tokens = Absent()
    if total - 1 not in mine:
        inner.norm = Absent()
        model.lm_head = Absent()
    return bounds


def _stage_forward(model, x: torch.Tensor, positions: torch.Tensor | None = None, first: bool = True,
                   seq: int = 0, tp: int = 1):
    """One stage's forward: token ids (the first stage) or the hidden states the stage before sent
    (under tensor parallel this rank's slice of the sequence), through this stage's layers (HF's
    own forward; the others pass through); the hidden states on (the last stage: the head's
    output, or the final hidden states where the loss applies the head itself). `seq`: the
    sequence's length (every row is seq_len wide under pp)."""
    extra = {"attention_mask": attention_mask(model, positions, seq, x.device)}
    if positions is not None:
        extra["position_ids"] = positions
    elif tp > 1:  # HF would count this rank's slice of the sequence
        extra["position_ids"] = torch.arange(seq, device=x.device)[None]
    inputs = {"input_ids": x} if first else {"inputs_embeds": x}
    return type(model).forward(model, **inputs, **extra).logits


ABSENT = Absent()


class _Part(torch.nn.Module):
    """One of several stages a rank holds (interleaved schedules): the model's forward with only
    this stage's layers (and the final norm and head only on the last stage) in place for the
    call; the rank's other stages' layers pass through meanwhile. Holds its layers as submodules
    so that its parameters are its stage's (the model keeps the names)."""

    def __init__(self, model, bounds: tuple[int, int], first: bool, last: bool):
        super().__init__()
        inner = model.model
        self.start, self.end, self.first, self.last = *bounds, first, last
        self.held = torch.nn.ModuleList([inner.layers[i] for i in range(*bounds)])
        self._model = [model]  # not a submodule: its parameters are the rank's, not this stage's

    def forward(self, x: torch.Tensor, *routed, **kwargs):
        model = self._model[0]
        inner = model.model
        away = [(inner.layers._modules, str(i)) for i in range(len(inner.layers)) if not self.start <= i < self.end]
        if not self.last:
            away += [(inner._modules, "norm"), (model._modules, "lm_head")]
        kept = [(where, key, where[key]) for where, key in away]
        for where, key, _ in kept:
            where[key] = ABSENT
        try:
            return model(x, *routed, first=self.first, **kwargs)
        finally:
            for where, key, module in kept:
                where[key] = module


class Pipeline:
    """This rank's stages and the schedule that runs a step's micro-batches through all stages."""

    def __init__(self, model: torch.nn.Module, head, cfg, layout: Layout, scaler, device: torch.device,
                 routers=None):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        self.cfg, self.layout, self.head, self.scaler = cfg, layout, head, scaler
        self.routers = routers  # model/moe.Routers of this rank's layers: a Mixture-of-Experts model
        self.routed, self.aux, self.routing = [], [], None
        self.mine, self.stages = stages_of(layout), layout.dims.pipeline * layout.dims.stages_per_rank
        self.first, self.last = 0 in self.mine, self.stages - 1 in self.mine
        self.model, self.device = model, device
        inner = unwrap(model)
        self.seq = cfg.data.seq_len
        forward = functools.partial(_stage_forward, inner, seq=self.seq, tp=layout.dims.tensor)
        if routers is not None:
            forward = functools.partial(self._routed, forward)
        inner.forward = forward
        self.group = layout.mesh("pp").get_group()
        self.accum = layout.dims.accumulation(cfg.train.global_batch_size, cfg.train.micro_batch_size)
        self.normaliser, self.factor, self.losses = 1.0, 1.0, []
        self.training, self.steps, self.log = True, 0, None
        self.bounds = [stage_bounds(inner.config.num_hidden_layers, self.stages)[s] for s in self.mine]

        def stages():
            if len(self.mine) == 1:  # the model itself: FSDP2's reduction deferred to the last micro-batch
                inner.forward = functools.partial(forward, first=self.first)
                return PipelineStage(model, self.mine[0], self.stages, device, group=self.group)
            return [PipelineStage(_Part(inner, b, s == 0, s == self.stages - 1), s, self.stages, device,
                                  group=self.group) for s, b in zip(self.mine, self.bounds)]

        schedule = get_schedule_class(SCHEDULE_CLASSES[cfg.parallel.pp_schedule])
        self.schedule = schedule(stages(), n_microbatches=self.accum, loss_fn=self._loss, scale_grads=False)
        # evaluation: forward only, one micro-batch a call (its rows padded to micro_batch_size:
        # a stage's shapes are fixed once inferred), on stages of its own
        evaluation = get_schedule_class("GPipe" if len(self.mine) == 1 else "LoopedBFS")
        self.eval_schedule = evaluation(stages(), n_microbatches=1, loss_fn=self._loss, scale_grads=False)

    def start(self, log: Callable[[str], None], watch=None) -> None:
        """The start-up lines (this rank's stages, the schedule's bubble, a warning where the
        micro-batches are too few); `log` also gets the measured idle share of every stage after
        the second step (the first infers the stages' shapes and compiles). `watch`
        (training/watchdog.Watchdog): its diagnosis of a stuck collective names each rank's stages."""
        self.log = log
        if watch is not None:
            dims = self.layout.dims
            per_coordinate, total = dims.world_size // dims.pipeline, self.stages

            def place(rank: int) -> str:
                held = range(rank // per_coordinate, total, dims.pipeline)
                return f" (pipeline stage{'s' if len(held) > 1 else ''} {', '.join(map(str, held))} of {total})"
            watch.place = place
        for line in [self.describe(), *self.layout.dims.pipeline_warnings(self.cfg)]:
            log(line)

    def bubble(self) -> float:
        """The share of a step each GPU idles while the pipeline fills and drains, on paper:
        (p - 1) / (v m + p - 1) for m micro-batches, p ranks and v stages a rank (v = 1: 1F1B,
        GPipe); stages of equal cost and sends taking no time."""
        p, v = self.layout.dims.pipeline, len(self.mine)
        return (p - 1) / (v * self.accum + p - 1)

    def describe(self) -> str:
        """The start-up line: this rank's stages and what they hold."""
        parts = []
        for s, (start, end) in zip(self.mine, self.bounds):
            held = (["the embedding"] if s == 0 else []) + ([f"layers {start}-{end - 1}"] if end > start else [])
            held += ["the final norm and head"] if s == self.stages - 1 else []
            parts.append(f"stage {s} of {self.stages} ({', '.join(held)})")
        return (f"pipeline: {'; '.join(parts)}; schedule {self.cfg.parallel.pp_schedule}, {self.accum} "
                f"micro-batches of {self.cfg.train.micro_batch_size} a step (bubble {self.bubble():.0%} of a step "
                f"on paper)")

    def _routed(self, forward, x: torch.Tensor, summed: torch.Tensor | None = None, *, real=None, **kwargs):
        """A Mixture-of-Experts stage's forward: its output and the router statistics summed over
        every MoE layer so far (model/moe.Routers.summed, [1, 2 E + 1]; the first stage starts
        from zeros), which travel to the last stage with the hidden states. There the
        load-balancing loss is transformers' over all layers (one formula over every layer's
        statistics: no stage's share of it stands alone), and its gradient comes back to each
        stage's routers with the hidden states'. Training forwards collect (`real`: this
        micro-batch's tokens that are not padding); the tokens per expert of each wait in
        self.routed for the step's metrics."""
        training = torch.is_grad_enabled()
        with self.routers.collecting(real) if training else contextlib.nullcontext():
            out = forward(x, **kwargs)
        mine, counts = self.routers.summed(x.device)
        if training:
            self.routed.append((self.routers.fired, counts.detach()))
        return out, mine[None] if summed is None else summed + mine[None]

    def _loss(self, out, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss on the last stage: its summed cross-entropy over the step's
        normaliser (training: scaled for fp16 and by the fault injector's factor), plus, for a
        Mixture-of-Experts model, its load-balancing loss at its weight, a share of the step's
        (as training/step.Step; not in the returned loss either)."""
        out, summed = out if self.routers is not None else (out, None)
        loss = hidden_loss(out, targets, self.head, self.normaliser) * self.factor
        self.losses.append(loss.detach())
        if summed is not None and self.training:
            moe = self.routers.moe
            aux = balancing_loss(summed[0], moe.experts)
            self.aux.append(aux.detach())
            loss = loss + aux * (moe.aux_coef * self.factor / self.accum)
        return self.scaler.scale(loss) if self.training else loss

    def _run(self, schedule, tokens, targets, positions, n: int, real=None) -> torch.Tensor:
        """One call of `schedule` over a rank's batch of `n` micro-batches; returns the sum of their
        losses, the same on every stage (the last stage's, by one all-reduce over the pipeline group).
        A Mixture-of-Experts model's training step (`real`: its tokens that are not padding) also
        leaves self.routing, as Step.routing: the step's load-balancing loss, on every stage, and
        this rank's tokens per expert."""
        self.losses, self.aux, self.routed = [], [], []
        args = (tokens,) if self.first else ()
        kwargs = {"positions": positions} if positions is not None else {}
        if self.routers is not None:
            kwargs["real"] = real
        run = schedule.step if self.training else schedule.eval
        run(*args, target=targets if self.last else None, **kwargs)
        # the last n: a stage's first call infers its shapes with one more forward, on empty tensors
        losses = self.losses[-n:] if self.last else []
        total = torch.stack(losses).sum() if losses else torch.zeros((), device=tokens.device)
        if self.routers is None or not self.training:
            dist.all_reduce(total, group=self.group)  # only the last stage's is not zero
            return total
        aux = torch.stack(self.aux[-n:]).sum() / n if self.last else torch.zeros((), device=tokens.device)
        both = torch.stack([total, aux])
        dist.all_reduce(both, group=self.group)  # one collective for the loss and the routers' loss
        self.routing = (both[1], self._tokens_per_expert(n))
        return both[0]

    def _tokens_per_expert(self, n: int) -> torch.Tensor:
        """The step's tokens per expert of this rank's MoE layers, in a [decoder layers, E] table
        (zero rows: the other stages' layers and dense ones): the table summed over every rank is
        the model's, as without a pipeline (training/report.py sums them)."""
        moe, model = self.routers.moe, unwrap(self.model)
        table = torch.zeros(model.config.num_hidden_layers, moe.experts, device=self.device)
        for fired, counts in self.routed[-n * len(self.mine):]:  # each stage's n micro-batches
            table[fired] += counts
        return table

    def forward_backward(self, micro_batches, normaliser: float, loss_factor: float = 1.0):
        """The step's forward and backward under the schedule: returns this rank's part of the step's
        loss (as Step.forward_backward). Gradients are reduced by FSDP2 at the last micro-batch's
        backward (the stage tells it)."""
        self.normaliser, self.factor, self.training = max(normaliser, 1e-9), loss_factor, True
        real = _real(micro_batches, self.seq) if self.routers is not None else None  # before the rows widen
        micro_batches = [_full_width(b, self.seq) for b in micro_batches]
        tokens = torch.cat([b.tokens for b in micro_batches])
        self.steps += 1
        with self._timed(self.steps == 2 and self.log is not None) as busy:
            total = self._run(self.schedule, tokens[:, :-1], _targets(micro_batches), _positions(micro_batches),
                              len(micro_batches), real)
        if busy:
            self._report_idle(busy)
        return total

    @contextlib.contextmanager
    def _timed(self, on: bool):
        """Times this rank's stages' forward and backward chunks (the device synchronised around
        each: one step only) and the whole step; yields [busy seconds, step seconds] (empty: off)."""
        if not on:
            yield []
            return
        stages = getattr(self.schedule, "_stages", None) or [self.schedule._stage]
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        busy = [0.0, 0.0]

        def timed(fn):
            def call(*args, **kwargs):
                sync()
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    sync()
                    busy[0] += time.perf_counter() - start
            return call

        for stage in stages:
            stage.forward_one_chunk, stage.backward_one_chunk = (timed(stage.forward_one_chunk),
                                                                 timed(stage.backward_one_chunk))
        sync()
        start = time.perf_counter()
        try:
            yield busy
        finally:
            sync()
            busy[1] = time.perf_counter() - start
            for stage in stages:
                del stage.forward_one_chunk, stage.backward_one_chunk  # the class's methods again

    def _report_idle(self, busy: list[float]) -> None:
        """Each stage's measured idle share of the timed step (one all-gather over the pipeline's
        ranks), logged by every rank."""
        idle = torch.tensor([max(0.0, 1 - busy[0] / max(busy[1], 1e-9))], device=self.device)
        shares = [torch.zeros_like(idle) for _ in range(self.layout.dims.pipeline)]
        dist.all_gather(shares, idle, group=self.group)
        per_rank = ", ".join(f"rank {r} {float(x):.0%}" for r, x in enumerate(shares))
        self.log(f"pipeline: idle share of step 2 by pipeline rank (measured, the device synchronised around "
                 f"each stage's work): {per_rank}; {self.bubble():.0%} on paper")

    @torch.no_grad()
    def loss_sum(self, batch) -> torch.Tensor:
        """An evaluation batch's summed loss (normaliser 1), forward only through the stages; the
        batch's rows padded to train.micro_batch_size with untrained rows."""
        self.normaliser, self.factor, self.training = 1.0, 1.0, False
        try:
            batch = _full_width(batch, self.seq)
            rows, mb = batch.tokens.shape[0], self.cfg.train.micro_batch_size
            tokens, targets, positions = batch.tokens[:, :-1], _targets([batch]), _positions([batch])
            if rows < mb:
                pad = mb - rows
                tokens = torch.cat([tokens, tokens[:1].expand(pad, -1)])
                targets = torch.cat([targets, torch.full_like(targets[:1], IGNORE).expand(pad, -1)])
                if positions is not None:
                    positions = torch.cat([positions, positions[:1].expand(pad, -1)])
            return self._run(self.eval_schedule, tokens, targets, positions, 1, torch.ones_like(targets, dtype=torch.bool))
        finally:
            self.training = True

    def over_stages(self, norm: torch.Tensor) -> torch.Tensor:
        """The gradient norm over every stage's parameters from this stage's (`norm`, over its
        FSDP2 shards: training/step.total_grad_norm): squared, summed over the pipeline group."""
        squared = norm.float() ** 2
        dist.all_reduce(squared, group=self.group)
        return squared.sqrt()


def _full_width(batch, seq: int):
    """`batch` with rows of seq + 1 tokens: a stage's shapes are fixed once inferred, and unpacked
    fine-tuning rows are cut to their batch's longest sample (data/loader.py). The tail is not
    trained and is its own document (positions from 0), so it changes no loss and no attention."""
    n, width = batch.tokens.shape
    if width == seq + 1:
        return batch
    pad = seq + 1 - width
    tokens = torch.cat([batch.tokens, batch.tokens.new_zeros((n, pad))], dim=1)
    trained = batch.trained if batch.trained is not None else torch.ones_like(batch.tokens, dtype=torch.bool)
    trained = torch.cat([trained, trained.new_zeros((n, pad))], dim=1)
    tail = torch.arange(pad, device=batch.tokens.device).expand(n, pad)
    positions = (batch.positions if batch.positions is not None
                 else torch.arange(width, device=batch.tokens.device).expand(n, width))
    return type(batch)(tokens=tokens, trained=trained, positions=torch.cat([positions, tail.to(positions.dtype)], dim=1))


def _targets(micro_batches) -> torch.Tensor:
    return torch.cat([lm_targets(b) for b in micro_batches])


def _real(micro_batches, seq: int) -> torch.Tensor:
    """The input tokens that are not padding (model/loss.real_tokens: every one where none is),
    [rows, seq]: the tail _full_width adds is padding too."""
    rows = []
    for b in micro_batches:
        real = real_tokens(b)
        real = torch.ones_like(b.tokens[:, 1:], dtype=torch.bool) if real is None else real
        rows.append(torch.nn.functional.pad(real, (0, seq - real.shape[1]), value=False))
    return torch.cat(rows)


def _positions(micro_batches) -> torch.Tensor | None:
    if micro_batches[0].positions is None:
        return None
    return torch.cat([b.positions[:, :-1] for b in micro_batches])


def summed_over_stages(counts: list[int], layout: Layout, device) -> list[int]:
    """Counts each stage makes of its own part (parameters, trainable ones) summed over the
    pipeline's stages: the whole model's, for the start-up line and the FLOPs per token."""
    if layout.dims.pipeline <= 1:
        return counts
    t = torch.tensor(counts, dtype=torch.int64, device=device)
    dist.all_reduce(t, group=layout.mesh("pp").get_group())
    return [int(x) for x in t.tolist()]
