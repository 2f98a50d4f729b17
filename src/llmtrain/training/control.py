"""Stopping and saving on request, agreed by every rank at a step boundary.

    control = Control(cfg, world, log)
    verdict = control.agree(finite)     # once per step: ONE all-reduce carries every flag
    if verdict.stop: save, control.exit(reason, step, trained), leave the loop

Requests come from:
- signals: SIGUSR1 or SIGTERM to a training process (torchrun forwards SIGTERM; `scancel -s USR1`
  reaches job steps), and SIGINT: Ctrl-C on a local run reaches torchrun, which forwards it to its
  workers (they run in their own sessions, so only torchrun's copy arrives). The handler only sets
  a flag; SIGINT's reason is "user" (not requeued), the others' "signal".
- switch files in `<run_dir>/control/`: `stop` (save and stop), `save` (save, go on) and
  `profile` (trace the next N steps, training/profiling.py), written by
  `llmtrain control RUN_DIR stop|save|profile` or by train.slurm's trap when Slurm sends the batch
  shell its warning signal (`--signal=B:USR1@lead`). A file's text is the reason ("preempt",
  "user"), or profile's `STEPS [RANKS]` (`2 0,8`, `3 all`; without RANKS, profile.ranks).
  A switch older than this launch was meant for an earlier one: rank 0 removes it at start.
- the job's end time: rank 0 reads it from Slurm once, and asks to stop early enough that the
  step under way, the next one (a stop is read a step later), an evaluation and the final save
  all end before Slurm's kill, signal or not (`Deadline`: measured step, eval and save times,
  never later than `slurm.signal_lead_s` before the end).

Rank 0 stats the switch files at most every second; the agreement is a MAX all-reduce of
[stop, save, non-finite, profile steps, then a 0/1 per rank: it traces them] so every rank takes
the same decision at the same step (4 bytes a rank: 2 KiB at 512 ranks, still one small message).
The all-reduce stays on the device: the optimizer skips a non-finite step there (fused AdamW's
`found_inf`), and the host reads the flags from a pinned copy one step later, unless the step logs, evaluates or
saves (then at once). So a step that does nothing else never waits for the device, and a stop
or save request lands one step after the one that saw it, on every rank alike.
`<run_dir>/control/exit.json` tells train.slurm why the trainer stopped: "preempt", "deadline"
and "signal" are requeued; "user" and "done" are not; "slow_node" (training/preflight.py, before
the first step) comes back as a continuation job without the nodes its `exclude` lists.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ..config import Config, parse_ranks
from ..rundir import DEADLINE_MARGIN_S, Log, RunPaths
from ..files import write_atomic

SWITCH_POLL_S = 1.0
RECENT_STEPS = 8  # the deadline's step time: the slowest of the last few
REQUEUE_REASONS = ("preempt", "deadline", "signal", "slow_node")
SWITCHES = ("stop", "save", "profile")
PROFILE_STEPS = 3  # `llmtrain control RUN_DIR profile` without --steps
IMPORTED = time.time()  # launch_start_time()'s fallback
# Ctrl-C is a person asking to stop (not requeued); the others come from the cluster or torchrun.
SIGNAL_REASONS = {signal.SIGUSR1: "signal", signal.SIGTERM: "signal", signal.SIGINT: "user"}


@dataclass(frozen=True)
class Verdict:
    step: int
    stop: bool
    save: bool
    nonfinite: bool
    reason: str
    samples: object = None  # this rank's sample indices in that step (named if it is skipped)
    profile: int = 0  # steps to profile from the next one (a request through control/profile)
    profile_ranks: tuple = ()  # the ranks that trace them


class Agreement:
    """One step's flags [stop, save, non-finite, profile steps, tracing ranks], all-reduced on
    the device; `read()` gives the Verdict. On CUDA the flags are copied into pinned memory
    behind the step's work, so reading them a step later waits for nothing that is still running."""

    def __init__(self, control: "Control", step: int, flags, samples=None):
        import torch

        self.control, self.step, self.flags, self.samples = control, step, flags, samples
        self.nonfinite = flags[2]  # 0-dim, on the device: fused AdamW's found_inf
        self.event = None
        if flags.device.type == "cuda":
            self.host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self.host.copy_(flags, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flags
        self._verdict: Verdict | None = None

    def read(self) -> Verdict:
        if self._verdict is None:
            if self.event is not None:
                self.event.synchronize()
            flags = self.host.tolist()
            stop, save, bad, profile = flags[:4]
            control = self.control
            if stop and not control.reason:
                control.reason = "signal"  # another rank's request; rank 0 writes the reason it saw
            self._verdict = Verdict(self.step, bool(stop), bool(save), bool(bad), control.reason,
                                    self.samples, int(profile),
                                    tuple(rank for rank, traces in enumerate(flags[4:]) if traces))
        return self._verdict


def settle(agreement: Agreement, pending: Agreement | None,
           read_now: bool) -> tuple[list[Verdict], Agreement | None]:
    """The verdicts the host reads after a step's update: the previous step's (`pending`, long
    done), and this step's if `read_now` (it logs, evaluates or saves, or its flags were read for
    the update) or the previous one asks to stop or save; and what stays pending."""
    verdicts = [pending.read()] if pending is not None else []
    if read_now or any(v.stop or v.save for v in verdicts):
        return verdicts + [agreement.read()], None
    return verdicts, agreement


class Deadline:
    """When to stop for the job's time limit. A stop decided at step N's agreement is read at step
    N+1's and saved after it, so from the decision on the job still needs the rest of step N, step
    N+1, maybe an evaluation, and the final save (a 70B step on 64 GPUs takes ~75 s and its save
    minutes: a fixed lead of 120 s would start the save after Slurm's kill, and a killed job is
    never requeued). So the stop comes when

        now + 2 x step + eval + save + DEADLINE_MARGIN_S  (never less than slurm.signal_lead_s)

    passes the job's end. step: the slowest of the last RECENT_STEPS intervals between two
    agreements, less the evaluation and checkpoint time the loop reports in between (`paused`);
    eval and save: the last measured (a save from its start to its last shard written, async
    included), else the save estimated at start from the checkpoint's size (`save_s`)."""

    def __init__(self, end_time: float, lead_s: float, save_s):
        """save_s: a callable, the checkpointer's expected seconds for a save (measured, or
        estimated until one is)."""
        self.end_time, self.lead_s, self.save_s = end_time, lead_s, save_s
        self.eval_s = 0.0
        self.steps: list[float] = []
        self.last: float | None = None
        self.paused_s = 0.0

    def agreed(self, now: float) -> None:
        """A step's agreement: the interval since the previous one, less its pauses, is a step."""
        if self.last is not None:
            self.steps = [*self.steps, max(0.0, now - self.last - self.paused_s)][-RECENT_STEPS:]
        self.last, self.paused_s = now, 0.0

    def need_s(self) -> float:
        step = max(self.steps, default=0.0)
        return max(self.lead_s, 2 * step + self.eval_s + self.save_s() + DEADLINE_MARGIN_S)

    def due(self, now: float) -> bool:
        return now + self.need_s() > self.end_time

    def why(self) -> str:
        return (f"the job ends at {datetime.fromtimestamp(self.end_time):%H:%M:%S} and the next step "
                f"(~{max(self.steps, default=0.0):.0f}s), an evaluation (~{self.eval_s:.0f}s) and the "
                f"save (~{self.save_s():.0f}s) need {self.need_s():.0f}s")


class Control:
    def __init__(self, cfg: Config, world, log: Log, save_s=lambda: 0.0):
        """save_s: a callable, the seconds a save is expected to take (Checkpointer.save_s)."""
        self.world, self.log = world, log
        self.paths = RunPaths(cfg.run_dir)
        self.folder = self.paths.control
        self.signal_reason: str | None = None
        self.reason = ""
        self.lead_s = cfg.slurm.signal_lead_s
        self.profile_ranks = cfg.profile.rank_set  # a profile request's, unless it names its own
        end_time = job_end_time() if world.is_main and self.lead_s > 0 else None
        self.deadline = Deadline(end_time, self.lead_s, save_s) if end_time else None
        self.last_poll = 0.0
        self.timeout_s = cfg.parallel.collective_timeout_s
        if world.is_main:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.paths.exit.unlink(missing_ok=True)
            self._remove_stale_switches()
            if self.deadline:
                log.info(f"job ends at {datetime.fromtimestamp(end_time):%H:%M:%S}: saving and "
                         f"stopping {self.deadline.need_s():.0f}s before (or more, as the measured "
                         f"step and save times ask), for a requeue")
        for sig in SIGNAL_REASONS:
            signal.signal(sig, self._on_signal)

    def _remove_stale_switches(self) -> None:
        """A switch written before this launch started was meant for an earlier one (which ended
        before it looked): it must not stop this one. A switch written since (a request, or
        Slurm's warning, during start-up) is this launch's and is acted on at the first step."""
        started = launch_start_time()
        for name in SWITCHES:
            path = self.folder / name
            try:
                stale = path.stat().st_mtime < started
            except FileNotFoundError:
                continue
            if stale:
                path.unlink(missing_ok=True)
                self.log.info(f"removed {path}: written before this launch started, for an "
                              f"earlier one")

    def _on_signal(self, signum, frame) -> None:
        # Only a flag: the loop acts at the next step boundary. The first signal's reason stands.
        self.signal_reason = self.signal_reason or SIGNAL_REASONS.get(signum, "signal")
        # A rank stuck in a collective never reaches that boundary: if it has not stopped within
        # the collective timeout, dump its stacks and exit (torchrun would SIGKILL it 30 s after
        # its SIGTERM anyway, without a word). The save after a stop runs well within this.
        if self.log.file is not None:
            faulthandler.dump_traceback_later(self.timeout_s, exit=True, file=self.log.file)

    def agree(self, step: int, finite, samples=None) -> Agreement:
        """One collective per step: every rank learns whether any rank wants to stop or save,
        or saw a non-finite loss or gradient norm (`finite`: a bool tensor on the device). The
        host reads the answer with Agreement.read(), now or a step later."""
        import torch
        import torch.distributed as dist

        stop, save, profile, tracing = 0.0, 0.0, 0, ()
        if self.signal_reason:
            stop, self.reason = 1.0, self.signal_reason
        if self.world.is_main:
            now = time.time()
            if now - self.last_poll >= SWITCH_POLL_S:
                self.last_poll = now
                reason = self._take("stop")
                if reason == "preempt" and self.deadline and self.deadline.end_time - now <= self.lead_s + 5:
                    reason = "deadline"  # Slurm's warning before the time limit, not a preemption
                if reason:
                    stop, self.reason = 1.0, reason
                if self._take("save"):
                    save = 1.0
                profile, tracing = self._take_profile()
            if self.deadline:
                self.deadline.agreed(now)
                if not stop and self.deadline.due(now):
                    stop, self.reason = 1.0, "deadline"
                    self.log.info(f"stopping for the time limit: {self.deadline.why()}")
        # [stop, save, non-finite, profile steps, then one per rank: 1 if it traces them], filled
        # on the device: a Python number is a fill kernel (torch.tensor would copy and wait); the
        # ranks' index list is copied only with a request
        flags = torch.zeros(4 + self.world.world_size, device=finite.device)
        flags[0], flags[1], flags[2], flags[3] = stop, save, ~finite, profile
        if tracing:
            flags[[4 + rank for rank in tracing]] = 1.0
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # NCCL: queued on the device, no host wait
        return Agreement(self, step, flags, samples)

    @contextlib.contextmanager
    def paused(self, what: str):
        """Time the loop spends between two steps ("eval", "checkpoint"): not a step's, and an
        evaluation's is counted once more in the deadline."""
        start = time.time()
        try:
            yield
        finally:
            if self.deadline:
                seconds = time.time() - start
                self.deadline.paused_s += seconds
                if what == "eval":
                    self.deadline.eval_s = seconds

    def _take(self, name: str) -> str | None:
        path = self.folder / name
        try:
            reason = path.read_text().strip() or "user"
        except FileNotFoundError:
            return None
        path.unlink(missing_ok=True)
        if name != "profile":  # _take_profile says what it read
            self.log.info(f"{name} requested ({reason}) through {path}")
        return reason

    def _take_profile(self) -> tuple[int, tuple[int, ...]]:
        """(steps, ranks) that `llmtrain control RUN_DIR profile` asked for ((0, ()): none), from
        its `STEPS [RANKS]`; RANKS as profile.ranks takes them, the config's where absent."""
        text = self._take("profile")
        if text is None:
            return 0, ()
        words = text.split()
        try:
            steps = max(1, int(words[0]))
        except ValueError:
            steps = PROFILE_STEPS
        try:
            ranks = parse_ranks(words[1]) if len(words) > 1 else self.profile_ranks
        except ValueError:  # the CLI checks; a hand-written file falls back to the config's
            ranks = self.profile_ranks
        world = self.world.world_size
        ranks = range(world) if ranks == "all" else ranks
        tracing = tuple(rank for rank in ranks if rank < world)
        outside = "" if len(tracing) == len(ranks) else f"; ranks >= {world} are not in this run"
        self.log.info(f"profile requested ({steps} steps on ranks {_ranks_text(tracing, world)}{outside}) "
                      f"through {self.folder / 'profile'}")
        return steps, tracing

    def exit(self, reason: str, step: int, trained: int) -> None:
        """Record why training ended, for train.slurm (rank 0), and how many steps this launch
        trained. The Slurm job id says which job stopped: train.slurm requeues only for a stop of
        its own job (null outside Slurm)."""
        faulthandler.cancel_dump_traceback_later()
        if self.world.is_main:
            write_exit(self.folder, reason, step, trained=trained)


def write_exit(folder: Path, reason: str, step: int, **extra) -> None:
    """control/exit.json: why training ended, whether to requeue, the Slurm job id (null outside
    Slurm), and `extra` (a slow_node stop's `exclude`: the nodes to leave out)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "exit.json",
                 json.dumps({"reason": reason, "step": step, "requeue": reason in REQUEUE_REASONS,
                             "job_id": os.environ.get("SLURM_JOB_ID"), **extra}) + "\n")


def _ranks_text(ranks, world: int) -> str:
    return f"0-{world - 1} (all)" if len(ranks) == world > 1 else ", ".join(map(str, ranks)) or "none"


def launch_start_time() -> float:
    """When this launch started (epoch seconds, to within a second, never later): under torchrun
    its agent's start (workers start only after the rendezvous, and again after a restart), else
    this process's. From /proc on Linux; elsewhere when this module was imported."""
    pid = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return IMPORTED


def job_end_time() -> float | None:
    """The Slurm job's end (epoch seconds), or None outside Slurm or with no limit."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True,
                             text=True, timeout=20).stdout.strip()
        return datetime.strptime(out, "%Y-%m-%dT%H:%M:%S").timestamp()
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
