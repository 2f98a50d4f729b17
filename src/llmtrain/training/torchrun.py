"""torchrun with llmtrain's endings: `python -m llmtrain.training.torchrun [--quiet-user-error]
ARGS` is `torchrun ARGS` (same options, same agent); only how a run ends on stderr differs.

- A user error of the trainer (every rank records its line in torchrun's error file:
  cli.error_lines): that line, once, last; none of torchrun's ~25-line failure summary.
  With --quiet-user-error, not even the line when the run's logs/error.txt holds it: the caller
  prints that file last (train.slurm, below srun's own lines and its requeue decision).
- Any other worker failure (a segfault, a killed worker, a bug, whose traceback is above):
  one line naming the first failing rank, its host and its exit code or signal.
- A stop signal to the agent (scancel, a preemption: SIGTERM to every process of the job):
  the workers save and stop, as on Ctrl-C, and the agent ends with 128 + the signal's number
  instead of a SignalException traceback. Repeats of a stop signal are ignored while they save.

A failure is exit 1. submit.sh --local, train.slurm and llmtrain bench start training through it."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import threading
from pathlib import Path

from . import workers

# On a stop signal (scancel, a preemption's SIGTERM, the local launcher's end) the agent passes
# SIGTERM to the workers and SIGKILLs them after this many seconds: torch's 30 s cut a big
# model's save short (a 70B checkpoint takes minutes), and a kill -9'd local launcher's run lost
# its save under load. The workers end on their own (their save, or the stack dump at the
# collective timeout, training/control.py); Slurm's KillWait still bounds a job.
SHUTDOWN_TIMEOUT_S = 900
os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
from torch.distributed.elastic.multiprocessing import SignalException  # noqa: E402
from torch.distributed.elastic.multiprocessing import api as _workers  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.elastic.rendezvous import utils as _rendezvous  # noqa: E402
from torch.distributed.run import main  # noqa: E402

# The same end-of-run race in C++: the other agent's last store operation finds the socket
# closed, and c10d logs a warning with a 30-frame stack dump. This agent process only logs C++
# errors but not warnings; its workers log at the level TORCH_CPP_LOG_LEVEL asks.
workers.quiet_cpp_logging()


def timers_stop_from_their_own_thread() -> None:
    """The rendezvous's keep-alive timer stops its thread when the timer is collected: it sets the
    stop event and joins the thread. Its function holds the rendezvous handler while it runs, so
    where the agent lets go of the handler during a keep-alive (its end, after a stop signal,
    under load), the handler and its timer are collected in the timer's own thread, the join
    raises "cannot join current thread", and the job log gets that traceback ("Exception ignored
    in: <finalize object>", torch 2.11-2.13). From the timer's own thread the event alone ends it."""
    timer = getattr(_rendezvous, "_PeriodicTimer", None)
    stop = getattr(timer, "_stop_thread", None)
    if stop is None:  # not the torch this was written for
        return

    def stop_thread(thread, stop_event):
        if thread is threading.current_thread():
            stop_event.set()  # the loop ends after this call returns
        else:
            stop(thread, stop_event)
    timer._stop_thread = staticmethod(stop_thread)


timers_stop_from_their_own_thread()

from ..errors import IN_ERROR_TXT, USER_ERROR, exit_process  # noqa: E402 (a worker's error file)
from ..files import read_json  # noqa: E402
from ..rundir import RunPaths  # noqa: E402

QUIET_USER_ERROR = "--quiet-user-error"

# torchrun's log lines that the one line at the end replaces (logger name: parts of messages).
_REPLACED = {
    "torch.distributed.elastic.agent.server.api": ("death signal, shutting down workers",),
    "torch.distributed.elastic.multiprocessing.api": ("closing signal", "failed (exitcode: "),
    "torch.distributed.elastic.multiprocessing.errors.error_handler": ("no error file defined for parent",),
    # At the end of a multi-node run the first node's agent, which hosts the rendezvous, can exit
    # before another node's agent marks the rendezvous closed, and that agent then says it "has
    # failed to shutdown the rendezvous". Every worker has ended by then (the agents passed their
    # exit barrier), so nothing is lost; the line only reads like a failure.
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous": ("has failed to shutdown the rendezvous",),
}


class _Replaced(logging.Filter):
    def __init__(self, parts: tuple[str, ...]):
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(part in str(record.msg) for part in self.parts)


def first_stop_signal_only() -> None:
    """torch's agent takes each stop signal as a new one: the second shuts the workers down again
    and the third raises out of the shutdown, so the agent exits while they save, and its workers
    die with it (training/distributed.py `die_with_launcher`), the checkpoint half-written.
    Repeats are what a kill -9'd `llmtrain submit --local` sends: the kernel sends the parent-death
    signal once per thread of the dying launcher (the child is handed from thread to thread as each
    ends; three SIGTERMs in 0.3 s, seen with strace). So the first stop signal starts the shutdown
    and the ones after it are ignored; SHUTDOWN_TIMEOUT_S (then a SIGKILL) still bounds it."""
    handler = getattr(_workers, "_terminate_process_handler", None)
    if handler is None:  # not the torch this was written for: its own handling stays
        return

    def first_only(signum, frame):
        for sig in signal.valid_signals():
            if signal.getsignal(sig) is first_only:
                signal.signal(sig, _ignored)
        handler(signum, frame)
    # PContext.start() registers the module's handler by name when it starts the workers.
    _workers._terminate_process_handler = first_only


def _ignored(signum, frame) -> None:
    pass


def launch(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet = argv[:1] == [QUIET_USER_ERROR]
    for name, parts in _REPLACED.items():
        logging.getLogger(name).addFilter(_Replaced(parts))
    first_stop_signal_only()
    if workers.wanted(argv[quiet:]):  # workers forked after one import of the trainer
        workers.preload()
    try:
        main(argv[quiet:])
    except ChildFailedError as e:
        user = user_error(e.failures)
        if user is None:
            sys.stderr.write(failure_line(e.failures) + "\n")
        elif not (quiet and user.get(IN_ERROR_TXT)):
            sys.stderr.write(user[USER_ERROR])
        return 1
    except SignalException as e:  # the workers had their stop signal and the time to save
        return 128 + e.sigval
    remove_node_scratch()
    return 0


def remove_node_scratch() -> None:
    """train.slurm's node-local scratch for the job (LLMTRAIN_NODE_SCRATCH, its TMPDIR: torchelastic's
    folders, the compile caches), removed when the run has ended for good: the launch succeeded,
    so every agent passed torchrun's exit barrier and no rank needs it, and the trainer's
    control/exit.json asks no requeue. A stop that comes back keeps it (a requeue on this node
    finds its compile caches warm), as do a failure and a launch without that record."""
    scratch, run_dir = os.environ.get("LLMTRAIN_NODE_SCRATCH"), os.environ.get("LLMTRAIN_RUN_DIR")
    if not scratch or not run_dir:
        return
    stop = read_json(RunPaths(Path(run_dir)).exit)  # None where missing or torn
    if isinstance(stop, dict) and stop.get("requeue") is False and str(stop.get("job_id")) == os.environ.get(
            "SLURM_JOB_ID"):
        shutil.rmtree(scratch, ignore_errors=True)  # both agents of a test cluster share one /tmp


def user_error(failures: dict) -> dict | None:
    """The record of the lowest failed rank that recorded a user error: rank 0's where it did (a
    rank that fails alone records its line with its rank and host: cli.entry)."""
    recorded = {rank: f.error_file_data for rank, f in failures.items()
                if isinstance(f.error_file_data, dict) and f.error_file_data.get(USER_ERROR)}
    return recorded[min(recorded)] if recorded else None


def failure_line(failures: dict) -> str:
    """The first failure, one line; a rank the agent itself stopped (SIGTERM) after another
    failed is not a cause (failures in the same second share a timestamp)."""
    rank, failure = min(failures.items(), key=lambda rf: (rf[1].exitcode == -signal.SIGTERM, rf[1].timestamp))
    how = (f"was killed by signal {failure.signal_name()}" if failure.exitcode < 0
           else f"exited with code {failure.exitcode}")
    return f"error: rank {rank} on {socket.gethostname()} {how}"


if __name__ == "__main__":
    exit_process(launch())
