"""The planner's cost model (login/plan.py) against measured runs on this machine.

    python bench/plan.py [--steps 30]

Trains bench/throughput.py's model (Llama, 4 layers x 256, seq_len 256, micro batch 8, fp32, a
global batch of 16; 32 on 4 processes) under each layout this machine can run: one process; two
under ddp, fsdp, fsdp x tp 2, fsdp x cp 2 and pp 2 (1F1B); four under ddp, fsdp, hsdp 2 x 2, fsdp 2
x tp 2 and pp 2 x fsdp 2 (four processes share the 2 cores: half a core each). For each it prints
the planner's predicted tokens/s and the estimator's memory against the measured median tokens/s
(after the first log window), the peak tensor memory of a step by torch's memory tracker
(tests/memory_probe.py, the trainer's own step: what the estimator estimates) and the process's
resident peak, and the ratio again with the compute rate calibrated on one measured run of as many
processes (one process; ddp on 2, on 4): how each layout's extra work adds up. The planner's "GPU"
is this CPU: its compute rate is a large fp32 matmul measured here at the threads each process
trains with, its links gloo over loopback (an all-reduce, and the all-gathers and reduce-scatters
fsdp, tp and cp run, which gloo runs at about half the all-reduce's rate: medians measured here),
its host serial (login/plan.py's host term, each layer's dispatch, charged in full), so what this
checks is the compute and memory models and how the layouts' extra work adds up, not a cluster's
links or a GPU's kernels. Needs an environment from setup.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import MICRO, REPO, launcher, llmtrain_config  # noqa: E402

LAYOUTS = {  # name: (processes, --set overrides)
    "one process": (1, ["parallel.strategy=ddp"]),
    "ddp": (2, ["parallel.strategy=ddp"]),
    "fsdp": (2, ["parallel.strategy=fsdp"]),
    "fsdp x tp 2": (2, ["parallel.strategy=fsdp", "parallel.tp=2"]),
    "fsdp x cp 2": (2, ["parallel.strategy=fsdp", "parallel.cp=2"]),
    "pp 2 (1f1b)": (2, ["parallel.strategy=ddp", "parallel.pp=2"]),
    "ddp, 4 processes": (4, ["parallel.strategy=ddp"]),
    "fsdp, 4": (4, ["parallel.strategy=fsdp"]),
    "hsdp 2 x 2": (4, ["parallel.strategy=hsdp", "parallel.shard_size=2"]),
    "fsdp 2 x tp 2": (4, ["parallel.strategy=fsdp", "parallel.tp=2"]),
    "pp 2 x fsdp 2": (4, ["parallel.strategy=fsdp", "parallel.pp=2"]),
}


CORES = os.cpu_count() or 1


def global_batch(nproc: int) -> int:
    """The step's rows: a micro-batch of 8 a data-parallel rank at 4 processes, 2 micro-batches a
    rank where tp, cp or pp halve the data-parallel degree."""
    return MICRO * max(2, nproc)


def core_share(nproc: int) -> float:
    """Of a core, what each of `nproc` one-thread processes gets: 1 while they do not outnumber
    the cores, 1/2 for 4 on 2."""
    return min(1.0, CORES / nproc)


BUSBW = """
import statistics, time, torch, torch.distributed as dist
from llmtrain.training.preflight import ALL_REDUCE_BYTES
dist.init_process_group("gloo")
n = dist.get_world_size()
whole, part = torch.zeros(ALL_REDUCE_BYTES["cpu"] // 4), torch.zeros(ALL_REDUCE_BYTES["cpu"] // 4 // n)
def busbw(collective, times):  # GB/s of the median of 20 after one, as a training step's many see them
    collective()
    took = []
    for _ in range(20):
        t0 = time.perf_counter()
        collective()
        took.append(time.perf_counter() - t0)
    return times * (n - 1) / n * whole.numel() * 4 / statistics.median(took) / 1e9
reduce = busbw(lambda: dist.all_reduce(whole), 2)
gather = busbw(lambda: dist.all_gather_into_tensor(whole, part), 1)
scatter = busbw(lambda: dist.reduce_scatter_tensor(part, whole), 1)
if dist.get_rank() == 0:
    print(reduce, 2 / (1 / gather + 1 / scatter))
dist.destroy_process_group()
"""


def matmul_tflops(threads: int, n: int = 1024) -> float:
    """The best of 10 fp32 products of two n x n matrices on `threads` threads."""
    torch.set_num_threads(threads)
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.mm(a, b)
    best = min(_timed(a, b) for _ in range(10))
    return 2 * n ** 3 / best / 1e12


def _timed(a, b) -> float:
    t0 = time.perf_counter()
    torch.mm(a, b)
    return time.perf_counter() - t0


def busbw(tmp: Path, nproc: int) -> tuple[float, float]:
    """(an all-reduce's, an all-gather and reduce-scatter's) bus bandwidth over `nproc` processes, GB/s,
    at the preflight's size (4 MiB), the median of 20: this machine's best and median differ by
    up to 2.5x. The latter's time is an equal number of each."""
    script = tmp / "busbw.py"
    script.write_text(BUSBW)
    out = subprocess.run([*launcher(nproc), str(script)], capture_output=True, text=True, check=True).stdout
    reduce, gather = map(float, out.strip().splitlines()[-1].split())
    return reduce, gather


def measured(tmp: Path, name: str, nproc: int, sets: list[str], steps: int) -> tuple[float, float]:
    """(median tokens/s of the log windows after the first, peak GiB above the process's memory
    before the model: on a CPU the peak is the process's resident memory, torch's libraries
    included) of one run."""
    config = llmtrain_config(tmp, nproc, name="-" + name.replace(" ", "").replace("(", "").replace(")", ""))
    run = ["--set", f"run.name={config.stem}", "--set", f"train.max_steps={steps}",
           "--set", f"train.global_batch_size={global_batch(nproc)}"] + [x for s in sets for x in ("--set", s)]
    subprocess.run([sys.executable, "-m", "llmtrain", "prepare", "--config", str(config)], check=True,
                   capture_output=True)
    proc = subprocess.run([*launcher(nproc), "-m", "llmtrain", "train", "--config", str(config), *run],
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{name}: llmtrain train failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (tmp / "runs" / config.stem / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"][1:]
    log = (tmp / "runs" / config.stem / "logs" / "rank-0.log").read_text()
    before = float(re.search(r"\(([\d.]+) GiB before the model\)", log)[1])
    return statistics.median(r["tokens_per_sec"] for r in train), max(r["peak_mem_gib"] for r in train) - before


def tracked(tmp: Path) -> dict[str, float]:
    """{layout: the peak tensor GiB of one of its training steps, the larger of its ranks'}, by
    torch's memory tracker (tests/memory_probe.py: the trainer's own parallelize, loss and step,
    a rank's micro-batches of the step; what the estimator estimates). One torchrun a process count."""
    found = {}
    for nproc in sorted({n for n, _ in LAYOUTS.values()}):
        config = llmtrain_config(tmp, nproc, name="-m")
        names = [name for name, (n, _) in LAYOUTS.items() if n == nproc]
        cases = [f"case{i}={','.join([f'train.global_batch_size={global_batch(nproc)}', *LAYOUTS[name][1]])}"
                 for i, name in enumerate(names)]
        out = tmp / f"probe-{nproc}"
        out.mkdir()
        proc = subprocess.run([*launcher(nproc), str(REPO / "tests" / "memory_probe.py"), str(config), str(out), *cases],
                              capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"tests/memory_probe.py failed:\n{proc.stderr[-3000:]}")
        ranks = [json.loads(f.read_text()) for f in out.glob("rank-*.json")]
        for i, name in enumerate(names):
            found[name] = max(r[f"case{i}"]["peak"] for r in ranks) / 2 ** 30
    return found


def predicted(tmp: Path, name: str, nproc: int, sets: list[str], gemm: float, bw: tuple[float, float]
              ) -> tuple[float, float]:
    """(predicted tokens/s, estimated GiB) of the same run: this CPU as the planner's GPU."""
    from llmtrain.config import load_config
    from llmtrain.login.estimate import GIB
    from llmtrain.gpus import GEMM_EFFICIENCY, GPU
    from llmtrain.login.plan import predict
    config = llmtrain_config(tmp, nproc, name="-p")
    cfg = load_config(config, [f"train.global_batch_size={global_batch(nproc)}", "slurm.procs_per_node=null",
                               "slurm.gpus_per_node=2", *sets], world_size=nproc)
    reduce, gather = bw
    cpu = GPU("this CPU", 24, gemm / GEMM_EFFICIENCY, None, reduce, reduce, gemm_tflops=gemm, intra_gbs=reduce,
              inter_gbs=reduce, measured="here", host_serial=True, gather_scale=gather / reduce,
              host_scale=1 / core_share(nproc))  # processes sharing a core share its host
    c = predict(cfg, cpu, nproc, max(nproc, 2))  # two a "node": gloo's loopback is its links
    return c.tokens_per_s * nproc, c.memory / GIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        one = matmul_tflops(1)  # a process trains on 2 threads alone, else on one, sharing the cores
        rates = {n: matmul_tflops(CORES) if n == 1 else one * core_share(n) for n, _ in LAYOUTS.values()}
        bw = {n: busbw(tmp, n) for n in (2, 4)}
        print(f"this machine: fp32 matmul {rates[1]:.3f} TFLOP/s on {CORES} threads, {one:.3f} on 1; "
              + "; ".join(f"{n} processes: gloo all-reduce {bw[n][0]:.2f} GB/s bus bandwidth, all-gather and "
                          f"reduce-scatter {bw[n][1]:.2f}" for n in bw) + " (4 MiB)")
        tensors = tracked(tmp)
        rows = []
        for name, (nproc, sets) in LAYOUTS.items():
            tokens, peak = measured(tmp, name, nproc, sets, args.steps)
            guess, memory = predicted(tmp, name, nproc, sets, rates[nproc], bw[max(nproc, 2)])
            rows.append((name, nproc, guess, tokens, memory, peak))
            print(f"{name}: predicted {guess:,.0f} tokens/s, measured {tokens:,.0f}", flush=True)
        # The compute rate calibrated on one measured run of as many processes, the first layout of
        # each count (one process; ddp, whose step is its compute and one all-reduce): what is left
        # is how each layout's extra work adds up, the part of the model a layout choice turns on.
        scale = {}
        for name, nproc, guess, tokens, *_ in rows:
            scale.setdefault(nproc, tokens / guess)
        print("| layout | predicted tokens/s | measured | measured / predicted | the same, compute calibrated on "
              "the first run of as many processes | estimated GiB | tracked peak GiB | estimated / tracked | "
              "resident GiB above the start |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, nproc, guess, tokens, memory, peak in rows:
            print(f"| {name} | {guess:,.0f} | {tokens:,.0f} | {tokens / guess:.2f} | "
                  f"{tokens / guess / scale[nproc]:.2f} | {memory:.3f} | {tensors[name]:.3f} | "
                  f"{memory / tensors[name]:.3f} | {peak:.2f} |")


if __name__ == "__main__":
    main()
