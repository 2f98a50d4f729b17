"""`llmtrain control RUN_DIR stop|save|profile`: a switch file a running trainer reads at its
next step boundary (training/control.py reads it; every rank agrees on the step)."""

from __future__ import annotations

from pathlib import Path

from ..config import UserError
from ..files import write_atomic
from ..rundir import RunPaths
from .status import assess, latest_job


def request(run_dir: Path, what: str, reason: str = "user") -> Path:
    """`llmtrain control RUN_DIR stop|save|profile`: ask a running trainer to stop, save or
    profile (`reason`: profile's `STEPS [RANKS]`). A run that is
    not running is refused (UserError), and nothing is written: a switch must not wait in the
    run directory for a later launch."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    verdict = assess(run_dir, latest_job(run_dir))
    if verdict.state != "running":
        raise UserError(f"{run_dir}: not running ({verdict.text}); nothing to {what}")
    path = RunPaths(run_dir).switch(what)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, reason + "\n")
    return path
