"""The Slurm path on a real cluster (cluster/local-cluster.sh: slurmctld + 2 slurmd, munge)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import DEMO, REPO, cli, losses, read_metrics, tiny_config
from llmtrain.config import load_config
from llmtrain.data.sources import prepared_path
from trackers import tensorboard_scalars, wandb_runs

pytestmark = pytest.mark.slow
SLOW_NODE2 = {"LLMTRAIN_TEST_SLOW_HOST": "node2"}  # the preflight's test hook: node2 looks slow


@pytest.fixture
def job_config(tmp_path, cluster):
    """A tiny config whose runs and prepared data live in tmp_path (a path with a space)."""
    def make(**sections) -> Path:
        root = tmp_path / "shared fs"
        run = {"name": "slurm", "dir": str(root / "runs"), **sections.pop("run", {})}
        data = {"prepared_dir": str(root / "prepared"), **sections.pop("data", {})}
        cfg = tiny_config(run=run, data=data, **sections)
        cfg["slurm"].setdefault("cpus_per_node", 1)  # of the 8 declared: jobs share the nodes
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path
    return make


def submit(*args, env=None) -> dict:
    proc = subprocess.run(["bash", str(REPO / "submit.sh"), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return dict(re.findall(r"^(\w+): (.*)$", proc.stdout, re.MULTILINE))


def wait_for(job_id: str, timeout: float = 240) -> str:
    """The job's final state (COMPLETED, FAILED, ...), from scontrol."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        state = re.search(r"JobState=(\w+)", out).group(1)
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED",
                         "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED"):
            return state
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} still {state} after {timeout}s")


def test_two_node_job_completes_with_everything_in_the_run_dir(job_config):
    """2 nodes x 2 processes, data not prepared yet: a CPU prepare job runs first and training
    waits for it (afterok). (2 nodes x 1 process: the preemption trials' reference run.) node2
    is slowed on purpose: the preflight names it, and training goes on."""
    config = job_config(train={"global_batch_size": 8, "micro_batch_size": 2})
    out = submit("--config", config, "--nodes", 2, "--procs-per-node", 2, env={**os.environ, **SLOW_NODE2})
    assert "prepare_job_id" in out, out
    assert wait_for(out["job_id"]) == "COMPLETED"
    run_dir = Path(out["run_dir"])
    assert out["log"] == f"{run_dir}/slurm-{out['job_id']}.out"
    log = Path(out["log"]).read_text()
    assert "done: 8 steps" in log and "(hosts: node1, node2)" in log
    assert re.search(rf"^llmtrain \w+, torch {re.escape(version('torch'))}$", log, re.MULTILINE), log
    # A run that went well ends quietly: no C++ store dump, no warning or traceback from torch.
    assert not re.search(r"TCPStore|recvValue|Traceback|^\[?[WE]\d{4} ", log, re.MULTILINE), log
    prov = json.loads((run_dir / "provenance.json").read_text())
    assert prov["world_size"] == 4 and sorted(set(prov["hostnames"])) == ["node1", "node2"]
    assert prov["slurm"]["SLURM_JOB_ID"] == out["job_id"] and prov["slurm"]["SLURM_NNODES"] == "2"
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"] == list(range(1, 9))
    assert (run_dir / "checkpoints" / "step-00000008" / "meta.json").is_file()
    assert not node_scratch(out["job_id"]).exists()  # the nodes' TMPDIR went with the run's end
    status = cli("status", out["job_id"])
    assert f"job: {out['job_id']} COMPLETED" in status.stdout
    assert "progress: step 8/8 (100%)" in status.stdout and "step-00000008 (latest)" in status.stdout

    record = run_dir / "preflight" / f"{out['job_id']}-0.json"
    named = re.search(r"preflight: node2 is slow: (\S+) TFLOP/s matmul vs (\S+) on the others \(below "
                      r"0\.7x\); training on it anyway \(slurm\.exclude_slow_nodes: true leaves it "
                      r"out\); figures in (.*)$", log, re.MULTILINE)
    assert named and named.group(3) == str(record), log
    assert re.search(r"preflight: node1 \(2 ranks\): matmul \S+ TFLOP/s .* all-reduce \S+ GB/s inside the node, "
                     r"\S+ across nodes \(bus bandwidth\)$", log, re.MULTILINE), log
    assert "node1 is slow" not in log
    figures = json.loads(record.read_text())
    nodes = figures["nodes"]
    assert sorted(nodes) == ["node1", "node2"] and list(figures["slow"]) == ["node2"]
    assert 0 < nodes["node2"]["matmul_tflops"] < 0.7 * nodes["node1"]["matmul_tflops"]
    assert all(n["intra_node_busbw_gbps"] > 0 and n["inter_node_busbw_gbps"] > 0 for n in nodes.values())
    assert sorted(r["node"] for r in figures["ranks"]) == ["node1", "node1", "node2", "node2"]


def test_a_crashing_rank_fails_the_job_promptly(job_config, tmp_path):
    config = job_config(train={"max_steps": 500})
    cli("prepare", "--config", config, check=True)
    crash = tmp_path / "crash"
    crash.mkdir()
    # Rank 1 (on node2) dies as Python starts; the other rank would wait for it forever.
    (crash / "sitecustomize.py").write_text(
        "import os, sys\nif os.environ.get('RANK') == '1':\n"
        "    sys.stderr.write('injected crash on rank 1\\n'); sys.stderr.flush(); os._exit(3)\n")
    env = {**os.environ, "PYTHONPATH": str(crash), "LLMTRAIN_FORK_WORKERS": "0"}  # as each rank's Python starts
    out = submit("--config", config, "--nodes", 2, "--procs-per-node", 1, env=env)
    t0 = time.monotonic()
    assert wait_for(out["job_id"], timeout=120) == "FAILED"
    assert time.monotonic() - t0 < 90  # srun --kill-on-bad-exit, not the wall-time limit
    log = Path(out["log"]).read_text()
    assert "injected crash on rank 1" in log
    # torchrun's failure summary shortened to one line; the other node's agent, stopped, says nothing.
    assert log.count("error: rank 1 on node2 exited with code 3\n") == 1, log[-3000:]
    assert not re.search(r"Root Cause|Traceback|SignalException", log), log[-3000:]


def test_a_stale_exit_file_does_not_requeue_a_job_that_crashes_at_start(job_config, tmp_path):
    """An earlier stop left control/exit.json asking for a requeue; this job dies before training."""
    config = job_config(slurm={"nodes": 1, "procs_per_node": 1, "max_requeues": 1})
    cli("prepare", "--config", config, check=True)
    run_dir = Path(cli("check-config", config, "--get", "run_dir", check=True).stdout.strip())
    stale = run_dir / "control" / "exit.json"
    stale.parent.mkdir(parents=True)
    stale.write_text('{"reason": "preempt", "step": 40, "requeue": true}\n')
    crash = tmp_path / "crash"
    crash.mkdir()
    (crash / "sitecustomize.py").write_text(
        "import os, sys\nif 'RANK' in os.environ:\n"
        "    sys.stderr.write('injected start-up crash\\n'); sys.stderr.flush(); os._exit(3)\n")
    env = {**os.environ, "LLMTRAIN_FORK_WORKERS": "0",  # as the rank's Python starts
           "PYTHONPATH": os.pathsep.join(filter(None, [str(crash), os.environ.get("PYTHONPATH")]))}
    out = submit("--config", config, env=env)
    assert wait_for(out["job_id"], timeout=120) == "FAILED"
    job = subprocess.run(["scontrol", "show", "job", out["job_id"]], capture_output=True, text=True).stdout
    assert "Restarts=0" in job, job
    log = Path(out["log"]).read_text()
    assert "injected start-up crash" in log and "requeueing" not in log, log[-2000:]
    assert not stale.exists()  # train.slurm removed it before the step; the trainer wrote none


def test_dry_run_prints_the_exact_sbatch_command(job_config):
    """submit.sh runs what `llmtrain sbatch-command` prints (its matrix: tests/test_sbatch.py)."""
    config = job_config(run={"name": "dry"}, slurm={"nodes": 1, "procs_per_node": 2})
    subprocess.run(["llmtrain", "prepare", "--config", str(config)], check=True, capture_output=True)
    proc = subprocess.run(["bash", str(REPO / "submit.sh"), "--config", str(config), "--dry-run",
                           "--time", "02:30:00", "--dependency", "afterok:41", "--", "--exclusive"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    [command] = [shlex.split(line) for line in proc.stdout.splitlines() if line.startswith("env ")]
    run_dir = Path(yaml.safe_load(config.read_text())["run"]["dir"]) / "dry"
    frozen = next(c for c in command if c.startswith("LLMTRAIN_CONFIG="))
    assert re.fullmatch(re.escape(f"LLMTRAIN_CONFIG={run_dir}/submitted/") + r"\d{8}-\d{6}-\d+\.yaml",
                        frozen)
    assert not Path(frozen.split("=", 1)[1]).exists()  # a dry run writes nothing
    estimate = proc.stdout[proc.stdout.index("memory estimate (llmtrain estimate):"):]
    assert re.search(r"^  llama: [\d,]+ parameters .*ddp on 2 ranks", estimate, re.MULTILINE), estimate
    assert re.search(r"^  total +\d+\.\d\d ", estimate, re.MULTILINE), estimate
    assert ("planner: the slurm section names no GPU it knows (--gres=gpu:h100:8, a partition); `llmtrain plan "
            "--gpu NAME` plans for one") in estimate  # a CPU test cluster
    assert command[command.index("sbatch"):] == [
        "sbatch", "--parsable", "--job-name=dry", "--nodes=1", "--ntasks-per-node=1",
        "--cpus-per-task=1", "--mem=0", "--time=02:30:00", f"--output={run_dir}/%x-%j.out",
        "--open-mode=append", "--requeue", "--signal=B:USR1@120", "--exclusive",
        "--dependency=afterok:41", "--kill-on-invalid-dep=yes", str(REPO / "train.slurm")]
    assert not subprocess.run(["squeue", "-h", "-n", "dry"], capture_output=True, text=True).stdout


def test_the_job_trains_the_config_that_was_submitted(job_config, tmp_path):
    """Submitted (with a --set), edited while the job waits: the job trains what was validated.
    The source is deleted while it waits too: the job reads the prepared folder submit found."""
    source = tmp_path / "stories.txt"
    shutil.copyfile(DEMO / "stories.txt", source)
    config = job_config(train={"max_steps": 8, "eval_every": 0}, data={"dataset": str(source)})
    cli("prepare", "--config", config, check=True)
    out = submit("--config", config, "--set", "train.log_every=4", "--", "--hold")
    frozen = Path(out["config"].split(" (the jobs train")[0])
    assert frozen.parent == Path(out["run_dir"]) / "submitted" and frozen.is_file()
    assert yaml.safe_load(frozen.read_text())["data"]["prepared"] == str(prepared_path(load_config(config)))
    config.write_text(config.read_text().replace("max_steps: 8", "max_steps: 2"))
    source.unlink()
    subprocess.run(["scontrol", "release", out["job_id"]], check=True)
    assert wait_for(out["job_id"]) == "COMPLETED"
    train = [r["step"] for r in read_metrics(Path(out["run_dir"])) if r["kind"] == "train"]
    assert train == [4, 8]  # max_steps 8 and log_every 4, as submitted
    assert f"config: {frozen}" in Path(out["log"]).read_text()


def test_dry_run_chains_a_prepare_job_when_data_is_not_prepared(job_config):
    config = job_config()
    proc = subprocess.run(["bash", str(REPO / "submit.sh"), "--config", str(config), "--dry-run"],
                          capture_output=True, text=True)
    prepare, train = [shlex.split(x) for x in proc.stdout.splitlines() if x.startswith("env ")]
    assert "LLMTRAIN_STEP=prepare" in prepare and "--job-name=prepare-slurm" in prepare
    assert "--dependency=afterok:DRY_RUN_JOB_ID" in train
    assert "--kill-on-invalid-dep=yes" in train  # a failed prepare job cancels training


def test_submit_refuses_a_model_that_is_not_downloaded(job_config):
    config = job_config()
    raw = yaml.safe_load(config.read_text())
    raw["model"] = {"name_or_path": "org/absent"}
    config.write_text(yaml.safe_dump(raw))
    proc = subprocess.run(["bash", str(REPO / "submit.sh"), "--config", str(config)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0].startswith("model.name_or_path: org/absent is not downloaded yet")
    assert "bash download_data_model.sh" in proc.stderr


def test_a_sweep_runs_its_points_as_one_throttled_array_and_its_status_shows_them(job_config):
    """Three learning rates, at most two at once: one job array, a run directory per point
    trained from its own value; `sweep status` shows each point's state, step and eval loss."""
    config = job_config(run={"name": "sw"}, train={"max_steps": 4, "eval_every": 2})
    cli("prepare", "--config", config, check=True)
    grid = ["--grid", "train.lr=1e-3,3e-3,1e-2"]
    proc = cli("sweep", "--config", config, *grid, "--max-parallel", "2", "--", "--hold")
    assert proc.returncode == 0, proc.stderr
    out = dict(re.findall(r"^(\w+): (.*)$", proc.stdout, re.MULTILINE))
    array = out["array_job_id"].split()[0]
    queued = subprocess.run(["scontrol", "show", "job", array], capture_output=True, text=True).stdout
    assert "ArrayTaskId=0-2%2 ArrayTaskThrottle=2" in queued, queued  # 3 tasks, 2 at a time
    # Held in the queue: each point's status says pending, and the same sweep again is refused.
    point = Path(out["sweep_dir"]).parent / "sw-2"
    assert cli("status", point, check=True).stdout.splitlines()[1].startswith(f"state: pending (job {array})")
    again = cli("sweep", "--config", config, *grid)
    assert again.returncode == 1 and again.stderr.startswith("error: run 'sw-0' is pending now"), again.stderr
    subprocess.run(["scontrol", "release", array], check=True)
    deadline = time.monotonic() + 240
    while subprocess.run(["squeue", "-h", "-j", array], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, "the sweep's array did not finish in 240 s"
        time.sleep(1)
    tasks = subprocess.run(["scontrol", "show", "job", array], capture_output=True, text=True).stdout
    assert sorted(re.findall(r"ArrayTaskId=(\d+) ", tasks)) == ["0", "1", "2"], tasks
    assert re.findall(r"JobState=(\w+)", tasks) == ["COMPLETED"] * 3
    sweep_dir = Path(out["sweep_dir"])
    table = cli("sweep", "status", sweep_dir, check=True).stdout
    for i, lr in enumerate(["1e-3", "3e-3", "1e-2"]):
        run_dir = sweep_dir.parent / f"sw-{i}"
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["lr"] == float(lr)
        [log] = run_dir.glob(f"sw-{i}-*.out")  # the task's own log, in its own run directory
        assert "done: 4 steps" in log.read_text()
        last_eval = [r["eval_loss"] for r in read_metrics(run_dir) if r["kind"] == "eval"][-1]
        assert f"| {i} | sw-{i} | train.lr={lr} | finished | 4 | {last_eval:.4f} |" in table, table
    plot = cli("plot", *(sweep_dir.parent / f"sw-{i}" for i in range(3)), "--out", sweep_dir / "plot.png")
    assert plot.returncode == 0 and (sweep_dir / "plot.png").stat().st_size > 10_000


def test_a_run_submitted_from_python_is_a_handle_on_its_job(job_config):
    """`llmtrain.submit(config, overrides)` (a notebook): the code submit.sh runs, and a handle."""
    import llmtrain
    config = job_config(run={"name": "handle"})
    cli("prepare", "--config", config, check=True)
    job = llmtrain.submit(config, ["train.max_steps=3"])
    assert re.fullmatch(r"\d+", job.job_id) and job.state() in ("pending", "running")
    assert job.wait(poll_s=1) == "finished"
    assert [r["step"] for r in job.metrics() if r["kind"] == "train"] == [1, 2, 3]
    assert "done: 3 steps" in job.log.read_text() and job.log.parent == job.run_dir
    assert yaml.safe_load(job.config.read_text())["train"]["max_steps"] == 3


def test_the_scaling_table_as_slurm_jobs_on_one_and_two_nodes(job_config):
    """`llmtrain bench --nodes 1,2`: two jobs, one after the other, each row its job's figures."""
    import statistics
    config = job_config(run={"name": "scale"}, slurm={"procs_per_node": 1})
    cli("prepare", "--config", config, check=True)
    proc = cli("bench", "--config", config, "--nodes", "1,2", "--steps", "4", "--warmup", "1")
    assert proc.returncode == 0, proc.stderr
    jobs = re.findall(r"job (\d+) \.\.\.$", proc.stderr, re.MULTILINE)
    assert len(jobs) == 2, proc.stderr
    header, _, *rows = proc.stdout.splitlines()
    assert header.startswith("| processes | tokens/s |") and len(rows) == 2
    root = config.parent / "shared fs" / "runs" / "scale-scaling"
    speeds = []
    for n, job, row in zip((1, 2), jobs, rows):
        run_dir = root / f"{n}n"
        assert json.loads((run_dir / "provenance.json").read_text())["slurm"]["SLURM_NNODES"] == str(n)
        assert (run_dir / f"{n}n-{job}.out").is_file()
        train = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
        assert [r["step"] for r in train] == [1, 2, 3, 4]
        speeds.append(statistics.median(r["tokens_per_sec"] for r in train if r["step"] > 1))
        assert row.startswith(f"| {n} ({n} x 1) | {speeds[-1]:,.0f} | {speeds[-1] / n:,.0f} | "), row
    assert rows[1].endswith(f"| {speeds[1] / 2 / speeds[0]:.0%} |")
    first, second = (subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
                     for job in jobs)
    end = re.search(r"EndTime=(\S+)", first).group(1)
    assert re.search(r"StartTime=(\S+)", second).group(1) >= end  # no row shared the nodes


def logged(run_dir: Path) -> int:
    try:
        return max((r["step"] for r in read_metrics(run_dir)), default=0)
    except (OSError, ValueError):
        return 0


def wait_until_step(run_dir: Path, step: int, job_id: str | None = None) -> None:
    """Until the run has logged `step` (and, with job_id, its rank-1 worker is up)."""
    deadline = time.monotonic() + 180
    while logged(run_dir) < step or (job_id and worker_pid(job_id, 1) is None):
        assert time.monotonic() < deadline, f"{run_dir.name} never reached step {step}"
        time.sleep(0.1)


def worker_pid(job_id: str, rank: int) -> int | None:
    """The training process of `rank` in a job (all fake nodes share this machine's /proc)."""
    for proc in Path("/proc").iterdir():
        try:
            env = dict(x.split("=", 1) for x in (proc / "environ").read_text().split("\0") if "=" in x)
            cmd = (proc / "cmdline").read_text()
        except (OSError, ValueError):
            continue
        if (env.get("SLURM_JOB_ID") == job_id and env.get("RANK") == str(rank)
                and "llmtrain" in cmd and "torch.distributed.run" not in cmd and "torchrun" not in cmd):
            return int(proc.name)
    return None


# Imported by every Python process of the job (PYTHONPATH): once the marker exists, a new rank-0
# worker starts late, so the restarted rank 1 is first to the store. With torchrun's shared store
# it then read the previous attempt's rank-0 address and failed every restart.
SLOW_RANK0 = """
import os, time
if os.environ.get("RANK") == "0" and os.path.exists(os.environ["LLMTRAIN_TEST_SLOW_RANK0"]):
    time.sleep(4)
"""


def uninterrupted(config: Path) -> dict:
    job = submit("--config", config, "--nodes", 2, "--procs-per-node", 1)
    return {**job, "state": wait_for(job["job_id"], timeout=300)}


def warned(config: Path, at_step: int, *sets: str) -> dict:
    """Slurm's warning signal to the batch shell (what --signal=B:USR1@lead sends) at a step."""
    job = submit("--config", config, "--nodes", 2, "--procs-per-node", 1,
                 "--set", f"run.name=preempted-{at_step}", *sets)
    wait_until_step(Path(job["run_dir"]), at_step)
    subprocess.run(["scancel", "-b", "-s", "USR1", job["job_id"]], check=True)
    return {**job, "state": wait_for(job["job_id"], timeout=300)}


def killed(config: Path, root: Path) -> dict:
    """SIGKILL to the rank-1 worker at step 25 of a job with slurm.max_restarts."""
    (root / "sitecustomize.py").write_text(SLOW_RANK0)
    marker = root / "slow-rank0"
    env = {**os.environ, "PYTHONPATH": str(root), "LLMTRAIN_TEST_SLOW_RANK0": str(marker),
           "LLMTRAIN_FORK_WORKERS": "0"}  # each rank runs the sitecustomize: new interpreters
    job = submit("--config", config, "--nodes", 2, "--procs-per-node", 1, "--set", "run.name=restarted",
                 "--set", "slurm.max_restarts=3", "--set", "train.checkpoint_every=10", env=env)
    wait_until_step(Path(job["run_dir"]), 25, job["job_id"])
    marker.touch()
    os.kill(worker_pid(job["job_id"], 1), 9)
    return {**job, "state": wait_for(job["job_id"], timeout=300)}


def continued(config: Path) -> dict:
    """The warning signal at step 10 of a job that may not be requeued (sbatch --no-requeue)."""
    job = submit("--config", config, "--nodes", 2, "--procs-per-node", 1,
                 "--set", "run.name=continued", "--", "--no-requeue")
    wait_until_step(Path(job["run_dir"]), 10)
    subprocess.run(["scancel", "-b", "-s", "USR1", job["job_id"]], check=True)
    state = wait_for(job["job_id"], timeout=300)
    m = re.search(r"requeue refused; submitted continuation job (\d+)", Path(job["log"]).read_text())
    follow = wait_for(m.group(1), timeout=300) if m else None
    return {**job, "state": state, "continuation": m and m.group(1), "continuation_state": follow}


def cancelled(config: Path) -> dict:
    """`scancel JOB` at step 10 (SIGTERM to every process of the job, SIGKILL KillWait later),
    with TensorBoard and W&B on: the user's own stop, not a preemption."""
    job = submit("--config", config, "--nodes", 2, "--procs-per-node", 1, "--set", "run.name=cancelled",
                 *TRACKERS)
    wait_until_step(Path(job["run_dir"]), 10)
    subprocess.run(["scancel", job["job_id"]], check=True)
    return {**job, "state": wait_for(job["job_id"], timeout=300)}


@pytest.fixture(scope="module")
def trials(cluster, tmp_path_factory):
    """An uninterrupted 2-node run, the reference, and every preemption trial of the same config,
    submitted at once: each job takes 1 of a node's 8 CPUs, so they run side by side and take
    about as long as the longest trial. Once per pytest run: the first xdist worker to get here
    runs them (under a lock) and records each outcome; the other reads the record."""
    shared = tmp_path_factory.getbasetemp().parent / f"preemption-{os.environ['LLMTRAIN_TEST_RUN']}"
    shared.mkdir(exist_ok=True)
    record = shared / "outcomes.json"
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not record.exists():
            record.write_text(json.dumps(run_trials(shared)))
    return json.loads(record.read_text())


def run_trials(root: Path) -> dict:
    cfg = tiny_config(run={"name": "uninterrupted", "dir": str(root / "runs")},
                      data={"prepared_dir": str(root / "prepared")},
                      train={"max_steps": 120, "checkpoint_every": 1000, "eval_every": 0},
                      slurm={"cpus_per_node": 1})
    config = root / "job.yaml"
    config.write_text(yaml.safe_dump(cfg))
    cli("prepare", "--config", config, check=True)
    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = {"reference": pool.submit(uninterrupted, config),
                   "warned-3": pool.submit(warned, config, 3),
                   "warned-40": pool.submit(warned, config, 40, *TRACKERS),
                   "killed": pool.submit(killed, config, root),
                   "continued": pool.submit(continued, config),
                   "cancelled": pool.submit(cancelled, config)}
        return {name: outcome(f) for name, f in futures.items()}


# One preempted trial also writes TensorBoard and W&B (offline), to check them across the requeue.
TRACKERS = ("--set", "metrics.tensorboard=true", "--set", "metrics.wandb.project=trials")


def outcome(future) -> dict:
    try:
        return future.result()
    except Exception as e:  # noqa: BLE001 (the test of this trial reports it)
        return {"error": f"{type(e).__name__}: {e}"}


def node_scratch(job_id: str) -> Path:
    """A job's node-local TMPDIR (train.slurm); the test cluster's nodes share this machine's /tmp."""
    return Path(os.environ.get("SLURM_TMPDIR", "/tmp")) / f"llmtrain-{job_id}"


def trial(trials: dict, name: str) -> dict:
    job = trials[name]
    assert "error" not in job, job.get("error")
    return job


def reference_losses(trials) -> list:
    ref = trial(trials, "reference")
    assert ref["state"] == "COMPLETED"
    return losses(Path(ref["run_dir"]))


@pytest.mark.parametrize("at_step", [3, 40])
def test_warning_signal_saves_requeues_and_resumes_bit_identically(trials, at_step):
    job = trial(trials, f"warned-{at_step}")
    assert job["state"] == "COMPLETED"
    run_dir = Path(job["run_dir"])
    log = Path(job["log"]).read_text()
    stopped = re.search(r"stopping at step (\d+) \(preempt\)", log)
    assert stopped and at_step <= int(stopped.group(1)) < 120
    assert "requeueing job" in log and "SLURM_RESTART_COUNT=1" in log
    assert f"resumed from {run_dir}/checkpoints/step-{int(stopped.group(1)):08d}" in log
    assert losses(run_dir) == reference_losses(trials)  # every step, bit for bit
    assert not re.search(r"Traceback|SignalException", log), log  # a stop, requeue, resume: no failure


def test_scancel_saves_and_the_log_reads_as_a_clean_stop(trials):
    """scancel: every rank saves at the same step within Slurm's KillWait; the job log ends with
    that stop, without the agent's SignalException traceback or W&B's `Connection lost`."""
    job = trial(trials, "cancelled")
    assert job["state"] == "CANCELLED"
    run_dir = Path(job["run_dir"])
    stop = json.loads((run_dir / "control" / "exit.json").read_text())
    assert stop["reason"] == "signal" and 10 <= stop["step"] < 120
    assert (run_dir / "checkpoints" / f"step-{stop['step']:08d}" / "meta.json").is_file()
    log = Path(job["log"]).read_text()
    assert f"stopping at step {stop['step']} (signal)" in log
    assert not re.search(r"Traceback|SignalException|Connection lost|Root Cause|warning:", log), log[-3000:]
    assert "requeueing" not in log  # cancelled by the user: not requeued
    # A stop that asks a requeue keeps the nodes' scratch (a requeue there finds its compile
    # caches); the uninterrupted reference and a preempted run that came back and finished do not.
    assert node_scratch(job["job_id"]).is_dir()
    assert not node_scratch(trial(trials, "reference")["job_id"]).exists()
    assert not node_scratch(trial(trials, "warned-3")["job_id"]).exists()


def test_a_requeued_run_continues_one_wandb_run_and_one_tensorboard_curve(trials):
    """Preempted at step 40 and requeued: both launches finished their W&B files, which hold one
    run id, the job's id, and each of the 120 steps once with metrics.jsonl's loss; TensorBoard
    shows each step once with the same values."""
    job = trial(trials, "warned-40")
    run_dir = Path(job["run_dir"])
    train = {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"}
    assert list(train) == list(range(1, 121))
    state = json.loads((run_dir / "wandb-run.json").read_text())
    launches = wandb_runs(run_dir / "wandb")
    assert len(launches) == 2 and not (run_dir / "wandb" / "incomplete").exists()
    assert {run["id"] for run in launches} == {state["id"]}
    assert state["slurm_job_ids"] == [job["job_id"]] == launches[-1]["config"]["slurm_job_ids"]
    rows = [row for run in launches for row in run["history"]]
    assert [row["_step"] for row in rows] == list(range(1, 121))
    assert all(row["train/loss"] == train[row["_step"]] for row in rows)
    tb = tensorboard_scalars(run_dir / "tensorboard")["train/loss"]
    assert tb == [(s, float(np.float32(loss))) for s, loss in train.items()]


def _seconds_of_day(clock: str) -> int:
    hours, minutes, seconds = map(int, clock.split(":"))
    return hours * 3600 + minutes * 60 + seconds


def test_a_slow_step_near_the_time_limit_saves_before_it_requeues_and_resumes(job_config):
    """The review's 70B case in small: steps of 12 s (injected, first launch only), a lead of
    10 s and no warning signal at all (removed after --), so only the trainer's deadline acts.
    A stop 10 s before the end would be read a step later, after Slurm's kill (a TIMEOUT, never
    requeued); the measured step moves it early enough that the save completes before the end.
    The time-limit requeue is planned: it happens with slurm.max_requeues 0."""
    config = job_config(train={"max_steps": 30, "checkpoint_every": 1000000, "eval_every": 0,
                               "log_every": 1},
                        slurm={"signal_lead_s": 10, "max_requeues": 0})
    cli("prepare", "--config", config, check=True)
    env = {**os.environ, "LLMTRAIN_INJECT_STEP_S": "12@0"}
    job = submit("--config", config, "--nodes", 2, "--procs-per-node", 1, "--time", "00:02:00",
                 "--", "--signal=B:URG@1", env=env)
    assert wait_for(job["job_id"], timeout=300) == "COMPLETED"
    log = Path(job["log"]).read_text()
    ends = re.search(r"job ends at (\d\d:\d\d:\d\d)", log).group(1)
    assert re.search(r"stopping for the time limit: the job ends at \S+ and the next step \(~1[2-9]s\)", log)
    stop = int(re.search(r"stopping at step (\d+) \(deadline\)", log).group(1))
    saved = re.search(rf"(\d\d:\d\d:\d\d) \[rank 0\] checkpoint saved: .*/step-{stop:08d}", log).group(1)
    # The final save finished before the time limit (clock times: a job may span midnight)
    before_end = (_seconds_of_day(ends) - _seconds_of_day(saved)) % 86400
    assert 0 < before_end < 120, (saved, ends)  # within the job's 2 minutes
    assert f"requeueing job {job['job_id']} at its time limit (planned" in log
    assert f"resumed from {job['run_dir']}/checkpoints/step-{stop:08d}" in log
    steps = [r["step"] for r in read_metrics(Path(job["run_dir"])) if r["kind"] == "train"]
    assert steps == list(range(1, 31))  # each step once: nothing lost, nothing trained twice


NO_ACCOUNTING = ("slurm.account: partition restricted allows only accounts physics, and this cluster keeps no "
                 "accounting (AccountingStorageType=accounting_storage/none), so Slurm never knows a job's "
                 "account and the job would pend forever; choose another partition (slurm.partition)")


@pytest.mark.parametrize("flags,line", [
    (["--set", "slurm.cpus_per_node=16"],
     "slurm.cpus_per_node: asks 16 CPUs per node; the nodes of the default partition debug have at most "
     "8; set slurm.cpus_per_node <= 8"),
    (["--gpus-per-node", "2"],
     "slurm.gpus_per_node: asks 2 GPUs per node; the nodes of the default partition debug have none; "
     "choose a GPU partition (slurm.partition) or set slurm.gpus_per_node <= 0"),
    (["--partition", "short", "--time", "01:00:00"],
     "slurm.time: asks 01:00:00; partition short allows at most 00:10:00; lower slurm.time (a requeue "
     "continues the run) or choose another partition"),
    (["--partition", "nosuch"], "slurm.partition: no partition 'nosuch' on this cluster; choose one of debug, "
                                "restricted, short"),
    (["--partition", "restricted", "--account", "bio"], "slurm.account: partition restricted does not take "
     "account 'bio' (allows physics); choose another account or another partition (slurm.partition)"),
    (["--partition", "restricted", "--qos", "low"], [NO_ACCOUNTING, "slurm.qos: partition restricted does not "
     "take qos 'low' (allows high); choose another QOS or another partition (slurm.partition)"]),
    (["--partition", "restricted", "--nodes", "2", "--set", "train.global_batch_size=16"],
     [NO_ACCOUNTING, "slurm.nodes: asks 2 nodes; partition restricted allows at most 1 per job; lower "
      "slurm.nodes or choose another partition"]),
    # No account given, or an allowed one: without accounting (this cluster) sbatch takes the job
    # and it pends forever ("Job's account not known, so it can't use this partition").
    (["--partition", "restricted", "--qos", "high"], NO_ACCOUNTING),
    (["--partition", "restricted", "--qos", "high", "--account", "physics"], NO_ACCOUNTING),
    (["--nodes", "3", "--set", "train.global_batch_size=24"],
     "slurm.nodes: asks 3 nodes with 1 CPU and 0 GPUs each; the default partition debug has 2 such "
     "nodes (2 in all)"),
], ids=["cpus", "gpus", "time", "partition", "account", "qos", "max-nodes", "no-account", "allowed-account",
        "nodes"])
def test_a_request_the_cluster_can_never_meet_fails_before_queueing(job_config, flags, line):
    """Slurm would accept each of these and leave the job PENDING forever (or, for the
    partition, refuse it only at sbatch): check-config asks sinfo first, and nothing is queued."""
    config = job_config(run={"name": "never"})
    proc = subprocess.run(["bash", str(REPO / "submit.sh"), "--config", str(config), *flags],
                          capture_output=True, text=True)
    assert (proc.returncode, proc.stderr.splitlines()) == (2, [line] if isinstance(line, str) else line)
    assert "job_id:" not in proc.stdout and not (config.parent / "shared fs" / "runs" / "never").exists()
    assert not subprocess.run(["squeue", "-h", "-n", "never"], capture_output=True, text=True).stdout


def test_a_request_sbatch_refuses_is_one_clear_failure(job_config):
    """What sinfo cannot tell (an unknown node feature here) sbatch refuses: its lines, then ours."""
    config = job_config(run={"name": "rejected"})
    cli("prepare", "--config", config, check=True)
    proc = subprocess.run(["bash", str(REPO / "submit.sh"), "--config", str(config), "--",
                           "--constraint=nosuch"], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "sbatch: error: Batch job submission failed: Invalid feature specification",
        "error: sbatch failed (above); nothing more was submitted"]
    assert "job_id:" not in proc.stdout
    assert not subprocess.run(["squeue", "-h", "-n", "rejected"], capture_output=True, text=True).stdout


def test_a_killed_worker_is_restarted_and_resumes_bit_identically(trials):
    """slurm.max_restarts: torchrun restarts the workers, which resume from the newest checkpoint."""
    job = trial(trials, "killed")
    assert job["state"] == "COMPLETED"
    run_dir = Path(job["run_dir"])
    log = Path(job["log"]).read_text()
    assert re.search(rf"resumed from {run_dir}/checkpoints/step-000000[2-9]0 ", log), log[-3000:]
    # checkpoint_every differs from the reference, which changes nothing in the losses.
    assert losses(run_dir) == reference_losses(trials)


def test_jobs_side_by_side_on_the_same_nodes_each_rendezvous_on_their_own_port(trials):
    """The trials' five jobs ran at once on node1 and node2 (1 CPU of 8 each): every one
    completed, on a rendezvous port of its own (a fixed 29500 would have joined them)."""
    jobs = [trial(trials, name) for name in ("reference", "warned-3", "warned-40", "killed", "continued")]
    assert [job["state"] for job in jobs] == ["COMPLETED"] * 5
    assert not any("prepare_job_id" in job for job in jobs)  # prepared on the login node first
    logs = [Path(job["log"]).read_text() for job in jobs]
    assert all("(hosts: node1, node2)" in log for log in logs)
    ports = {re.search(r"rendezvous node1:(\d+)", log).group(1) for log in logs}
    assert len(ports) == 5, ports


def test_where_requeue_is_refused_a_continuation_job_finishes_the_run(trials):
    job = trial(trials, "continued")
    assert job["state"] == "COMPLETED"
    assert job["continuation"], Path(job["log"]).read_text()[-2000:]
    assert job["continuation_state"] == "COMPLETED"
    run_dir = Path(job["run_dir"])
    assert "resumed from" in (run_dir / f"continued-{job['continuation']}.out").read_text()
    assert losses(run_dir) == reference_losses(trials)


# The preflight's test hook: the ranks on node2 report a tenth of their matmul speed.


def test_with_exclude_slow_nodes_the_run_comes_back_without_the_slow_node(job_config):
    """The job stops before building the model; a continuation job with --exclude=node2 (Slurm
    refuses to change a running job's ExcNodeList) trains the run on node1. On a cluster of two
    nodes, the job asks for one or two (Slurm gives a range as many as are free, when the tasks
    fit: 2 tasks, up to 2 a node): two at first, one will do for the continuation."""
    config = job_config(run={"name": "excluded"}, train={"max_steps": 4, "eval_every": 0},
                        slurm={"nodes": 2, "procs_per_node": 1, "exclude_slow_nodes": True})
    cli("prepare", "--config", config, check=True)
    job = submit("--config", config, "--", "--nodes=1-2", "--ntasks=2", "--ntasks-per-node=2",
                 env={**os.environ, **SLOW_NODE2})
    assert wait_for(job["job_id"]) == "COMPLETED"
    log = Path(job["log"]).read_text()
    assert "(hosts: node1, node2)" in log and "model ready" not in log
    assert ("node2 is slow" in log and "stopping before training (slurm.exclude_slow_nodes): the "
            "job asks to come back without it" in log), log
    assert (f"requeueing job {job['job_id']} without node2 (slow in the preflight) as a "
            f"continuation job (requeue 1 of at most 5)") in log
    follow = re.search(r"slow node left out; submitted continuation job (\d+)", log).group(1)
    assert wait_for(follow) == "COMPLETED"
    shown = subprocess.run(["scontrol", "show", "job", follow], capture_output=True, text=True).stdout
    assert re.search(r"\bExcNodeList=node2\b", shown) and re.search(r"\bNodeList=node1\b", shown), shown
    again = (Path(job["run_dir"]) / f"excluded-{follow}.out").read_text()
    assert "(hosts: node1)" in again and "preflight: one node, nothing to compare" in again
    assert "done: 4 steps" in again, again[-2000:]
