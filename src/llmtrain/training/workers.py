"""torchrun's workers forked from their agent, which imported the trainer once.

torchrun starts each rank as a new interpreter (`python -u -m llmtrain ARGS`), and each imports
torch, transformers and the trainer before its first step: ~2-4 s of CPU a rank at every start,
requeue and restart, each reading the same thousands of files from the shared filesystem
(doc/benchmarks.md, "Process start"). Under `python -m llmtrain.training.torchrun` the agent
imports them once (`preload`, before the rendezvous) and forks each worker from itself; the
child becomes what the new interpreter would have been (`become_worker`) and runs
`python -m llmtrain` in place. torchrun's agent is unchanged: it polls, signals and reaps these
workers as its own (`ForkedHandler`: its SubprocessHandler with a fork for the Popen).

What a forked child does not inherit from the agent, so that it is the worker a new interpreter
would be: the agent's signal handlers (`new_interpreter_signals`: what exec and Python's start
make of the agent's dispositions at the fork), the
files and sockets the agent opened after the imports (an exec'd worker has only 0, 1 and 2), its
environment (the worker's replaces it: torchrun's RANK etc.), C++ logging at ERROR (the agent's
own quiet, training/torchrun.py), the thread count (OMP_NUM_THREADS from the worker's
environment), buffered output (-u), its command line (ps shows the worker's), and the exit-time
finalizers the agent's objects registered after the imports (the rendezvous's keep-alive timer
stops its thread at exit: in a child that has no such thread, it waits on a lock that thread may
have held at the fork). It starts a
session of its own, as torchrun's Popen does. As in any forked process, what a sitecustomize did
at the agent's start is there, and it does not run again: code that must run in each rank as it
starts (a test's fault in one rank) needs LLMTRAIN_FORK_WORKERS=0. /proc/PID/environ, which the
kernel keeps from the process's start, shows the agent's variables.

Only the trainer is forked (`-m llmtrain`, this interpreter), and only where the imports left
CUDA untouched (a fork after CUDA's initialisation cannot use the GPU); anything else, and
LLMTRAIN_FORK_WORKERS=0, starts workers as torchrun does."""

from __future__ import annotations

import ctypes
import gc
import importlib
import inspect
import io
import os
import signal
import subprocess
import sys
import time
import traceback
import weakref

from ..errors import exit_process

ENV_SWITCH = "LLMTRAIN_FORK_WORKERS"
# What a trainer's rank imports before its first step, whatever the model: the CLI, the loop
# (torch.distributed and its checkpointing, transformers, datasets' loaders) and transformers'
# modeling core (the model's own module is small and is the worker's to import).
PRELOAD = ("llmtrain.cli", "llmtrain.training.loop", "transformers.modeling_utils")
C10_LOG_LEVEL = "FLAGS_caffe2_log_level"  # c10's level, set from TORCH_CPP_LOG_LEVEL as torch loads


class _Agent:
    """What the agent was before torchrun changed it: the descriptors its imports hold open and
    the exit-time finalizers they registered (`preload`), and C++ logging's level as torch set it
    from the user's environment (`quiet_cpp_logging`)."""
    kept_fds: frozenset[int] = frozenset()
    finalizers: frozenset = frozenset()
    cpp_log_level: int | None = None


def new_interpreter_signals() -> dict[int, object]:
    """The dispositions a worker that torchrun's Popen started now would have, from this
    process's: exec resets a handler to the default and keeps an ignored signal ignored (an
    agent started in the background of a script, with SIGINT ignored, whose torchrun then took
    SIGINT over, gives its workers SIGINT back); Popen restores SIGPIPE and SIGXFSZ before exec and
    the new interpreter ignores them; it takes SIGINT with its own handler where SIGINT is left at
    the default. A handler set outside Python (getsignal's None) is left as it is: the worker's
    imports would set it again."""
    out = {}
    for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
        now = signal.getsignal(sig)
        if now is not None:
            out[sig] = signal.SIG_IGN if now is signal.SIG_IGN else signal.SIG_DFL
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        out[sig] = signal.SIG_IGN
    if out.get(signal.SIGINT) is signal.SIG_DFL:
        out[signal.SIGINT] = signal.default_int_handler
    return out


def wanted(argv: list[str]) -> bool:
    """Whether this torchrun command starts the trainer with this interpreter on Linux, forks not
    turned off."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    from torch.distributed.run import parse_args
    args = parse_args(argv)
    return (args.module and not args.no_python and not args.run_path and args.training_script == "llmtrain"
            and os.environ.get("PYTHON_EXEC", sys.executable) == sys.executable)


def preload() -> bool:
    """Import what every rank imports, then hand torchrun the forking handler. False (and torchrun
    left as it is) where the imports initialised CUDA or the handler's hooks are not there."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
    if not hasattr(api, "get_subprocess_handler") or not hasattr(SubprocessHandler, "_popen"):
        return False  # another torch's process handling: its own start stays
    opened = import_trainer()
    import torch
    if torch.cuda.is_initialized() or _cuda_driver_initialised():
        return False
    _Agent.kept_fds = frozenset({0, 1, 2} | opened)
    _Agent.finalizers = frozenset(_finalizers())
    _fork_workers(api)
    return True


def import_trainer() -> set[int]:
    """Import PRELOAD as a rank's start would (its progress bars quiet where stderr is no
    terminal, torchao kept out), with CUDA's driver left alone; the descriptors the imports left
    open."""
    before = _open_fds()
    cli = importlib.import_module(PRELOAD[0])  # the top of the package: imported by name, as a worker's start does
    cli.quiet_progress_bars()  # what a worker's cli.main does first, before huggingface_hub loads
    # An import that asks torch.cuda.is_available() would initialise the driver; NVML answers it
    # without (read at each call).
    nvml = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        _import_without_torchao(PRELOAD[1:])
    finally:
        if nvml is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = nvml
    return _open_fds() - before


def quiet_cpp_logging() -> None:
    """C++ logging at ERROR in this process (the agent's end-of-run races, training/torchrun.py),
    remembering the level torch took from the user's environment, which forked workers get back."""
    flag = _c10_log_level()
    if flag is not None:
        _Agent.cpp_log_level = flag.value
        flag.value = 2  # ERROR


def _c10_log_level() -> ctypes.c_int | None:
    import torch
    try:
        return ctypes.c_int.in_dll(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")),
                                   C10_LOG_LEVEL)
    except (OSError, ValueError):
        return None


def _import_without_torchao(modules) -> None:
    """transformers imports torchao with its modeling code where it is installed; a run without
    train.fp8 keeps it out (cli.without_torchao), so the preload does too, and forgets the answer
    so that an FP8 worker finds it."""
    ours = "torchao" not in sys.modules
    if ours:
        sys.modules["torchao"] = None
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        if ours:
            del sys.modules["torchao"]
            from transformers.utils import import_utils
            for name in ("is_torchao_available", "_is_package_available"):
                getattr(getattr(import_utils, name, None), "cache_clear", lambda: None)()


def _cuda_driver_initialised() -> bool:
    """Whether this process has initialised the CUDA driver (cuInit), after which a forked child
    cannot use the GPU. Asked of the driver where it is loaded: cuDeviceGetCount answers
    CUDA_ERROR_NOT_INITIALIZED (3) before cuInit, and initialises nothing."""
    with open("/proc/self/maps") as maps:
        path = next((line.split()[-1] for line in maps if "/libcuda.so" in line), None)
    if path is None:
        return False
    try:
        count = ctypes.c_int()
        return ctypes.CDLL(path).cuDeviceGetCount(ctypes.byref(count)) != 3
    except (OSError, AttributeError):
        return True


def _finalizers() -> set[weakref.finalize]:
    """The weakref.finalize callbacks that will run at this process's exit (CPython's registry)."""
    return set(getattr(weakref.finalize, "_registry", {}))


def _open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def _fork_workers(api) -> None:
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
    started = api.get_subprocess_handler

    class ForkedHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]):
            return ForkedWorker.start(args, env, self._stdout, self._stderr)

    def handler(entrypoint, args, env, stdout, stderr, local_rank_id, **rest):
        given = {"entrypoint": entrypoint, "args": args, "env": env, "stdout": stdout, "stderr": stderr,
                 "local_rank_id": local_rank_id, **rest}
        trainer = entrypoint == sys.executable and tuple(args[:3]) == ("-u", "-m", "llmtrain")
        if not trainer or rest.get("numa_options") is not None or set(given) - set(accepted):
            return started(**given)  # numactl wraps the command: a new interpreter
        return ForkedHandler(**given)
    accepted = inspect.signature(SubprocessHandler.__init__).parameters
    api.get_subprocess_handler = handler


class ForkedWorker:
    """The Popen of a forked worker, as much of it as torchrun uses: pid, poll, wait, signals."""

    def __init__(self, pid: int, args: tuple):
        self.pid, self.args, self.returncode = pid, list(args), None

    @classmethod
    def start(cls, args: tuple, env: dict[str, str], stdout, stderr) -> "ForkedWorker":
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or the child writes the agent's buffered output again
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            _run_worker(args, env, stdout, stderr, ready_w)
        os.close(ready_w)
        os.read(ready_r, 1)  # its session exists, as when Popen returns (torchrun signals it by group)
        os.close(ready_r)
        return cls(pid, args)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_worker(args: tuple, env: dict[str, str], stdout, stderr, ready_w: int):
    """In the forked child: become the worker, run `python -m llmtrain ARGS`, end as it would
    (the trainer ends through errors.exit_process itself; this is for what escapes it)."""
    code = 1
    try:
        become_worker(args, env, stdout, stderr, ready_w)
        import runpy
        runpy.run_module("llmtrain", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        exit_process(code)  # never returns to the agent's code


def become_worker(command: tuple, env: dict[str, str], stdout, stderr, ready_w: int) -> None:
    """The forked child's state as a new interpreter's of `command` (python -u -m llmtrain ...)
    would be (the module's docstring)."""
    gc.freeze()  # the agent's objects are never collected here: none closes a descriptor reused below
    os.setsid()
    os.write(ready_w, b"x")
    for fd, file in ((1, stdout), (2, stderr)):
        if file is not None:
            os.dup2(file.fileno(), fd)
    for finalizer in _finalizers() - _Agent.finalizers:
        finalizer.detach()  # the agent's objects' (a module's import registers its own before the fork)
    for fd in _open_fds() - _Agent.kept_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread: the handlers below cannot be set either
        pass
    for sig, disposition in new_interpreter_signals().items():
        try:
            signal.signal(sig, disposition)
        except (OSError, ValueError):
            pass
    os.environ.clear()
    os.environ.update(env)
    # -u: unbuffered standard streams (the old objects stay referenced: none closes 1 or 2)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=sys.stdout.encoding,
                                  errors=sys.stdout.errors, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=sys.stderr.encoding,
                                  errors=sys.stderr.errors, write_through=True)
    import torch
    if _Agent.cpp_log_level is not None and (flag := _c10_log_level()) is not None:
        flag.value = _Agent.cpp_log_level
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    if "numpy" in sys.modules:  # a new interpreter seeds numpy's global generator afresh
        sys.modules["numpy"].random.seed()
    _name_the_process(*command)
    sys.argv = ["-m", *command[4:]]  # as the interpreter's start sets it, until runpy names the module


def _name_the_process(*command: str) -> None:
    """/proc/PID/cmdline (ps, top, pgrep -f) shows the worker's command, not the agent's: written
    over the agent's, which is longer (torchrun's options and the same trainer arguments)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49
    except (OSError, ValueError, IndexError):
        return
    text = b"\0".join(os.fsencode(part) for part in command) + b"\0"
    if len(text) <= end - start:
        ctypes.memmove(start, text, len(text))
        ctypes.memset(start + len(text), 0, end - start - len(text))
