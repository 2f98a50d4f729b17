"""Switches and non-finite losses under real torchrun processes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from conftest import (cli, launch_training, losses, prepared_home, read_metrics, tiny_config, torchrun,
                      torchrun_unchecked)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = tiny_config(train={"max_steps": 150, "checkpoint_every": 1000, "eval_every": 0,
                             "log_every": 1})
    with prepared_home(tmp_path_factory, "control", cfg) as home:
        yield home


@pytest.fixture(scope="module")
def reference(setup):
    """150 uninterrupted steps: the losses every stopped and resumed run must match."""
    root, config = setup
    torchrun(2, "train", "--config", config, "--set", "run.name=ref")
    return root / "home" / "runs" / "ref"


def wait_for_step(proc: subprocess.Popen, step: int) -> str:
    """Block on the run's output (no polling) until rank 0 has logged `step` (its metrics line
    is written just before); returns what it printed so far."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        m = re.search(r"\[rank 0\] step (\d+)/", line)
        if m and int(m.group(1)) >= step:
            return "".join(seen)
    proc.wait()
    raise AssertionError(f"the run ended (exit {proc.returncode}) before step {step}:\n" + "".join(seen))


def test_stop_switch_saves_stops_and_resumes_bit_identically(setup, reference):
    root, config = setup
    run_dir = root / "home" / "runs" / "stopped"
    proc = launch_training(2, config, "run.name=stopped")
    early = wait_for_step(proc, 5)
    status = cli("status", run_dir, check=True).stdout.splitlines()
    assert status[1].startswith("state: running at step ") and status[1].endswith(" of 150")
    assert status[2].startswith("progress: step ") and ", eta " in status[2]
    assert cli("control", run_dir, "stop", check=True).stdout.startswith("stop requested")
    out = early + proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    exit_info = json.loads((run_dir / "control" / "exit.json").read_text())
    assert exit_info["reason"] == "user" and exit_info["requeue"] is False
    stopped_at = exit_info["step"]
    assert 5 <= stopped_at < 150 and (run_dir / "checkpoints" / f"step-{stopped_at:08d}").is_dir()
    assert f"stopping at step {stopped_at} (user)" in out
    status = cli("status", run_dir, check=True).stdout.splitlines()
    assert status[1] == (f"state: stopped by request at step {stopped_at} of 150; launch the same "
                         f"config again to continue")
    assert status[2].startswith("progress: step ") and "eta" not in status[2]  # it is not coming

    torchrun(2, "train", "--config", config, "--set", "run.name=stopped")
    assert losses(run_dir) == losses(reference)


def test_ctrl_c_saves_at_the_step_it_stopped_and_resumes_bit_identically(setup, reference):
    """Ctrl-C in a terminal: SIGINT to torchrun's process group; torchrun forwards it to its
    workers (in sessions of their own) and SIGKILLs them 30 s later. They must save and stop."""
    root, config = setup
    run_dir = root / "home" / "runs" / "ctrl-c"
    proc = launch_training(2, config, "run.name=ctrl-c")
    early = wait_for_step(proc, 5)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    out = early + proc.communicate(timeout=60)[0]
    assert time.monotonic() - t0 < 20, out  # saved and gone, not killed after 30 s
    exit_info = json.loads((run_dir / "control" / "exit.json").read_text())
    assert exit_info["reason"] == "user" and exit_info["requeue"] is False  # a person: no requeue
    stopped_at = exit_info["step"]
    assert (run_dir / "checkpoints" / f"step-{stopped_at:08d}" / "meta.json").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{stopped_at:08d}"
    assert f"stopping at step {stopped_at} (user); the checkpoint is saved" in out
    # Both workers ended on their own, with exit 0: torchrun had nobody to kill or report.
    assert "forcefully exiting" not in out and "ChildFailedError" not in out, out
    assert "KeyboardInterrupt" not in out, out

    torchrun(2, "train", "--config", config, "--set", "run.name=ctrl-c")
    assert losses(run_dir) == losses(reference)


def test_control_on_a_run_that_is_not_running_says_so_and_writes_nothing(setup, reference):
    for action in ("stop", "save"):
        proc = cli("control", reference, action)
        assert proc.returncode == 1 and proc.stdout == ""
        assert proc.stderr.splitlines() == [f"error: {reference}: not running (finished: 150 of 150 "
                                            f"steps); nothing to {action}"]
        assert not (reference / "control" / action).exists()


def test_a_stale_switch_never_stops_a_later_launch(setup):
    """Switches an earlier launch never read (it ended first) are removed when the next one
    starts, and it trains to the end; one written after the launch started is acted on."""
    root, config = setup
    run_dir = root / "home" / "runs" / "stale"
    switches = run_dir / "control"
    switches.mkdir(parents=True)
    for name in ("stop", "save"):
        (switches / name).write_text("user\n")
        os.utime(switches / name, (time.time() - 60, time.time() - 60))
    proc = torchrun(2, "train", "--config", config, "--set", "run.name=stale",
                    "--set", "train.max_steps=6")
    assert json.loads((switches / "exit.json").read_text())["reason"] == "done"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-00000006"]
    assert not (switches / "stop").exists() and not (switches / "save").exists()
    assert f"removed {switches / 'stop'}: written before this launch started" in proc.stdout

    # A stop written while the next launch starts up (Slurm's warning, a user) is that launch's.
    proc = launch_training(2, config, "run.name=stale", "train.max_steps=12")
    time.sleep(0.2)  # torchrun's agent has started; its workers start seconds later
    (switches / "stop").write_text("preempt\n")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert json.loads((switches / "exit.json").read_text())["reason"] == "preempt"
    assert "stopping at step 7 (preempt)" in out


def test_save_switch_checkpoints_and_goes_on(setup):
    root, config = setup
    run_dir = root / "home" / "runs" / "saved"
    proc = launch_training(2, config, "run.name=saved")
    early = wait_for_step(proc, 3)
    cli("control", run_dir, "save", check=True)
    out = early + proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert len(saved) == 2 and saved[-1] == "step-00000150"  # the requested one and the final one
    assert json.loads((run_dir / "control" / "exit.json").read_text())["reason"] == "done"


def test_a_non_finite_step_is_skipped_and_too_many_in_a_row_stop_with_a_diagnostic(setup):
    """Step 7 is non-finite: skipped, logged with its samples, and training goes on. Steps 9-12
    are too: 4 in a row, more than train.max_bad_steps (3), end the run with one line."""
    root, config = setup
    run_dir = root / "home" / "runs" / "nan"
    proc = torchrun_unchecked(2, "train", "--config", config, "--set", "run.name=nan",
                              "--set", "train.max_steps=20", "--set", "train.checkpoint_every=2",
                              env={"LLMTRAIN_INJECT_NAN_STEPS": "7,9,10,11,12"})
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert "warning: step 7: non-finite loss or gradient norm on some rank; step skipped (1 in a row" in log
    assert "this rank's samples: [" in log
    train = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 12))  # step 12 ends the run unlogged
    assert [r["skipped_steps"] for r in train] == [0] * 6 + [1, 1, 2, 3, 4]
    finite = [r["loss"] == r["loss"] for r in train]
    assert finite == [True] * 6 + [False, True] + [False] * 3  # step 8 trained again

    assert proc.returncode != 0
    errors = {x for x in proc.stderr.splitlines() if x.startswith("error:")}
    assert errors == {"error: training stopped at step 12: 4 steps in a row had a non-finite loss or "
                      "gradient norm (train.max_bad_steps is 3); lower train.lr, check the data "
                      "(logs/rank-*.log name the samples), or resume from an earlier checkpoint "
                      "with train.resume"}
    ckpts = run_dir / "checkpoints"
    assert (ckpts / (ckpts / "latest").read_text().strip() / "meta.json").is_file()

    # Steps that do not log are skipped on the device and counted in by the host a step later:
    # the same steps skip, the same warnings, the same end, the same checkpoints' contents.
    lagged = root / "home" / "runs" / "nan-lagged"
    again = torchrun_unchecked(2, "train", "--config", config, "--set", "run.name=nan-lagged",
                               "--set", "train.max_steps=20", "--set", "train.checkpoint_every=4",
                               "--set", "train.log_every=4", "--set", "train.eval_every=0",
                               env={"LLMTRAIN_INJECT_NAN_STEPS": "7,9,10,11,12"})
    assert {x for x in again.stderr.splitlines() if x.startswith("error:")} == errors
    warned = [[x.split("] ", 1)[1] for x in (d / "logs" / "rank-0.log").read_text().splitlines()
               if "non-finite" in x] for d in (run_dir, lagged)]
    assert warned[1] == warned[0] and len(warned[0]) == 5
    steps = {r["step"]: r for r in train}
    assert [(r["step"], r["loss"], r["skipped_steps"]) for r in read_metrics(lagged)] == \
        [(s, steps[s]["loss"], steps[s]["skipped_steps"]) for s in (4, 8)]
    meta = json.loads((lagged / "checkpoints" / "step-00000008" / "meta.json").read_text())
    assert meta["run"] == {"step": 8, "tokens": 8 * 8 * 64, "skipped": 1, "bad_in_a_row": 0}


def test_a_rank_that_stops_participating_is_named_within_the_timeout(setup):
    root, config = setup
    t0 = time.monotonic()
    proc = torchrun_unchecked(2, "train", "--config", config, "--set", "run.name=hang",
                              "--set", "parallel.collective_timeout_s=10",
                              env={"LLMTRAIN_INJECT_HANG_STEP": "6"}, timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    run_dir = root / "home" / "runs" / "hang"
    [line] = {x for x in proc.stderr.splitlines() if x.startswith("error:")}
    assert line.startswith("error: a collective did not complete within "
                           "parallel.collective_timeout_s=10s: rank 1 on ")
    assert "(last heartbeat " in line and line.endswith(
        f"stopped participating: stuck or dead; its stack dump is in {run_dir}/logs/rank-1.log")
    # The watchdog named it before the timeout: under NCCL, whose own watchdog kills the process
    # without a Python error, that warning is the line the user gets.
    warnings = [x for x in proc.stderr.splitlines() if x.startswith("warning: a collective")]
    assert warnings and warnings[0].removeprefix("warning: ") == line.removeprefix("error: ")
    assert proc.stderr.index(warnings[0]) < proc.stderr.index(line)
    assert elapsed < 10 + 40  # the timeout, the diagnosis, the shutdown: not the wall time
    # faulthandler's watchdog dumped the stuck rank's stacks into its own log.
    assert "_injected_fault" in (run_dir / "logs" / "rank-1.log").read_text()


def test_a_start_up_that_overruns_its_timeout_names_the_phase(setup):
    """Start-up has its own timeout: the last rank stops in the first step (part of start-up),
    and both ranks end with the phase named, long before the collective timeout (600 s)."""
    root, config = setup
    t0 = time.monotonic()
    proc = torchrun_unchecked(2, "train", "--config", config, "--set", "run.name=slow-start",
                              "--set", "parallel.startup_timeout_s=10",
                              env={"LLMTRAIN_INJECT_HANG_STEP": "1"}, timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 10 + 40
    lines = {x for x in proc.stderr.splitlines() if x.startswith("error: start-up")}
    assert any(x.startswith("error: start-up did not finish within parallel.startup_timeout_s=10s: "
                            "rank 1 on ") and "was in phase 'first step'" in x for x in lines), lines
    log = (root / "home" / "runs" / "slow-start" / "logs" / "rank-1.log").read_text()
    assert "was in phase 'first step'" in log


def test_the_deadline_leaves_room_for_the_measured_step_evaluation_and_save():
    """The review's case: 75 s steps and a 300 s save with the default 120 s lead. The stop
    comes when two steps, the last evaluation and the save no longer fit before the end; with
    nothing measured yet, the lead (or the estimated save) alone."""
    from llmtrain.rundir import DEADLINE_MARGIN_S
    from llmtrain.training.control import Deadline

    save = [300.0]
    deadline = Deadline(end_time=10_000.0, lead_s=120, save_s=lambda: save[0])
    assert deadline.need_s() == 300 + DEADLINE_MARGIN_S  # before a step: the save's estimate
    save[0] = 0.0
    assert deadline.need_s() == 120  # never less than slurm.signal_lead_s
    t = 5_000.0
    for _ in range(3):  # steps of 75 s; one with a 40 s evaluation after it, which is no step
        deadline.agreed(t)
        t += 75
    deadline.paused_s, deadline.eval_s = 40.0, 40.0
    deadline.agreed(t + 40)
    assert deadline.steps == [75.0, 75.0, 75.0]
    save[0] = 300.0
    need = 2 * 75 + 40 + 300 + DEADLINE_MARGIN_S
    assert deadline.need_s() == need
    assert not deadline.due(10_000 - need - 1) and deadline.due(10_000 - need + 1)
    assert "the next step (~75s), an evaluation (~40s) and the save (~300s) need 505s" in deadline.why()


def test_heartbeats_come_from_the_watchdog_thread_spread_by_host_and_two_ranks_diagnose(tmp_path,
                                                                                     monkeypatch):
    """While the training thread is busy (here: asleep), the watchdog thread writes the beat:
    rank 0's where status reads it, another rank's under logs/heartbeats/<host>/. At a stall,
    rank 0 reads every rank's file and names the one that never reached the agreement; a rank
    that is neither the first nor the last only points to rank 0's log (4 ranks: 2 readers)."""
    import socket

    from llmtrain.rundir import Log
    from llmtrain.training import watchdog
    from llmtrain.training.watchdog import Watchdog

    monkeypatch.setattr(watchdog, "HEARTBEAT_S", 0.0)  # the diagnosis waits for others' records
    (tmp_path / "logs").mkdir()
    host = socket.gethostname()
    dogs = {rank: Watchdog(tmp_path, rank, 4, startup_timeout_s=600, collective_timeout_s=600)
            for rank in range(4)}
    try:
        for rank, dog in dogs.items():
            dog.log = Log(rank, tmp_path / "logs")
            dog.step(8)
        time.sleep(watchdog.POLL_S * 3)  # the training thread does nothing meanwhile
        beat = json.loads((tmp_path / "logs" / "heartbeats" / host / "rank-2.json").read_text())
        assert beat["step"] == 7 and beat["host"] == host and beat["pid"] == os.getpid()
        assert json.loads((tmp_path / "logs" / "heartbeat-rank-0.json").read_text())["step"] == 7
        assert not list((tmp_path / "logs").glob("heartbeat-rank-[123].json"))
        for rank in (1, 2):
            dogs[rank].at_sync()
        dogs[0].at_sync()
        dogs[3].step_no = 7  # rank 3 never started step 8: its last beat is from step 7
        for rank in (1, 2, 3):
            dogs[rank].diagnose()
        head = "a collective did not complete within parallel.collective_timeout_s=600s"
        assert dogs[2].diagnose() == (f"{head}; rank 0's log names the ranks that held it up: "
                                      f"{tmp_path}/logs/rank-0.log")
        line = dogs[0].diagnose()
        assert line.startswith(f"{head}: rank 3 on {host} (last heartbeat ")
        assert line.endswith(f"stopped participating: stuck or dead; its stack dump is in "
                             f"{tmp_path}/logs/rank-3.log")
    finally:
        for dog in dogs.values():
            dog.close()
