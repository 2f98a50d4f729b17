"""`llmtrain sweep`: one run per point of a grid, as a Slurm job array, or one after another here.

    llmtrain sweep --config FILE --grid train.lr=1e-4,3e-4 [--grid KEY=V,V ...] [--set K=V ...]
                   [--max-parallel 4] [--dry-run] [--local] [-- SBATCH ARGS]
    llmtrain sweep status SWEEP_DIR        # a table: state, step, latest eval loss of each point
    llmtrain plot RUN_DIR RUN_DIR ...      # the points' curves on one figure (status prints it)

The points are the grid's product, in the order given; point i is the run `<run.name>-<i>`, in
its own run directory `<run.dir>/<run.name>-<i>`, trained from its own frozen config, so
`llmtrain status`, `control`, `export` and `plot` work on a point as on any run. The sweep's
record, `<run.dir>/<run.name>-sweep/sweep.json`, lists the points and the array's job id.

On Slurm, every point is checked first (as `llmtrain submit` checks one run), then the points are
one job array, `sbatch --array=0-<N-1>%<max parallel>`, named run.name: Slurm starts at most
--max-parallel points at once. Each task is an ordinary training job for its point: train.slurm
puts the task's index for %a in its config and run directory, its log is
`<run_dir>/<run.name>-<i>-<job id>.out`, and it is requeued and resumed like any job. The points
share the array's Slurm request, so a grid over slurm.* keys is refused. Data not prepared yet
gets one CPU prepare job per distinct prepared dataset, and the array waits for them (afterok).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
from pathlib import Path

from ..config import Config, ConfigError, UserError, load_config
from ..files import read_json
from ..rundir import RunPaths
from .slurm import sbatch_command, with_extra_args
from .status import ARRAY_TASK, array_tasks
from .submit import freeze, is_prepared, pin_prepared, refusals, run_local, sbatch, slurm_environment, stamp

RECORD = "sweep.json"


def parse_grid(items: list[str]) -> list[tuple[str, list[str]]]:
    """["train.lr=1e-4,3e-4", ...] -> [("train.lr", ["1e-4", "3e-4"]), ...]; bad items refused."""
    grid, problems = [], []
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        choices = [v.strip() for v in values.split(",")]
        if not sep or "." not in key or not all(choices):
            problems.append(f"--grid {item}: expected section.key=value,value,... (e.g. "
                            f"--grid train.lr=1e-4,3e-4)")
        elif key.startswith("slurm.") or key in ("run.name", "run.dir"):
            problems.append(f"--grid {key}: a sweep's points share one job array (its Slurm "
                            f"request) and are named <run.name>-<i> in run.dir; sweep this key "
                            f"as separate sweeps")
        elif key in (k for k, _ in grid):
            problems.append(f"--grid {key}: given twice; list all its values in one --grid")
        else:
            grid.append((key, choices))
    if not grid and not problems:
        problems.append("--grid: give at least one, e.g. --grid train.lr=1e-4,3e-4")
    if problems:
        raise ConfigError(problems)
    return grid


def points(grid: list[tuple[str, list[str]]]) -> list[list[str]]:
    """The grid's product, as override lists: [["train.lr=1e-4", "train.wd=0"], ...]."""
    keys = [key for key, _ in grid]
    return [[f"{k}={v}" for k, v in zip(keys, combo)]
            for combo in itertools.product(*(values for _, values in grid))]


@dataclasses.dataclass
class Sweep:
    name: str
    dir: Path  # <run.dir>/<name>-sweep
    points: list[dict]  # {"index", "overrides", "run_name", "run_dir"}
    array_job_id: str | None = None
    prepare_job_ids: list[str] = dataclasses.field(default_factory=list)
    commands: list[list[str]] = dataclasses.field(default_factory=list)

    def record(self) -> dict:
        return {"name": self.name, "points": self.points, "array_job_id": self.array_job_id,
                "prepare_job_ids": self.prepare_job_ids}


def plan(config: str | os.PathLike, overrides: list[str], grid: list[str],
         world_size: int | str | None = None) -> tuple[Sweep, list[Config]]:
    """Every point's config, each validated and checked as `llmtrain submit` checks one run
    (world_size: load_config's; a local sweep's process count, or "local")."""
    todo = points(parse_grid(grid))
    cfgs, problems, name = [], [], None
    for i, point in enumerate(todo):  # the config alone need not be valid: the grid may mend it
        try:
            if name is None:
                name = load_config(config, [*overrides, *point], world_size).run.name
            cfgs.append(load_config(config, [*overrides, *point, f"run.name={name}-{i}"], world_size))
        except ConfigError as e:
            problems += [f"point {i} ({', '.join(point)}): {line}" for line in e.problems]
    if problems:
        raise ConfigError(problems)
    sweep = Sweep(name, Path(cfgs[0].run.dir) / f"{name}-sweep",
                  [{"index": i, "overrides": point, "run_name": cfg.run.name, "run_dir": str(cfg.run_dir)}
                   for i, (point, cfg) in enumerate(zip(todo, cfgs))])
    earlier = read_json(sweep.dir / RECORD)
    if isinstance(earlier, dict) and [p.get("overrides") for p in earlier.get("points", [])] != todo:
        # point i would resume the other sweep's run i, trained with other values
        raise ConfigError([f"run.name: a sweep {name!r} with other points exists ({sweep.dir / RECORD}); "
                           f"choose another run.name, or give the same --grid to continue it"])
    return sweep, cfgs


def sweep_slurm(config: str | os.PathLike, overrides: list[str], grid: list[str], *,
                max_parallel: int, sbatch_args: list[str] = (), dry_run: bool = False,
                script: str | os.PathLike | None = None) -> Sweep:
    if max_parallel < 1:
        raise UserError(f"--max-parallel: must be >= 1 (got {max_parallel})")
    home, script = slurm_environment(script)
    sweep, cfgs = plan(config, overrides, grid)
    for i, cfg in enumerate(cfgs):  # every point may start: downloaded, not live; the request fits
        refusals(cfg, config, offline=True, launch=True, cluster=i == 0)
    cfgs = [pin_prepared(with_extra_args(cfg, list(sbatch_args))) for cfg in cfgs]
    st = stamp()
    if not dry_run:
        sweep.dir.mkdir(parents=True, exist_ok=True)
        for cfg in cfgs:
            freeze(cfg, cfg.run_dir / "submitted" / f"{st}.yaml", config)
    unprepared = {}
    for cfg in cfgs:
        if not is_prepared(cfg):
            from ..data.sources import prepared_path
            unprepared.setdefault(tuple(prepared_path(one) for one in cfg.source_configs()), cfg)
    for cfg in unprepared.values():  # one CPU job per distinct dataset to tokenize
        sweep.prepare_job_ids.append(sbatch(sweep.commands, sbatch_command(
            cfg, "prepare", script=script, home=home,
            frozen=cfg.run_dir / "submitted" / f"{st}.yaml"), dry_run))
    template = dataclasses.replace(cfgs[0], run=dataclasses.replace(cfgs[0].run, name=f"{sweep.name}-%a"))
    # From the array's sbatch to its records, Ctrl-C waits: a queued array nobody can find would be
    # queued again by the next try.
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sweep.array_job_id = sbatch(sweep.commands, sbatch_command(
            template, "train", script=script, home=home, array=f"0-{len(cfgs) - 1}%{max_parallel}",
            frozen=template.run_dir / "submitted" / f"{st}.yaml",
            after=":".join(sweep.prepare_job_ids) or None), dry_run)
        if not dry_run:
            from ..files import write_atomic
            _write_record(sweep)
            for point in sweep.points:  # llmtrain status finds a task that has not started by these
                write_atomic(Path(point["run_dir"]) / "submitted" / ARRAY_TASK,
                             json.dumps({"array_job_id": sweep.array_job_id, "index": point["index"]}) + "\n")
    finally:
        signal.signal(signal.SIGINT, interrupt)
    return sweep


def sweep_local(config: str | os.PathLike, overrides: list[str], grid: list[str],
                nproc: int | None = None) -> tuple[Sweep, list[int]]:
    """The points one after another on this machine; each one's exit code. A point that fails
    does not stop the others; one stopped by Ctrl-C stops the sweep."""
    sweep, cfgs = plan(config, overrides, grid, nproc or "local")
    for cfg in cfgs:
        refusals(cfg, config, offline=True, launch=True, cluster=False)
    sweep.dir.mkdir(parents=True, exist_ok=True)
    _write_record(sweep)
    st, codes = stamp(), []
    for point, cfg in zip(sweep.points, cfgs):
        frozen = cfg.run_dir / "submitted" / f"{st}.yaml"
        freeze(cfg, frozen, config)
        print(f"sweep {sweep.name}: point {point['index']} of {len(cfgs)} ({', '.join(point['overrides'])})",
              flush=True)
        codes.append(run_local(frozen, [], nproc))
        stop = read_json(RunPaths(cfg.run_dir).exit) or {}
        if stop.get("reason") == "user" or codes[-1] == 130:  # 130: ended by a third Ctrl-C
            print(f"sweep {sweep.name}: stopped by request at point {point['index']}; the others "
                  f"were not run", flush=True)
            break
    return sweep, codes


def _write_record(sweep: Sweep) -> None:
    from ..files import write_atomic
    write_atomic(sweep.dir / RECORD, json.dumps(sweep.record(), indent=1) + "\n")


def read_sweep(target: str | os.PathLike, runs: Path | None = None) -> Sweep:
    """The sweep in folder `target`, or named `target` (its run.name) under run.dir: `runs`,
    else run.dir's default ($LLMTRAIN_HOME/runs)."""
    from .status import runs_root
    folder, root = Path(target), runs_root(runs)
    if not folder.is_dir() and "/" not in str(target) and root:
        folder = next((f for f in (root / f"{target}-sweep", root / str(target)) if (f / RECORD).is_file()),
                      folder)
    record = read_json(folder / RECORD)
    if not isinstance(record, dict) or "points" not in record:
        where = f", nor a sweep named so in {root}" if root and "/" not in str(target) else ""
        raise UserError(f"{target}: not a sweep directory (no {RECORD}){where}; it is "
                        f"<run.dir>/<run.name>-sweep, which llmtrain sweep prints")
    return Sweep(record["name"], folder.resolve(), record["points"], record.get("array_job_id"),
                 record.get("prepare_job_ids", []))


def status_table(sweep: Sweep) -> str:
    """One row per point: its state (as `llmtrain status` judges it), step, latest eval loss."""
    from ..metrics import read_metrics
    from .status import assess, latest_job
    queued = array_tasks(sweep.array_job_id) if sweep.array_job_id else {}
    rows = []
    for point in sweep.points:
        run_dir = Path(point["run_dir"])
        job = latest_job(run_dir) if run_dir.is_dir() else None
        task = queued.get(str(point["index"]))
        if task and (job is None or task[0] != job):  # not started yet: only the array knows it
            state = "pending" if task[1] == "PENDING" else task[1].lower()
        elif run_dir.is_dir():
            state = assess(run_dir, job).state
        else:
            state = "not started"
        records = read_metrics(run_dir) if run_dir.is_dir() else []
        steps = [r["step"] for r in records if r.get("kind") == "train"]
        evals = [r["eval_loss"] for r in records if r.get("kind") == "eval"]
        rows.append([str(point["index"]), point["run_name"], ", ".join(point["overrides"]), state,
                     str(steps[-1]) if steps else "-", f"{evals[-1]:.4f}" if evals else "-"])
    head = ["point", "run", "overrides", "state", "step", "eval loss"]
    lines = [f"sweep: {sweep.name}  ({sweep.dir})" + (f", array job {sweep.array_job_id}"
                                                     if sweep.array_job_id else ""),
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    lines.append("compare: llmtrain plot " + " ".join(p["run_dir"] for p in sweep.points)
                 + f" --out {sweep.dir}/plot.png")
    return "\n".join(lines)
