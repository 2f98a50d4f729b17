"""`llmtrain bench --config FILE --nprocs 1,2,4`: the same run on 1, 2, 4 processes of this
machine, a few steps each, as a markdown table of throughput, per-process throughput, peak memory
and scaling efficiency against one process.

The global batch stays the config's (strong scaling: more processes, fewer accumulation steps),
so each row trains the same steps on the same samples. Each run is a real `llmtrain train` under
torchrun (as submit.sh --local starts it), in <run.dir>/<run.name>-scaling/<N>p, started afresh
(train.resume: none); it evaluates and saves nothing. Tokens/s is the median over the logged
steps after the first `--warmup` ones (start-up, compilation). Imports no torch.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
from pathlib import Path

from .config import Config, ConfigError, UserError, load_config
from .metrics import read_metrics


@dataclasses.dataclass(frozen=True)
class Row:
    nprocs: int
    tokens_per_sec: float
    peak_mem_gib: float


def scaling_table(config: str, overrides: list[str], nprocs: list[int], steps: int, warmup: int) -> str:
    if steps <= warmup:
        raise UserError(f"--steps: must be more than --warmup ({warmup}) (got {steps})")
    if not nprocs or any(n < 1 for n in nprocs):
        raise UserError(f"--nprocs: a comma-separated list of process counts >= 1, like 1,2,4 (got {nprocs})")
    # Every world size checked before any run (the global batch must divide among its processes).
    cfgs = [load_config(config, overrides, world_size=n) for n in nprocs]
    return render([measure(cfg, config, overrides, n, steps, warmup) for cfg, n in zip(cfgs, nprocs)])


def measure(cfg: Config, config: str, overrides: list[str], n: int, steps: int, warmup: int) -> Row:
    root = Path(cfg.run.dir) / f"{cfg.run.name}-scaling"
    sets = [*overrides, f"run.dir={root}", f"run.name={n}p", "train.resume=none", "train.epochs=null",
            f"train.max_steps={steps}",
            "train.warmup_steps=0", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0",
            "metrics.plot_every_eval=false", "metrics.tensorboard=false", "metrics.wandb=null",
            "profile.start_step=null"]
    cmd = [sys.executable, "-m", "llmtrain.training.torchrun", "--standalone", "--nproc-per-node", str(n),
           "-m", "llmtrain", "train", "--config", config, *(x for s in sets for x in ("--set", s))]
    print(f"bench: {n} process{'es' if n > 1 else ''}, {steps} steps ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get(
                              "OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // n)))})
    if proc.returncode != 0:
        last = [line for line in proc.stderr.splitlines() if line.startswith("error:")] or proc.stderr.splitlines()[-1:]
        raise UserError(f"bench: the run on {n} processes failed ({root / f'{n}p'}): "
                        f"{last[-1] if last else 'no output'}")
    train = [r for r in read_metrics(root / f"{n}p") if r.get("kind") == "train"]
    timed = [r["tokens_per_sec"] for r in train if r["step"] > warmup]
    return Row(n, statistics.median(timed), max(r["peak_mem_gib"] for r in train))


def render(rows: list[Row]) -> str:
    base = rows[0]
    lines = ["| processes | tokens/s | tokens/s per process | peak memory per process (GiB) | scaling efficiency |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        efficiency = (r.tokens_per_sec / r.nprocs) / (base.tokens_per_sec / base.nprocs)
        lines.append(f"| {r.nprocs} | {r.tokens_per_sec:,.0f} | {r.tokens_per_sec / r.nprocs:,.0f} | "
                     f"{r.peak_mem_gib:.2f} | {efficiency:.0%} |")
    return "\n".join(lines)


def parse_nprocs(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError([f"--nprocs: a comma-separated list of process counts, like 1,2,4 (got {text!r})"]) from None
