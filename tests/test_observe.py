"""Watching a run: TensorBoard and W&B across a kill and resume, the plot, profiler traces on
request, status, and none of it imported by a run that does not ask for it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import (cli, env_with, llmtrain, prepared_home, read_metrics, tiny_config, torchrun,
                      torchrun_popen)
from test_checkpoint import kill_when, logged_step
from trackers import tensorboard_scalars, wandb_runs

PNG = b"\x89PNG\r\n\x1a\n"
PHASES = ("data", "forward", "backward", "optimizer", "communication")


@pytest.fixture(scope="module")
def observe(tmp_path_factory):
    with prepared_home(tmp_path_factory, "observe", tiny_config()) as prepared:
        yield prepared


def test_prepare_into_a_log_file_prints_no_progress_bars(tmp_path):
    """stderr a pipe (a Slurm .out file): the libraries' progress bars (datasets' `Generating
    train split`) and prepare's own are off; no carriage returns, only the plain lines."""
    cfg = tiny_config(data={"prepared_dir": str(tmp_path / "prepared")})
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps(cfg))
    env = {k: v for k, v in env_with().items() if "PROGRESS_BARS" not in k}
    proc = llmtrain("prepare", "--config", config, check=True, env=env)
    assert "\r" not in proc.stdout + proc.stderr, proc.stderr
    assert "Generating" not in proc.stderr and "tokenize" not in proc.stderr, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith(f"prepared {tmp_path / 'prepared'}/")


def family(pid: int) -> list[int]:
    """`pid` and every process it started, theirs too (W&B's service has a session of its own)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # pid (comm) state ppid ...: comm may hold spaces, so split after its ')'
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            pass
    found = [pid]
    for p in found:
        found += [child for child, parent in parents.items() if parent == p]
    return found


@pytest.mark.slow
def test_scancel_of_a_run_with_wandb_reads_as_a_clean_stop(observe):
    """scancel (and a preemption) sends SIGTERM to every process of the job at once: torchrun's
    agent, the workers, W&B's service. The workers save and stop; the log holds no traceback:
    neither the agent's SignalException nor W&B's `Connection lost` from its exit handler."""
    root, config = observe
    run_dir = root / "home" / "runs" / "scancelled"
    proc = torchrun_popen(2, "train", "--config", config, "--set", "run.name=scancelled",
                          "--set", "metrics.wandb.project=llmtrain-tests", "--set", "train.max_steps=400",
                          "--set", "train.eval_every=0", "--set", "train.checkpoint_every=1000")
    deadline = time.monotonic() + 120
    while logged_step(run_dir) < 5 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in family(proc.pid):
        os.kill(pid, signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out
    stop = json.loads((run_dir / "control" / "exit.json").read_text())
    assert (run_dir / "checkpoints" / f"step-{stop['step']:08d}" / "meta.json").is_file()
    assert f"stopping at step {stop['step']} (signal); the checkpoint is saved" in out
    assert not re.search(r"Traceback|SignalException|death signal|closing signal", out), out


@pytest.mark.slow
def test_tensorboard_and_wandb_hold_each_step_once_across_a_kill_and_resume(observe):
    """Killed (SIGKILL) at step 6 after logging step 5, with its checkpoint at step 4; resumed at
    4. metrics.jsonl is the truth: TensorBoard shows exactly its values (float32) at each step
    once; the W&B files that `wandb sync` gets hold one run id, each step once. (A requeue after
    a stop, where both launches finish their files, is checked in test_slurm.py.)"""
    root, config = observe
    run_dir = root / "home" / "runs" / "tracked"
    sets = ["--set", "run.name=tracked", "--set", "metrics.tensorboard=true",
            "--set", "metrics.wandb.project=llmtrain-tests", "--set", "metrics.plot_every_eval=true",
            "--set", "profile.start_step=2", "--set", "profile.steps=1"]
    proc = torchrun_popen(1, "train", "--config", config, *sets, env=env_with(LLMTRAIN_INJECT_HANG_STEP="6"))
    kill_when(proc, lambda: logged_step(run_dir) >= 5)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    (killed,) = (run_dir / "wandb").glob("offline-run-*")
    torchrun(1, "train", "--config", config, *sets)

    records = read_metrics(run_dir)
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    evals = {r["step"]: r["eval_loss"] for r in records if r["kind"] == "eval"}
    assert list(train) == list(range(1, 9)) and list(evals) == [4, 8]

    tb = tensorboard_scalars(run_dir / "tensorboard")
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one per launch
    for key in ("loss", "lr", "grad_norm", "tokens_per_sec", "peak_mem_gib", "tokens"):
        assert tb[f"train/{key}"] == [(s, float(np.float32(train[s][key]))) for s in train], key
    assert tb["eval/loss"] == [(s, float(np.float32(v))) for s, v in evals.items()]

    # W&B's service process dropped what it had buffered when the killed launch died: that
    # launch's files are set aside, and the next one logged steps 1-4 again from metrics.jsonl.
    state = json.loads((run_dir / "wandb-run.json").read_text())
    assert (run_dir / "wandb" / "incomplete" / killed.name).is_dir()
    launches = wandb_runs(run_dir / "wandb")
    assert len(launches) == 1 and state["launches"] == [launches[0]["dir"].name] and state["logged"] == 8
    assert {run["id"] for run in launches} == {state["id"]}
    assert {run["name"] for run in launches} == {"tracked"}
    rows = [row for run in launches for row in run["history"]]
    assert [row["_step"] for row in rows] == list(range(1, 9))  # each step once, in order
    for row in rows:
        assert row["train/loss"] == train[row["_step"]]["loss"]
        assert row.get("eval/loss") == evals.get(row["_step"])
    config = launches[-1]["config"]
    assert config["run"]["name"] == "tracked" and config["train"]["max_steps"] == 8
    assert config["provenance"]["world_size"] == 1 and "slurm_job_ids" in config
    sync = f"wandb sync --id {state['id']} -p llmtrain-tests {run_dir}/wandb/offline-run-*-{state['id']}"
    assert sync in (run_dir / "logs" / "rank-0.log").read_text()

    assert (run_dir / "plot.png").read_bytes()[:8] == PNG
    (trace,) = (run_dir / "profile").glob("*.json")
    assert trace.name == "steps-2-2-rank-0.json"
    assert {"step 2", *PHASES} <= annotations(trace)

    status = cli("status", run_dir, check=True).stdout
    assert "loss: " in status and f"-> {train[8]['loss']:.4f} over 8 logged steps" in status
    assert f"eval: step 8, eval_loss {evals[8]:.4f}" in status
    assert f"plot: {run_dir}/plot.png" in status
    assert f"tensorboard: tensorboard --logdir {run_dir}" in status
    assert f"W&B: run {state['id']} (tracked, project llmtrain-tests), offline; sync it with: {sync}" in status


def annotations(trace: Path) -> set[str]:
    """The labelled ranges (record_function) of a Chrome trace."""
    events = json.loads(trace.read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("cat") == "user_annotation"}


@pytest.mark.slow
def test_profiles_trace_the_configured_ranks_or_those_a_request_names(observe):
    """Two ranks, profile.ranks [1]: the planned step 2 is traced on rank 1 only; a request
    with --ranks all traces the same steps on both; one without --ranks, the config's rank 1."""
    root, config = observe
    run_dir = root / "home" / "runs" / "profiled"
    proc = torchrun_popen(2, "train", "--config", config, "--set", "run.name=profiled",
                          "--set", "train.max_steps=100000", "--set", "train.log_every=1",
                          "--set", "train.eval_every=0", "--set", "train.checkpoint_every=0",
                          "--set", "profile.start_step=2", "--set", "profile.steps=1",
                          "--set", "profile.ranks=[1]")

    def wait_for_traces(count: int) -> None:
        while len(list((run_dir / "profile").glob("*.json"))) < count:
            assert proc.poll() is None and time.monotonic() < deadline, f"no trace {count} came"
            time.sleep(0.1)

    try:
        deadline = time.monotonic() + 120
        wait_for_traces(1)  # the planned one, before any request (one under way defers it)
        asked = cli("control", run_dir, "profile", "--steps", "2", "--ranks", "all", check=True)
        assert asked.stdout.startswith(f"profile requested: {run_dir}/control/profile")
        wait_for_traces(3)
        cli("control", run_dir, "profile", "--steps", "2", check=True)
        wait_for_traces(4)
        cli("control", run_dir, "stop", check=True)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    names = {t.name for t in (run_dir / "profile").glob("*.json")}
    both = sorted(int(n.split("-")[1]) for n in names if n.endswith("-rank-0.json"))
    assert len(both) == 1, names
    first = both[0]
    last = next(int(n.split("-")[1]) for n in names if n.endswith("-rank-1.json") and int(n.split("-")[1]) > first)
    assert names == {"steps-2-2-rank-1.json", f"steps-{first}-{first + 1}-rank-0.json",
                     f"steps-{first}-{first + 1}-rank-1.json", f"steps-{last}-{last + 1}-rank-1.json"}
    assert {"step 2", *PHASES} <= annotations(run_dir / "profile" / "steps-2-2-rank-1.json")
    for rank in (0, 1):
        trace = annotations(run_dir / "profile" / f"steps-{first}-{first + 1}-rank-{rank}.json")
        assert {f"step {first}", f"step {first + 1}", *PHASES} <= trace
        assert f"step {first + 2}" not in trace
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert f"profile requested (2 steps on ranks 0-1 (all)) through {run_dir}/control/profile" in log
    assert f"profile requested (2 steps on ranks 1) through {run_dir}/control/profile" in log
    # where the traces are: printed by the lowest rank that traced them
    assert f"profile of steps {first}-{first + 1}: {run_dir}/profile/steps-{first}-{first + 1}-rank-*.json" in log
    assert "profile of steps 2-2: " not in log
    assert f"profile of steps 2-2: {run_dir}/profile/steps-2-2-rank-*.json" in out


def fake_run(run_dir: Path, name: str, scale: float, steps: int = 60, mem_gib=None) -> None:
    """A run directory as training leaves it, with made-up curves (the plot's input is the file);
    mem_gib: (first, last) peak memory, else 10 x scale throughout."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(f"run:\n  name: {name}\ntrain:\n  max_steps: {steps}\n")
    lines = []
    first, last = mem_gib or (10 * scale, 10 * scale)
    for s in range(1, steps + 1):
        lines.append({"kind": "train", "step": s, "loss": scale * (2 + 8 / s ** 0.5), "lr": 1e-3,
                      "grad_norm": 1 / s, "tokens": 4096 * s, "tokens_per_sec": 1e5 * scale,
                      "mfu": 0.4 * scale, "elapsed_s": s, "eta_s": steps - s,
                      "peak_mem_gib": first + (last - first) * s / steps})
        if s % 20 == 0:
            lines.append({"kind": "eval", "step": s, "eval_loss": scale * (2.2 + 8 / s ** 0.5)})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_plot_draws_one_run_and_compares_three(tmp_path, monkeypatch):
    from matplotlib.image import imread

    runs = [tmp_path / f"run{i}" for i in range(3)]
    for i, run in enumerate(runs):
        fake_run(run, f"lr-{i}", 1 + i / 4)
    one = cli("plot", runs[0], check=True)
    assert one.stdout == f"plot: {runs[0]}/plot.png\n"
    monkeypatch.chdir(tmp_path)
    three = cli("plot", *runs, "--out", "compare/three.png", check=True)
    assert three.stdout == "plot: compare/three.png\n"

    def colours(path: Path) -> set:
        pixels = imread(path)[..., :3].reshape(-1, 3)
        return {tuple(p) for p in np.round(pixels * 255).astype(int)}

    c0, c1, c2 = ((31, 119, 180), (255, 127, 14), (44, 160, 44))  # matplotlib's C0, C1, C2
    drawn_one, drawn_three = colours(runs[0] / "plot.png"), colours(tmp_path / "compare" / "three.png")
    assert c0 in drawn_one and c1 not in drawn_one
    assert {c0, c1, c2} <= drawn_three
    assert imread(runs[0] / "plot.png").shape[:2] == (720, 1600)
    assert not list(tmp_path.glob("compare/.*tmp*"))  # written atomically: no temporary left


def test_a_sweeps_plot_names_its_points_by_their_overrides_and_keeps_its_labels_apart(tmp_path):
    """`llmtrain plot` of a sweep's points: each is labelled by its overrides (was its name,
    sw-0, sw-1: which lr was which?), a run of no sweep by its name; no two labels of a log axis
    overlap (every minor tick was labelled: 0.06 0.07 0.08 0.09 in one smear); and the memory
    axis starts at 0, so a run whose peak went 0.411 -> 0.418 GiB does not fill the panel as a
    climb. The figure's objects, drawn as the image is, not its pixels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from llmtrain.login.sweep import _write_record, plan
    from llmtrain.login.plot import DPI, figure, load_runs

    cfg = tiny_config(run={"name": "sw", "dir": str(tmp_path / "runs")})
    config = tmp_path / "sw.yaml"
    config.write_text(json.dumps(cfg))
    sweep, cfgs = plan(config, [], ["train.lr=1e-3,3e-3", "train.micro_batch_size=4"])
    sweep.dir.mkdir(parents=True)
    _write_record(sweep)  # as `llmtrain sweep` leaves it
    for i, point in enumerate(cfgs):
        fake_run(point.run_dir, point.run.name, 1 + i / 4, mem_gib=(0.411, 0.418))
    fake_run(tmp_path / "runs" / "baseline", "baseline", 1.5, mem_gib=(0.411, 0.418))
    fig = figure(load_runs([str(c.run_dir) for c in cfgs] + [str(tmp_path / "runs" / "baseline")]))
    fig.set_dpi(DPI)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()

    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["lr=1e-3, micro_batch_size=4 train", "lr=1e-3, micro_batch_size=4 eval",
                      "lr=3e-3, micro_batch_size=4 train", "lr=3e-3, micro_batch_size=4 eval",
                      "baseline train", "baseline eval"]
    assert fig.get_suptitle().startswith("3 runs:\nsw-0 (lr=1e-3, micro_batch_size=4): step 60/60")
    for many in (fig, figure(load_runs([str(c.run_dir) for c in cfgs] * 3 + [str(tmp_path / "runs" / "baseline")]))):
        many.set_dpi(DPI)
        FigureCanvasAgg(many).draw()
        title = many._suptitle.get_window_extent(many.canvas.get_renderer())  # not off the figure's edges
        assert 0 <= title.x0 < title.x1 <= many.bbox.width, (title, many.bbox)
    assert many.get_suptitle().splitlines()[-1] == "... and 1 more (see the legends)"  # 7 runs, 6 shown
    log_axes = [ax for ax in fig.axes if ax.get_yscale() == "log"]
    assert [ax.get_title() for ax in log_axes] == ["Loss", "Loss against tokens seen",
                                                   "Gradient norm (before clipping)"]
    for ax in log_axes:
        low, high = sorted(ax.get_ylim())
        boxes = [(tick.label1.get_text(), tick.label1.get_window_extent(renderer))
                 for tick in ax.yaxis.get_major_ticks() + ax.yaxis.get_minor_ticks()
                 if low <= tick.get_loc() <= high and tick.label1.get_visible() and tick.label1.get_text()]
        assert len(boxes) >= 2, (ax.get_title(), boxes)  # labelled, in plain numbers
        assert all(re.fullmatch(r"[0-9.]+", text) for text, _ in boxes), boxes
        overlapping = [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1:]
                       if box.overlaps(other)]
        assert overlapping == [], (ax.get_title(), overlapping)
    [memory] = [ax for ax in fig.axes if ax.get_ylabel() == "GiB"]
    bottom, top = memory.get_ylim()
    assert bottom == 0 and 0.418 < top < 0.5


def test_plot_of_what_cannot_be_drawn_is_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = cli("plot", empty)
    assert proc.returncode == 1
    assert proc.stderr == (f"error: {empty}: nothing to plot yet (no step in {empty}/metrics.jsonl); "
                           f"wait for the first logged step (train.log_every)\n")
    proc = cli("plot", tmp_path / "nosuch")
    assert (proc.returncode, proc.stderr) == (1, f"error: {tmp_path}/nosuch: no such run directory\n")
    assert not (empty / "plot.png").exists()


@pytest.mark.parametrize("args,line", [
    (["profile", "--steps", "0"], "--steps: must be >= 1 (got 0)"),
    (["profile", "--ranks", "0,-8"], "--ranks: must be all or ranks >= 0, like 0,8 (got '0,-8')"),
    (["save", "--ranks", "1"], "--ranks: only for profile (got save --ranks 1)"),
])
def test_control_profile_needs_positive_steps_and_ranks(tmp_path, args, line):
    proc = cli("control", tmp_path, *args)
    assert (proc.returncode, proc.stderr) == (1, f"error: {line}\n")


@pytest.mark.parametrize("missing,key", [("wandb", "metrics.wandb.project=p"),
                                         ("tensorboard", "metrics.tensorboard=true")])
def test_a_tracker_that_is_not_installed_fails_check_config(observe, monkeypatch, missing, key):
    _, config = observe
    monkeypatch.setitem(sys.modules, missing, None)  # what importlib finds where it is not installed
    proc = cli("check-config", "--config", config, "--set", key)
    assert proc.returncode == 2  # a config error
    assert proc.stderr == (
        f"metrics.{key.split('.')[1].split('=')[0]}: the {missing} package is not installed in "
        f"this environment; install it with: pip install 'llmtrain[{missing}]' (or bash setup.sh "
        f"--extras {missing}), or turn metrics.{key.split('.')[1].split('=')[0]} off\n")


@pytest.mark.parametrize("value,line", [
    ("{projct: p}", "metrics.wandb.projct: unknown key (did you mean 'project'?); use entity, mode, name, "
                    "project, tags"),
    ("{mode: cloud}", "metrics.wandb.mode: must be one of offline, online (got 'cloud')"),
    ("true", "metrics.wandb: must be a mapping (got True)"),
])
def test_bad_wandb_settings_are_one_line_each(observe, value, line):
    _, config = observe
    proc = cli("check-config", "--config", config, "--set", f"metrics.wandb={value}")
    assert (proc.returncode, proc.stderr) == (2, f"{line}\n")


@pytest.mark.slow
def test_a_run_without_trackers_imports_none_and_still_draws_its_plot(observe):
    """The plot is drawn by a child process: the trainer imports no matplotlib either."""
    root, config = observe
    run_dir = root / "home" / "runs" / "plain"
    probe = ("import sys\nfrom llmtrain.cli import main\n"
             f"code = main(['train', '--config', {str(config)!r}, '--set', 'run.name=plain', "
             "'--set', 'train.max_steps=3', '--set', 'train.eval_every=3', '--set', 'metrics.plot_every_eval=true'])\n"
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'wandb', 'tensorboard', 'matplotlib'}) or "
             "sorted(m for m in sys.modules if m.startswith('torch.utils.tensorboard')))\n"
             "sys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"
    assert (run_dir / "plot.png").read_bytes()[:8] == PNG
    assert not (run_dir / "tensorboard").exists() and not (run_dir / "wandb").exists()
