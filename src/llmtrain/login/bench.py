"""`llmtrain bench --config FILE --nprocs 1,2,4`: the same run on 1, 2, 4 processes of this
machine, a few steps each, as a markdown table of throughput, per-process throughput, peak memory
and scaling efficiency against one process. `--nodes 1,2,4`: the same as Slurm jobs on 1, 2, 4
nodes of slurm.procs_per_node processes each, one after another (each waits for the last:
afterany), so no row shares the nodes with another.

The global batch stays the config's (strong scaling: more processes, fewer accumulation steps),
so each row trains the same steps on the same samples. Each run is a real `llmtrain train` under
torchrun (as submit.sh --local starts it), or a job `llmtrain submit` queues (as submit.sh
does), in <run.dir>/<run.name>-scaling/<N>p (or <N>n), started afresh (train.resume: none); it
evaluates and saves nothing. Tokens/s is the median over the logged steps after the first
`--warmup` ones (start-up, compilation). Imports no torch.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ..config import Config, ConfigError, UserError, load_config
from ..metrics import read_metrics


@dataclasses.dataclass(frozen=True)
class Row:
    nprocs: int
    tokens_per_sec: float
    peak_mem_gib: float
    label: str = ""  # the first column, where it says more than the process count


def scaling_table(config: str, overrides: list[str], nprocs: list[int], steps: int, warmup: int) -> str:
    if steps <= warmup:
        raise UserError(f"--steps: must be more than --warmup ({warmup}) (got {steps})")
    if not nprocs or any(n < 1 for n in nprocs):
        raise UserError(f"--nprocs: a comma-separated list of process counts >= 1, like 1,2,4 (got {nprocs})")
    # Every world size checked before any run (the global batch must divide among its processes).
    cfgs = [load_config(config, overrides, world_size=n) for n in nprocs]
    return render([measure(cfg, config, overrides, n, steps, warmup) for cfg, n in zip(cfgs, nprocs)])


def bench_root(cfg: Config) -> Path:
    return Path(cfg.run.dir) / f"{cfg.run.name}-scaling"


def bench_sets(cfg: Config, overrides: list[str], name: str, steps: int) -> list[str]:
    """The overrides of one row's run: a fresh, short run that evaluates and saves nothing."""
    return [*overrides, f"run.dir={bench_root(cfg)}", f"run.name={name}", "train.resume=none", "train.epochs=null",
            f"train.max_steps={steps}", "train.warmup_steps=0", "train.log_every=1", "train.eval_every=0",
            "train.checkpoint_every=0", "metrics.plot_every_eval=false", "metrics.tensorboard=false",
            "metrics.wandb=null", "profile.start_step=null"]


def measured(run_dir: Path, nprocs: int, warmup: int, label: str = "") -> Row:
    train = [r for r in read_metrics(run_dir) if r.get("kind") == "train"]
    timed = [r["tokens_per_sec"] for r in train if r["step"] > warmup]
    return Row(nprocs, statistics.median(timed), max(r["peak_mem_gib"] for r in train), label)


def measure(cfg: Config, config: str, overrides: list[str], n: int, steps: int, warmup: int) -> Row:
    from .submit import thread_share, torchrun_command
    run_dir = bench_root(cfg) / f"{n}p"
    print(f"bench: {n} process{'es' if n > 1 else ''}, {steps} steps ...", file=sys.stderr, flush=True)
    proc = subprocess.run(torchrun_command(n, config, bench_sets(cfg, overrides, f"{n}p", steps)),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": thread_share(n)})
    if proc.returncode != 0:
        last = [line for line in proc.stderr.splitlines() if line.startswith("error:")] or proc.stderr.splitlines()[-1:]
        raise UserError(f"bench: the run on {n} processes failed ({run_dir}): "
                        f"{last[-1] if last else 'no output'}")
    return measured(run_dir, n, warmup)


def slurm_table(config: str, overrides: list[str], nodes: list[int], steps: int, warmup: int) -> str:
    """The rows as Slurm jobs on 1, 2, ... nodes, queued one after another, then waited for."""
    from .submit import refusals, submit
    if steps <= warmup:
        raise UserError(f"--steps: must be more than --warmup ({warmup}) (got {steps})")
    if not nodes or any(n < 1 for n in nodes):
        raise UserError(f"--nodes: a comma-separated list of node counts >= 1, like 1,2,4 (got {nodes})")
    cfgs = [load_config(config, [*overrides, f"slurm.nodes={n}"]) for n in nodes]
    for cfg in cfgs:  # every row checked before any is queued (the cluster may lack 64 nodes)
        refusals(cfg, config, offline=True, launch=False, cluster=True)
    jobs, after = [], None
    for cfg, n in zip(cfgs, nodes):
        job = submit(config, [*bench_sets(cfg, overrides, f"{n}n", steps), f"slurm.nodes={n}"],
                     dependency=after and f"afterany:{after}")
        print(f"bench: {n} node{'s' if n > 1 else ''} x {cfg.world_size // n}, {steps} steps: "
              f"job {job.job_id} ...", file=sys.stderr, flush=True)
        jobs.append((job, cfg))
        after = job.job_id
    rows = []
    for job, cfg in jobs:
        n, per = cfg.slurm.nodes, cfg.world_size // cfg.slurm.nodes  # procs_per_node, else the GPUs
        if (state := job.wait(poll_s=2)) != "finished":
            raise UserError(f"bench: the job on {n} node(s) is {state}: {job.status().splitlines()[1]} "
                            f"(log: {job.log})")
        rows.append(measured(job.run_dir, n * per, warmup, f"{n * per} ({n} x {per})"))
    return render(rows)


def render(rows: list[Row]) -> str:
    base = rows[0]
    lines = ["| processes | tokens/s | tokens/s per process | peak memory per process (GiB) | scaling efficiency |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        efficiency = (r.tokens_per_sec / r.nprocs) / (base.tokens_per_sec / base.nprocs)
        lines.append(f"| {r.label or r.nprocs} | {r.tokens_per_sec:,.0f} | {r.tokens_per_sec / r.nprocs:,.0f} | "
                     f"{r.peak_mem_gib:.2f} | {efficiency:.0%} |")
    return "\n".join(lines)


def parse_nprocs(text: str, flag: str = "--nprocs") -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError([f"{flag}: a comma-separated list of counts, like 1,2,4 (got {text!r})"]) from None
