"""The run directory: resolved config, provenance, per-rank logs and metrics.jsonl.

    <run.dir>/<run.name>/
        config.yaml        the resolved config of the latest start (atomic write)
        provenance.json    git commit, package versions, hosts, world size, SLURM_* (atomic)
        metrics.jsonl      one JSON object per line: {"kind": "train"|"eval", "step": N, ...}
        logs/rank-N.log    everything rank N logged; rank 0's lines also go to stdout
        logs/error.txt     the one-line user error the last launch ended with, if it did
        logs/heartbeat-rank-0.json, logs/heartbeats/<host>/rank-N.json   the watchdog's beats
        control/           switches (stop, save, profile), exit.json (why the trainer stopped),
                           requeues.json (a submission's time-limit requeues)
        run.lock           held by the launch that writes the directory (RunLock)
        checkpoints/       step-NNNNNNNN/ (complete once meta.json is in it) and `latest`

Every path is named once, in RunPaths (train.slurm gets its three from the job's environment);
the checkpoint layout's names are here too, without torch, for status and check-config; the
checkpoints themselves are training/checkpoint.py's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import yaml

from .errors import UserError
from .files import load_yaml, read_json

CHECKPOINTS = "checkpoints"
META = "meta.json"  # written last: a step folder without it is incomplete
LATEST = "latest"   # the name of the newest complete checkpoint
BUFFERS = "buffers.pt"  # a checkpoint's buffers (rotary frequencies, ...), rank 0's, for export
# What a run assumes of a save before it has timed one (the deadline, submit's lead warning),
# and the time-limit stop's margin beyond the measured step and save: the exit, the requeue.
ASSUMED_WRITE_BYTES_PER_S_PER_NODE = 0.5e9
DEADLINE_MARGIN_S = 15.0
# meta.json's "format": raised when a checkpoint's layout changes in a way older code misreads.
CHECKPOINT_FORMAT = 1
SECRET_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
PACKAGES = ("llmtrain", "torch", "transformers", "datasets", "accelerate", "tokenizers",
            "huggingface_hub", "numpy")


class RunPaths:
    """Every path of a run directory, named once. train.slurm gets the ones it touches as paths
    relative to the run directory from the job's environment (SHELL_NAMES, login/slurm.py)."""

    LOGS, CONTROL, PROFILE = "logs", "control", "profile"
    EXIT = "control/exit.json"  # why the trainer stopped: train.slurm's requeue reads it
    STOP = "control/stop"  # switches a user or Slurm's warning writes: stop, save, profile
    REQUEUES = "control/requeues.json"  # the time-limit requeues of one submission
    ERROR = "logs/error.txt"  # the one-line user error the last launch ended with
    HEARTBEAT = "logs/heartbeat-rank-0.json"  # rank 0's, every 2 s: the status command reads it
    HEARTBEATS = "logs/heartbeats"  # the other ranks', by host

    def __init__(self, root: Path):
        self.root = Path(root)
        self.logs, self.control = self.root / self.LOGS, self.root / self.CONTROL
        self.checkpoints, self.profile = self.root / CHECKPOINTS, self.root / self.PROFILE
        self.config, self.provenance = self.root / "config.yaml", self.root / "provenance.json"
        self.metrics = self.root / "metrics.jsonl"
        self.exit, self.requeues = self.root / self.EXIT, self.root / self.REQUEUES
        self.error, self.heartbeat = self.root / self.ERROR, self.root / self.HEARTBEAT

    def switch(self, name: str) -> Path:
        """control/stop, control/save, control/profile."""
        return self.control / name

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def heartbeat_of(self, rank: int, host: str) -> Path:
        return self.heartbeat if rank == 0 else self.root / self.HEARTBEATS / host / f"rank-{rank}.json"

    def samples(self, rank: int) -> Path:
        return self.logs / f"samples-rank-{rank}.jsonl"


# train.slurm's names, in the job's environment as paths under LLMTRAIN_RUN_DIR
SHELL_NAMES = {"LLMTRAIN_EXIT_FILE": RunPaths.EXIT, "LLMTRAIN_ERROR_FILE": RunPaths.ERROR,
               "LLMTRAIN_STOP_FILE": RunPaths.STOP}


class Log:
    """Rank-aware logging: one line is one write(), so ranks sharing a pipe never interleave."""

    def __init__(self, rank: int, folder: Path | None = None):
        self.rank, self.file = rank, None
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            self.file = open(folder / f"rank-{rank}.log", "a", buffering=1)

    def info(self, msg: str, all_ranks: bool = False) -> None:
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} [rank {self.rank}] {msg}\n"
        if self.file:
            self.file.write(line)
        if self.rank == 0 or all_ranks:
            os.write(sys.stdout.fileno(), line.encode())

    def close(self) -> None:
        if self.file:
            self.file.close()


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def complete_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints (meta.json written), newest first."""
    found = [p for p in folder.glob("step-*") if (p / META).is_file()]
    return sorted(found, key=lambda p: p.name, reverse=True)


def latest_checkpoint(folder: Path) -> str | None:
    """The name `latest` points to, if it exists."""
    try:
        return (folder / LATEST).read_text().strip() or None
    except OSError:
        return None


def run_config(run_dir: Path) -> dict:
    """The resolved config the latest start wrote, as a dict ({} before a first start)."""
    try:
        return load_yaml(RunPaths(run_dir).config.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def provenance(world_size: int, hostnames: list[str]) -> dict:
    repo = Path(__file__).resolve().parents[2]
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": _git(repo),
        "python": sys.version.split()[0],
        "packages": {p: _version(p) for p in PACKAGES},
        "world_size": world_size,
        "hostnames": hostnames,
        "argv": sys.argv,
        "slurm": {k: _redacted(v) for k, v in sorted(os.environ.items()) if k.startswith("SLURM_")},
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def _redacted(value: str) -> str:
    """SLURM_EXPORT_ENV can hold `ALL,WANDB_API_KEY=...` (sbatch --export): values never leave."""
    return ",".join(item.split("=", 1)[0] + "=<redacted>" if "=" in item else item
                    for item in value.split(","))


def _git(repo: Path) -> dict:
    def run(*args):
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None

    try:
        commit = run("rev-parse", "HEAD")
        return {"commit": commit, "dirty": bool(run("status", "--porcelain")) if commit else None}
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def hostname() -> str:
    return socket.gethostname()


# -- one writer per run directory ------------------------------------------------------------

LOCK = "run.lock"


class RunLock:
    """`<run_dir>/run.lock`: the one launch that writes this run directory (rank 0 holds it).

    Taken with O_EXCL, so two launches can never both win; a lock whose owner is gone (its pid
    dead on this host, its Slurm job no longer running, or on another host with no Slurm job, a
    heartbeat older than STALE_S) is taken over. A requeued or restarted job has the same job
    id as the lock's, which is then its own. Released at every exit the process sees.
    """

    STALE_S = 300

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        self.held = False

    def acquire(self) -> str | None:
        """Take the lock; return the live owner's description instead if there is one."""
        me = {"host": hostname(), "pid": os.getpid(), "job_id": os.environ.get("SLURM_JOB_ID"),
              "time": time.time()}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = read_json(self.path)
                if owner is not None and _alive(owner, me, self.path.parent):
                    job = f"job {owner['job_id']}, " if owner.get("job_id") else ""
                    return f"{job}host {owner.get('host')}, pid {owner.get('pid')}"
                self.path.unlink(missing_ok=True)  # a dead owner's (or torn) lock
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(me) + "\n")
            self.held = True
            return None
        return "another launch that keeps taking it"

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def _alive(owner: dict, me: dict, run_dir: Path) -> bool:
    job = owner.get("job_id")
    if job and job == me["job_id"]:
        return False  # this job's own lock: requeued, or its workers restarted
    if owner.get("host") == me["host"]:
        return pid_alive(owner.get("pid"))
    if job:
        return job_alive(job)  # cannot tell: do not take a live run's directory
    beat = read_json(RunPaths(run_dir).heartbeat) or {}
    return time.time() - float(beat.get("time", owner.get("time", 0))) < RunLock.STALE_S


def job_alive(job) -> bool:
    """A Slurm job that may still run: squeue says so, or cannot say (no controller answers);
    False only where squeue knows it ended or no longer knows it."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return True  # cannot tell: do not take what a live job holds
    if out.returncode != 0 and "invalid job id" not in out.stderr.lower():
        return True  # no answer from slurmctld: cannot tell either
    return out.stdout.strip() in ("RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED")


def pid_alive(pid) -> bool:
    """An llmtrain process with this pid runs on this host: not a zombie (killed, not yet
    reaped), not a recycled pid of another program."""
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
        cmdline = Path(f"/proc/{int(pid)}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc (macOS): signal 0 said it exists
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X") and b"llmtrain" in cmdline


def resolve_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """The checkpoint to read for export/generate: step N, or the newest complete one."""
    folder = run_dir / CHECKPOINTS
    every = complete_checkpoints(folder)
    found = [p for p in every if step is None or p.name == step_name(step)]
    if not found:
        what = f"no step {step}" if step is not None else "no complete checkpoint"
        steps = ", ".join(str(int(p.name.removeprefix("step-"))) for p in reversed(every))
        hint = (f"; its complete checkpoints are at steps {steps}" if steps else
                "" if step is not None else "; a run saves one every train.checkpoint_every steps and at its end")
        raise UserError(f"{what} in {folder}{hint}")
    return found[0]
