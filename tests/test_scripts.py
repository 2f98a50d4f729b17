"""setup.sh and submit.sh as a user runs them, from a path with spaces; ShellCheck on every script;
train.slurm's job step and requeue decision, with stand-ins for srun and scontrol."""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, imported_first, read_metrics, tiny_config
from llmtrain.rundir import SHELL_NAMES

THINGS = runpy.run_path(str(REPO / "configs" / "demo" / "make_demo_assets.py"))["THINGS"]  # the story world's

SCRIPTS = ["setup.sh", "submit.sh", "download_data_model.sh", "train.slurm", "lib/find-env.sh",
           "cluster/local-cluster.sh", ".ci/run", "tests/gpu.sh"]
USER_SCRIPTS = ["setup.sh", "submit.sh", "download_data_model.sh"]
pytestmark = pytest.mark.slow


def bash(*args, env=None, cwd=None, timeout=600):
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout)


@pytest.mark.parametrize("script", ["setup.sh", "submit.sh", "download_data_model.sh", "train.slurm"])
def test_the_user_facing_scripts_stay_short(script):
    """Decisions live in Python (llmtrain sbatch-command, check-config); a script only runs them."""
    assert len((REPO / script).read_text().splitlines()) <= 115


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_pass_shellcheck_and_bash_n(script):
    assert shutil.which("shellcheck"), "ShellCheck is not installed (apt-get install shellcheck)"
    lint = subprocess.run(["shellcheck", "-x", script], cwd=REPO, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    assert bash("-n", REPO / script).returncode == 0


@pytest.mark.parametrize("script", USER_SCRIPTS)
def test_unknown_flag_is_exit_2_with_usage(script):
    proc = bash(REPO / script, "--frobnicate")
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == f"{script}: unknown option: --frobnicate"
    assert "Usage: bash " + script in proc.stderr


def test_setup_in_a_path_with_spaces_then_demo_through_submit(tmp_path):
    """Fresh setup (a real venv), an idempotent second run, then the demo on its environment."""
    shared = tmp_path / "shared fs"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMTRAIN_", "VIRTUAL_ENV"))}
    clone = tmp_path / "my repo"
    shutil.copytree(REPO, clone, ignore=shutil.ignore_patterns("workspace", ".llmtrain-home", ".git",
                                                                 "__pycache__", ".pytest_cache"))

    # No extras: the trainer needs none of the test suite's packages, nor a tracker's (CI's own
    # setup.sh run installs the default, "test").
    first = bash(clone / "setup.sh", "--shared-dir", shared, "--extras", "", env=env)
    assert first.returncode == 0, first.stderr
    home = shared / "llmtrain"
    assert f'source "{home}/env.sh"' in first.stdout
    stamp = {p: p.stat().st_mtime_ns for p in [home / "env.sh", home / "venv" / "constraints.txt"]}

    # The second run is the README's test command, with the shared folder given as SHARED_DIR
    # (the variable setup.sh documents): it sources the environment setup.sh made there.
    [readme] = [line for line in (REPO / "README.md").read_text().splitlines()
                if line.startswith("bash setup.sh && ") and line.endswith(" && python -m pytest")]
    second = bash("-c", readme.replace("python -m pytest", 'echo "tests in: $LLMTRAIN_HOME"'), cwd=clone,
                  env={**env, "SHARED_DIR": str(shared), "LLMTRAIN_EXTRAS": ""}, timeout=60)
    assert second.returncode == 0 and "venv is up to date" in second.stdout, second.stderr
    assert second.stdout.splitlines()[-1] == f"tests in: {home}"
    assert {p: p.stat().st_mtime_ns for p in stamp} == stamp  # nothing rewritten

    probe = bash("-c", f'source "{home}/env.sh" && echo "$LLMTRAIN_HOME|$HF_HOME" && '
                 'python -c "import torch, llmtrain, importlib.util as u; print(torch.__version__, '
                 '[m for m in (\'pytest\', \'wandb\', \'tensorboard\') if u.find_spec(m)])"', env=env)
    assert probe.stdout.splitlines() == [f"{home}|{home}/cache/huggingface", "2.13.0+cpu []"]

    # Both demos as the README runs them (300 steps each, about a minute together here), and
    # the README's figures are this run's.
    readme = (REPO / "README.md").read_text()
    demo = bash(clone / "submit.sh", "--local", "--config", clone / "configs" / "demo.yaml", env=env)
    assert demo.returncode == 0, demo.stderr[-3000:]
    run_dir = home / "runs" / "demo"
    assert demo.stdout.splitlines().count(f"run_dir: {run_dir}") == 2  # before and after training
    train = {r["step"]: r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"}
    readme = readme.replace("\n", " ")
    first, last = re.search(r"falls to about ([\d.]+) at step 10 and about ([\d.]+) at step 300", readme).groups()
    assert abs(train[10] - float(first)) < 0.1 and abs(train[300] - float(last)) < 0.1, (train[10], train[300])
    assert (run_dir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # redrawn at each eval

    # The fine-tuning demo on that model, with the README's commands: LoRA on shipped chats.
    user = f'source "{home}/env.sh" && '
    base = bash("-c", user + f'llmtrain export --run-dir "{run_dir}" --out "$LLMTRAIN_HOME/models/demo-base"',
                env=env)
    assert base.returncode == 0, base.stderr
    sft = bash(clone / "submit.sh", "--local", "--config", clone / "configs" / "sft-demo.yaml", env=env)
    assert sft.returncode == 0, sft.stderr[-3000:]
    # A shipped demo runs clean, one row length everywhere (prepare's and the trainer's).
    assert "warning:" not in sft.stdout + sft.stderr, [x for x in sft.stdout.splitlines() if "warning:" in x]
    assert " rows of 128 tokens " in sft.stdout and " rows (" in sft.stdout and " of 128 tokens;" in sft.stdout
    # The model's size and the LoRA's, the fine-tuning losses and the README's example reply.
    size, lora = re.search(r"model of ([\d,]+) parameters \(LoRA adds ([\d,]+)\)", readme).groups()
    assert f"model: {size} parameters" in demo.stdout and f"LoRA: {lora} trainable parameters" in sft.stdout
    tuned = {r["step"]: r["loss"] for r in read_metrics(home / "runs" / "sft-demo") if r["kind"] == "train"}
    first, last = re.search(r"fine-tuning loss \(answers only\) falls from about ([\d.]+) at step 10 "
                            r"to about ([\d.]+) in 300 steps", readme).groups()
    assert abs(tuned[10] - float(first)) < 0.1 and abs(tuned[300] - float(last)) < 0.1, (tuned[10], tuned[300])
    [(prompt, answer)] = re.findall(r'--prompt "([^"]+)" +# e\.g\. (.+?\.) ', readme)
    reply = bash("-c", user + f'llmtrain generate --run-dir "{home}/runs/sft-demo" --chat --temperature 0 '
                 f'--prompt "{prompt}"', env=env)
    assert reply.returncode == 0, reply.stderr
    # The taught shape: the prompt's name, then one of the story world's things. Which thing is
    # up to the kernels' rounding over 600 steps (CPUs of this machine kind differ), as the README says.
    name = re.fullmatch(r"(\w+) had the (\w+)\.", answer).group(1)
    assert re.fullmatch(rf"{name} had the ({'|'.join(THINGS)})\.", reply.stdout.strip()), (reply.stdout, answer)

    # The Slurm path from the same spaced paths: the exact command, every path one argument.
    if shutil.which("sbatch"):
        dry = bash(clone / "submit.sh", "--config", clone / "configs" / "demo.yaml", "--dry-run",
                   env=env)
        assert dry.returncode == 0, dry.stderr
        [cmd] = [shlex.split(x) for x in dry.stdout.splitlines() if x.startswith("env ")]
        assert str(clone / "train.slurm") in cmd and f"LLMTRAIN_HOME={home}" in cmd
        assert f"--output={run_dir}/%x-%j.out" in cmd


def local_config(tmp_path, name: str, **sections) -> Path:
    """tiny_config for a local run named `name` whose run directory (runs/) and prepared data
    stay under tmp_path; written to tmp_path/NAME.yaml."""
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(tiny_config(run={"name": name, "dir": str(tmp_path / "runs")},
                                                 data={"prepared_dir": str(tmp_path / "prepared")}, **sections)))
    return config


def test_local_run_gives_each_process_its_share_of_the_cpus(tmp_path):
    """torchrun would set OMP_NUM_THREADS=1 for 2 processes; the workers record what they got."""
    config = local_config(tmp_path, "threads", train={"max_steps": 2, "warmup_steps": 1, "eval_every": 0})
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\nif 'RANK' in os.environ:\n"
        "    with open(os.path.join(os.environ['THREADS_LOG'], 'rank-' + os.environ['RANK']), 'w') as f:\n"
        "        f.write(os.environ.get('OMP_NUM_THREADS', 'unset'))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")])),
               THREADS_LOG=str(tmp_path), LLMTRAIN_FORK_WORKERS="0")  # the hook runs as each rank starts
    proc = bash(REPO / "submit.sh", "--local", "--config", config, "--nproc", 2, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert f"torchrun: 2 process(es) x {share} thread(s) (OMP_NUM_THREADS)" in proc.stdout.splitlines()
    assert [(tmp_path / f"rank-{r}").read_text() for r in (0, 1)] == [share, share]


def test_a_user_error_inside_torchrun_is_one_line_the_last(tmp_path):
    """Printed once (not once per rank), as the last line, instead of torchrun's failure summary
    and its log lines about the failure; no traceback."""
    config = local_config(tmp_path, "one-line", slurm={"gpus_per_node": 1, "procs_per_node": 2})  # no CUDA here
    # The losing order, forced: rank 0 starts late, so rank 1 fails first; torchrun stops the
    # other ranks when one fails, and rank 0 must still get to print the line.
    env = imported_first(tmp_path, "import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(1.5)\n")
    proc = bash(REPO / "submit.sh", "--local", "--config", config, "--nproc", 2, env=env)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    errors = [x for x in lines if "CUDA is unusable" in x]
    assert errors == [lines[-1]], proc.stderr[-3000:]
    assert errors[0].startswith("error: slurm.gpus_per_node is 1 but CUDA is unusable on ")
    assert "Traceback" not in proc.stderr  # neither the trainer's nor torchrun's own
    assert not re.search(r"Root Cause|FAILED|error_file|^[WE]\d{4} ", proc.stderr, re.MULTILINE), proc.stderr
    assert (tmp_path / "runs" / "one-line" / "logs" / "error.txt").read_text() == errors[0] + "\n"


def test_a_crashed_worker_is_one_line_naming_its_rank_host_and_signal(tmp_path):
    """Not a user error (a segfault in native code): torchrun's summary shortened to one line."""
    config = local_config(tmp_path, "crash")
    env = imported_first(tmp_path, "import os, signal\nif os.environ.get('RANK') == '1':\n"
                                   "    os.kill(os.getpid(), signal.SIGSEGV)\n")
    proc = bash(REPO / "submit.sh", "--local", "--config", config, "--nproc", 2, env=env)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [f"error: rank 1 on {socket.gethostname()} was killed by signal SIGSEGV"]
    assert not (tmp_path / "runs" / "crash" / "logs" / "error.txt").exists()  # no user error to show


def test_submit_rejects_a_bad_config_before_starting(tmp_path):
    shutil.copytree(REPO / "configs" / "demo", tmp_path / "demo")  # its relative paths resolve
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "configs" / "demo.yaml").read_text().replace("max_steps: 300", "max_stepz: 3"))
    proc = bash(REPO / "submit.sh", "--local", "--config", bad)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["train.max_stepz: unknown key (did you mean 'max_steps'?)"]


def test_submit_without_slurm_points_to_local(tmp_path):
    """A machine without sbatch: a PATH holding only the tools submit.sh needs besides Slurm."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "dirname", "basename", "sed", "cat"):
        (tools / tool).symlink_to(shutil.which(tool))
    env = {**os.environ, "PATH": str(tools)}
    proc = bash(REPO / "submit.sh", "--config", REPO / "configs" / "demo.yaml", env=env)
    assert proc.returncode == 1
    assert proc.stderr.strip() == ("error: no Slurm on this machine (sbatch not found); to run "
                                   "here, use: bash submit.sh --local")


# --- train.slurm outside Slurm: srun and scontrol replaced by scripts that record their calls ---

FAKE_SRUN = r"""#!/usr/bin/env bash
# Records the job step's command line and environment; then plays the step ($FAKE_STEP).
printf '%s\n' "$@" >"$FAKE_LOG/srun.args"
echo "${OMP_NUM_THREADS-unset}" >"$FAKE_LOG/srun.omp"
eval "${FAKE_STEP:-}"
"""
FAKE_SCONTROL = r"""#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") echo node1 ;;
  *) echo "$*" >>"$FAKE_LOG/scontrol.calls" ;;
esac
"""
# The trainer's own record of a stop in this job: Control.exit, the code training/loop.py calls.
TRAINER_STOPS = ('python -c "import pathlib, sys, types; from llmtrain.training.control import Control; '
                 'Control.exit(types.SimpleNamespace(world=types.SimpleNamespace(is_main=True), '
                 'folder=pathlib.Path(sys.argv[1])), \'preempt\', 7, 7)" "$LLMTRAIN_RUN_DIR/control"')


def fake_job(tmp_path, step: str = "", **env):
    """Run train.slurm as Slurm would start job 4242 on one node; `env` adds SLURM_*/LLMTRAIN_*."""
    bin_dir, log, home = tmp_path / "bin", tmp_path / "calls", tmp_path / "home"
    for d in (bin_dir, log, home, tmp_path / "run" / "control"):
        d.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (home / "env.sh").write_text("")  # the venv's python is on PATH already
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LLMTRAIN_", "OMP_"))}
    job_env = {**base, "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}:{base['PATH']}",
               "FAKE_LOG": str(log), "FAKE_STEP": step, "SLURM_JOB_ID": "4242",
               "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_NUM_NODES": "1", "SLURM_TMPDIR": str(tmp_path),
               "LLMTRAIN_CONFIG": str(tmp_path / "config.yaml"), "LLMTRAIN_HOME": str(home),
               "LLMTRAIN_REPO": str(REPO), "LLMTRAIN_RUN_DIR": str(tmp_path / "run"),
               "LLMTRAIN_MAX_REQUEUES": "5", "LLMTRAIN_MAX_RESTARTS": "0", "LLMTRAIN_STEP": "train",
               "LLMTRAIN_CONTINUATION": "0", **SHELL_NAMES, **env}
    proc = bash(REPO / "train.slurm", env=job_env, timeout=120)
    srun = (log / "srun.args").read_text().splitlines()
    return proc, srun[:srun.index("bash")], (log / "srun.omp").read_text().strip()


@pytest.mark.parametrize("env,cpus_flag,threads", [
    ({"SLURM_CPUS_PER_TASK": "8", "LLMTRAIN_PROCS_PER_NODE": "3"}, ["--cpus-per-task=8"], "2"),
    ({"SLURM_CPUS_PER_TASK": "2", "LLMTRAIN_PROCS_PER_NODE": "4"}, ["--cpus-per-task=2"], "1"),
    ({"SLURM_CPUS_PER_TASK": "8", "LLMTRAIN_PROCS_PER_NODE": "2", "OMP_NUM_THREADS": "3"},
     ["--cpus-per-task=8"], "3"),  # the user's choice stands
    ({"LLMTRAIN_PROCS_PER_NODE": "2"}, [], "1"),  # bare sbatch without --cpus-per-task: 1 CPU a task
])
def test_job_step_gets_the_jobs_cpus_and_each_worker_its_share_of_threads(tmp_path, env, cpus_flag,
                                                                          threads):
    proc, srun_options, omp = fake_job(tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    assert srun_options == ["--kill-on-bad-exit=1", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1",
                            *cpus_flag]
    assert omp == threads  # what torchrun passes on to its workers instead of its own 1
    procs = env["LLMTRAIN_PROCS_PER_NODE"]
    assert (f"1 node(s) [node1] x {procs} process(es) x {threads} thread(s); rendezvous node1:"
            in proc.stdout), proc.stdout


def test_a_job_without_the_environment_contract_says_which_variable_is_missing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMTRAIN_")}
    proc = bash(REPO / "train.slurm", env={**env, "LLMTRAIN_CONFIG": str(tmp_path / "c.yaml")})
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["train.slurm: LLMTRAIN_HOME is not set; submit with bash submit.sh"]


STALE_EXIT = {"reason": "preempt", "step": 4, "requeue": True}  # what an earlier stop left behind


@pytest.mark.parametrize("planted,step,requeued", [
    (None, TRAINER_STOPS, True),  # the trainer stopped in this job: requeue
    (STALE_EXIT, "exit 1", False),  # crashed at start-up; the file is an earlier job's
    ({**STALE_EXIT, "job_id": "4242"}, "exit 1", False),  # this id's run before a requeue
    (None, "printf '%s\\n' '{\"reason\": \"preempt\", \"step\": 4, \"requeue\": true, \"job_id\": \"4100\"}'"
           " >\"$LLMTRAIN_RUN_DIR/control/exit.json\"; exit 1", False),  # another job's, written meanwhile
    (None, "echo '{\"requeue\": tr' >\"$LLMTRAIN_RUN_DIR/control/exit.json\"; exit 1", False),  # torn
], ids=["this-jobs-stop", "stale", "stale-same-id", "other-job", "unreadable"])
def test_requeue_only_for_a_stop_the_trainer_recorded_in_this_job(tmp_path, planted, step, requeued):
    exit_json = tmp_path / "run" / "control" / "exit.json"
    if planted is not None:
        exit_json.parent.mkdir(parents=True)
        exit_json.write_text(json.dumps(planted) + "\n")
    proc, _, _ = fake_job(tmp_path, step=step, SLURM_CPUS_PER_TASK="2", LLMTRAIN_PROCS_PER_NODE="1")
    calls = tmp_path / "calls" / "scontrol.calls"
    if requeued:
        assert proc.returncode == 0, proc.stderr
        assert calls.read_text().splitlines() == ["requeue 4242"]
        assert "requeueing job 4242 (requeue 1 of at most 5)" in proc.stdout
    else:
        assert proc.returncode == 1, proc.stderr  # the step's failure is the job's
        assert not calls.exists(), calls.read_text()
        assert "requeueing" not in proc.stdout


def test_ctrl_c_on_a_local_run_saves_stops_and_exits_0(tmp_path):
    """The terminal's SIGINT goes to the whole foreground process group (bash, torchrun): the
    run saves at the step it stops at, and submit.sh exits 0 without a traceback."""
    import json
    import signal
    import time
    config = local_config(tmp_path, "ctrl-c", train={"max_steps": 400, "eval_every": 0, "checkpoint_every": 1000})
    run_dir = tmp_path / "runs" / "ctrl-c"
    proc = subprocess.Popen(["bash", str(REPO / "submit.sh"), "--local", "--config", str(config),
                             "--nproc", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # its own group, like a terminal's
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().count("\n") >= 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    stop = json.loads((run_dir / "control" / "exit.json").read_text())
    assert stop["reason"] == "user" and 3 <= stop["step"] < 400
    assert (run_dir / "checkpoints" / f"step-{stop['step']:08d}" / "meta.json").is_file()
    assert "interrupted: asking the trainer to save and stop at the next step" in err
    assert "Traceback" not in err and f"stopping at step {stop['step']} (user)" in out


@pytest.mark.parametrize("nproc", [2])  # torchrun's agent and its workers' own sessions (a
# single trainer's session is the same killpg; not run twice, for the suite's time)
def test_a_third_ctrl_c_ends_a_local_run_at_once_without_saving(tmp_path, nproc):
    """A big model's save takes minutes. The first Ctrl-C asks for a save and a stop, the second
    says that this is under way and what a third does, and the third ends the run at once: exit
    130, no process of the run left (torchrun's workers have sessions of their own), no new
    checkpoint, and the last line names the checkpoint a relaunch resumes from. Before, every
    press wrote the stop switch again and nothing ended the run."""
    import signal
    import time
    config = local_config(tmp_path, "impatient", train={"max_steps": 3, "eval_every": 0, "checkpoint_every": 1000})
    run_dir = tmp_path / "runs" / "impatient"
    first = bash(REPO / "submit.sh", "--local", "--config", config, "--nproc", "1", timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000003"]
    beat = run_dir / "logs" / "heartbeat-rank-0.json"
    beat.unlink(missing_ok=True)  # launch 1's
    # Resumed at step 3, each step 60 s longer: the three presses come during step 4, before
    # the trainer reads the stop switch at its agreement (whose save would be a checkpoint).
    said_file = tmp_path / "stderr.txt"
    with open(said_file, "w") as said_to:  # read as it grows: each press waits for the last one's line
        proc = subprocess.Popen(["bash", str(REPO / "submit.sh"), "--local", "--config", str(config),
                                 "--nproc", str(nproc), "--set", "train.max_steps=400"],
                                stdout=subprocess.PIPE, stderr=said_to, text=True,
                                env={**os.environ, "LLMTRAIN_INJECT_STEP_S": "60"},
                                start_new_session=True)  # its own group, like a terminal's
    try:
        deadline = time.monotonic() + 300
        while not beat.exists():  # written at the first step's start
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        assert len(set(processes_naming(str(config))) - {proc.pid}) == (1 if nproc == 1 else 3)
        for press in range(1, 4):
            os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends the foreground group
            deadline = time.monotonic() + 30
            while sum(line.startswith(("interrupted", "stopped")) for line in said_file.read_text().splitlines()) < press:
                assert time.monotonic() < deadline, f"no answer to Ctrl-C number {press}: {said_file.read_text()}"
                time.sleep(0.05)
        out, _ = proc.communicate(timeout=30)
        err = said_file.read_text()
        assert proc.returncode == 130, err[-3000:]
        left = processes_naming(str(config))
    finally:
        for pid in processes_naming(str(config)):  # ours: children of the launcher started above
            os.kill(pid, signal.SIGKILL)
    assert left == [], "left running after the third Ctrl-C"
    said = err.splitlines()
    assert said[-3:] == [
        "interrupted: asking the trainer to save and stop at the next step",
        "interrupted again: the trainer saves a checkpoint at its next step, then stops; a third "
        "Ctrl-C stops it at once, without saving",
        "stopped without saving: the last checkpoint is step-00000003"], err[-3000:]
    assert sum(line.startswith(("interrupted", "stopped")) for line in said) == 3
    assert "Traceback" not in err and "stopping at step" not in out
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith(("step-", ".tmp"))) == \
        ["step-00000003"]
    assert not (run_dir / "control" / "stop").exists()  # the request went with the run
    assert not (run_dir / "control" / "exit.json").exists()  # the trainer never got to stop


def processes_naming(text: str) -> list[int]:
    """The pids of live processes whose command line contains `text` (a test's own config path)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    pids.append(int(pid))
        except OSError:  # ended meanwhile
            pass
    return pids


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_killed_local_launcher_takes_its_run_with_it(tmp_path, nproc):
    """kill -9 of `submit.sh --local` (exec'd into `llmtrain submit --local`) runs none of its
    handlers: its child (the one trainer, or torchrun's agent and its workers) used to train on as
    an orphan holding the run's lock. Now the child saves, stops and exits, and a relaunch resumes."""
    import signal
    import time
    config = local_config(tmp_path, "orphan", train={"max_steps": 5000, "eval_every": 0, "checkpoint_every": 10000})
    run_dir = tmp_path / "runs" / "orphan"
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as o, open(err, "w") as e:  # files: the orphans keep writing after the kill
        proc = subprocess.Popen(["bash", str(REPO / "submit.sh"), "--local", "--config", str(config),
                                 "--nproc", str(nproc)], stdout=o, stderr=e, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or (run_dir / "metrics.jsonl").read_text().count("\n") < 3:
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.2)
        children = set(processes_naming(str(config))) - {proc.pid}
        assert len(children) == (1 if nproc == 1 else 3)  # the trainer, or the agent + 2 workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while processes_naming(str(config)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert processes_naming(str(config)) == [], "left training after the launcher's kill -9"
    finally:
        for pid in processes_naming(str(config)):  # ours: children of the launcher started above
            os.kill(pid, signal.SIGKILL)
    said = err.read_text()
    assert "Traceback" not in said, said[-3000:]
    # The trainer (or torchrun's agent, which passes SIGTERM on to its workers and gives them
    # training/torchrun.SHUTDOWN_TIMEOUT_S, not torch's 30 s, before a SIGKILL) saved and
    # stopped, and freed the lock.
    stop = json.loads((run_dir / "control" / "exit.json").read_text())
    assert stop["reason"] == "signal" and 3 <= stop["step"] < 5000
    assert (run_dir / "checkpoints" / f"step-{stop['step']:08d}" / "meta.json").is_file()
    assert not (run_dir / "run.lock").exists()
    assert f"stopping at step {stop['step']} (signal)" in out.read_text()
    # The relaunch is not refused as "in use by a live run": it resumes and trains 2 more steps.
    trained = max(r["step"] for r in read_metrics(run_dir) if r["kind"] == "train")
    again = bash(REPO / "submit.sh", "--local", "--config", config, "--nproc", nproc,
                 "--set", f"train.max_steps={trained + 2}")
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert steps[-2:] == [trained + 1, trained + 2]


def test_one_local_process_runs_alone_even_inside_another_launcher(tmp_path):
    """--nproc 1 runs the trainer without torchrun, as a group of one: rank variables left by an
    outer launcher (an srun or torchrun shell) must not make it wait for ranks that never come."""
    config = local_config(tmp_path, "alone", train={"max_steps": 2, "warmup_steps": 1, "eval_every": 0})
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "9", "TORCHELASTIC_RUN_ID": "outer"}
    proc = bash(REPO / "submit.sh", "--local", "--config", config, "--nproc", 1, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "one process (no torchrun needed)" in proc.stdout and "done: 2 steps" in proc.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "runs" / "alone") if r["kind"] == "train"] == [1, 2]


def test_setup_takes_every_extra_the_package_defines_and_its_help_names_them():
    """Each optional part of pyproject.toml (tensorboard, wandb, fp8, test) is an --extras value
    setup.sh accepts and lists; a wrong one is refused in one line naming them all."""
    import tomllib
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    usage = bash(REPO / "setup.sh", "--help").stderr
    listed = usage[usage.index("--extras LIST"):]
    wrong = bash(REPO / "setup.sh", "--extras", "fp16")
    assert wrong.returncode == 1 and wrong.stdout == ""
    for extra in extras:
        assert re.search(rf"\b{extra}\b", listed), extra
        assert re.search(rf"\b{extra}\b", wrong.stderr.splitlines()[0]), wrong.stderr
