"""training/workers.py: torchrun's workers forked from an agent that imported the trainer once
start as new interpreters would, and train the same run."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from conftest import assert_same_curve, imported_first, prepared_home, run_dir, tiny_config, torchrun_command

pytestmark = pytest.mark.slow

# Every Python process of a launch runs this first (a sitecustomize): a worker started as a new
# interpreter writes what it starts with to PROBE_DIR/rank-N.json and ends (its agent ends with
# exit 0); an agent that forks its workers writes it in each, as the fork has made it a worker.
PROBE = """
import json, os, signal, sys, weakref

def record():
    import ctypes, torch
    c10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    with open("/proc/self/cmdline") as f:
        command = f.read().rstrip("\\0").split("\\0")
    record = {
        "imported before its start": "transformers.modeling_utils" in sys.modules,
        "parent is the agent": os.getppid() == int(os.environ["AGENT_PID"]),
        "own session": os.getsid(0) == os.getpid(),
        "open descriptors": sorted(fd for fd in fds if os.path.exists(f"/proc/self/fd/{fd}")),
        "SIGTERM": str(signal.getsignal(signal.SIGTERM)),
        "SIGINT": str(signal.getsignal(signal.SIGINT)),
        "SIGPIPE": str(signal.getsignal(signal.SIGPIPE)),
        "threads": torch.get_num_threads(),
        "C++ log level": ctypes.c_int.in_dll(c10, "FLAGS_caffe2_log_level").value,
        "stdout write-through": sys.stdout.write_through,
        "environment": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "EXTRA")},
        "argv": sys.argv[1:],
        "command line": command[1:],
        # what torchrun's objects would run at the exit (its rendezvous's keep-alive timer)
        "agent's exit finalizers": sorted(f.func.__qualname__ for f in weakref.finalize._registry.values()
                                          if f.func.__module__.startswith("torch.distributed")),
    }
    with open(os.path.join(os.environ["PROBE_DIR"], "rank-" + os.environ["RANK"] + ".json"), "w") as f:
        json.dump(record, f)
    os._exit(0)

if os.environ.get("PROBE_DIR"):
    if "RANK" in os.environ:
        record()
    elif os.environ["LLMTRAIN_FORK_WORKERS"] == "1":
        import llmtrain.training.workers as workers
        become = workers.become_worker

        def observed(*args):
            become(*args)
            record()
        workers.become_worker = observed
"""


def probe(tmp_path, name: str, fork: str) -> dict[str, dict]:
    """Each rank's record (PROBE) of a 2-process launch with LLMTRAIN_FORK_WORKERS=`fork`, under
    an agent started without OMP_NUM_THREADS, with C++ logging at INFO, and with SIGINT ignored (as
    a script's background job starts) which torchrun then takes over: a started worker has
    Python's SIGINT handler again."""
    out = tmp_path / name
    out.mkdir()
    env = imported_first(tmp_path, PROBE)
    env.pop("OMP_NUM_THREADS", None)  # torchrun sets 1 for its workers, after torch loaded here
    env.update(PROBE_DIR=str(out), LLMTRAIN_FORK_WORKERS=fork, TORCH_CPP_LOG_LEVEL="INFO", EXTRA="x")
    agent = subprocess.Popen(["bash", "-c", 'AGENT_PID=$$ exec "$@"', "-",
                              *torchrun_command(2, "train", "--config", "c.yaml")],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    output = agent.communicate(timeout=300)[0]
    assert agent.returncode == 0, output
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.iterdir())}


def test_a_forked_worker_starts_as_a_new_interpreter_would(tmp_path):
    forked, started = probe(tmp_path, "forked", "1"), probe(tmp_path, "started", "0")
    assert list(forked) == list(started) == ["rank-0", "rank-1"]
    for rank in forked:
        assert forked[rank].pop("imported before its start") is True  # the fork is taken
        assert started[rank].pop("imported before its start") is False
        assert forked[rank] == started[rank]
    one = forked["rank-1"]
    assert one["parent is the agent"] and one["own session"]
    assert one["open descriptors"] == [0, 1, 2]  # none of the agent's sockets or files
    assert one["SIGTERM"] == str(signal.SIG_DFL) and "default_int_handler" in one["SIGINT"]
    assert one["SIGPIPE"] == str(signal.SIG_IGN)
    # torchrun's OMP_NUM_THREADS=1 (the agent's torch loaded with the machine's count), the
    # user's C++ log level (the agent's own is ERROR), -u, torchrun's variables and the user's
    assert one["threads"] == 1 and one["C++ log level"] == 0 and one["stdout write-through"]
    assert one["environment"] == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
                                  "EXTRA": "x"}
    assert one["argv"] == ["train", "--config", "c.yaml"]
    assert one["command line"] == ["-u", "-m", "llmtrain", "train", "--config", "c.yaml"]  # ps shows the worker
    assert one["agent's exit finalizers"] == []


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with prepared_home(tmp_path_factory, "workers", tiny_config()) as home:
        yield home


def test_forked_and_started_workers_train_the_same_run(setup):
    _, config = setup
    for name, fork in (("forked", "1"), ("started", "0")):
        proc = subprocess.run(torchrun_command(2, "train", "--config", config, "--set", f"run.name={name}"),
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "LLMTRAIN_FORK_WORKERS": fork})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr
    assert_same_curve(run_dir(setup, "forked"), run_dir(setup, "started"), tol=0.0)
