"""The training loop: `llmtrain train --config FILE`, usually under torchrun.

    torchrun --nproc-per-node 2 -m llmtrain train --config config.yaml

One optimizer step: set the learning rate, run the micro-batches (gradients reduced on the
last one only), clip, step; then log, evaluate and checkpoint when their turn comes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import Config, ConfigError, UserError, dump_yaml
from ..data.loader import Prefetcher, StepSampler, TokenStream
from ..data.run import Prepared, Sampler, TrainData, locate
from ..data.tokenizer import load_tokenizer
from ..metrics import peak_memory_gib, plural
from ..model.build import (flops_per_token, model_config, num_params, pretrained_dir, unwrap,
                           vocab_padding)
from ..model.loss import chunk_head
from ..model.moe import MoE
from ..parallel import compression
from ..parallel.float8 import describe as describe_fp8
from ..parallel.pipeline import summed_over_stages
from ..parallel.precision import configure_matmul_precision, grad_scaler
from ..parallel.wrap import parallelize
from ..optimizers import apply_settings, build_optimizer, lr_at, set_lr
from ..optimizers import describe as describe_optimizer
from ..rundir import Log, RunLock, RunPaths, hostname, provenance
from ..files import write_atomic
from . import distributed, preflight
from .checkpoint import Checkpointer, compat_info, will_resume
from .control import Agreement, Control, Verdict, settle
from ..parallel.dims import Layout
from ..parallel.world import World
from .hooks import StepHooks
from .profiling import out_of_memory, record_memory_history
from .report import Due, Reporter
from .step import Step
from .watchdog import Watchdog


@dataclass
class RunState:
    """What the loop has done so far; saved in checkpoints next to the sampler position."""

    step: int = 0
    tokens: int = 0
    skipped: int = 0  # steps skipped for a non-finite loss or gradient norm, in all
    bad_in_a_row: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "skipped": self.skipped,
                "bad_in_a_row": self.bad_in_a_row}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.tokens = int(sd["step"]), int(sd["tokens"])
        self.skipped, self.bad_in_a_row = int(sd.get("skipped", 0)), int(sd.get("bad_in_a_row", 0))


class TrainingDiverged(UserError):
    pass


class CollectiveTimeout(UserError):
    pass


def train(cfg: Config) -> None:
    world = distributed.init(cfg)
    watch = Watchdog(cfg.run_dir, world.rank, world.world_size, cfg.parallel.startup_timeout_s,
                     cfg.parallel.collective_timeout_s)
    run_lock = RunLock(cfg.run_dir)
    finished = False
    try:
        run(cfg, world, watch, run_lock)
        finished = True
    except torch.OutOfMemoryError as e:
        raise out_of_memory(cfg, world.rank, world.device, e) from None
    except RuntimeError as e:  # gloo: "Timed out waiting"; NCCL's watchdog: "...timeout"
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        raise CollectiveTimeout(watch.diagnose()) from None
    finally:
        faulthandler.cancel_dump_traceback_later()  # the watchdog's stack-dump timer
        run_lock.release()
        watch.close()
        # Stop requests mean nothing outside the loop: a SIGTERM from torchrun while this rank
        # is on its way out (another rank failed) must end it now, not 30 s later.
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        distributed.teardown(world, finished)


def run(cfg: Config, world: World, watch: Watchdog, run_lock: RunLock) -> None:
    t, seq_len = cfg.train, cfg.data.seq_len
    with watch.phase("reading data and tokenizer"):
        prepared = locate(cfg)  # each source's folder (data.dataset: one); the manifest stands for them all
        manifest = prepared.manifest
        log, hosts = open_run_dir(cfg, world, run_lock)
        watch.log = log
        torch.manual_seed(t.seed + world.rank)
        tokenizer = load_tokenizer(cfg)
        config = model_config(cfg, tokenizer)
        check_model_fits(cfg, config, manifest)
    with watch.phase("preflight"):
        verdict = preflight.run(cfg, world, log)
    if verdict == "stop":  # a slow node and slurm.exclude_slow_nodes: a job without it resumes
        log.close()
        return
    written = cfg  # as the user wrote it: train.epochs, not the max_steps derived from it
    cfg = steps_from_epochs(cfg, prepared, log)
    t = cfg.train
    if padding := vocab_padding(cfg, config, tokenizer):
        log.info(padding)
    configure_matmul_precision(cfg, world.device)
    record_memory_history(cfg, world.device)
    before_model = peak_memory_gib(world.device)  # the runtime's own: imports, process group
    resuming = will_resume(cfg)
    model = parallelize(cfg, config, world, watch, resuming=resuming)
    if cfg.model.name_or_path is not None and (cfg.model.lora is not None or not resuming):
        log.info(f"loaded pretrained weights from {pretrained_dir(cfg)}")
    elif cfg.model.name_or_path is not None:
        log.info(f"pretrained weights not read from {pretrained_dir(cfg)}: the checkpoint to resume "
                 f"holds every weight")
    head = chunk_head(model, config, compile=t.compile, layout=world.layout) if t.chunked_loss else None
    if t.chunked_loss and head is None:
        log.info(f"train.chunked_loss: not for model type {config.model_type!r} (its head is not "
                 f"a plain linear layer it applies last); the loss takes the full logits")
    optimizer = build_optimizer(model, t, world.device)
    scaler = grad_scaler(cfg, world.device)
    # a pipeline stage holds its part of the model: the whole model's counts are the stages' sum
    # a Mixture-of-Experts token uses top-k of each layer's experts: FLOPs and MFU count those
    moe = MoE.of(config, t.router_aux_loss_coef)
    n_active = (moe.active_params((n, p.numel()) for n, p in unwrap(model).named_parameters())[1]
                if moe is not None else num_params(model))
    n_params, n_trainable, n_active = summed_over_stages(
        [num_params(model), num_params(model, trainable=True), n_active], world.layout, world.device)
    active = (f" ({n_active:,} active per token: {moe.top_k} of {moe.experts} experts a layer; load-balancing "
              f"loss at {moe.aux_coef:g})" if moe is not None else "")
    log.info(f"model: {n_params:,} parameters{active}, {world.dims.describe()} on "
             f"{world.device.type}, {t.precision}")
    if cfg.parallel.grad_compression != "none":
        log.info(compression.describe(cfg))
    if t.fp8 != "none":
        log.info(describe_fp8(unwrap(model), t.fp8, t.precision, world.device.type, world.dims.tensor, t.compile))
    if cfg.model.lora is not None:
        lora = cfg.model.lora_spec
        log.info(f"LoRA: {n_trainable:,} trainable parameters ({n_trainable / n_params:.2%}), rank {lora.rank}, "
                 f"alpha {lora.alpha:g} on {', '.join(lora.target_modules)}; the base is frozen"
                 + ("" if moe is None else ", its experts and routers too (fused expert stacks are not linear "
                                           "layers: adapters go on attention and dense layers)"))
    log.info(describe_optimizer(optimizer, t))

    dp = world.dims.dp  # the data-parallel ranks share every batch
    data = prepared.open()  # a mixture's sources blended under its sampler; each evaluated on its own
    train_data, val_data = data.train, data.validation
    for name, split in val_data.items():
        check_eval_split(cfg, split, world, log, source=name)
    sampler = data.sampler(t.global_batch_size, world.dims.dp_rank(world.rank), dp)
    for line in data.describe(sampler):
        log.info(line)
    accum = world.dims.accumulation(t.global_batch_size, t.micro_batch_size)
    log.info(f"data: {sampler.num_samples:,} {data.unit()} of {seq_len} tokens; global batch "
             f"{t.global_batch_size} = {t.micro_batch_size} x {dp} ranks x {accum} "
             f"accumulation steps")

    state = RunState()
    checkpointer = Checkpointer(cfg, world, log, compat_info(cfg, config, manifest),
                                hf_files=(config, tokenizer))
    job = Job(cfg, model, head, optimizer, scaler, checkpointer, sampler, state, train_data, val_data, accum,
              flops_per_token(config, n_active, seq_len, min(n_trainable, n_active))
              * t.global_batch_size * seq_len,
              layout=world.layout)
    if job.step.pipeline is not None:
        job.step.pipeline.start(log.info, watch)  # its stages, its bubble; the idle share at step 2
    checkpointer.estimate_save(model, optimizer)  # the deadline's figure until a save is timed
    with watch.phase("resuming"):
        resumed = checkpointer.load(model, optimizer)  # a refused resume raises here
    if resumed:
        job.restore(resumed)
        for line in sampler.resumed():  # a mixture's changed weights
            log.info(line)
        apply_settings(optimizer, t)  # the config's weight decay, betas and eps win
    job.step.weights_changed()  # FP8's float8-gathered weights: their scales, before the first forward
    job.provenance = record_start(written, world, hosts)  # only a start that goes ahead replaces them
    log.info(f"model ready: peak memory {peak_memory_gib(world.device):.2f} GiB on this rank "
             f"({before_model:.2f} GiB before the model)")
    if t.max_steps is not None and state.step >= t.max_steps:
        log.info(f"nothing to train: the run is at step {state.step} of {t.max_steps} already; "
                 f"raise train.max_steps (or train.epochs) to train further")
    try:
        loop(cfg, world, watch, log, job)
    except BaseException:
        # An async save in flight uploads on its own group: let it finish (or fail) before the
        # process group goes, or its collectives are torn down under it.
        with contextlib.suppress(BaseException):
            checkpointer.close()
        raise
    checkpointer.close()  # the last save completes before the process group goes
    log.info(f"peak memory: {peak_memory_gib(world.device):.2f} GiB on rank {world.rank}")
    log.info(f"{ending(job.reason, state.step)}: {plural(state.step, 'step')}, {state.tokens:,} "
             f"tokens; run_dir: {cfg.run_dir}")
    log.close()


@dataclass
class Job:
    """Everything the loop works with, built once by run()."""

    cfg: Config
    model: torch.nn.Module
    head: torch.nn.Module | None  # the output head lm_loss applies in chunks (model/loss.py)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    checkpointer: Checkpointer
    sampler: Sampler  # either kind answers alike (data/run.py)
    state: RunState
    train_data: TrainData
    val_data: dict  # {source: its validation split} (data.dataset's: {None: it}); {}: none
    accum: int  # micro-batches per rank per step
    flops_per_step: float
    reason: str = "done"  # why the loop ended (control.py's reasons)
    provenance: dict | None = None  # this start's provenance.json (rank 0), for the W&B run
    layout: Layout | None = None  # which part of every sequence this rank computes (lm_loss)

    def __post_init__(self):
        self.step = Step(self.model, self.head, self.optimizer, self.scaler, self.cfg, self.layout)

    def carried(self) -> dict:
        """What a checkpoint carries besides the model and optimizer (into meta.json)."""
        return {"run": self.state.state_dict(), "sampler": self.sampler.state.state_dict(),
                "scaler": self.scaler.state_dict()}

    def restore(self, meta: dict) -> None:
        self.state.load_state_dict(meta["run"])
        self.sampler.state.load_state_dict(meta["sampler"])
        self.scaler.load_state_dict(meta["scaler"])


def loop(cfg: Config, world: World, watch: Watchdog, log: Log, job: Job) -> None:
    t, state, step = cfg.train, job.state, job.step
    control = Control(cfg, world, log, save_s=job.checkpointer.save_s)  # stop, save: every rank agrees
    hooks = StepHooks(cfg, world, log, watch)  # profiler, watchdog beats, injected faults
    report = Reporter(cfg, world, log, watch, job, control, hooks.phase)  # metrics, eval, checkpoints
    prefetch = Prefetcher(job.train_data, job.sampler, job.accum, cfg.data.seq_len, world.device,
                          prefetch_depth(cfg, world.device))
    pending: Agreement | None = None  # the previous step's, when nothing made the host read it
    failed, first, reason = True, state.step, "done"
    try:
        while state.step < t.max_steps:
            n = state.step + 1
            hooks.begin(n)
            due = Due.at(n, t, bool(job.val_data))
            lr = lr_at(state.step, t)
            set_lr(job.optimizer, lr)
            # The step's samples: the global batch, drawn alike everywhere; this rank reads its share.
            batch = job.sampler.next_global()
            mine = job.sampler.share(batch)
            report.samples.write(n, mine)
            with hooks.phase("data"):
                micro_batches, targets = prefetch.next(batch)
            # Forward and backward over the micro-batches; gradients reduced on the last one.
            loss, grad_norm = step.forward_backward(micro_batches, targets / world.dims.loss_ranks, hooks.loss_factor(n),
                                                    norm=due.logs or t.grad_clip > 0, phase=hooks.phase)
            hooks.synced(n)
            # One all-reduce on the device: did any rank ask to stop or save, or see a non-finite step?
            with hooks.phase("communication"):
                agreement = control.agree(n, step.finite(loss, grad_norm), samples=mine)
            # The update, or on every rank its skip; the host reads the flags when it must.
            with hooks.phase("optimizer"):
                read = step.update(agreement.nonfinite, lambda: agreement.read().nonfinite)
                verdicts, pending = settle(agreement, pending, read or due.reads)
            hooks.updated()
            state.step, state.tokens = n, state.tokens + t.global_batch_size * cfg.data.seq_len
            for verdict in verdicts:
                account(verdict, state, t, log)
                hooks.requested(state.step, verdict)
            # Log, evaluate and save when due, or when a rank asked to stop or save.
            stop = report.after(due, verdicts, loss, grad_norm, lr)
            hooks.end(state.step)
            if stop:
                reason = stop.reason
                log.info(f"stopping at step {state.step} ({reason}); the checkpoint is saved")
                break
        failed = False
        control.exit(reason, state.step, state.step - first)  # for train.slurm: first, whatever the closing below does
    finally:
        prefetch.close()
        hooks.close(state.step)
        report.close(failed)
    job.reason = reason
    report.finish(reason, state.step)


def prefetch_depth(cfg: Config, device) -> int:
    """data.prefetch_steps, or by default 2 on a GPU (pinned batches copied while the previous
    step runs) and 0 on a CPU, where there is no copy to hide and a reading thread competes with
    the compute threads (a one-process CPU run measured ~3% slower with it: doc/benchmarks.md)."""
    if cfg.data.prefetch_steps is not None:
        return cfg.data.prefetch_steps
    return 2 if device.type == "cuda" else 0


def ending(reason: str, step: int) -> str:
    """The last log line's words: what happened, as the user asked or Slurm did."""
    if reason == "done":
        return "done"
    if reason == "user":
        return f"stopped by request at step {step}"
    return f"stopped at step {step} ({reason}); a requeued or resubmitted job resumes here"


def account(verdict: Verdict, state: RunState, t, log: Log) -> None:
    """Count a step's verdict in (in step order): a skipped step is logged with this rank's
    samples, and too many in a row stop the run."""
    if not verdict.nonfinite:
        state.bad_in_a_row = 0
        return
    state.skipped += 1
    state.bad_in_a_row += 1
    log.info(f"warning: step {verdict.step}: non-finite loss or gradient norm on some rank; step "
             f"skipped ({state.bad_in_a_row} in a row, {state.skipped} in all); this rank's samples: "
             f"{[int(i) for i in verdict.samples]}")
    if state.bad_in_a_row > t.max_bad_steps:
        raise TrainingDiverged(
            f"training stopped at step {verdict.step}: {plural(state.bad_in_a_row, 'step')} in a row had "
            f"a non-finite loss or gradient norm (train.max_bad_steps is {t.max_bad_steps}); lower "
            f"train.lr, check the data (logs/rank-*.log name the samples), or resume from an earlier "
            f"checkpoint with train.resume")


def check_eval_split(cfg: Config, data: TokenStream | None, world: World, log: Log, source: str | None = None) -> None:
    """Evaluation needs at least one validation sample per data-parallel rank; fewer gives no
    loss at all. `source`: a mixture's source, each evaluated on its own eval_samples."""
    if data is None or not cfg.train.eval_every:
        return
    dp = world.dims.dp
    available = data.num_samples(cfg.data.seq_len)
    split = f"the validation split of source {source!r}" if source else "the validation split"
    each = " (a mixture evaluates each source on as many)" if source else ""
    if available < cfg.train.eval_samples and world.is_main:
        log.info(f"warning: train.eval_samples is {cfg.train.eval_samples}{each} but {split} has "
                 f"{available} samples of {cfg.data.seq_len} tokens: evaluating on {available - available % dp}")
    if min(available, cfg.train.eval_samples) < dp:
        raise UserError(f"train.eval_samples: evaluation needs at least one validation sample per "
                        f"rank ({dp}), and {split} has {available} samples of "
                        f"{cfg.data.seq_len} tokens; raise data.validation_fraction or set "
                        f"train.eval_every: 0")


def steps_from_epochs(cfg: Config, prepared: Prepared, log: Log) -> Config:
    """train.epochs as train.max_steps: an epoch is the whole global batches its samples fill
    (the sampler drops the remainder); logged. A config with max_steps is returned as it is."""
    t = cfg.train
    if t.epochs is None:
        return cfg
    samples = prepared.train_samples()
    per_epoch = StepSampler(samples, t.global_batch_size, t.seed, 0, 1).steps_per_epoch
    steps = t.epochs * per_epoch
    log.info(f"train.epochs: {t.epochs} x {per_epoch} steps per epoch ({samples:,} samples // "
             f"global batch {t.global_batch_size}) = {steps} steps")
    if t.warmup_steps >= steps:
        raise ConfigError([f"train.warmup_steps: must be < the {steps} steps of train.epochs "
                           f"{t.epochs} (got {t.warmup_steps})"])
    return dataclasses.replace(cfg, train=dataclasses.replace(t, max_steps=steps))


def check_model_fits(cfg: Config, config, manifest: dict) -> None:
    """The checks check-config can only make once the model and prepared data are on disk."""
    problems = []
    vocab, data_vocab = config.vocab_size, manifest["tokenizer"]["vocab_size"]
    if data_vocab > vocab:
        problems.append(f"model.tokenizer: the data was tokenized with {data_vocab} tokens, more "
                        f"than the model's vocab_size {vocab}")
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos and cfg.data.seq_len > max_pos:
        problems.append(f"data.seq_len: must be <= the model's max_position_embeddings "
                        f"(got {cfg.data.seq_len} > {max_pos})")
    if problems:
        raise ConfigError(problems)


def open_run_dir(cfg: Config, world: World, run_lock: RunLock) -> tuple[Log, list[str]]:
    """The run directory, locked, and this rank's log; nothing in it is replaced yet
    (record_start)."""
    run_dir = cfg.run_dir
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"run.dir: cannot create {run_dir} ({e.strerror}); choose a writable "
                        f"folder on the shared filesystem") from None
    # One launch writes a run directory: rank 0 takes its lock and every rank learns the verdict.
    busy = [run_lock.acquire() if world.is_main else None]
    dist.broadcast_object_list(busy, src=0)
    if busy[0] is not None:
        raise UserError(f"run.name: {run_dir} is in use by a live run ({busy[0]}); wait for it, "
                        f"stop it with: llmtrain control {run_dir} stop, or choose another run.name")
    hosts = [None] * world.world_size
    dist.all_gather_object(hosts, hostname())
    log = Log(world.rank, RunPaths(run_dir).logs)
    restarts = os.environ.get("SLURM_RESTART_COUNT")
    log.info(f"run_dir: {run_dir} (hosts: {', '.join(sorted(set(hosts)))})"
             + (f"; SLURM_RESTART_COUNT={restarts}" if restarts else ""))
    return log, hosts


def record_start(cfg: Config, world: World, hosts: list[str]) -> dict | None:
    """The resolved config and provenance of this start, once it is accepted (rank 0); returns
    the provenance."""
    if not world.is_main:
        return None
    prov = provenance(world.world_size, hosts)
    paths = RunPaths(cfg.run_dir)
    write_atomic(paths.config, dump_yaml(cfg))
    write_atomic(paths.provenance, json.dumps(prov, indent=2) + "\n")
    return prov
