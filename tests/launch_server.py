"""The tests' torchrun launches, forked from a process that imported torch and the trainer once.

A test's `python -m llmtrain.training.torchrun ...` pays ~4 s of CPU before the rendezvous: the
interpreter, torch, and the agent's one import of the trainer (training/workers.py). The suite
launches torchrun ~250 times on two cores. So each pytest worker starts one server
(`python tests/launch_server.py SOCKET`, a fresh interpreter that imports the same modules and
nothing else) and asks it, over a Unix socket, to fork each launch: the child is the agent as
`python -m llmtrain.training.torchrun ARGS` would be, with the test's environment, working folder,
standard streams (passed as descriptors) and, where asked, a session of its own; it runs the
same module as __main__. Its workers are the agent's own, as in any launch. The server reports
each child's pid, then its exit status.

What a fork cannot be is left to a new interpreter (conftest.ServedLaunch falls back): an
environment that changes what the C library reads as a process starts (MALLOC_*, LD_*, the
locale) or what loads as the interpreter, torch or transformers start (PYTHONPATH and the other
PYTHON* variables, TORCH_CPP_LOG_LEVEL, HF_*, OMP_NUM_THREADS): conftest.START_VARIABLES."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys

# Imported here once, as the agent and its preload would (never llmtrain.training.torchrun itself:
# its import quiets C++ logging and records what it was, which each launch must do afresh).
import torch  # noqa: F401
import torch.distributed.run  # noqa: F401

from llmtrain.training import workers

workers.import_trainer()  # as each agent's preload does


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    os.write(1, b"ready\n")
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection that asked for it
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                pid = launch(conn)
                if pid:
                    waiting[pid] = conn
            else:
                os.read(wake_r, 4096)
        while waiting:  # reap every child that ended, and tell its test
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()


def launch(conn: socket.socket) -> int | None:
    """Read one request (JSON and the child's stdin, stdout, stderr), fork the agent; its pid."""
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not msg.endswith(b"\n"):  # a long environment may come in parts
        more = conn.recv(1 << 20)
        if not more:
            return None
        msg += more
    request = json.loads(msg)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            agent(request, fds)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    return pid


def agent(request: dict, fds: list[int]) -> None:
    """In the child: become `python -m llmtrain.training.torchrun ARGS` and run it: the test's
    streams, folder and environment, only descriptors 0-2 (the server's are not the agent's),
    the signal handling a new interpreter has."""
    import gc
    gc.freeze()  # the server's objects are never collected here: none closes a descriptor reused below
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if request["new_session"]:
        os.setsid()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False, buffering=1, errors="backslashreplace")
    sys.argv = ["-m", *request["argv"]]  # until runpy names the module, as at an interpreter's start
    import runpy
    runpy.run_module("llmtrain.training.torchrun", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    # Ends with the pytest worker that started it (its parent), as the worker's own child.
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        sys.exit(0)
    serve(sys.argv[1])
