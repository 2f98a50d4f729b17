"""What a step leaves behind when its turn comes: the metrics line and the progress line, the
evaluation, the checkpoint; and the outputs they go to (metrics.jsonl, trackers, plots, the
sample log). The loop calls `after` once a step; it returns the verdict that stops the run, if any.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..config import Config
from ..data.loader import SampleRows, TokenStream
from ..data.run import Sampler
from ..metrics import (MetricsWriter, SampleLog, Slowdown, Throughput, peak_flops, peak_memory_gib,
                       progress_line)
from ..model.loss import lm_loss
from ..model.moe import imbalance
from ..parallel.precision import autocast
from ..parallel.wrap import compile_seconds
from ..rundir import Log, RunPaths
from ..tracking import PlotRefresher, open_sinks
from . import distributed
from .control import Control, Verdict
from ..parallel.world import World
from .watchdog import Watchdog


@dataclass(frozen=True)
class Due:
    """What step `step` does besides training: log, evaluate, save (periodic)."""

    logs: bool
    evals: bool
    saves: bool

    @classmethod
    def at(cls, step: int, t, has_validation: bool) -> "Due":
        return cls(due(step, t.log_every, t.max_steps),
                   has_validation and t.eval_every > 0 and due(step, t.eval_every, t.max_steps),
                   t.checkpoint_every > 0 and due(step, t.checkpoint_every, t.max_steps))

    @property
    def reads(self) -> bool:
        """The host reads this step's flags at once (a log line, an evaluation, a save)."""
        return self.logs or self.evals or self.saves


def due(step: int, every: int, last: int) -> bool:
    """Every `every` steps (0: never), and always at the last step."""
    return (every > 0 and step % every == 0) or step == last


class Reporter:
    def __init__(self, cfg: Config, world: World, log: Log, watch: Watchdog, job, control: Control, phase):
        t = cfg.train
        self.cfg, self.world, self.log, self.watch, self.job, self.control = cfg, world, log, watch, job, control
        self.phase = phase  # the profiler's labels (hooks.StepHooks.phase)
        state = job.state
        sinks = []
        if world.is_main and cfg.metrics.trackers:
            with watch.phase("opening trackers"):  # TensorBoard's import, W&B's service: seconds
                sinks = open_sinks(cfg, state.step, log, job.provenance)
        self.metrics = MetricsWriter(RunPaths(cfg.run_dir).metrics if world.is_main else None, state.step, sinks,
                                     warn=log.info, stopping=lambda: control.signal_reason is not None)
        self.plots = (PlotRefresher(cfg.run_dir, log) if world.is_main and cfg.metrics.plot_every_eval
                      else None)
        self.samples = SampleLog(RunPaths(cfg.run_dir).samples(world.rank)
                                 if t.log_samples else None, state.step)
        self.meter = Throughput(t.global_batch_size * cfg.data.seq_len, job.flops_per_step,
                                peak_flops(world.device, t.precision, t.tf32, t.peak_tflops),
                                world.world_size, state.step, t.max_steps)
        self.slowdown = Slowdown()

    def after(self, due: Due, verdicts: list[Verdict], loss, grad_norm, lr: float) -> Verdict | None:
        """The step's log line, evaluation and checkpoint, as due or as a verdict asks; returns
        the verdict that stops the run (after its checkpoint), if one does."""
        cfg, job, watch, log = self.cfg, self.job, self.watch, self.log
        state = job.state
        self.meter.step()
        job.checkpointer.poll()
        if watch.starting:
            log.info(watch.started())
            if cfg.train.compile:
                log.info(f"torch.compile: {compile_seconds():.1f}s compiling in the first step "
                         f"(caches: {os.environ['TORCHINDUCTOR_CACHE_DIR']}, "
                         f"{os.environ['TRITON_CACHE_DIR']})")
        if due.logs:
            with self.phase("log"):
                speed = self.meter.read(state.step)
                log_step(self.metrics, log, speed, state, loss, grad_norm, lr,
                         cfg.train, self.world, job.step.scaler, job.sampler, job.step.routing)
                if warning := self.slowdown.check(speed["tokens_per_sec"], speed["elapsed_s"]):
                    log.info(warning)
        if due.evals:
            with self.meter.paused(), self.control.paused("eval"), self.phase("eval"), job.step.eval_weights():
                record = evaluation(job, cfg, self.world)
            self.metrics.write({"kind": "eval", "step": state.step, **record})
            by_source = "".join(f", {name} {v:.4f}" for name, v in record.get("eval_loss_by_source", {}).items())
            log.info(f"eval step {state.step}: eval_loss {record['eval_loss']:.4f}{by_source}")
            if self.plots:
                self.plots.refresh(state.step)
        stop = next((v for v in verdicts if v.stop), None)
        if due.saves or stop or any(v.save for v in verdicts):
            with self.meter.paused(), self.control.paused("checkpoint"), self.phase("checkpoint"):
                job.checkpointer.save(state.step, job.model, job.optimizer, job.carried())
        return stop

    def close(self, failed: bool) -> None:
        self.samples.close()
        self.metrics.close(failed)

    def finish(self, reason: str, step: int) -> None:
        if self.plots and reason == "done":  # a stopping job's time is the final checkpoint's
            self.plots.refresh(step)  # a run without evaluation is drawn at its end
            self.plots.close()


def log_step(metrics: MetricsWriter, log: Log, speed: dict, state, loss, grad_norm,
             lr: float, t, world: World, scaler, sampler: Sampler, routing=None) -> None:
    """One metrics line and one progress line: the loss averaged over ranks, and the peak memory
    of the rank that uses the most (one collective for all of it). fp16 adds the loss scale: the
    scaler skips a step with inf/NaN gradients by itself and halves it, which shows there. The
    data's position: the epoch fractional in metrics (1.5: halfway through the second), "epoch
    2/3" in the line; a mixture's tokens and epochs per source, in metrics only. A Mixture-of-
    Experts model's `routing` (training/step.py: the step's load-balancing loss and tokens per
    expert per layer, on the device, read here only): `moe_aux_loss` averaged over ranks,
    `expert_imbalance` from every rank's tokens (model/moe.imbalance)."""
    routed = [] if routing is None else [routing[0].item(), *routing[1].flatten().tolist()]
    per_rank = distributed.gather_floats(
        [loss.item(), float(grad_norm), peak_memory_gib(world.device), *routed], world.device)
    peak_rank = max(range(world.world_size), key=lambda r: per_rank[r][2])
    mean_loss = sum(r[0] for r in per_rank) / world.world_size
    moe = {}
    if routing is not None:
        counts = torch.tensor([r[4:] for r in per_rank]).sum(0).view(routing[1].shape)
        moe = {"moe_aux_loss": sum(r[3] for r in per_rank) / world.world_size, "expert_imbalance": imbalance(counts)}
    metrics.write({"kind": "train", "step": state.step, "loss": mean_loss, "lr": lr,
                   "grad_norm": sum(r[1] for r in per_rank) / world.world_size,
                   "tokens": state.tokens, **speed, "peak_mem_gib": per_rank[peak_rank][2],
                   "peak_mem_rank": peak_rank, "skipped_steps": state.skipped,
                   **sampler.position(), **moe,
                   **({"loss_scale": scaler.get_scale()} if scaler.is_enabled() else {})})
    log.info(progress_line(state.step, t.max_steps, mean_loss, lr, speed["tokens_per_sec"],
                           speed["eta_s"], epoch=sampler.progress(t.max_steps)))


def evaluation(job, cfg: Config, world: World) -> dict:
    """An eval record's values: each source evaluated on its own validation split (eval_samples
    each), and the record the sampler makes of them (eval_loss; a mixture's by source too)."""
    losses = {name: evaluate(job.model, job.head, data, cfg, world, job.step.pipeline)
              for name, data in job.val_data.items()}
    return job.sampler.eval_record(losses)


@torch.no_grad()
def evaluate(model, head, data: TokenStream | SampleRows, cfg: Config, world: World, pipeline=None) -> float:
    """Mean loss over the trained targets of the first eval_samples validation samples, whatever
    the world size.

    The count is rounded down to a multiple of the data-parallel degree so that every rank runs
    the same number of forwards: FSDP2 gathers parameters collectively.
    """
    seq_len, mb = cfg.data.seq_len, cfg.train.micro_batch_size
    dp = world.dims.dp  # the data-parallel ranks split the samples, context-parallel ones each sequence
    per_rank = min(data.num_samples(seq_len), cfg.train.eval_samples) // dp
    indices = np.arange(per_rank) * dp + world.dims.dp_rank(world.rank)
    total = torch.zeros((), dtype=torch.float64, device=world.device)
    targets = 0
    model.eval()
    for chunk in np.array_split(indices, -(-per_rank // mb)) if per_rank else []:
        batch = data.batch(chunk, seq_len)
        targets += batch.targets()
        on_device = batch.pinned(world.device).to(world.device)
        with autocast(cfg, world.device):
            if pipeline is not None:  # forward only through the stages; every stage gets the sum
                total += pipeline.loss_sum(on_device).double()
            else:
                total += lm_loss(model, on_device, head, normaliser=1.0, layout=world.layout).double()
    model.train()
    # summed over the loss's ranks (a tensor-parallel group's ranks hold the same sums: one of
    # them counts); each of a context-parallel group holds its part of the loss but the whole
    # count: the count once per such group
    sums = torch.stack([total, torch.tensor(targets / world.dims.context, dtype=torch.float64, device=world.device)])
    dist.all_reduce(sums, group=world.layout.mesh("loss").get_group())
    return (sums[0] / sums[1]).item() if sums[1] > 0 else float("nan")


