"""Per-step instrumentation, behind one small interface for the loop: the profiler's traces and
phase labels, the watchdog's step beats (its stuck-step detection and stack dump), and the faults tests inject.

    hooks = StepHooks(cfg, world, log, watch)
    hooks.begin(step)              # before anything of the step
    with hooks.phase("data"): ...  # a labelled phase (a null context outside profiled steps)
    hooks.synced(step)             # after backward, before the step's agreement all-reduce
    hooks.updated()                # after the update: the rank waits on nothing
    hooks.requested(step, verdict) # a profile request the step's agreement carried
    hooks.end(step)
    hooks.close(step)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..config import Config
from ..rundir import Log
from .control import Verdict
from ..parallel.world import World
from .profiling import Profiler
from .watchdog import Watchdog


class StepHooks:
    def __init__(self, cfg: Config, world: World, log: Log, watch: Watchdog):
        self.profiler = Profiler(cfg, world.rank, world.device, log)
        self.watch = watch
        self.faults = Faults.from_env(world)
        self.phase = self.profiler.phase

    def begin(self, step: int) -> None:
        self.profiler.begin(step)
        self.watch.step(step)

    def loss_factor(self, step: int) -> float:
        return self.faults.loss_factor(step)

    def synced(self, step: int) -> None:
        self.faults.maybe_hang(step)
        self.faults.maybe_slow()
        self.watch.at_sync()

    def updated(self) -> None:
        self.watch.idle()

    def requested(self, step: int, verdict: Verdict) -> None:
        if verdict.profile:
            self.profiler.request(step, verdict.profile, verdict.profile_ranks)

    def end(self, step: int) -> None:
        self.profiler.after_step(step)

    def close(self, step: int) -> None:
        self.profiler.close(step)


@dataclass(frozen=True)
class Faults:
    """Testing hooks, read once from the environment (doc/operations.md):
    LLMTRAIN_INJECT_NAN_STEPS="5,6" makes rank 0's loss NaN at those steps;
    LLMTRAIN_INJECT_HANG_STEP=5 makes the last rank stop at step 5, after its backward, where
    the other ranks wait for it in the step's agreement (as they do under NCCL);
    LLMTRAIN_INJECT_STEP_S=12 makes every step of every rank last 12 s more (a big model's
    step); "12@0": in the job's first launch only (SLURM_RESTART_COUNT 0 or unset)."""

    nan_steps: frozenset = frozenset()
    hang_step: int | None = None
    slow_s: float = 0.0

    @classmethod
    def from_env(cls, world: World) -> "Faults":
        nan = os.environ.get("LLMTRAIN_INJECT_NAN_STEPS", "")
        hang = os.environ.get("LLMTRAIN_INJECT_HANG_STEP")
        return cls(frozenset(int(s) for s in nan.split(",") if s.strip()) if world.is_main else frozenset(),
                   int(hang) if hang and world.rank == world.world_size - 1 else None,
                   slow_step_s())

    def loss_factor(self, step: int) -> float:
        return float("nan") if step in self.nan_steps else 1.0

    def maybe_hang(self, step: int) -> None:
        if step == self.hang_step:
            _injected_fault()

    def maybe_slow(self) -> None:
        if self.slow_s:
            time.sleep(self.slow_s)


def slow_step_s() -> float:
    seconds, _, launch = (os.environ.get("LLMTRAIN_INJECT_STEP_S") or "0").partition("@")
    if launch and launch != os.environ.get("SLURM_RESTART_COUNT", "0"):
        return 0.0
    return float(seconds)


def _injected_fault() -> None:
    time.sleep(10**6)


