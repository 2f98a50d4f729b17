"""`llmtrain plot RUN_DIR [RUN_DIR ...] [--out FILE.png]`: a run's curves on one figure, or
several runs' on the same axes to compare them.

Eight panels, from metrics.jsonl: loss and eval loss against steps and against tokens (log
scale), eval loss alone, learning rate, gradient norm (log scale), tokens/s, MFU and peak memory;
a mixture's run (data.mixture) adds each source's eval loss to the eval panel and a ninth panel
of each source's tokens.
A sweep's point is labelled by its overrides (`lr=1e-3`), from the record of the sweep next to it
(`<run.dir>/*-sweep/sweep.json`). A log axis labels only the minor ticks that fit (matplotlib's
LogFormatter thresholds); the memory axis starts at 0 (0.411 -> 0.418 GiB is not a climb). A run
also redraws <run_dir>/plot.png at each evaluation (metrics.plot_every_eval), in a child process
(tracking.PlotRefresher). matplotlib's object API only (no pyplot: no global state, no display);
imports no torch. The image is written atomically.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import UserError
from ..files import read_json
from ..metrics import read_metrics
from ..rundir import run_config

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
        self.overrides = sweep_overrides(run_dir)
        self.label = self.overrides or self.name  # in the legends

    def tokens_at(self, steps: list[int]) -> list[float]:
        """Tokens seen at each step, from the train records (eval records carry no count)."""
        per_step = self.train[-1]["tokens"] / self.train[-1]["step"] if self.train else 0
        return [s * per_step for s in steps]

    def summary(self) -> str:
        last = self.train[-1]
        text = f"{self.name} ({self.overrides})" if self.overrides else self.name
        text += f": step {last['step']}" + (f"/{self.max_steps}" if self.max_steps else "")
        text += f", loss {last['loss']:.4f}"
        if self.evals:
            text += f", eval {self.evals[-1]['eval_loss']:.4f}"
        return text


def sweep_overrides(run_dir: Path) -> str | None:
    """A sweep point's overrides, short (`lr=1e-3, micro_batch_size=4`: a key's last part, or the
    whole key where two would read the same), from the record of the sweep it belongs to: a
    sweep's folder sits next to its points (login/sweep.py). None for a run of no sweep."""
    here = run_dir.resolve()
    for record in sorted(run_dir.parent.glob("*-sweep/sweep.json")):
        data = read_json(record)
        points = data.get("points") if isinstance(data, dict) else None
        for point in points if isinstance(points, list) else ():
            try:
                ours = isinstance(point, dict) and Path(point["run_dir"]).resolve() == here
            except (KeyError, TypeError):
                continue
            if ours and point.get("overrides"):
                pairs = [str(o).partition("=") for o in point["overrides"]]
                short = [key.rsplit(".", 1)[-1] for key, _, _ in pairs]
                return ", ".join(f"{name if short.count(name) == 1 else key}={value}"
                                 for name, (key, _, value) in zip(short, pairs))
    return None


def plot(run_dirs: list[str], out: str | None = None) -> Path:
    runs = load_runs(run_dirs)
    target = Path(out) if out else (runs[0].dir / "plot.png" if len(runs) == 1 else Path("runs.png"))
    fig = figure(runs)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        fig.savefig(tmp, dpi=DPI, format="png")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


DPI = 80  # 20 x 9 inches: 1600 x 720 pixels


def load_runs(run_dirs: list[str]) -> list[Run]:
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
    if len({r.label for r in runs}) < len(runs):  # two sweeps' points with the same values
        for r in runs:
            r.label = r.name
    return runs


def figure(runs: list[Run]):
    """The eight panels of `runs` (a matplotlib Figure, not drawn yet), a ninth for a mixture's
    sources, another for an MoE model's routing."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import EngFormatter, LogFormatter
    except ImportError:
        raise UserError("llmtrain plot needs matplotlib: pip install matplotlib") from None

    class Plain(LogFormatter):
        """LogFormatter's choice of ticks to label (fewer as the axis spans more decades: the
        labels of 0.06, 0.07, 0.08, 0.09 overlap), written 5, 6, 0.5: not 5 x 10^0."""

        def _num_to_string(self, x, vmin, vmax):
            return f"{x:g}"

    mixed = any("source_tokens" in r for run in runs for r in run.train)  # data.mixture: a panel more
    routed = any("expert_imbalance" in r for run in runs for r in run.train)  # an MoE model: a panel more
    panels = 8 + mixed + routed
    fig = Figure(figsize=(20, 9) if panels == 8 else (18, 13) if panels == 9 else (22, 13), layout="constrained")
    axes = fig.subplots(*{8: (2, 4), 9: (3, 3), 10: (3, 4)}[panels]).flatten()
    for ax in axes[panels:]:
        ax.set_visible(False)
    extra = iter(axes[8:])
    colors = [f"C{i % 10}" for i in range(len(runs))]
    loss_step, loss_tokens, eval_ax = axes[0], axes[1], axes[2]
    for run, color in zip(runs, colors):
        steps = [r["step"] for r in run.train]
        loss_step.plot(steps, [r["loss"] for r in run.train], color=color, lw=1.2, label=f"{run.label} train")
        loss_tokens.plot(run.tokens_at(steps), [r["loss"] for r in run.train], color=color, lw=1.2,
                         label=f"{run.label} train")
        if run.evals:
            e_steps, e_loss = [r["step"] for r in run.evals], [r["eval_loss"] for r in run.evals]
            for ax, xs in ((loss_step, e_steps), (loss_tokens, run.tokens_at(e_steps)), (eval_ax, e_steps)):
                ax.plot(xs, e_loss, color=color, ls="--", marker="o", ms=3, label=f"{run.label} eval")
            for (name, points), marker in zip(by_source(run.evals, "eval_loss_by_source").items(), MARKERS):
                eval_ax.plot(*zip(*points), color=color, ls=":", marker=marker, ms=4, label=f"{run.label} {name}")

    def log_y(ax):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(Plain(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(Plain(labelOnlyBase=False))

    loss_step.set(title="Loss", xlabel="step", ylabel="loss (nats/token)")
    loss_tokens.set(title="Loss against tokens seen", xlabel="tokens", ylabel="loss (nats/token)")
    log_y(loss_step)
    log_y(loss_tokens)
    loss_tokens.xaxis.set_major_formatter(EngFormatter())
    eval_ax.set(title="Eval loss", xlabel="step", ylabel="loss (nats/token)")
    if not any(run.evals for run in runs):
        _empty(eval_ax, "no evaluation yet (train.eval_every)")

    if mixed:  # each source's tokens so far: its weight is the slope's share
        ax = next(extra)
        for run, color in zip(runs, colors):
            for (name, points), style in zip(by_source(run.train, "source_tokens").items(), STYLES):
                ax.plot(*zip(*points), color=color, ls=style, lw=1.2, label=f"{run.label} {name}")
        ax.set(title="Tokens per source (data.mixture)", xlabel="step", ylabel="tokens")
        ax.yaxis.set_major_formatter(EngFormatter())
        ax.legend(fontsize=8)
    if routed:  # model/moe.py: the load-balancing loss (top-k when balanced) and the busiest expert's load
        ax = next(extra)
        for run, color in zip(runs, colors):
            for key, style in (("expert_imbalance", "-"), ("moe_aux_loss", "--")):
                points = [(r["step"], r[key]) for r in run.train if r.get(key) is not None]
                if points:
                    ax.plot(*zip(*points), color=color, ls=style, lw=1.2, label=f"{run.label} {key}")
        ax.set(title="Experts: busiest over mean (worst layer), load-balancing loss", xlabel="step",
               ylabel="ratio / loss")
        ax.legend(fontsize=8)
    if any(by_source(run.evals, "eval_loss_by_source") for run in runs):
        eval_ax.legend(fontsize=8)

    for ax, (key, title, ylabel, log) in zip(axes[3:], SERIES):
        drawn, tallest = False, 0.0
        for run, color in zip(runs, colors):
            points = [(r["step"], r[key] * (100 if key == "mfu" else 1)) for r in run.train
                      if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), color=color, lw=1.2, label=run.label)
                drawn, tallest = True, max(tallest, *(y for _, y in points))
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        if key == "tokens_per_sec":
            ax.yaxis.set_major_formatter(EngFormatter())
        if drawn and log:
            log_y(ax)
        if drawn and key == "peak_mem_gib":  # from 0: autoscaled, 0.411 -> 0.418 GiB filled the panel
            ax.set_ylim(0, tallest * 1.1 or 1)
        if not drawn:
            _empty(ax, "no MFU: a CPU run, or a GPU without a peak in the table\n(set train.peak_tflops)"
                   if key == "mfu" else "not logged")
    for ax in axes:
        ax.grid(True, which="major", alpha=0.3)
    loss_step.legend(fontsize=8)
    fig.suptitle(_title(runs), fontsize=11)
    return fig


SHOWN_RUNS = 6  # summaries in a comparison's title, one a line: more would crowd out the panels


def _title(runs: list) -> str:
    """The figure's title: a run's summary, or one line per run (on one line, a few runs ran off
    both edges of the figure), the first SHOWN_RUNS and how many more the legends hold."""
    if len(runs) == 1:
        return runs[0].summary()
    more = len(runs) - SHOWN_RUNS
    return "\n".join([f"{len(runs)} runs:", *(r.summary() for r in runs[:SHOWN_RUNS])]
                     + ([f"... and {more} more (see the legends)"] if more > 0 else []))


MARKERS, STYLES = "svd^<>p*", ["-", "--", ":", "-."] * 4  # a mixture's sources, told apart


def by_source(records: list[dict], key: str) -> dict[str, list[tuple[int, float]]]:
    """A mixture's per-source series ({source: [(step, value)]}) from the records that carry `key`."""
    series: dict[str, list] = {}
    for r in records:
        for name, value in (r.get(key) or {}).items():
            series.setdefault(name, []).append((r["step"], value))
    return series


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
