"""The run directory: resolved config, provenance, per-rank logs and metrics.jsonl.

    <run.dir>/<run.name>/
        config.yaml        the resolved config of the latest start (atomic write)
        provenance.json    git commit, package versions, hosts, world size, SLURM_* (atomic)
        metrics.jsonl      one JSON object per line: {"kind": "train"|"eval", "step": N, ...}
        logs/rank-N.log    everything rank N logged; rank 0's lines also go to stdout
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

SECRET_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
PACKAGES = ("llmtrain", "torch", "transformers", "datasets", "accelerate", "tokenizers",
            "huggingface_hub", "numpy")


def write_atomic(path: Path, text: str) -> None:
    """Write then rename: readers on a shared filesystem never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


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


class MetricsWriter:
    """Appends metrics.jsonl lines (rank 0 only); each line is flushed as it is written.

    Opening at step S first drops the lines past S: a run killed after its last checkpoint
    logged steps that the resumed run does again.
    """

    def __init__(self, path: Path | None, step: int = 0):
        self.file = None
        if path is not None:
            if path.exists():
                write_atomic(path, "".join(_lines_up_to(path, step)))
            self.file = open(path, "a", buffering=1)

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.file:
            self.file.close()


class SampleLog:
    """Opt-in (train.log_samples): logs/samples-rank-N.jsonl, {"step": S, "samples": [...]}."""

    def __init__(self, path: Path | None, step: int = 0):
        self.writer = MetricsWriter(path, step) if path is not None else None

    def write(self, step: int, indices) -> None:
        if self.writer:
            self.writer.write({"step": step, "samples": [int(i) for i in indices]})

    def close(self) -> None:
        if self.writer:
            self.writer.close()


def _lines_up_to(path: Path, step: int) -> list[str]:
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):  # a line cut short by a kill
            continue
    return kept


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
        "slurm": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SLURM_")},
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


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
