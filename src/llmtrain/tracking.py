"""Metrics beyond metrics.jsonl: TensorBoard event files and one Weights & Biases run, each
continued across resumes and Slurm requeues (rank 0 writes them); and the run's plot, redrawn
by a child process at each evaluation.

    sinks = open_sinks(cfg, step, log, provenance)       # before MetricsWriter cuts the file back
    metrics = MetricsWriter(metrics_path, step, sinks)   # each record reaches every sink

A launch resuming at step S redoes the steps that the previous one logged after its checkpoint
at S. metrics.jsonl is cut back to S. TensorBoard gets a purge marker (purge_step = S + 1): its
reader drops earlier files' events from S + 1 on. A W&B history cannot be rewritten: each launch
logs only the steps that no finished launch logged (WandB below), so the synced history has each
step once.

The packages are optional extras (`pip install 'llmtrain[tensorboard,wandb]'`), imported only
when the config asks for them; check-config refuses a config that asks for a missing one.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import string
import subprocess
import sys
from pathlib import Path

from .config import Config
from .files import read_json
from .metrics import read_metrics
from .rundir import Log, RunPaths
from .files import write_atomic

TENSORBOARD_DIR = "tensorboard"
WANDB_STATE = "wandb-run.json"  # the W&B run id, what its finished launches hold, its Slurm jobs
PLOT = "plot.png"
NOT_SCALARS = ("kind", "step")


def scalars(record: dict) -> dict[str, float]:
    """A metrics.jsonl record as tagged scalars: train/loss, train/lr, ..., eval/loss; a mapping
    (a mixture's source_tokens, eval_loss_by_source) as one per entry: train/source_tokens/wiki."""
    kind = record.get("kind", "train")
    flat = {}
    for key, value in record.items():
        tag = f"{kind}/{key.removeprefix(kind + '_')}"
        if key not in NOT_SCALARS:
            flat.update({f"{tag}/{name}": v for name, v in value.items()} if isinstance(value, dict) else {tag: value})
    return {tag: float(value) for tag, value in flat.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


class TensorBoard:
    """<run_dir>/tensorboard: one event file per launch; flushed at every record, like
    metrics.jsonl, so a killed run's file holds every step up to its last checkpoint."""

    def __init__(self, run_dir: Path, step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = run_dir / TENSORBOARD_DIR
        self.writer = SummaryWriter(str(self.folder), purge_step=step + 1)

    def log(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandB:
    """One W&B run per run directory: its id is kept in <run_dir>/wandb-run.json, so every
    requeue, restart and resubmission continues it; its files are under <run_dir>/wandb.

    A launch that ends, even by an error or a stop signal, finishes its W&B files and records the
    last step they hold ("logged"). A launch that was killed (SIGKILL, a node lost) may leave its
    offline files empty or cut short: W&B's service process drops what it buffered when its
    parent dies. The next launch moves such files to wandb/incomplete/ (out of the sync
    command's reach) and logs again, from metrics.jsonl, the steps after "logged" up to the
    step it resumes at; then its own. So the synced history has each step once. A launch resumed
    from a checkpoint older than a finished launch's last logged step (train.resume: an earlier
    checkpoint) redoes those steps in metrics.jsonl and TensorBoard; W&B keeps their first values
    (a W&B run cannot be rewound)."""

    def __init__(self, cfg: Config, step: int, log: Log, provenance: dict):
        import wandb

        spec = cfg.metrics.wandb_spec
        self.state_path = cfg.run_dir / WANDB_STATE
        state = read_json(self.state_path) or {}
        if "id" not in state or step == 0 and state.get("logged", 0) > 0:  # (started over) a new W&B run
            state = {"id": new_run_id(), "logged": 0, "launches": [], "slurm_job_ids": []}
        self._set_aside_incomplete(cfg.run_dir / "wandb", state, log)
        job = os.environ.get("SLURM_JOB_ID")
        if job and job not in state["slurm_job_ids"]:
            state["slurm_job_ids"].append(job)
        name = spec.name or cfg.run.name
        self.run = wandb.init(
            id=state["id"], resume="allow", project=spec.project, entity=spec.entity, name=name,
            tags=list(spec.tags), mode=spec.mode, dir=str(cfg.run_dir),
            settings=wandb.Settings(console="off", silent=True, init_timeout=120))
        try:
            self.run.config.update({**cfg.to_dict(), "provenance": provenance,
                                    "slurm_job_ids": state["slurm_job_ids"]}, allow_val_change=True)
        except Exception:
            self.run.finish(exit_code=1)  # its service process must not outlive this
            raise
        where = (self.run.url if spec.mode == "online" else
                 sync_command(cfg.run_dir, spec.project, spec.entity, state["id"]))
        state.update(name=name, project=spec.project, entity=spec.entity, mode=spec.mode, where=where)
        self.state = state
        write_atomic(self.state_path, json.dumps(state, indent=2) + "\n")  # also for llmtrain status
        log.info(f"W&B: run {state['id']} ({name}), " + (
            f"offline in {cfg.run_dir / 'wandb'}; sync it from the login node with: {where}"
            if spec.mode == "offline" else where))
        # Online, the server has what it received and ignores steps below its run's step.
        self.floor = max(state["logged"], getattr(self.run, "step", 1) - 1 if spec.mode == "online" else 0)
        self.last = self.floor
        for record in read_metrics(cfg.run_dir):  # what earlier launches logged but W&B lost
            if self.floor < record["step"] <= step:
                self.log(record)

    @staticmethod
    @contextlib.contextmanager
    def _service_lost():
        """A failure here is W&B's service process gone, mostly: scancel and a preemption send
        SIGTERM to every process of the job, W&B's too, whose Go runtime exits on it whatever
        we block or ignore. The caller warns once (MetricsWriter); the connection is dropped
        now, or W&B's exit handler tries it again and prints a `Connection lost` traceback under
        the run's clean stop. This launch's files are then incomplete: the next one logs their
        steps again (the class docstring)."""
        try:
            yield
        except Exception:
            import wandb
            with contextlib.suppress(Exception, SystemExit):
                wandb.teardown()
            raise

    @staticmethod
    def _set_aside_incomplete(folder: Path, state: dict, log: Log) -> None:
        for launch in sorted(folder.glob(f"offline-run-*-{state['id']}")):
            if launch.name not in state["launches"]:
                (folder / "incomplete").mkdir(exist_ok=True)
                launch.rename(folder / "incomplete" / launch.name)
                log.info(f"W&B: {launch.name} was not finished (its launch was killed): moved to "
                         f"{folder / 'incomplete'}; its steps are logged again from metrics.jsonl")

    def log(self, record: dict) -> None:
        if record["step"] > self.floor:
            with self._service_lost():
                self.run.log(scalars(record), step=record["step"])
            self.last = max(self.last, record["step"])

    def close(self, failed: bool = False) -> None:
        with self._service_lost():
            self.run.finish(exit_code=1 if failed else 0)
        self.state["logged"] = self.last
        if self.state["mode"] == "offline":
            self.state["launches"].append(Path(self.run.dir).parent.name)
        write_atomic(self.state_path, json.dumps(self.state, indent=2) + "\n")


def new_run_id() -> str:
    """8 lowercase letters and digits, as W&B's own ids."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def sync_command(run_dir: Path, project: str, entity: str | None, run_id: str) -> str:
    """The one command that uploads every launch's offline files into the one W&B run."""
    return (f"wandb sync --id {run_id} -p {project}" + (f" -e {entity}" if entity else "")
            + f" {run_dir / 'wandb'}/offline-run-*-{run_id}")


def open_sinks(cfg: Config, step: int, log: Log, provenance: dict) -> list:
    """The trackers the config asks for (rank 0), resuming at `step`; a W&B run that cannot
    start (online, no network) is a warning, not a stopped job."""
    sinks: list = []
    if cfg.metrics.tensorboard:
        sinks.append(TensorBoard(cfg.run_dir, step))
        log.info(f"TensorBoard: {cfg.run_dir / TENSORBOARD_DIR} (view: tensorboard --logdir {cfg.run_dir})")
    if cfg.metrics.wandb_spec is not None:
        try:
            sinks.append(WandB(cfg, step, log, provenance))
        except Exception as e:  # wandb raises its own errors (CommError, UsageError, ...)
            log.info(f"warning: W&B did not start ({type(e).__name__}: {e}); training goes on "
                     f"without it (metrics.jsonl has every step)")
    return sinks


class PlotRefresher:
    """Redraws <run_dir>/plot.png in a child process (`llmtrain plot`), so training never waits
    for matplotlib: one drawing at a time; one asked for meanwhile is drawn after it; the last
    one is waited for at the end (a Slurm job step's end would kill it)."""

    def __init__(self, run_dir: Path, log: Log):
        self.run_dir, self.log = run_dir, log
        self.proc: subprocess.Popen | None = None
        self.drawn = -1  # the step of the newest drawing started
        self.wanted = -1
        self.warned = False

    def refresh(self, step: int) -> None:
        self.wanted = max(self.wanted, step)
        if self.wanted > self.drawn and not self._busy():
            self.drawn = self.wanted
            with open(RunPaths(self.run_dir).logs / "plot.log", "w") as out:
                # Not torchrun's error file of this rank: a plot's error is not the run's.
                env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_ERROR_FILE"}
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "llmtrain", "plot", str(self.run_dir), "--out", str(self.run_dir / PLOT)],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)

    def _busy(self) -> bool:
        if self.proc is None:
            return False
        if self.proc.poll() is None:
            return True
        if self.proc.returncode != 0 and not self.warned:
            self.warned = True
            self.log.info(f"warning: the plot was not redrawn (see {self.run_dir / 'logs' / 'plot.log'})")
        return False

    def close(self, timeout_s: float = 60.0) -> None:
        while self.proc is not None:
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._busy()
            if self.wanted <= self.drawn:
                break
            self.refresh(self.wanted)
