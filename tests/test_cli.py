"""The llmtrain command as a whole: --version, and help that gives every option's default."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from importlib import metadata

import pytest

from conftest import llmtrain
from llmtrain.cli import parser


def test_version_names_the_package_and_torch_without_importing_torch():
    proc = llmtrain("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"llmtrain {metadata.version('llmtrain')} (")
    assert f"torch {metadata.version('torch')}" in proc.stdout
    code = ("import sys; from llmtrain.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit as e:\n    rc = e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def commands() -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.parametrize("command", sorted(commands()))
def test_every_option_of_every_command_says_its_default(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    text = commands()[command].format_help()  # what `llmtrain COMMAND --help` prints
    entries = re.findall(r"^  (-[^\n]*(?:\n {4,}[^\n]*)*)", text, flags=re.M)
    assert entries, text
    for entry in entries:
        if entry.startswith("-h, --help"):
            continue
        words = " ".join(entry.split())
        assert "default" in words or "required" in words, f"llmtrain {command} --help: {words}"


def test_a_second_launch_of_a_running_run_is_refused_before_anything_starts(home, write_config, capfd):
    """submit.sh (and --local) check with --launch: a live run is named, with the ways out."""
    import json
    import socket
    import time

    from conftest import tiny_config
    from llmtrain.cli import main
    path = write_config(tiny_config(run={"name": "live"}))
    assert main(["check-config", str(path), "--launch"]) == 0  # no run directory yet
    run_dir = home / "runs" / "live"
    (run_dir / "logs").mkdir(parents=True)
    # A local trainer of this run, as status sees one: rank 0's heartbeat names a live process.
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "llmtrain"])
    try:
        beat = {"step": 7, "time": time.time(), "pid": trainer.pid, "host": socket.gethostname()}
        (run_dir / "logs" / "heartbeat-rank-0.json").write_text(json.dumps(beat))
        capfd.readouterr()
        assert main(["check-config", str(path), "--launch"]) == 1
        assert capfd.readouterr().err.splitlines() == [
            f"error: run 'live' is running now (running at step 7); stop it (llmtrain control "
            f"{run_dir} stop), or use another run.name"]
        assert main(["check-config", str(path)]) == 0  # without --launch: the config is fine
    finally:
        trainer.kill()
        trainer.wait()
    assert main(["check-config", str(path), "--launch"]) == 0  # it ended: a launch may go ahead


@pytest.mark.parametrize("library", ["torch", "datasets"])
def test_a_process_with_torch_or_datasets_loaded_ends_with_its_code_its_output_and_atexit_handlers(library):
    """cli.exit_process skips CPython's module teardown (1.3 s with torch and transformers, 0.2 s
    with datasets: prepare's) but nothing a user sees: the exit code, output still in Python's
    buffers, atexit handlers."""
    code = (f"import atexit, sys, {library}\n"
            "from llmtrain.cli import exit_process\n"
            "atexit.register(lambda: print('atexit ran', file=sys.stderr))\n"
            "sys.stdout.write('buffered, no newline')\n"
            "exit_process(3)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffers, as usual
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "buffered, no newline", "atexit ran\n")


def test_the_torchrun_agent_keeps_the_stores_end_of_run_race_quiet_but_not_its_workers():
    """At the end of a multi-node run the agent that hosts the rendezvous can exit while another
    agent's last store operation is under way: that one fails (and is handled), and c10d would
    print a warning with a C++ stack dump into a job log that went well. Our torchrun's process
    keeps C++ warnings out; the variable its workers inherit is the user's."""
    code = """
import datetime, os, sys
import llmtrain.training.torchrun
import torch.distributed as dist
print(os.environ.get("TORCH_CPP_LOG_LEVEL"))
server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", server.port, 2, False, timeout=datetime.timedelta(seconds=5))
client.set("closed", "0")
del server
try:
    client.compare_set("closed", "0", "1")
except dist.DistNetworkError:
    print("handled")
"""
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert (proc.returncode, proc.stdout.split(), proc.stderr) == (0, ["WARNING", "handled"], "")
    # The same in a process that did not go through it: the warning and its stack dump.
    bare = code.replace("import llmtrain.training.torchrun\n", "")
    proc = subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True, env=env, timeout=120)
    assert "TCPStore.cpp" in proc.stderr and "recvVector failed" in proc.stderr


def test_the_torchrun_agent_lets_go_of_its_rendezvous_during_a_keep_alive_without_a_traceback():
    """The rendezvous handler's keep-alive timer holds the handler while it beats; an agent that
    lets go of the handler then (its end after scancel, under load) has the handler and its timer
    collected in the timer's own thread, whose finalizer joined that thread: "Exception ignored
    ... cannot join current thread" in the job log (seen in the test cluster's scancel trial).
    Our torchrun's process stops such a timer without the join."""
    code = """
import datetime, threading, time, weakref
import llmtrain.training.torchrun
from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer

class Handler:  # as DynamicRendezvousHandler: its timer beats through a weak reference to it
    def __init__(self):
        self.timer = _PeriodicTimer(datetime.timedelta(milliseconds=10), Handler.beat, weakref.ref(self))
        self.timer.start()

    @staticmethod
    def beat(ref):
        handler = ref()  # held while it beats
        if handler is not None:
            beating.set()
            let_go.wait()

beating, let_go = threading.Event(), threading.Event()
handler = Handler()
beating.wait()
del handler  # the agent lets go during a beat: the timer's thread holds the last reference
let_go.set()
time.sleep(0.5)
print("ended", [t.name for t in threading.enumerate() if t is not threading.main_thread()])
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "ended []\n", "")
    # The same in a process that did not go through it: the traceback.
    bare = code.replace("import llmtrain.training.torchrun\n", "")
    proc = subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True, timeout=120)
    assert "Exception ignored in: <finalize object" in proc.stderr
    assert "RuntimeError: cannot join current thread" in proc.stderr


@pytest.mark.slow  # it trains: two local launches
def test_a_local_run_needs_no_slurm_keys(home, write_config, tmp_path):
    """slurm.procs_per_node is what Slurm starts on a CPU-only node; a local run of one process,
    given by --nproc or by default, trains without it (a Slurm submission still asks for it)."""
    from conftest import read_metrics, tiny_config
    cfg = tiny_config(run={"name": "cpu-local"}, train={"max_steps": 2, "warmup_steps": 1, "eval_every": 0},
                      data={"prepared_dir": str(tmp_path / "prepared")})
    cfg["slurm"] = {"nodes": 2, "gpus_per_node": 0}  # no procs_per_node; two nodes count not here
    path = write_config(cfg)
    for nproc, steps in ((["--nproc", "1"], 2), ([], 4)):  # the second launch resumes the first
        proc = llmtrain("submit", "--local", "--config", path, *nproc, "--set", f"train.max_steps={steps}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "one process (no torchrun needed)" in proc.stdout and f"done: {steps} steps" in proc.stdout
    steps = [r["step"] for r in read_metrics(home / "runs" / "cpu-local") if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4]
    # Relaunched at its end: said at once, before any trainer starts (it took 10 s of torchrun to say it)
    again = llmtrain("submit", "--local", "--config", path, "--nproc", "2", "--set", "train.max_steps=4")
    assert (again.returncode, again.stdout.splitlines()[-1]) == (0, (
        f"nothing to train: {home}/runs/cpu-local is at step 4 of 4 already; raise train.max_steps (or "
        f"train.epochs) to train further")), again.stdout + again.stderr
    assert "torchrun" not in again.stdout
    proc = llmtrain("check-config", path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "slurm.procs_per_node: set it on CPU-only nodes (slurm.gpus_per_node is 0)"]


def test_help_lists_the_users_commands_and_not_the_scripts_plumbing(monkeypatch):
    """sbatch-command and requeue are run by submit.sh's code and train.slurm: they still work
    (and have their own --help), but `llmtrain --help` lists only what a user types, one line each
    where it fits; `sweep status` is listed under sweep, as it is typed."""
    from conftest import cli
    monkeypatch.setenv("COLUMNS", "100")
    proc = cli("--help")
    assert proc.returncode == 0
    listed = re.findall(r"^    (\S+)", proc.stdout, flags=re.M)
    assert listed == ["check-config", "submit", "sweep", "prepare", "train", "export", "generate",
                      "status", "control", "plot", "bench", "estimate", "plan", "download"]
    assert "    check-config  validate a config without importing torch" in proc.stdout.splitlines()
    assert "`llmtrain sweep status SWEEP_DIR`" in " ".join(proc.stdout.split())
    for plumbing in ("requeue", "sbatch-command", "sweep-status"):
        assert plumbing not in proc.stdout
    for command, usage in ((["requeue"], "usage: llmtrain requeue"),
                           (["sbatch-command"], "usage: llmtrain sbatch-command"),
                           (["sweep", "status"], "usage: llmtrain sweep status [-h] [--config FILE] SWEEP_DIR|NAME")):
        proc = cli(*command, "--help")
        assert proc.returncode == 0 and proc.stdout.startswith(usage), proc.stdout


def test_the_torchrun_agent_gives_its_workers_time_to_save_on_a_stop_signal():
    """torch's agent SIGKILLs its workers 30 s after passing them a SIGTERM (scancel, a
    preemption): a big model's save takes longer. llmtrain's agent waits SHUTDOWN_TIMEOUT_S,
    unless the user chose (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, or --shutdown-timeout)."""
    code = ("import os, llmtrain.training.torchrun as t; from torch.distributed.run import parse_args, "
            "config_from_args; a = parse_args(['--standalone', '--nproc-per-node', '1', 'x.py']); "
            "print(config_from_args(a)[0].shutdown_timeout)")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT")}
    ours = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**env, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"})
    assert (ours.stdout, theirs.stdout) == ("900\n", "45\n"), ours.stderr + theirs.stderr



WORKER_SAVING_ON_SIGTERM = """
import pathlib, signal, sys, time
folder = pathlib.Path(sys.argv[1])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
(folder / "ready").touch()
while not stop:
    time.sleep(0.01)
time.sleep(1.5)  # the save
(folder / "saved").write_text(str(len(stop)))
"""


def test_repeated_stop_signals_to_the_torchrun_agent_leave_its_workers_their_save(tmp_path):
    """A kill -9'd local launcher's agent gets its parent-death SIGTERM once per thread of the
    dying launcher (three within 0.3 s, seen with strace). torch's agent exited at the third while
    its workers saved, and they died with it (a checkpoint half-written: a CI failure). The first
    stop signal is the one that counts: the agent ends after its worker, with 128 + 15."""
    import signal
    import time
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER_SAVING_ON_SIGTERM)
    agent = subprocess.Popen([sys.executable, "-m", "llmtrain.training.torchrun", "--standalone",
                              "--nproc-per-node", "1", str(worker), str(tmp_path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()
            time.sleep(0.05)
        for _ in range(3):
            agent.send_signal(signal.SIGTERM)
            time.sleep(0.1)
        _, err = agent.communicate(timeout=60)
    finally:
        agent.kill()
    assert (tmp_path / "saved").read_text() == "1", err  # saved before the agent ended; told once
    assert agent.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err
