"""Fixtures: tiny configs, corpora and models in tmp_path; real subprocesses for the CLI where a
process matters (torchrun, signals, memory), the CLI in this process where none does."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import io
import json
import os
import select
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from llmtrain.training.workers import ForkedWorker

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo"
CLUSTER = REPO / "cluster" / "local-cluster.sh"


CLUSTER_STATE = Path(os.environ.get("LLMTRAIN_CLUSTER_DIR", "/tmp/llmtrain-cluster"))


def pytest_configure(config):
    """Names this pytest run for its xdist workers (they inherit the environment), and gives
    every test process one thread: the workers share the machine's cores, and torch's threads spin
    when the cores are oversubscribed (five 2-node jobs at once took 275 s with 2 threads a
    process, 121 s with 1). Tests of the thread share unset OMP_NUM_THREADS themselves."""
    if not hasattr(config, "workerinput"):
        os.environ.setdefault("LLMTRAIN_TEST_RUN", str(os.getpid()))
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def started_by_this_run() -> Path:
    """The marker a pytest run leaves when it, not someone else, started the test cluster."""
    return CLUSTER_STATE / "run" / f"started-by-pytest-{os.environ['LLMTRAIN_TEST_RUN']}"


def pytest_sessionfinish(session):
    """The run that started the test cluster stops it, once every worker is done with it."""
    if hasattr(session.config, "workerinput"):
        return
    marker = started_by_this_run()
    if marker.exists():
        subprocess.run(["bash", str(CLUSTER), "stop"], check=True, capture_output=True)
        marker.unlink()


# pytest-xdist runs the suite on three workers (pyproject's addopts: worksteal), each starting
# with its share of this order. The longest work comes first, the fresh-clone test (setup.sh's
# pip install, then two demos) before all, so that no worker is left alone with a long test at
# the end, and a worker that runs out of tests takes half of another's queue. (A fixture that
# the workers share, like test_slurm's preemption trials, runs once under a file lock.) After the
# list, only modules of short tests: the local launches of test_scripts.py, last in file order,
# were the tail (modules by their time in a --durations run of the slow tier, 2026-11-28).
LONGEST_FIRST = ("test_scripts.py::test_setup_", "test_slurm.py", "test_sweep.py::test_a_local_",
                 "test_pipeline.py", "test_control.py", "test_checkpoint.py", "test_bigmodel.py", "test_train.py",
                 "test_optimizers.py", "test_tensor_parallel.py", "test_expert_parallel.py", "test_estimate.py",
                 "test_finetune.py", "test_moe.py", "test_context_parallel.py", "test_observe.py", "test_parallel.py",
                 "test_scripts.py", "test_export.py", "test_status.py", "test_float8.py", "test_cli.py",
                 "test_download.py", "test_plan.py", "test_attention.py", "test_bad_inputs.py", "test_mixture.py")


def pytest_collection_modifyitems(items):
    def rank(item) -> tuple[int, bool]:
        where = item.nodeid.split("/")[-1]
        first = [i for i, prefix in enumerate(LONGEST_FIRST) if where.startswith(prefix)]
        return (first[0] if first else len(LONGEST_FIRST)), "trials" not in item.fixturenames
    items.sort(key=rank)


@pytest.fixture(scope="session")
def cluster():
    """The project's test cluster (cluster/local-cluster.sh) for the tests that submit jobs: the
    first worker to need it starts it unless one runs already; pytest_sessionfinish stops it
    if this run started it."""
    CLUSTER_STATE.mkdir(parents=True, exist_ok=True)
    with open(CLUSTER_STATE / "pytest.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker starts it, the others find it running
        started = subprocess.run(["bash", str(CLUSTER), "start"], capture_output=True, text=True)
        if started.returncode != 0:
            pytest.fail(f"the test cluster did not start: {started.stderr.strip()}", pytrace=False)
        if not started.stdout.startswith("already running"):
            started_by_this_run().touch()
    mp = pytest.MonkeyPatch()
    mp.setenv("SLURM_CONF", str(CLUSTER_STATE / "etc" / "slurm.conf"))
    yield
    mp.undo()


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A private LLMTRAIN_HOME for the test (runs, prepared data, downloaded models)."""
    h = tmp_path / "home"
    (h / "models").mkdir(parents=True)
    (h / "datasets").mkdir()
    monkeypatch.setenv("LLMTRAIN_HOME", str(h))
    return h


def tiny_config(**sections) -> dict:
    """The demo config shrunk for tests: a 2-layer, 64-wide Llama; sections override keys."""
    cfg = {
        "run": {"name": "test"},
        "model": {
            "tokenizer": str(DEMO / "tokenizer"),
            "architecture": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                             "num_hidden_layers": 2, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "max_position_embeddings": 128,
                             "tie_word_embeddings": False},
        },
        "data": {"dataset": str(DEMO / "stories.txt"), "seq_len": 64, "validation_fraction": 0.02},
        "train": {"max_steps": 8, "global_batch_size": 8, "micro_batch_size": 4, "lr": 3e-3,
                  "min_lr": 3e-4, "warmup_steps": 2, "precision": "fp32", "log_every": 1,
                  "eval_every": 4, "eval_samples": 16, "checkpoint_every": 4},
        "parallel": {"strategy": "ddp"},
        "slurm": {"nodes": 1, "procs_per_node": 2},
        # A plot process per evaluation would load the 2 cores: test_observe turns it on.
        "metrics": {"plot_every_eval": False},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


@contextlib.contextmanager
def prepared_home(tmp_path_factory, name: str, cfg: dict):
    """For a module's runs: a private LLMTRAIN_HOME and `cfg` with its data prepared."""
    root = tmp_path_factory.mktemp(name)
    mp = pytest.MonkeyPatch()
    mp.setenv("LLMTRAIN_HOME", str(root / "home"))
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    try:
        cli("prepare", "--config", config, check=True)
        yield root, config
    finally:
        mp.undo()


def reference_run(tmp_path_factory, name: str, cfg: dict, *sets: str) -> Path:
    """The run directory of one process training `cfg` (with `--set` `sets`): the curve a test
    holds another layout to (tensor parallel, context parallel). Made once per pytest run and
    shared: test_tensor_parallel.py and test_context_parallel.py hold their layouts to the same
    one, and a module whose tests xdist splits between its workers made its references on both
    (module fixtures run on each worker). The first worker to ask trains it in a home of its own,
    under a file lock; another waits and reads it. Keyed by name and content: another config
    gets another run."""
    key = hashlib.sha256(json.dumps([name, cfg, sets], sort_keys=True).encode()).hexdigest()[:12]
    root = shared_folder(tmp_path_factory, "references") / f"{name}-{key}"
    root.mkdir(exist_ok=True)
    run = root / "home" / "runs" / name
    with open(root / "lock", "w") as lock, pytest.MonkeyPatch.context() as mp:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "made").exists():
            mp.setenv("LLMTRAIN_HOME", str(root / "home"))
            config = root / "config.yaml"
            config.write_text(yaml.safe_dump(cfg))
            cli("prepare", "--config", config, check=True)
            shutil.rmtree(run, ignore_errors=True)  # a worker that failed here left a part
            cli("train", "--config", config, "--set", f"run.name={name}", *(x for s in sets for x in ("--set", s)),
                check=True)
            (root / "made").touch()
    return run


def shared_folder(tmp_path_factory, name: str) -> Path:
    """A folder of this pytest run that all its xdist workers see (each worker's basetemp is a
    folder of the run's; without workers, the basetemp itself)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture
def write_config(tmp_path):
    def write(cfg: dict, name: str = "config.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path
    return write


def llmtrain(*args: str, check: bool = False, timeout: float = 300, env: dict | None = None):
    """Run `python -m llmtrain ARGS` as a user would; returns the CompletedProcess."""
    proc = subprocess.run([sys.executable, "-m", "llmtrain", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"llmtrain {' '.join(map(str, args))} exited {proc.returncode}:\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def cli(*args: str, check: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    """`llmtrain ARGS` run in this process: what a user sees (exit code, stdout, stderr at the
    file-descriptor level) without a new interpreter importing torch. `env` adds variables for
    the call. For commands whose process matters (torchrun, signals, peak memory) use llmtrain()."""
    from llmtrain.cli import main
    argv = [str(a) for a in args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            pytest.MonkeyPatch.context() as mp:
        for key, value in (env or {}).items():
            mp.setenv(key, value)
        sys.stdout.flush()
        sys.stderr.flush()
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        streams = (sys.stdout, sys.stderr)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False),
                                                   line_buffering=True) for fd in (1, 2))
        try:
            try:
                code = main(argv)
            except SystemExit as e:  # argparse's usage errors, --version
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            sys.stdout, sys.stderr = streams
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
        out.seek(0)
        err.seek(0)
        proc = subprocess.CompletedProcess(["llmtrain", *argv], code, out.read().decode(),
                                           err.read().decode())
    if check and proc.returncode != 0:
        raise AssertionError(f"llmtrain {' '.join(argv)} exited {proc.returncode}:\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def torchrun(nproc: int, *args: str, timeout: float = 300):
    """`torchrun --standalone --nproc-per-node N -m llmtrain ARGS` (as submit.sh --local starts it:
    llmtrain.training.torchrun), checked."""
    proc = torchrun_unchecked(nproc, *args, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def torchrun_unchecked(nproc: int, *args: str, env: dict | None = None, timeout: float = 300):
    """The same for runs meant to fail (extra environment variables in `env`): the
    CompletedProcess; workers left behind by a failure get 5 s to go."""
    command = torchrun_command(nproc, *args, shutdown_timeout=5)
    env = {**os.environ, **env} if env else dict(os.environ)
    if (served := ServedLaunch.start(command, env, new_session=False, merged=False)) is None:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    try:
        out, err = served.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        served.kill()
        served.communicate()
        raise
    return subprocess.CompletedProcess(command, served.returncode, out, err)


def torchrun_popen(nproc: int, *args: str, env: dict | None = None):
    """The same, started and not waited for, in its own process group as a terminal's foreground
    job (os.killpg(pid, SIGINT) is Ctrl-C, SIGKILL ends it whole); output and errors in one pipe."""
    command = torchrun_command(nproc, *args)
    served = ServedLaunch.start(command, dict(env or os.environ), new_session=True, merged=True)
    return served or subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=env, start_new_session=True)


# What a launch forked by the server cannot differ in from the server's own start: what the C
# library reads as a process starts (malloc's settings, the dynamic loader, the locale) and what
# loads as the interpreter starts and as torch, transformers and the hub libraries load.
START_VARIABLES = ("MALLOC_", "GLIBC_", "LD_", "LANG", "LC_", "PYTHON", "TORCH", "HF_", "TRANSFORMERS", "OMP_",
                   "MKL_", "CUDA")


class ServedLaunch(ForkedWorker):
    """A torchrun launch that this pytest worker's launch server (tests/launch_server.py) forked
    instead of a new interpreter: the part of Popen the tests use (pid, poll, wait, communicate,
    signals, stdout and stderr as text pipes); its exit status comes from the server, which is
    its parent. LLMTRAIN_TEST_LAUNCH_SERVER=0 turns it off."""
    server: subprocess.Popen | None = None
    socket_path = ""
    start_env: dict = {}

    @classmethod
    def start(cls, command: list[str], env: dict, new_session: bool, merged: bool) -> "ServedLaunch | None":
        """The launch, or None where a new interpreter must start it (another environment at the
        start, the server off or gone)."""
        prefix = [sys.executable, "-m", "llmtrain.training.torchrun"]
        if os.environ.get("LLMTRAIN_TEST_LAUNCH_SERVER") == "0" or command[:3] != prefix:
            return None
        if cls.server is None:
            cls._start_server()
        if cls.server.poll() is not None or cls._start_keys(env) != cls._start_keys(cls.start_env):
            return None
        return cls(command, env, new_session, merged)

    @staticmethod
    def _start_keys(env: dict) -> dict:
        return {k: v for k, v in env.items() if k.startswith(START_VARIABLES)}

    @classmethod
    def _start_server(cls) -> None:
        folder = tempfile.mkdtemp(prefix="llmtrain-launch-")
        cls.socket_path = os.path.join(folder, "socket")
        cls.start_env = dict(os.environ)
        with open(os.path.join(folder, "server.log"), "w") as log:
            cls.server = subprocess.Popen([sys.executable, str(REPO / "tests" / "launch_server.py"), cls.socket_path],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                          env=cls.start_env)
        if cls.server.stdout.readline() != b"ready\n":
            raise RuntimeError(f"the launch server did not start: see {folder}/server.log")

    def __init__(self, command: list[str], env: dict, new_session: bool, merged: bool):
        out_r, out_w = os.pipe()
        err_r, err_w = (None, os.dup(out_w)) if merged else os.pipe()
        stdin = os.open(os.devnull, os.O_RDONLY)
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(self.socket_path)
        request = {"argv": command[3:], "env": env, "cwd": os.getcwd(), "new_session": new_session}
        socket.send_fds(self._conn, [json.dumps(request).encode() + b"\n"], [stdin, out_w, err_w])
        for fd in (stdin, out_w, err_w):
            os.close(fd)
        self.stdout = open(out_r)
        self.stderr = open(err_r) if err_r is not None else None
        self._lines = self._conn.makefile("r")
        super().__init__(int(self._lines.readline()), command)

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> int:
        """The exit status the server reports (its line on the connection)."""
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(self._lines.readline())
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Both streams to their end, then the exit status (as Popen.communicate)."""
        if self.stderr is None:  # one pipe: read to its end through the file, as Popen does
            out = self.stdout.read() if not self.stdout.closed else ""
            self.stdout.close()
            self.wait()
            return out, None
        end = None if timeout is None else time.monotonic() + timeout
        streams = [s for s in (self.stdout, self.stderr) if s is not None and not s.closed]
        chunks: dict = {s: [] for s in streams}
        with selectors.DefaultSelector() as sel:
            for s in streams:
                sel.register(s.fileno(), selectors.EVENT_READ, s)
            while sel.get_map():
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.data].append(data)
                    else:
                        sel.unregister(key.fd)
        # text=True's decoding: universal newlines, as Popen reads them
        texts = {s: b"".join(c).decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
                 for s, c in chunks.items()}
        for s in streams:
            s.close()
        self.wait(None if end is None else max(0.0, end - time.monotonic()))
        return texts.get(self.stdout, ""), texts.get(self.stderr) if self.stderr is not None else None



@functools.cache
def _torchrun_has_shutdown_timeout() -> bool:
    """torchrun's --shutdown-timeout is newer than torch 2.11 (the GPU machine's)."""
    from torch.distributed.run import get_args_parser
    return "--shutdown-timeout" in get_args_parser()._option_string_actions


def launch_training(nproc: int, config, *sets: str, env: dict | None = None) -> subprocess.Popen:
    """`train --config CONFIG --set S ...` under torchrun_popen: started in its own process
    group, not waited for (killpg SIGINT is Ctrl-C, SIGKILL ends it whole)."""
    return torchrun_popen(nproc, "train", "--config", config, *(x for s in sets for x in ("--set", s)), env=env)


def torchrun_command(nproc: int, *args: str, shutdown_timeout: int | None = None) -> list[str]:
    """llmtrain's torchrun, standalone, `-m llmtrain ARGS`: what submit.sh --local runs."""
    cmd = [sys.executable, "-m", "llmtrain.training.torchrun", "--standalone", "--nproc-per-node", str(nproc)]
    if shutdown_timeout is not None and _torchrun_has_shutdown_timeout():
        cmd += ["--shutdown-timeout", str(shutdown_timeout)]
    return cmd + ["-m", "llmtrain", *map(str, args)]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[tuple[str, int, float]]:
    """(kind, step, loss) for every metrics line, train and eval."""
    return [(r["kind"], r["step"], r["loss"] if r["kind"] == "train" else r["eval_loss"])
            for r in read_metrics(run_dir)]


def assert_same_curve(a: Path, b: Path, tol: float) -> None:
    la, lb = losses(a), losses(b)
    assert [x[:2] for x in la] == [x[:2] for x in lb], "different steps logged"
    worst = max(abs(x[2] - y[2]) for x, y in zip(la, lb))
    assert worst <= tol, f"loss curves differ by {worst:.2e} > {tol:.0e}:\n{la}\n{lb}"


def run_dir(setup, name: str) -> Path:
    """A run's directory under a module's prepared_home (`setup`: its (root, config) pair)."""
    return setup[0] / "home" / "runs" / name


def imported_first(folder, code: str) -> dict:
    """The environment in which every Python process of a run runs `code` first (a
    sitecustomize.py in `folder`, on PYTHONPATH): a fault placed in one rank. torchrun's workers
    start as new interpreters (a forked one would not run it: training/workers.py)."""
    (folder / "sitecustomize.py").write_text(code)
    return {**os.environ, "LLMTRAIN_FORK_WORKERS": "0",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


def env_with(**extra) -> dict:
    return {**os.environ, **extra}
