"""metrics.jsonl and the per-rank sample logs; throughput, MFU, peak memory and the compact progress
line (torch only where needed)."""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from pathlib import Path

from .files import write_atomic
from .gpus import gpu_called


def peak_tflops(device_name: str, precision: str, tf32: bool) -> float | None:
    """The peak a step in `precision` can reach on `device_name` (gpus.GPUS); None for a GPU
    not listed or whose peak is not published (set train.peak_tflops to get MFU there)."""
    gpu = gpu_called(device_name)
    return gpu.peak_tflops(precision, tf32) if gpu else None


def peak_flops(device, precision: str = "bf16", tf32: bool = True,
               override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one rank's device for MFU: the config's override, else the table (GPUs
    only: a CPU has no meaningful peak here)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    import torch
    tflops = peak_tflops(torch.cuda.get_device_name(device), precision, tf32)
    return tflops * 1e12 if tflops else None


class Throughput:
    """Tokens/s and MFU over the steps since the last reading; ETA from all steps so far.

    Work that is not training (evaluation, a checkpoint) runs under `with meter.paused():`, so
    its time counts neither for nor against the steps around it.
    """

    def __init__(self, tokens_per_step: int, flops_per_step: float, peak: float | None,
                 world_size: int, first_step: int, total_steps: int):
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self.peak_total = peak * world_size if peak else None
        self.first_step, self.total_steps = first_step, total_steps
        self.started = self.window_start = time.perf_counter()
        self.window_steps = 0
        self.window_paused = 0.0  # seconds of the window spent outside training

    def step(self) -> None:
        self.window_steps += 1

    @contextlib.contextmanager
    def paused(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.window_paused += time.perf_counter() - t

    def read(self, step: int) -> dict:
        now = time.perf_counter()
        busy = max(now - self.window_start - self.window_paused, 1e-9)
        steps_per_sec = self.window_steps / busy
        out = {"tokens_per_sec": steps_per_sec * self.tokens_per_step,
               "elapsed_s": now - self.started,
               "eta_s": (now - self.started) / max(1, step - self.first_step) * (self.total_steps - step)}
        if self.peak_total:
            out["mfu"] = steps_per_sec * self.flops_per_step / self.peak_total
        self.window_start, self.window_steps, self.window_paused = now, 0, 0.0
        return out


class Slowdown:
    """Flags a collapse of tokens/s within a run: log windows under 1/FACTOR of the run's typical
    window (the median of those so far; the first window, with start-up and compilation, is
    none), RUN of them in a row and for at least SECONDS, once, and again only after the speed
    came back above half of it. Another job on the same cores or GPUs is the usual cause (a local
    CPU run with 2 threads a process fell from 17,000 to 600-2,900 tokens/s when a second job
    shared the 2 cores); a few slow seconds are noise on a shared machine, and say nothing."""

    FACTOR, RUN, SECONDS = 3, 3, 60.0

    def __init__(self):
        self.speeds: list[float] = []
        self.slow, self.slow_since, self.flagged = 0, None, False
        self.last = None  # the previous window's elapsed_s

    def check(self, tokens_per_sec: float, elapsed_s: float) -> str | None:
        """`elapsed_s`: the run's seconds at the end of this window (Throughput.read's)."""
        self.speeds.append(tokens_per_sec)
        started, self.last = self.last, elapsed_s
        earlier = self.speeds[1:-1]
        if not earlier:
            return None
        typical = sorted(earlier)[len(earlier) // 2]
        if tokens_per_sec > typical / 2:
            self.flagged = False
        if tokens_per_sec >= typical / self.FACTOR:
            self.slow, self.slow_since = 0, None
            return None
        self.slow += 1
        self.slow_since = self.slow_since if self.slow_since is not None else started
        if self.slow < self.RUN or elapsed_s - self.slow_since < self.SECONDS or self.flagged:
            return None
        self.flagged = True
        return (f"warning: {tokens_per_sec:,.0f} tokens/s for {elapsed_s - self.slow_since:.0f} s, under "
                f"1/{self.FACTOR} of this run's typical {typical:,.0f}: is another job using the same cores or "
                f"GPUs (top, nvidia-smi)? See doc/operations.md, 'A slow or shared machine'")


def peak_memory_gib(device) -> float:
    if device.type == "cuda":
        import torch
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def progress_line(step: int, total: int, loss: float, lr: float, tokens_per_sec: float,
                  eta_s: float, epoch: tuple[int, int] | None = None) -> str:
    """epoch: (the current one, counting from 1; how many the run takes)."""
    return (f"step {step}/{total} | loss {loss:.4f} | lr {lr:.2e} | "
            f"{tokens_per_sec:,.0f} tok/s | eta {format_duration(eta_s)}"
            + (f" | epoch {epoch[0]}/{epoch[1]}" if epoch else ""))


def plural(n: int, word: str) -> str:
    """1 step, 2 steps."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


METRICS = "metrics.jsonl"


def read_metrics(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl records ([] before the first log step)."""
    path = run_dir / METRICS
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except ValueError:  # a line cut short by a kill
            continue
    return records


class MetricsWriter:
    """Appends metrics.jsonl lines (rank 0 only), each flushed as it is written, and hands each
    record to the trackers (`sinks`).

    Opening at step S first drops the lines past S: a run killed after its last checkpoint
    logged steps that the resumed run does again.
    """

    def __init__(self, path: Path | None, step: int = 0, sinks: list = (), warn=print, stopping=lambda: False):
        self.file, self.sinks = None, list(sinks)  # sinks: tracking.py's TensorBoard, WandB
        self.warn = warn
        self.stopping = stopping  # whether a stop signal reached this process (scancel, preemption)
        if path is not None:
            if path.exists():
                write_atomic(path, "".join(_lines_up_to(path, step)))
            self.file = open(path, "a", buffering=1)

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
        for sink in list(self.sinks):
            try:
                sink.log(record)
            except Exception as e:  # a tracker is a view of the run, not a reason to stop it
                self.sinks.remove(sink)
                if self.stopping():  # W&B's service process got the job's SIGTERM too, and ended
                    self.warn(f"{type(sink).__name__}: its service ended with the stop signal; the "
                              f"steps from here on are in metrics.jsonl only")
                else:
                    self.warn(f"warning: {type(sink).__name__} failed ({type(e).__name__}: {e}); "
                              f"training goes on without it (metrics.jsonl has every step)")

    def close(self, failed: bool = False) -> None:
        if self.file:
            self.file.close()
            self.file = None
        for sink in self.sinks:
            try:
                sink.close(failed)
            except Exception as e:
                if self.stopping():  # its service ended with the stop signal before it could finish
                    self.warn(f"{type(sink).__name__}: its service ended with the stop signal before it "
                              f"closed; metrics.jsonl has every step (the next launch logs them again)")
                else:
                    self.warn(f"warning: {type(sink).__name__} did not close cleanly ({type(e).__name__}: {e})")
        self.sinks = []


class SampleLog:
    """Opt-in (train.log_samples): logs/samples-rank-N.jsonl, {"step": S, "samples": [...]}."""

    def __init__(self, path: Path | None, step: int = 0):
        self.writer = MetricsWriter(path, step) if path is not None else None

    def write(self, step: int, indices) -> None:
        if self.writer:
            self.writer.write({"step": step, "samples": [int(i) for i in indices]})

    def close(self) -> None:
        if self.writer:
            self.writer.close()


def _lines_up_to(path: Path, step: int) -> list[str]:
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):  # a line cut short by a kill
            continue
    return kept
