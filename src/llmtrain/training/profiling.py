"""torch.profiler traces of chosen steps on chosen ranks, and the CUDA memory snapshot of an
out-of-memory error.

Steps are profiled from the config (`profile: {start_step, steps}`) or on request
(`llmtrain control RUN_DIR profile --steps N [--ranks 0,8|all]`): rank 0 reads the request and the
step's agreement all-reduce carries it, with the ranks that trace it, to every rank, which all
read it at the same step (control.py), so the traced ranks profile the same steps (one still
tracing an earlier plan starts after it). Only the ranks in `profile.ranks` (default: rank 0;
"all") trace, or those a request names: one trace is hundreds of MB, and 512 of them would flood
the shared filesystem. Each step is labelled `step N` and its phases `data`, `forward`,
`backward`, `optimizer` and `communication` (the step's agreement all-reduce; the gradient
reduction runs inside `backward`, where DDP and FSDP2 launch it), and where they happen `log`
(the metrics gather), `eval` and `checkpoint`. One trace per traced rank:
<run_dir>/profile/steps-<first>-<last>-rank-<r>.json, for https://ui.perfetto.dev or TensorBoard.

Outside the profiled steps a phase is a null context: no record_function overhead.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from ..config import Config, UserError
from ..rundir import Log, RunPaths

PHASES = ("data", "forward", "backward", "optimizer", "communication", "log", "eval", "checkpoint")


class Profiler:
    def __init__(self, cfg: Config, rank: int, device: torch.device, log: Log):
        self.folder = RunPaths(cfg.run_dir).profile
        self.rank, self.device, self.log = rank, device, log
        p = cfg.profile
        ranks = p.rank_set
        # (first step, steps, the rank that prints where the traces are: the lowest traced)
        self.plans: list[tuple[int, int, int]] = []
        if p.start_step and (ranks == "all" or rank in ranks):
            self.plans.append((p.start_step, p.steps, 0 if ranks == "all" else ranks[0]))
        self.prof = None
        self.first = self.last = self.reporter = 0
        self.step_range = None

    def request(self, step: int, steps: int, ranks: tuple[int, ...]) -> None:
        """Profile `steps` steps from the one after `step` (a request every rank read at `step`)
        if this rank is one of `ranks`; after the trace under way, if one is."""
        if self.rank in ranks:
            self.plans.append((step + 1 if self.prof is None else self.last + 1, steps, min(ranks)))

    def begin(self, step: int) -> None:
        if self.prof is None:
            plan = next((p for p in self.plans if p[0] == step), None)  # a resumed run past it: none
            if plan is None:
                return
            self.plans.remove(plan)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()
            self.first, self.last, self.reporter = step, step + plan[1] - 1, plan[2]
        self.step_range = torch.profiler.record_function(f"step {step}")
        self.step_range.__enter__()

    def phase(self, name: str):
        return torch.profiler.record_function(name) if self.prof is not None else contextlib.nullcontext()

    def close(self, step: int) -> None:
        """At the loop's end: a trace cut short (the run stopped) is still written."""
        if self.prof is not None:
            self._finish(max(step, self.first))

    def _finish(self, step: int) -> None:
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        prof, self.prof = self.prof, None
        path = self.folder / f"steps-{self.first}-{step}-rank-{self.rank}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            prof.stop()
            self.folder.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(tmp))
            os.replace(tmp, path)
        except Exception as e:  # a profile is a help, not a reason to stop training
            tmp.unlink(missing_ok=True)
            self.log.info(f"warning: the profile of steps {self.first}-{step} was not written ({e})")
            return
        self.log.info(f"profile of steps {self.first}-{step}: {self.folder}/steps-{self.first}-{step}-rank-*.json "
                      f"(open in https://ui.perfetto.dev)", all_ranks=self.rank == self.reporter)

    def after_step(self, step: int) -> None:
        """The step's range ends here; the trace ends at the plan's last step."""
        if self.step_range is not None:
            self.step_range.__exit__(None, None, None)
            self.step_range = None
        if self.prof is not None and step >= self.last:
            self._finish(step)


def record_memory_history(cfg: Config, device: torch.device) -> None:
    """profile.memory_history on CUDA: every allocation's stack, for the out-of-memory snapshot."""
    if cfg.profile.memory_history and device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=200_000)


def out_of_memory(cfg: Config, rank: int, device: torch.device, error: BaseException) -> UserError:
    """The allocator's state at an out-of-memory error, saved for https://pytorch.org/memory_viz,
    and the one line that says so (returned, for the caller to raise)."""
    path: Path | str = "not saved"
    if device.type == "cuda":
        folder = RunPaths(cfg.run_dir).logs
        path = folder / f"oom-snapshot-rank-{rank}.pickle"
        tmp = folder / f".{path.name}.tmp"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(tmp))
            os.replace(tmp, path)
        except Exception as e:  # the snapshot is a help, not a reason to hide the error
            path = f"not saved ({e})"
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        held = torch.cuda.memory_reserved(device) / 2**30
        where = f"{held:.1f} of {total:.1f} GiB held by torch"
    else:
        where = "host memory"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return UserError(f"out of memory on rank {rank} ({where}): {first[:200]}; memory snapshot: {path} "
                     f"(drop it on https://pytorch.org/memory_viz); lower train.micro_batch_size, turn on "
                     f"model.activation_checkpointing, or shard with parallel.strategy: fsdp")
