"""One watchdog thread per rank: start-up phases with their own timeout, and stuck steps named
before the collective timeout kills the process.

    watch = Watchdog(cfg, world)           # first thing in the trainer
    with watch.phase("loading"): ...       # building, sharding, loading, resuming, first step
    watch.started(log)                     # start-up done: its phase times go to the log
    watch.step(n)                          # each step start (and the stack-dump timer) ...
    watch.at_sync()                        # ... and where a rank waits for the others

Start-up (reading a 70B checkpoint from a shared filesystem can take many minutes) runs under
`parallel.startup_timeout_s`; the process group is created with that timeout and switched to
`parallel.collective_timeout_s` once the first step is done. A start-up that overruns ends the
rank with one line naming the phase it was in.

The thread also writes the heartbeats, off the training thread: rank 0's every HEARTBEAT_S in
logs/heartbeat-rank-0.json (llmtrain status and the run lock read it), the other ranks' every
OTHERS_BEAT_S in a folder per host, logs/heartbeats/<host>/rank-N.json (512 ranks renaming a file
every 2 s in one directory made 256 metadata operations a second on the shared filesystem; now
~17, spread over a directory per node). A beat holds the steps done, when the last step began
(`step_time`: progress) and when it was written (`time`: the process lives).

During training, NCCL's own watchdog aborts a process whose collective times out before Python
sees an error, so the diagnosis cannot wait for an exception: at 3/4 of the collective timeout
each rank's thread records where its rank is ("compute", or "sync": done with its step and
waiting in the per-step agreement) in its heartbeat file; rank 0 and the last rank (DIAGNOSERS:
one of them is alive if the other is the rank that died) read every rank's file and name the
ranks that never reached the agreement while others wait there (two readers of 512 files, not
512). The line goes to stderr and the log at once; the gloo path raises it as the error when the
collective times out. NCCL's flight recorder is switched on (distributed.py), so its dump lands
in logs/ next to the stacks.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from ..rundir import RunPaths
from ..files import write_atomic

POLL_S = 0.5
HEARTBEAT_S = 2.0  # rank 0's heartbeat
OTHERS_BEAT_S = 30.0  # every other rank's
FIRE_AT = 0.75  # share of the collective timeout after which a step counts as stuck
ARM_S = 1.0  # the stack-dump timer's re-arming interval


class StartupTimeout(Exception):
    pass


class Watchdog:
    def __init__(self, run_dir: Path, rank: int, world_size: int, startup_timeout_s: int,
                 collective_timeout_s: int):
        self.run_dir, self.rank, self.world_size = run_dir, rank, world_size
        self.startup_timeout_s, self.collective_timeout_s = startup_timeout_s, collective_timeout_s
        self.heartbeat = heartbeat_path(run_dir, rank, socket.gethostname())
        self.beat_every = HEARTBEAT_S if rank == 0 else OTHERS_BEAT_S
        self.last_beat = self.last_arm = 0.0
        self.log = None  # a rundir.Log once the run directory exists
        self.t0 = self.phase_end = time.monotonic()
        self.current: str | None = "starting"
        self.times: list[tuple[str, float]] = []
        self.step_no, self.step_t0, self.stage = 0, None, "compute"
        self.step_time: float | None = None  # when the step under way began (epoch seconds)
        self.diagnosis: str | None = None
        self.place: Callable[[int], str] = lambda rank: ""  # what a rank holds, for the diagnosis (pipeline stages)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmtrain-watchdog", daemon=True)
        self._thread.start()

    # -- start-up ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str):
        self.current, t = name, time.monotonic()
        yield
        self.phase_end = time.monotonic()
        self.times.append((name, self.phase_end - t))
        self.current = "starting"

    def step(self, step: int) -> None:
        if self.current is not None and not any(n == "first step" for n, _ in self.times):
            self.current = "first step"
        first = self.step_time is None
        self.step_no, self.step_t0, self.stage = step, time.monotonic(), "compute"
        self.step_time = time.time()
        if first:  # the run shows as running from its first step on, not from the thread's next look
            self._beat()
        self._arm_stack_dump()

    def _arm_stack_dump(self) -> None:
        """The last resort of the stuck-step detection: a timer that dumps this rank's stacks
        into its log if no step starts for the collective timeout (re-armed at most every
        ARM_S: each arming starts a thread, so a stuck step's dump comes within a second of the
        timeout), after the thread's diagnosis at FIRE_AT of it."""
        now, log = time.time(), self.log
        if log is not None and log.file is not None and now - self.last_arm >= ARM_S:
            self.last_arm = now
            faulthandler.dump_traceback_later(self.collective_timeout_s, file=log.file)

    @property
    def starting(self) -> bool:
        return self.current is not None

    def started(self) -> str:
        """Start-up is over (after the first step): switch the process group to the collective
        timeout; return the phase times as one line for the log."""
        now = time.monotonic()
        self.times.append(("first step", now - self.phase_end))
        self.current = None
        _set_group_timeout(self.collective_timeout_s)
        total = now - self.t0
        phases = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.times)
        return f"start-up took {total:.1f}s: {phases}"

    # -- steps -------------------------------------------------------------------------------

    def at_sync(self) -> None:
        self.stage = "sync"

    def idle(self) -> None:
        """Between steps (evaluation, checkpoints): not watched."""
        self.step_t0 = None

    def close(self) -> None:
        self._stop.set()

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            now = time.monotonic()
            if self.current is not None and now - self.t0 > self.startup_timeout_s:
                self._emit(f"error: start-up did not finish within parallel.startup_timeout_s="
                           f"{self.startup_timeout_s}s: rank {self.rank} on {socket.gethostname()} "
                           f"was in phase '{self.current}'; raise parallel.startup_timeout_s if the "
                           f"filesystem is slow, or see logs/rank-{self.rank}.log")
                os._exit(1)
            if self.step_time is not None and time.time() - self.last_beat >= self.beat_every:
                self._beat()
            started = self.step_t0
            if (started is not None and self.current is None and self.diagnosis is None
                    and now - started > FIRE_AT * self.collective_timeout_s):
                self.diagnose()

    def diagnose(self) -> str:
        """Name the ranks that hold up the step, as a warning line at once (once; later calls
        return the same line). Whichever thread comes first writes the warning, under the lock:
        an error raised with the line (gloo's timeout) always follows its warning."""
        with self._lock:
            if self.diagnosis is None:
                self.diagnosis = self._diagnose()
                self._emit(f"warning: {self.diagnosis}")
            return self.diagnosis

    def _beat(self) -> None:
        """This rank's heartbeat: steps done, when the step under way began, now."""
        self.last_beat = now = time.time()
        with self._lock, contextlib.suppress(OSError):  # a full disk: the next beat tries again
            if self.diagnosis is not None:  # the stall record stays for the ranks that read it
                return
            self.heartbeat.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.heartbeat, json.dumps({
                "step": max(0, self.step_no - 1), "step_time": self.step_time, "time": now,
                "pid": os.getpid(), "host": socket.gethostname()}))

    def _diagnose(self) -> str:
        """Under the lock: no beat overwrites the stall record meanwhile."""
        self.heartbeat.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.heartbeat, json.dumps({
            "step": self.step_no, "stage": self.stage, "host": socket.gethostname(),
            "time": time.time(), "step_time": self.step_time, "pid": os.getpid(), "stalled": True}))
        head = (f"a collective did not complete within parallel.collective_timeout_s="
                f"{self.collective_timeout_s}s")
        if self.rank not in (0, self.world_size - 1):
            return (f"{head}; rank 0's log names the ranks that held it up: "
                    f"{self.run_dir}/logs/rank-0.log")
        time.sleep(HEARTBEAT_S + 1)  # the other ranks' watchdogs fire at about the same time
        beats = read_heartbeats(self.run_dir, self.world_size)
        waiting = [r for r, b in beats.items() if b and b.get("stage") == "sync"
                   and b.get("step") == self.step_no]
        if waiting:
            stuck, logs = [], []
            for rank, beat in beats.items():
                if rank in waiting:
                    continue
                logs.append(f"{self.run_dir}/logs/rank-{rank}.log")
                if beat is None:
                    stuck.append(f"rank {rank}{self.place(rank)} (never reported)")
                else:
                    stuck.append(f"rank {rank}{self.place(rank)} on {beat['host']} (last heartbeat "
                                 f"{time.time() - beat['time']:.0f}s ago, at step {beat['step']})")
            if stuck:
                dumps = (f"its stack dump is in {logs[0]}" if len(logs) == 1
                         else f"their stack dumps are in {', '.join(logs)}")
                return f"{head}: {', '.join(stuck)} stopped participating: stuck or dead; {dumps}"
        return (f"{head}: no rank finished step {self.step_no}, so a collective inside the "
                f"forward/backward is stuck; stack dumps are in {self.run_dir}/logs/rank-*.log "
                f"(and NCCL's flight recorder dumps, on GPUs)")

    def _emit(self, line: str) -> None:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
        log = self.log
        if log is not None and log.file is not None:
            with contextlib.suppress(ValueError):  # closed at the very end
                log.file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} [rank {self.rank}] {line}\n")


def heartbeat_path(run_dir: Path, rank: int, host: str) -> Path:
    """Rank 0's heartbeat where llmtrain status reads it; the others' in a folder per host."""
    return RunPaths(run_dir).heartbeat_of(rank, host)


def read_heartbeats(run_dir: Path, world_size: int) -> dict[int, dict | None]:
    """Every rank's last heartbeat (None: none written, or unreadable): one listing per host
    folder and one read per rank."""
    paths = {0: heartbeat_path(run_dir, 0, "")}
    found = []
    for path in (run_dir / RunPaths.HEARTBEATS).glob("*/rank-*.json"):
        with contextlib.suppress(OSError, ValueError):
            found.append((path.stat().st_mtime, int(path.stem.removeprefix("rank-")), path))
    for _, rank, path in sorted(found):  # an earlier launch's file on another host: the newest wins
        if rank > 0:
            paths[rank] = path
    beats: dict[int, dict | None] = {}
    for rank in range(world_size):
        try:
            beats[rank] = json.loads(paths[rank].read_text())
        except (KeyError, OSError, ValueError):
            beats[rank] = None
    return beats


def _set_group_timeout(seconds: int) -> None:
    import datetime

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    if dist.is_initialized() and hasattr(c10d, "_set_pg_timeout"):  # private, present 2.11-2.13
        c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))
