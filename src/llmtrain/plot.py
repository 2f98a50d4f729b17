"""`llmtrain plot RUN_DIR [RUN_DIR ...] [--out FILE.png]`: a run's curves on one figure, or
several runs' on the same axes to compare them.

Eight panels, from metrics.jsonl: loss and eval loss against steps and against tokens (log
scale), eval loss alone, learning rate, gradient norm (log scale), tokens/s, MFU and peak memory.
A run also redraws <run_dir>/plot.png at each evaluation (metrics.plot_every_eval), in a child
process (tracking.PlotRefresher). matplotlib's object API only (no pyplot: no global state, no
display); imports no torch. The image is written atomically.
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import UserError
from .metrics import read_metrics
from .rundir import run_config

# (metrics key, panel title, y-axis label, log scale)
SERIES = [
    ("lr", "Learning rate", "lr", False),
    ("grad_norm", "Gradient norm (before clipping)", "norm", True),
    ("tokens_per_sec", "Throughput", "tokens/s (all ranks)", False),
    ("mfu", "Model FLOPs utilisation", "MFU (%)", False),
    ("peak_mem_gib", "Peak memory (the rank using the most)", "GiB", False),
]


class Run:
    def __init__(self, run_dir: Path):
        self.dir = run_dir
        records = read_metrics(run_dir)
        self.train = [r for r in records if r.get("kind") == "train"]
        self.evals = [r for r in records if r.get("kind") == "eval"]
        cfg = run_config(run_dir)
        self.name = (cfg.get("run") or {}).get("name") or run_dir.name
        self.max_steps = (cfg.get("train") or {}).get("max_steps")

    def tokens_at(self, steps: list[int]) -> list[float]:
        """Tokens seen at each step, from the train records (eval records carry no count)."""
        per_step = self.train[-1]["tokens"] / self.train[-1]["step"] if self.train else 0
        return [s * per_step for s in steps]

    def summary(self) -> str:
        last = self.train[-1]
        text = f"{self.name}: step {last['step']}" + (f"/{self.max_steps}" if self.max_steps else "")
        text += f", loss {last['loss']:.4f}"
        if self.evals:
            text += f", eval {self.evals[-1]['eval_loss']:.4f}"
        return text


def plot(run_dirs: list[str], out: str | None = None) -> Path:
    runs = []
    for d in run_dirs:
        path = Path(d)
        if not path.is_dir():
            raise UserError(f"{d}: no such run directory")
        run = Run(path)
        if not run.train:
            raise UserError(f"{d}: nothing to plot yet (no step in {path / 'metrics.jsonl'}); wait for "
                            f"the first logged step (train.log_every)")
        runs.append(run)
    if len({r.name for r in runs}) < len(runs):  # the same run.name under different run.dir
        for r in runs:
            r.name = str(r.dir)
    target = Path(out) if out else (runs[0].dir / "plot.png" if len(runs) == 1 else Path("runs.png"))
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import EngFormatter, FuncFormatter
    except ImportError:
        raise UserError("llmtrain plot needs matplotlib: pip install matplotlib") from None

    fig = Figure(figsize=(20, 9), layout="constrained")
    axes = fig.subplots(2, 4).flatten()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    loss_step, loss_tokens, eval_ax = axes[0], axes[1], axes[2]
    for run, color in zip(runs, colors):
        steps = [r["step"] for r in run.train]
        loss_step.plot(steps, [r["loss"] for r in run.train], color=color, lw=1.2, label=f"{run.name} train")
        loss_tokens.plot(run.tokens_at(steps), [r["loss"] for r in run.train], color=color, lw=1.2,
                         label=f"{run.name} train")
        if run.evals:
            e_steps, e_loss = [r["step"] for r in run.evals], [r["eval_loss"] for r in run.evals]
            for ax, xs in ((loss_step, e_steps), (loss_tokens, run.tokens_at(e_steps)), (eval_ax, e_steps)):
                ax.plot(xs, e_loss, color=color, ls="--", marker="o", ms=3, label=f"{run.name} eval")
    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 5, 6, 0.5: not 5 x 10^0 on a log axis

    def log_y(ax):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)

    loss_step.set(title="Loss", xlabel="step", ylabel="loss (nats/token)")
    loss_tokens.set(title="Loss against tokens seen", xlabel="tokens", ylabel="loss (nats/token)")
    log_y(loss_step)
    log_y(loss_tokens)
    loss_tokens.xaxis.set_major_formatter(EngFormatter())
    eval_ax.set(title="Eval loss", xlabel="step", ylabel="loss (nats/token)")
    if not any(run.evals for run in runs):
        _empty(eval_ax, "no evaluation yet (train.eval_every)")

    for ax, (key, title, ylabel, log) in zip(axes[3:], SERIES):
        drawn = False
        for run, color in zip(runs, colors):
            points = [(r["step"], r[key] * (100 if key == "mfu" else 1)) for r in run.train
                      if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), color=color, lw=1.2, label=run.name)
                drawn = True
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        if key == "tokens_per_sec":
            ax.yaxis.set_major_formatter(EngFormatter())
        if drawn and log:
            log_y(ax)
        if not drawn:
            _empty(ax, "no MFU: a CPU run, or a GPU without a peak in the table\n(set train.peak_tflops)"
                   if key == "mfu" else "not logged")
    for ax in axes:
        ax.grid(True, which="major", alpha=0.3)
    loss_step.legend(fontsize=8)
    fig.suptitle(runs[0].summary() if len(runs) == 1 else f"{len(runs)} runs: " + "; ".join(
        r.summary() for r in runs), fontsize=11)

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        fig.savefig(tmp, dpi=80, format="png")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
