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


def test_a_process_with_torch_loaded_ends_with_its_code_its_output_and_its_atexit_handlers():
    """cli.exit_process skips CPython's module teardown (1.3 s with torch and transformers) but
    nothing a user sees: the exit code, output still in Python's buffers, atexit handlers."""
    code = ("import atexit, sys, torch\n"
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
