"""`llmtrain status RUN_DIR|JOB_ID|NAME [--config FILE] [--follow]`: where a run stands, from its
files and Slurm. A NAME is a run under run.dir: the --config file's, else run.dir's default,
$LLMTRAIN_HOME/runs.

    run: demo  (/shared/me/llmtrain/runs/demo)
    state: stopped by request at step 57 of 300; launch the same config again to continue
    job: 4242 COMPLETED (scontrol)
    progress: step 57/300 (19%), loss 2.1234, 20,000 tok/s
    loss: █▆▄▃▂▂▁▁ 6.2000 -> 2.1234 over 57 logged steps
    plot: /shared/me/llmtrain/runs/demo/plot.png (drawn 12:04:10)
    checkpoints: step-00000057 (latest)
    log: ... (last 10 lines)

The state line (assess) weighs, in order: the Slurm job (squeue, else sacct, else `scontrol
show job`, kept MinJobAge seconds); `control/exit.json`, which the trainer writes when it stops
({"reason": "done"|"user"|"preempt"|"deadline"|"signal", "step", "requeue", "job_id"}); rank 0's
heartbeat (`logs/heartbeat-rank-0.json`, every 2 s while it trains, with when its last step began); metrics.jsonl; and the
`error:` lines of the job's log or the rank logs. Imports no torch.
"""

from __future__ import annotations

import math
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


from ..config import UserError
from ..files import read_json
from ..metrics import format_duration, read_metrics
from ..rundir import CHECKPOINTS, RunPaths, complete_checkpoints, latest_checkpoint, pid_alive, run_config

LOG_LINES = 10
SPARKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 40
BEAT_FRESH_S = 60  # a heartbeat from another host, outside Slurm, this recent means running
QUEUED = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")
ACTIVE = ("CONFIGURING", "RUNNING", "COMPLETING", "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING",
          "STAGE_OUT")


@dataclass(frozen=True)
class Verdict:
    """state: running, pending, stopped by request, finished, failed, out of requeues, stopped,
    cancelled or not started; text: the sentence for people, starting with the state."""

    state: str
    text: str
    hint: str = ""

    @property
    def line(self) -> str:
        return f"{self.text}; {self.hint}" if self.hint else self.text


def status(target: str, follow: bool = False, interval: float = 10.0, runs: Path | None = None) -> None:
    run_dir, job_id = resolve_target(target, runs)
    while True:
        text = render(run_dir, job_id or latest_job(run_dir))
        if not follow:
            print(text, flush=True)
            return
        print("\033[2J\033[H" + text, flush=True)  # clear the screen, then redraw
        time.sleep(interval)


def runs_root(runs: Path | None = None) -> Path | None:
    """Where a run's NAME is looked up: `runs` (a config's run.dir), else run.dir's default."""
    import os
    home = os.environ.get("LLMTRAIN_HOME")
    return runs or (Path(home) / "runs" if home else None)


def resolve_target(target: str, runs: Path | None = None) -> tuple[Path, str | None]:
    if re.fullmatch(r"\d+(_\d+)?", target):  # a job, or a job array's task (squeue's 4242_3)
        fields = _scontrol(target)
        if not fields.get("StdOut") or not fields.get("ArrayTaskId", "0").isdigit():  # unsplit tasks
            raise UserError(f"job {target}: unknown to Slurm (it forgets finished jobs after "
                            f"MinJobAge), or an array task that has not started; pass the run "
                            f"directory instead")
        # The log is <run_dir>/<name>-<jobid>.out (submit.sh): a prepare job stands for its run.
        run_dir = Path(fields["StdOut"]).parent
        job = fields.get("JobId", target)
        return run_dir, None if fields.get("JobName", "").startswith("prepare-") else job
    run_dir = Path(target)
    root = runs_root(runs)
    if not run_dir.is_dir() and "/" not in target and root and (root / target).is_dir():
        run_dir = root / target  # a run's name
    if not run_dir.is_dir():
        where = f", nor a run in {root}" if root and "/" not in target else ""
        raise UserError(f"{target}: no such run directory, not a job id{where}; give the run "
                        f"directory, <run.dir>/<run.name>, or --config FILE for its run.dir")
    return run_dir.resolve(), None  # the paths it prints work from anywhere


def latest_job(run_dir: Path) -> str | None:
    """The newest training job of the run: one that logged into it (<name>-<jobid>.out), or one
    Slurm knows that would have (its log file appears only when it starts): queued, or ended
    before it started (a pending job cancelled), as the job's id shows it."""
    jobs = [m.group(1) for p in run_dir.glob("*-*.out") if not p.name.startswith("prepare-")
            for m in [re.fullmatch(r".+-(\d+)\.out", p.name)] if m]
    queued = _queued_jobs(run_dir)  # {id: state}
    running = [job for job, state in queued.items() if state in ACTIVE]
    if running:  # a job that trains the run says more than a newer one waiting behind it
        return max(running, key=int)
    jobs += list(queued)
    return max(jobs, key=int) if jobs else None


def _queued_jobs(run_dir: Path) -> dict[str, str]:
    """The run's jobs Slurm knows, and their states: those named as the run, in the queue or
    ended within MinJobAge (squeue --states all: what `scontrol show job` of its id still finds),
    and a sweep point's task of its job array (named as the sweep; submitted/array.json says which)."""
    if not shutil.which("squeue"):
        return {}
    out = _run(["squeue", "-h", "-t", "all", "-n", _run_name(run_dir), "-o", "%i|%T"]) or ""
    jobs = dict(line.split("|", 1) for line in out.split() if "|" in line)
    queued = {job: state for job, state in jobs.items()
              if Path(_scontrol(job).get("StdOut", "/")).parent.resolve() == run_dir.resolve()}
    task = read_json(run_dir / "submitted" / ARRAY_TASK)
    if isinstance(task, dict) and "array_job_id" in task:
        queued.update({job: state for index, (job, state) in array_tasks(str(task["array_job_id"])).items()
                       if index == str(task.get("index"))})
    return queued


ARRAY_TASK = "array.json"  # in a sweep point's run_dir/submitted: {"array_job_id", "index"}


def array_tasks(array_job_id: str) -> dict[str, tuple[str, str]]:
    """{task index: (its job id, state)} of a job array's tasks still in Slurm's queue (a task
    not started yet has the array's id)."""
    out = _run(["squeue", "-h", "-r", "-j", array_job_id, "-o", "%K|%A|%T"]) if shutil.which("squeue") else None
    tasks = {}
    for line in (out or "").splitlines():
        index, job_id, state = (line.split("|") + ["", ""])[:3]
        tasks[index] = (job_id, state)
    return tasks


def job_state(job_id: str) -> tuple[str, str, str]:
    """(state, Slurm's reason, which tool said so)."""
    # An array's id also matches its other tasks (the last task started runs under the array's
    # own id): the line whose own job id is this one, else the first (pending, unsplit tasks).
    if shutil.which("squeue"):
        out = _run(["squeue", "-h", "-j", job_id, "-o", "%A|%T|%r"])
        if out:
            lines = [line.split("|", 2) for line in out.splitlines() if line.count("|") == 2]
            if lines:
                _, state, reason = next((x for x in lines if x[0] == job_id), lines[0])
                return state, reason, "squeue"
    if shutil.which("sacct"):
        out = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "JobIDRaw,State"])
        if out and "disabled" not in out:
            rows = [line.split("|") for line in out.splitlines() if "|" in line]
            if rows:
                return next((r for r in rows if r[0] == job_id), rows[0])[1].split()[0], "", "sacct"
    fields = _scontrol(job_id)
    if fields.get("JobState"):
        return fields["JobState"], fields.get("Reason", ""), "scontrol"
    return "UNKNOWN", "", "no Slurm record"


def assess(run_dir: Path, job_id: str | None, slurm: tuple[str, str, str] | None = None) -> Verdict:
    """Whether the run is pending, running, stopped by request, finished, failed, ...: Slurm
    first (while it queues or runs the job), then the trainer's own record of its stop."""
    state, reason, _ = slurm or (job_state(job_id) if job_id else ("UNKNOWN", "", ""))
    stop = read_json(RunPaths(run_dir).exit)
    if stop and stop.get("job_id") not in (None, job_id):
        stop = None  # another job's stop: this one did not get that far
    if stop and state in ACTIVE and _mtime(RunPaths(run_dir).exit) < _job_start(job_id):
        stop = None  # the stop before a requeue: this attempt has not stopped yet
    beat = read_json(RunPaths(run_dir).heartbeat) or {}
    run = _Run(run_dir, job_id, run_config(run_dir).get("train", {}).get("max_steps"),
               stop["step"] if stop else max(_last_step(run_dir), int(beat.get("step", 0))))
    if state in QUEUED:
        return _pending(run, stop, reason or state)
    if state in ACTIVE or (state == "UNKNOWN" and not stop and _beating(run_dir)):
        return _running(run, stop)
    if stop:
        return _stopped(run, stop)
    return _ended(run, state)


@dataclass(frozen=True)
class _Run:
    dir: Path
    job_id: str | None
    total: int | None  # train.max_steps of the latest start (None before any)
    step: int  # where it stopped, else the last step logged

    @property
    def job(self) -> str:
        return f" (job {self.job_id})" if self.job_id else ""

    def at(self, word: str = "at", step: int | None = None) -> str:
        step = self.step if step is None else step
        if not step:
            return "before its first step"
        return f"{word} step {step} of {self.total}" if self.total else f"{word} step {step}"


def _pending(run: _Run, stop: dict | None, reason: str) -> Verdict:
    if stop and stop.get("requeue"):
        return Verdict("pending", f"pending{run.job}: requeued after a stop {run.at()} "
                       f"({stop['reason']}); it resumes from its checkpoint when it starts")
    if reason == "DependencyNeverSatisfied":
        return Verdict("pending", f"pending{run.job} forever: a job it waits for failed (the "
                       f"prepare job? see {run.dir}/prepare-*.out)", f"scancel {run.job_id}")
    return Verdict("pending", f"pending{run.job} in the Slurm queue (reason: {reason})")


def _running(run: _Run, stop: dict | None) -> Verdict:
    if stop:
        return Verdict("running", f"running{run.job}: the trainer stopped {run.at()} "
                       f"({stop['reason']}); the job is ending")
    beat = read_json(RunPaths(run.dir).heartbeat)
    if not beat or float(beat.get("time", 0)) < _job_start(run.job_id):  # an earlier attempt's
        return Verdict("running", f"running{run.job}: starting up, no step yet")
    age = time.time() - float(beat.get("step_time") or beat["time"])  # since the last step began
    quiet = (f"; no new step for {age:.0f}s (saving, evaluating or stuck? see {run.dir}/logs/)"
             if age > BEAT_FRESH_S else "")
    step = max(run.step, int(beat.get("step", 0)))
    where = run.at(step=step) if step else "in its first step"
    return Verdict("running", f"running{run.job} {where}{quiet}")


def _stopped(run: _Run, stop: dict) -> Verdict:
    """The trainer recorded why it stopped (Control.exit)."""
    again = f"{'submit' if run.job_id else 'launch'} the same config again to continue"
    if stop["reason"] == "done":
        return Verdict("finished", f"finished{run.job}: {run.step} of {run.total or run.step} steps")
    if stop["reason"] == "user":
        return Verdict("stopped by request", f"stopped by request {run.at()}{run.job}", again)
    gave_up = _log_search(_job_log(run.dir, run.job_id), r"not requeueing: (.*)")
    if stop.get("requeue") and gave_up:
        return Verdict("out of requeues", f"out of requeues{run.job}: stopped {run.at()} "
                       f"({stop['reason']}) and not requeued: {gave_up}", again)
    return Verdict("stopped", f"stopped {run.at()} ({stop['reason']}){run.job}", again)


def _ended(run: _Run, state: str) -> Verdict:
    """No record of a stop: the job or the launch ended another way, or never started."""
    prep_failed = None if run.step else _prepare_failure(run.dir)
    if state == "CANCELLED":  # by scancel, or by Slurm when a job it waited for failed
        return Verdict("cancelled", f"cancelled{run.job} {run.at()}"
                       + (f": {prep_failed}" if prep_failed else ""))
    if state == "COMPLETED" and run.total and run.step == run.total:
        return Verdict("finished", f"finished{run.job}: {run.step} of {run.total} steps")
    error = _error_line(run.dir, run.job_id)
    if state != "UNKNOWN" or error or run.step:
        said = ", ".join(x for x in (run.job_id and f"job {run.job_id}",
                                     state not in ("UNKNOWN", "COMPLETED") and f"Slurm: {state}") if x)
        where = error or (f"no error line found; see {_job_log(run.dir, run.job_id)}" if run.job_id
                          else f"it ended without recording a stop (an error or a kill: see the "
                          f"launch's output, or {run.dir}/logs/)")
        return Verdict("failed", f"failed{f' ({said})' if said else ''} {run.at('after')}: {where}")
    if RunPaths(run.dir).rank_log(0).exists():
        return Verdict("not started", f"not started: no step logged yet (starting up, or it ended "
                       f"before its first step; see {run.dir}/logs/rank-0.log)")
    if prep_failed:  # the training job never started: Slurm cancelled it (--kill-on-invalid-dep)
        return Verdict("failed", f"failed before its first step: {prep_failed}")
    return Verdict("not started", "not started: no job and no step logged yet")


PREPARE_FAILED = ("FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "CANCELLED", "BOOT_FAIL", "DEADLINE")


def _prepare_log(run_dir: Path) -> Path | None:
    """The log of the run's latest prepare job, <run_dir>/prepare-<job id>.out."""
    preps = sorted(run_dir.glob("prepare-*.out"), key=lambda p: int(p.stem.split("-")[-1]))
    return preps[-1] if preps else None


def _prepare_failure(run_dir: Path) -> str | None:
    """How the run's latest prepare job failed, and where its log is; None where it did not (or
    left no log). Its error line: llmtrain's own (error: ..., or a config key's), else Slurm's
    (slurmstepd's time limit or memory kill), else a traceback's exception; its state: Slurm's,
    while Slurm knows the job."""
    log = _prepare_log(run_dir)
    if log is None:
        return None
    lines = log.read_text(errors="replace").splitlines()
    patterns = (r"((?:error: |[a-z_]+\.[a-z_.]+: ).*)", r"slurmstepd: (error: .*)")
    line = next((m.group(1) for pattern in patterns for text in lines
                 for m in [re.match(pattern, text)] if m), None) or next(
        (text for text in reversed(lines) if re.match(r"\w+(Error|Exception|Interrupt)\b", text)), None)
    job = log.stem.split("-")[-1]
    state = job_state(job)[0]
    if state == "COMPLETED" or (not line and state not in PREPARE_FAILED):
        return None
    said = f" (Slurm: {state})" if state in PREPARE_FAILED else ""
    return f"its prepare job {job} failed{said}" + (f": {line}" if line else "") + f" (see {log})"


def render(run_dir: Path, job_id: str | None) -> str:
    cfg = run_config(run_dir)
    lines = [f"run: {cfg.get('run', {}).get('name', run_dir.name)}  ({run_dir})"]
    slurm = job_state(job_id) if job_id else None
    verdict = assess(run_dir, job_id, slurm)
    lines.append(f"state: {verdict.line}")
    if slurm:
        lines.append(f"job: {job_id} {slurm[0]} ({slurm[2]})")
    records = read_metrics(run_dir)
    lines += _progress(records, cfg.get("train", {}).get("max_steps"), verdict.state == "running")
    lines += _watching(run_dir, bool(records))
    ckpts = [p.name for p in reversed(complete_checkpoints(run_dir / CHECKPOINTS))]
    pointer = latest_checkpoint(run_dir / CHECKPOINTS)
    lines.append("checkpoints: " + (", ".join(f"{c}{' (latest)' if c == pointer else ''}"
                                              for c in ckpts) or "none yet"))
    # The training job's log, else the trainer's, else (no training yet) the prepare job's.
    log = next((p for p in (_job_log(run_dir, job_id), RunPaths(run_dir).rank_log(0),
                            _prepare_log(run_dir)) if p and p.exists()), None)
    if log:
        tail = log.read_text(errors="replace").splitlines()[-LOG_LINES:]
        lines.append(f"log: {log} (last {len(tail)} lines)")
        lines += [f"  {line}" for line in tail]
    return "\n".join(lines)


def _progress(records: list[dict], max_steps: int | None, running: bool) -> list[str]:
    train, evals = None, None
    for record in records:
        if record.get("kind") == "train":
            train = record
        elif record.get("kind") == "eval":
            evals = record
    if train is None:
        return ["progress: no step logged yet"]
    eta = train.get("eta_s")
    share = f"/{max_steps} ({100 * train['step'] / max_steps:.0f}%)" if max_steps else ""
    out = [f"progress: step {train['step']}{share}, loss {train['loss']:.4f}, "
           f"{train['tokens_per_sec']:,.0f} tok/s"
           + (f", eta {format_duration(eta)}" if running and eta is not None else "")]
    curve = [r["loss"] for r in records if r.get("kind") == "train"]
    out.append(f"loss: {sparkline(curve)} {curve[0]:.4f} -> {curve[-1]:.4f} over {len(curve)} logged steps")
    if evals:
        out.append(f"eval: step {evals['step']}, eval_loss {evals['eval_loss']:.4f}")
    return out


def sparkline(values: list[float], width: int = SPARK_WIDTH) -> str:
    """The trend in one line: `values` averaged into at most `width` bins, one block each; a bin
    with a NaN or inf is `!`."""
    bins = min(width, len(values))
    means = [sum(chunk) / len(chunk) for chunk in
             (values[i * len(values) // bins:(i + 1) * len(values) // bins] for i in range(bins))]
    finite = [m for m in means if math.isfinite(m)] or [0.0]
    low, high = min(finite), max(finite)
    span = (high - low) or 1.0
    return "".join(SPARKS[round((m - low) / span * (len(SPARKS) - 1))] if math.isfinite(m) else "!"
                   for m in means)


def _watching(run_dir: Path, logged: bool) -> list[str]:
    """Where else to look: the plot, TensorBoard and the W&B run."""
    out = []
    plot = run_dir / "plot.png"
    if plot.exists():
        out.append(f"plot: {plot} (drawn {time.strftime('%H:%M:%S', time.localtime(_mtime(plot)))})")
    elif logged:
        out.append(f"plot: none yet; draw one with: llmtrain plot {run_dir}")
    if (run_dir / "tensorboard").is_dir():
        out.append(f"tensorboard: tensorboard --logdir {run_dir}")
    wandb = read_json(run_dir / "wandb-run.json")
    if wandb and "where" in wandb:
        offline = wandb.get("mode") == "offline"
        out.append(f"W&B: run {wandb['id']} ({wandb.get('name')}, project {wandb.get('project')}), "
                   + (f"offline; sync it with: {wandb['where']}" if offline else wandb["where"]))
    return out


def _last_step(run_dir: Path) -> int:
    return max((r.get("step", 0) for r in read_metrics(run_dir)), default=0)


def _beating(run_dir: Path) -> bool:
    """Rank 0's heartbeat is live: its process runs (same host), or it beat within BEAT_FRESH_S."""
    beat = read_json(RunPaths(run_dir).heartbeat)
    if not beat:
        return False
    if beat.get("host") == socket.gethostname() and "pid" in beat:
        return pid_alive(beat["pid"])
    return time.time() - float(beat.get("time", 0)) < BEAT_FRESH_S


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _job_start(job_id: str | None) -> float:
    """When the job's latest attempt started (a requeued job starts again), else 0."""
    start = _scontrol(job_id).get("StartTime", "") if job_id else ""
    try:
        return time.mktime(time.strptime(start, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return 0.0


def _job_log(run_dir: Path, job_id: str | None) -> Path | None:
    logs = sorted(run_dir.glob(f"*-{job_id}.out")) if job_id else []
    return logs[0] if logs else None


def _last_attempt(log: Path | None) -> list[str]:
    """The lines of the job's latest attempt (a requeued job appends to the same log)."""
    if log is None or not log.exists():
        return []
    lines = log.read_text(errors="replace").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("llmtrain job ")]
    return lines[starts[-1]:] if starts else lines


def _log_search(log: Path | None, pattern: str) -> str | None:
    """The first match's group 1 in the job's latest attempt."""
    return next((m.group(1) for line in _last_attempt(log) for m in [re.search(pattern, line)] if m),
                None)


def _error_line(run_dir: Path, job_id: str | None) -> str | None:
    """The trainer's first `error: ...` line: from `logs/error.txt` (cli.cmd_train writes it;
    submit.sh and train.slurm remove it at each start), else the job's log (stderr goes there),
    else the rank logs since their last start."""
    try:
        found = RunPaths(run_dir).error.read_text().splitlines()[0] or None
    except (OSError, IndexError):
        found = None
    found = found or _log_search(_job_log(run_dir, job_id), r"^(?:.*\] )?(error: .*)")
    for log in sorted(RunPaths(run_dir).logs.glob("rank-*.log")) if not found else []:
        lines = log.read_text(errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if "] run_dir: " in line]
        found = next((m.group(1) for line in lines[starts[-1] if starts else 0:]
                      for m in [re.search(r"\] (error: .*)", line)] if m), None)
        if found:
            break
    return found


def _run_name(run_dir: Path) -> str:
    return run_config(run_dir).get("run", {}).get("name") or run_dir.name


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
