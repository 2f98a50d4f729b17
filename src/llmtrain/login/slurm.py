"""The sbatch command lines of a run, computed from its config; `llmtrain submit`, `sweep` and
`requeue` (train.slurm's continuation) run them.

    llmtrain sbatch-command train --config FILE [--set ...] [--frozen F] [--after ID] [-- ARGS]

prints one command (`env VAR=... sbatch ... train.slurm`), NUL-separated (`--shell`: quoted for
reading). There are three jobs:

    prepare       one node, one task, no GPUs: tokenizes the data when it is not prepared yet
    train         the training job; --after ID makes it wait for the prepare job (afterok)
    continuation  the training job again, after this one (afterany), where requeue is refused
                  or the trainer asked to leave slow nodes out (--exclude: excluded_nodes)

The job's environment is this contract, set by the command and read by train.slurm only:

    LLMTRAIN_CONFIG         the frozen config the job trains from (submitted/<stamp>.yaml)
    LLMTRAIN_HOME           the llmtrain home (env.sh, venv, models, datasets)
    LLMTRAIN_RUN_DIR        <run.dir>/<run.name>
    LLMTRAIN_PROCS_PER_NODE slurm.procs_per_node, else slurm.gpus_per_node
    LLMTRAIN_MAX_REQUEUES   slurm.max_requeues
    LLMTRAIN_MAX_RESTARTS   slurm.max_restarts
    LLMTRAIN_STEP           prepare or train
    LLMTRAIN_CONTINUATION   how many continuation jobs came before this one (0 for the first)

Arguments after `--` (and slurm.extra_args) go to sbatch verbatim; the frozen config keeps them
in slurm.extra_args, so a continuation asks for what the first job asked for. No torch here.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from ..config import Config
from ..files import read_json
from ..rundir import SHELL_NAMES, RunPaths
from ..files import write_atomic

JOBS = ("prepare", "train", "continuation")


def with_extra_args(cfg: Config, extra: list[str]) -> Config:
    """The config with sbatch arguments given on the command line appended to slurm.extra_args."""
    if not extra:
        return cfg
    slurm = dataclasses.replace(cfg.slurm, extra_args=[*cfg.slurm.extra_args, *extra])
    return dataclasses.replace(cfg, slurm=slurm)


def job_env(cfg: Config, frozen: Path, home: str, step: str, continuation: int = 0) -> dict[str, str]:
    s = cfg.slurm
    return {"LLMTRAIN_CONFIG": str(frozen), "LLMTRAIN_HOME": home, "LLMTRAIN_RUN_DIR": str(cfg.run_dir),
            "LLMTRAIN_PROCS_PER_NODE": str(s.procs_per_node or s.gpus_per_node or 1),
            "LLMTRAIN_MAX_REQUEUES": str(s.max_requeues), "LLMTRAIN_MAX_RESTARTS": str(s.max_restarts),
            "LLMTRAIN_STEP": step, "LLMTRAIN_CONTINUATION": str(continuation), **SHELL_NAMES}


def sbatch_command(cfg: Config, job: str, *, script: Path, frozen: Path, home: str,
                   after: str | None = None, dependency: str | None = None,
                   continuation: int = 0, array: str | None = None) -> list[str]:
    """`env VAR=... sbatch ARGS script` for one of JOBS. `after`: the job(s) this one waits for
    (the prepare job of a train job, id:id:... for several; the ending job of a continuation);
    `dependency`: the user's own --dependency, for the first job submitted. `array`: a sweep's
    job array of train jobs (e.g. "0-5%2"): run.name ends in -%a, which each task's index
    replaces in its paths (sbatch in --output, train.slurm in the LLMTRAIN_* paths), and the
    array is named run.name less the -%a."""
    if job not in JOBS:
        raise ValueError(f"job must be one of {JOBS} (got {job!r})")
    s, name, run_dir = cfg.slurm, cfg.run.name, cfg.run_dir
    place = [f"--{key}={value}" for key, value in
             (("partition", s.partition), ("account", s.account), ("qos", s.qos)) if value]
    if job == "prepare":
        # Its own CPUs and time (prepare_resources), the training job's memory and place; one
        # task on one node; no GPUs, so none of the user's GPU requests either; no warning signal
        # (the prepare step has no trap).
        cpus, limit, _ = prepare_resources(cfg)
        args = [f"--cpus-per-task={cpus}", f"--mem={s.mem}", f"--time={limit}",
                "--requeue", "--open-mode=append", *place, *without_gpus(s.extra_args),
                f"--job-name=prepare-{name}", "--nodes=1", "--ntasks=1",
                f"--output={run_dir}/prepare-%j.out"]
        waits = [f"--dependency={dependency}"] if dependency else []
    else:
        output = f"{run_dir}/{name}-%j.out" if array else f"{run_dir}/%x-%j.out"
        args = [f"--job-name={name.removesuffix('-%a')}", f"--nodes={s.nodes}", "--ntasks-per-node=1",
                f"--cpus-per-task={s.cpus_per_node}", f"--mem={s.mem}", f"--time={s.time}",
                f"--output={output}", "--open-mode=append", "--requeue"]
        if array:
            args.append(f"--array={array}")
        if s.signal_lead_s > 0:  # Slurm's warning to the batch shell, before the time limit
            args.append(f"--signal=B:USR1@{s.signal_lead_s}")
        if s.gpus_per_node > 0:
            args.append(f"--gpus-per-node={s.gpus_per_node}")
        args += [*place, *s.extra_args]
        if job == "continuation":
            waits = [f"--dependency=afterany:{after}"]
        elif after:  # a failed prepare job cancels training instead of leaving it pending
            waits = [f"--dependency=afterok:{after}", "--kill-on-invalid-dep=yes"]
        else:
            waits = [f"--dependency={dependency}", "--kill-on-invalid-dep=yes"] if dependency else []
    env = job_env(cfg, frozen, home, "prepare" if job == "prepare" else "train",
                  continuation + (job == "continuation"))
    return ["env", *(f"{k}={v}" for k, v in env.items()), "sbatch", "--parsable", *args, *waits,
            str(script)]


# Text a CPU tokenizes per second in prepare, on the slow side: measured 1.4-2.5M tokens/s on 2
# cores end to end, ~4 bytes a token (doc/benchmarks.md), i.e. ~3 MB/s a CPU; a third of that
# leaves room for a slower tokenizer, chat templates and the source's Arrow conversion.
PREPARE_BYTES_PER_S_PER_CPU = 1e6
PREPARE_MIN_S = 1800  # start-up, the tokenizer, the manifest: a small corpus still gets 30 min
UNCOMPRESSED = 4  # a compressed source file (.gz, .bz2, .xz, .parquet) holds about this much more text


def prepare_resources(cfg: Config) -> tuple[int, str, str]:
    """The prepare job's (CPUs, time limit, why that limit): slurm.prepare_cpus, else
    slurm.cpus_per_node; slurm.prepare_time, else the source's size at
    PREPARE_BYTES_PER_S_PER_CPU (a 100B-token corpus, ~400 GB of text, on 32 CPUs: 3.5 h; it
    took the training job's limit, and timed out)."""
    from ..data.sources import local_path, source_listing
    from .feasibility import format_limit
    s = cfg.slurm
    cpus = s.prepare_cpus or s.cpus_per_node
    if s.prepare_time is not None:
        return cpus, s.prepare_time, "slurm.prepare_time"
    sources = []
    for d in (one.data for one in cfg.source_configs()):  # a mixture's sources, all
        sources.append(local_path(d.dataset, "datasets"))
        if d.validation and Path(d.validation).exists():
            sources.append(Path(d.validation))
    size = 0
    for source in sources:
        for name, nbytes, _ in source_listing(source) if source.exists() else []:
            compressed = name.endswith((".gz", ".bz2", ".xz", ".zst", ".parquet"))
            size += nbytes * (UNCOMPRESSED if compressed else 1)
    seconds = max(PREPARE_MIN_S, 600 + size / (cpus * PREPARE_BYTES_PER_S_PER_CPU))
    seconds = -(-seconds // 600) * 600  # whole 10 minutes
    return cpus, format_limit(seconds), f"~{size / 1e9:,.1f} GB of text on {cpus} CPUs"


def without_gpus(args: list[str]) -> list[str]:
    """sbatch arguments less their GPU requests: --gpus*, -G, --gpu-*, --cpus-per-gpu,
    --mem-per-gpu (each with its value), and the gpu entries of a --gres."""
    out, rest = [], list(args)
    while rest:
        arg = rest.pop(0)
        if arg == "--gres" or arg.startswith("--gres="):
            spec = (rest.pop(0) if rest else "") if arg == "--gres" else arg.removeprefix("--gres=")
            kept = [e for e in spec.split(",") if e and not e.startswith("gpu")]
            out += [f"--gres={','.join(kept)}"] if kept else []
        elif arg.startswith(("--gpus", "--gpu-", "--cpus-per-gpu", "--mem-per-gpu")) or arg == "-G":
            if "=" not in arg and rest:
                rest.pop(0)  # its value
        elif not arg.startswith("-G"):
            out.append(arg)
    return out


def requeue_decision(run_dir: Path, job_id: str, restarts: int, max_requeues: int,
                     planned: int = 0) -> tuple[bool, str]:
    """Whether the job should come back after its step ended, and the line that says so. Only a
    stop this job's trainer recorded (control/exit.json) asks; a missing or torn file is a no.
    `restarts`: the job's launches before this one (requeues and continuations), `planned` of
    them at the time limit. A stop at the time limit that trained (reason "deadline") is the plan
    of a run longer than one allocation, not a failure: it always comes back and is not counted;
    slurm.max_requeues bounds the others (preemptions, signals, slow nodes, and a time-limit stop
    that trained nothing), against a loop that never progresses."""
    stop = read_json(RunPaths(run_dir).exit)
    if not (isinstance(stop, dict) and stop.get("requeue") is True and str(stop.get("job_id")) == job_id):
        return False, ""
    counted = max(0, restarts - planned)
    if is_planned(stop):
        return True, (f"requeueing job {job_id} at its time limit (planned; slurm.max_requeues counts "
                      f"the other requeues: {counted} of {max_requeues} so far)")
    if counted >= max_requeues:
        return False, (f"not requeueing: the job was requeued {counted} time{'s' * (counted != 1)} "
                       f"already for preemption or signals (slurm.max_requeues; time-limit requeues "
                       f"are not counted)")
    if exclude := excluded_nodes(run_dir, job_id):
        return True, (f"requeueing job {job_id} without {', '.join(exclude)} (slow in the "
                      f"preflight) as a continuation job (requeue {counted + 1} of at most "
                      f"{max_requeues})")
    return True, f"requeueing job {job_id} (requeue {counted + 1} of at most {max_requeues})"


def is_planned(stop: dict) -> bool:
    """A stop at the job's time limit after this launch trained (exit.json's `trained` steps;
    files from before it was recorded count as trained)."""
    return stop.get("reason") == "deadline" and stop.get("trained", 1) > 0




def planned_requeues(run_dir: Path, config: Path) -> int:
    """How many of this submission's launches came back at the time limit (a new submission,
    another frozen config, starts from 0)."""
    record = read_json(RunPaths(run_dir).requeues)
    if isinstance(record, dict) and record.get("config") == str(config):
        return int(record.get("planned", 0))
    return 0


def excluded_nodes(run_dir: Path, job_id: str | None) -> list[str]:
    """The nodes the trainer of `job_id` asked to leave out (a slow_node stop's `exclude` in
    control/exit.json: the slow nodes and those the job excluded already), which its
    continuation gets as --exclude; [] otherwise. Slurm refuses to change a running job's
    ExcNodeList, so such a job comes back as a continuation, never requeued in place."""
    stop = read_json(RunPaths(run_dir).exit)
    if not (job_id and isinstance(stop, dict) and str(stop.get("job_id")) == job_id):
        return []
    exclude = stop.get("exclude")
    return [str(node) for node in exclude] if isinstance(exclude, list) else []


def continuation_command(cfg: Config, after: str, *, script: Path, frozen: Path, home: str,
                         continuation: int = 0) -> list[str]:
    """The train job again, after job `after` ends; without the nodes its trainer asked to leave
    out (after the user's own sbatch arguments: the last --exclude wins)."""
    if exclude := excluded_nodes(cfg.run_dir, after):
        cfg = with_extra_args(cfg, [f"--exclude={','.join(exclude)}"])
    return sbatch_command(cfg, "continuation", script=script, frozen=frozen, home=home, after=after,
                          continuation=continuation)


def come_back(run_dir: Path, job_id: str, restarts: int, max_requeues: int, *, config: Path,
              script: Path, home: str, continuation: int, script_args: list[str]) -> int:
    """After the job's step (train.slurm): requeue the job if its trainer asked and requeues
    remain (`scontrol requeue`); where Slurm refuses, or to leave a slow node out (Slurm refuses to
    change a running job's ExcNodeList, and a requeue ends the batch script before it could
    change the requeued one's), submit a continuation job instead. Each decision is one line.
    Returns 1 only when a continuation was needed and sbatch refused it."""
    def say(line: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)

    planned = planned_requeues(run_dir, config)
    requeue, line = requeue_decision(run_dir, job_id, restarts, max_requeues, planned)
    if line:
        say(line)
    if not requeue:
        return 0
    if is_planned(read_json(RunPaths(run_dir).exit)):
        write_atomic(RunPaths(run_dir).requeues,
                     json.dumps({"config": str(config), "planned": planned + 1}) + "\n")
    if excluded_nodes(run_dir, job_id):
        why = "slow node left out"
    elif subprocess.run(["scontrol", "requeue", job_id]).returncode == 0:
        return 0
    else:
        why = "requeue refused"
    from ..config import ConfigError, load_config
    again = "submit the run again to resume it"
    try:
        cfg = load_config(config)
    except (ConfigError, OSError) as e:  # the frozen config gone or unreadable since the start
        problems = e.problems if isinstance(e, ConfigError) else [str(e)]
        print(f"error: no continuation job: {config}: {'; '.join(problems)}; {again}", file=sys.stderr, flush=True)
        return 1
    cmd = continuation_command(cfg, job_id, script=script, frozen=config, home=home, continuation=continuation)
    proc = subprocess.run([*cmd, *script_args], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        print(f"error: sbatch refused the continuation job (above); {again}", file=sys.stderr, flush=True)
        return 1
    say(f"{why}; submitted continuation job {proc.stdout.strip().split(';')[0]} (starts when this job ends)")
    return 0
