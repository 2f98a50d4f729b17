"""`llmtrain status`: one plain state line for each way a run stands, from the run's files and a
real Slurm (test_slurm's cluster). Running and stopped local runs: test_control.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import cli, read_metrics, tiny_config
from test_slurm import job_config, submit, wait_for  # noqa: F401 (job_config: a fixture)


def status_lines(target) -> list[str]:
    proc = cli("status", target)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return proc.stdout.splitlines()


def test_a_run_that_has_not_started_yet(tmp_path):
    run_dir = tmp_path / "runs" / "fresh"  # what submit.sh leaves before any job has run
    run_dir.mkdir(parents=True)
    assert status_lines(run_dir)[:4] == [f"run: fresh  ({run_dir})",
                                         "state: not started: no job and no step logged yet",
                                         "progress: no step logged yet", "checkpoints: none yet"]


def test_status_into_a_reader_that_left_ends_quietly(tmp_path):
    """`llmtrain status X | head -1`: head leaves after one line; no BrokenPipeError."""
    run_dir = tmp_path / "runs" / "fresh"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(tiny_config(run={"name": "fresh"})))
    head = subprocess.run(["bash", "-c", 'set -o pipefail; "$0" -m llmtrain status "$1" | head -1',
                           sys.executable, str(run_dir)], capture_output=True, text=True)
    assert (head.returncode, head.stdout, head.stderr) == (0, f"run: fresh  ({run_dir})\n", "")
    # The same, every time: a reader that has gone before the first line is written.
    proc = subprocess.Popen([sys.executable, "-m", "llmtrain", "status", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    assert (proc.wait(timeout=60), proc.stderr.read()) == (0, "")


@pytest.mark.slow
def test_a_pending_job_by_its_id_and_by_its_run_directory(job_config):
    config = job_config()
    cli("prepare", "--config", config, check=True)
    job = submit("--config", config, "--set", "run.name=held", "--", "--hold")
    try:
        run_dir = Path(job["run_dir"])
        state = f"state: pending (job {job['job_id']}) in the Slurm queue (reason: JobHeldUser)"
        assert status_lines(job["job_id"])[:3] == [
            f"run: held  ({run_dir})", state, f"job: {job['job_id']} PENDING (squeue)"]
        assert status_lines(run_dir)[1] == state  # found in the queue: it has no log yet
        stop = cli("control", run_dir, "stop")
        assert stop.returncode == 1 and stop.stderr.splitlines() == [
            f"error: {run_dir}: not running ({state.removeprefix('state: ')}); nothing to stop"]
        assert not (run_dir / "control" / "stop").exists()
    finally:
        subprocess.run(["scancel", job["job_id"]], check=True)


@pytest.mark.slow
def test_a_pending_job_cancelled_reads_the_same_by_its_id_and_by_its_run_directory(job_config):
    """It never started, so it left no log in the run directory: the folder's status finds it
    where the id's does, in what Slurm still knows (MinJobAge), instead of "not started"."""
    config = job_config()
    cli("prepare", "--config", config, check=True)
    job = submit("--config", config, "--set", "run.name=dropped", "--", "--hold")
    subprocess.run(["scancel", job["job_id"]], check=True)
    assert wait_for(job["job_id"]) == "CANCELLED"
    run_dir = Path(job["run_dir"])
    state = f"state: cancelled (job {job['job_id']}) before its first step"
    assert status_lines(job["job_id"])[1] == state
    assert status_lines(run_dir)[1] == state
    assert status_lines(run_dir) == status_lines(job["job_id"])
    assert not list(run_dir.glob("*.out"))  # what the folder alone cannot tell


@pytest.mark.slow
def test_a_failed_job_shows_the_trainers_error_line(job_config):
    config = job_config(slurm={"nodes": 1, "procs_per_node": 1})
    cli("prepare", "--config", config, check=True)
    # Non-finite losses at steps 2-5: more than train.max_bad_steps (3) in a row ends the run.
    job = submit("--config", config, "--set", "run.name=diverged",
                 env={**os.environ, "LLMTRAIN_INJECT_NAN_STEPS": "2,3,4,5"})
    assert wait_for(job["job_id"], timeout=180) == "FAILED"
    assert status_lines(job["job_id"])[1] == (
        f"state: failed (job {job['job_id']}, Slurm: FAILED) after step 4 of 8: error: training "
        f"stopped at step 5: 4 steps in a row had a non-finite loss or gradient norm "
        f"(train.max_bad_steps is 3); lower train.lr, check the data (logs/rank-*.log name the "
        f"samples), or resume from an earlier checkpoint with train.resume")


@pytest.mark.slow
def test_a_job_out_of_requeues_says_so(job_config):
    config = job_config(train={"max_steps": 100000, "checkpoint_every": 100000, "eval_every": 0},
                        slurm={"nodes": 1, "procs_per_node": 1, "max_requeues": 0})
    cli("prepare", "--config", config, check=True)
    job = submit("--config", config, "--set", "run.name=preempted")
    run_dir = Path(job["run_dir"])
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() or not read_metrics(run_dir):
            assert time.monotonic() < deadline, "the job never logged a step"
            time.sleep(0.2)
        assert status_lines(job["job_id"])[1].startswith(
            f"state: running (job {job['job_id']}) at step ")
        # Slurm's warning before a preemption: the job saves and stops, asking for a requeue.
        subprocess.run(["scancel", "-b", "-s", "USR1", job["job_id"]], check=True)
        assert wait_for(job["job_id"], timeout=180) == "COMPLETED"
    finally:
        subprocess.run(["scancel", job["job_id"]])  # 100000 steps: never leave it running
    lines = status_lines(run_dir)
    step = int(lines[1].split(" at step ")[1].split()[0])
    assert lines[1] == (f"state: out of requeues (job {job['job_id']}): stopped at step {step} of "
                        f"100000 (preempt) and not requeued: the job was requeued 0 times already "
                        f"for preemption or signals (slurm.max_requeues; time-limit requeues are "
                        f"not counted); submit the same config again to continue")
    assert lines[3].startswith(f"progress: step {step}/100000 (0%)") and "eta" not in lines[3]


def test_a_training_job_that_never_started_shows_its_prepare_jobs_error(tmp_path, monkeypatch):
    """Slurm cancelled the training job (--kill-on-invalid-dep) when its prepare job failed:
    status names that failure, not "not started"."""
    from llmtrain.login.status import assess
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))  # no squeue/sacct/scontrol here
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "prepare-150.out").write_text(
        "llmtrain prepare job 150 on node1: /runs/run/submitted/x.yaml\n"
        "data.dataset: no such file or folder (got 'gone.txt', resolved to /data/gone.txt)\n")
    verdict = assess(run_dir, None)
    assert (verdict.state, verdict.text) == (
        "failed", f"failed before its first step: its prepare job 150 failed: data.dataset: no such "
        f"file or folder (got 'gone.txt', resolved to /data/gone.txt) (see {run_dir}/prepare-150.out)")


def test_a_prepare_job_that_failed_is_named_with_its_line_and_its_log(tmp_path, monkeypatch):
    """A prepare job killed at its time limit (Slurm's line, no llmtrain error): the training job
    Slurm cancelled, and the run's folder, name the prepare job, the line and its log; the
    status shows that log's tail, since no training log exists."""
    from llmtrain.login.status import assess
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))  # no squeue/sacct/scontrol here
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    killed = "slurmstepd: error: *** JOB 150 ON node1 CANCELLED AT 2026-01-01T00:10:00 DUE TO TIME LIMIT ***"
    (run_dir / "prepare-150.out").write_text(
        f"llmtrain prepare job 150 on node1: /runs/run/submitted/x.yaml\ntokenizing 2 files\n{killed}\n")
    failed = (f"its prepare job 150 failed: {killed.removeprefix('slurmstepd: ')} "
              f"(see {run_dir}/prepare-150.out)")
    assert assess(run_dir, "151", ("CANCELLED", "", "scontrol")).text == (
        f"cancelled (job 151) before its first step: {failed}")
    lines = status_lines(run_dir)
    assert lines[1] == f"state: failed before its first step: {failed}"
    assert lines[-4:] == [f"log: {run_dir}/prepare-150.out (last 3 lines)",
                          "  llmtrain prepare job 150 on node1: /runs/run/submitted/x.yaml",
                          "  tokenizing 2 files", f"  {killed}"]


def test_a_run_and_a_sweep_by_their_names(home, tmp_path, write_config):
    """A NAME is a run (or a sweep) in run.dir: $LLMTRAIN_HOME/runs, run.dir's default, or the
    run.dir of --config's file; a name found nowhere says where it was looked for."""
    import json
    for root, name in ((home / "runs", "fresh"), (tmp_path / "elsewhere", "other")):
        (root / name).mkdir(parents=True)
    assert status_lines("fresh")[:2] == [f"run: fresh  ({home / 'runs' / 'fresh'})",
                                         "state: not started: no job and no step logged yet"]
    config = write_config(tiny_config(run={"name": "other", "dir": str(tmp_path / "elsewhere")}))
    proc = cli("status", "other", "--config", config)
    assert proc.returncode == 0 and proc.stdout.splitlines()[0] == f"run: other  ({tmp_path / 'elsewhere' / 'other'})"
    proc = cli("status", "other")
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr.splitlines() == [
        f"error: other: no such run directory, not a job id, nor a run in {home / 'runs'}; give the "
        f"run directory, <run.dir>/<run.name>, or --config FILE for its run.dir"]
    sweep = home / "runs" / "lr-sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({"name": "lr", "array_job_id": None, "points": [
        {"index": 0, "overrides": ["train.lr=1e-3"], "run_name": "lr-0", "run_dir": str(home / "runs" / "lr-0")}]}))
    proc = cli("sweep", "status", "lr")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == f"sweep: lr  ({sweep})"
    assert proc.stdout.splitlines()[3] == "| 0 | lr-0 | train.lr=1e-3 | not started | - | - |"
