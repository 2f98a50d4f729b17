"""`llmtrain status RUN_DIR|JOB_ID [--follow]`: where a run stands, from its files and Slurm.

Job state from squeue (pending/running), else sacct (when accounting is on), else
`scontrol show job` (kept MinJobAge seconds); progress from metrics.jsonl; checkpoints from
the run directory; the last lines of the job's log. Imports no torch.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import yaml

from .config import UserError
from .metrics import format_duration

LOG_LINES = 10


def status(target: str, follow: bool = False, interval: float = 10.0) -> None:
    run_dir, job_id = resolve_target(target)
    while True:
        text = render(run_dir, job_id or latest_job(run_dir))
        if not follow:
            print(text)
            return
        print("\033[2J\033[H" + text, flush=True)  # clear the screen, then redraw
        time.sleep(interval)


def resolve_target(target: str) -> tuple[Path, str | None]:
    if re.fullmatch(r"\d+", target):
        fields = _scontrol(target)
        if not fields.get("StdOut"):
            raise UserError(f"job {target}: unknown to Slurm (it forgets finished jobs after "
                            f"MinJobAge); pass the run directory instead")
        return Path(fields["StdOut"]).parent, target
    run_dir = Path(target)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{target}: not a run directory (no config.yaml) and not a job id")
    return run_dir, None


def latest_job(run_dir: Path) -> str | None:
    """The newest training job that logged into the run directory (<name>-<jobid>.out)."""
    jobs = [m.group(1) for p in run_dir.glob("*-*.out") if not p.name.startswith("prepare-")
            for m in [re.fullmatch(r".+-(\d+)\.out", p.name)] if m]
    return max(jobs, key=int) if jobs else None


def job_state(job_id: str) -> tuple[str, str]:
    """(state, which tool said so)."""
    if shutil.which("squeue"):
        out = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
        if out:
            return out.splitlines()[0], "squeue"
    if shutil.which("sacct"):
        out = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
        if out and "disabled" not in out:
            return out.splitlines()[0].split()[0], "sacct"
    state = _scontrol(job_id).get("JobState")
    return (state, "scontrol") if state else ("UNKNOWN", "no Slurm record")


def render(run_dir: Path, job_id: str | None) -> str:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    lines = [f"run: {cfg['run']['name']}  ({run_dir})"]
    if job_id:
        state, source = job_state(job_id)
        lines.append(f"job: {job_id} {state} ({source})")
    lines += _progress(run_dir, cfg["train"]["max_steps"])
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")
                   if (p / "meta.json").is_file())
    latest = run_dir / "checkpoints" / "latest"
    pointer = latest.read_text().strip() if latest.exists() else None
    lines.append("checkpoints: " + (", ".join(f"{c}{' (latest)' if c == pointer else ''}"
                                              for c in ckpts) or "none yet"))
    log = run_dir / f"{cfg['run']['name']}-{job_id}.out" if job_id else run_dir / "logs" / "rank-0.log"
    if log.exists():
        tail = log.read_text(errors="replace").splitlines()[-LOG_LINES:]
        lines.append(f"log: {log} (last {len(tail)} lines)")
        lines += [f"  {line}" for line in tail]
    return "\n".join(lines)


def _progress(run_dir: Path, max_steps: int) -> list[str]:
    train, evals = None, None
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == "train":
            train = record
        elif record.get("kind") == "eval":
            evals = record
    if train is None:
        return ["progress: no step logged yet"]
    eta = train.get("eta_s")
    out = [f"progress: step {train['step']}/{max_steps} ({100 * train['step'] / max_steps:.0f}%), "
           f"loss {train['loss']:.4f}, {train['tokens_per_sec']:,.0f} tok/s"
           + (f", eta {format_duration(eta)}" if eta is not None else "")]
    if evals:
        out.append(f"eval: step {evals['step']}, eval_loss {evals['eval_loss']:.4f}")
    return out


def _scontrol(job_id: str) -> dict:
    if not shutil.which("scontrol"):
        return {}
    out = _run(["scontrol", "show", "job", job_id]) or ""
    fields = dict(re.findall(r"(\w+)=(\S*)", out))
    for key in ("StdOut", "StdErr", "WorkDir"):  # whole lines: paths may hold spaces
        m = re.search(rf"^\s*{key}=(.*)$", out, re.MULTILINE)
        if m:
            fields[key] = m.group(1).strip()
    return fields


def _run(cmd: list[str]) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None
