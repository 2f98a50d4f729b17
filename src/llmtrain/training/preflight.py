"""Preflight: well under a second of measurement on every node before training; a slow node named.

    if preflight.run(cfg, world, log) == "stop":   # training/loop.py, once per process start
        return                                      # a continuation job comes back without it

Under Slurm (SLURM_JOB_ID set; a local run skips it) with `slurm.preflight: true`, once the
process group exists and before the model is built, every rank measures:

- matmul: the fastest of timed products of two square matrices on its device (CUDA: 8192 x 8192
  in bf16; CPU: 256 x 256 in fp32 on one thread, which stays in a core's cache, so ranks that
  share a machine's memory do not disturb each other's figure: a core's speed, whatever threads
  each process trains with), repeated for 0.1 s and at least 5 times, as TFLOP/s (2 n^3 per
  product);
- all-reduce: the best of a few timed sums of one buffer (CUDA 64 MiB, CPU 4 MiB, fp32), as bus
  bandwidth in GB/s, 2 (n - 1) / n x bytes / seconds (nccl-tests' "busbw": comparable across
  group sizes), twice: inside each node (its ranks, every node at once: NVLink on a GPU node),
  then across nodes (the ranks of one local rank on every node, every such group at once: each
  GPU's share of the network, all NICs busy). A world-wide all-reduce mixed the two and, at
  512+ ranks, measured latency more than bandwidth. Reported, not judged.

Rank 0 also records the cluster's figures for `llmtrain plan` (login/plan.py), which takes them
over the datasheet's: `$LLMTRAIN_HOME/cluster/<device name>.json`, the device's name, the nodes'
median matmul and the two bandwidths (the median over ranks).

Each node's matmul figure is its slowest rank's: training is synchronous, so one throttled GPU
sets the pace of the whole job. A node is slow when that figure is below `slurm.slow_node_ratio`
(default 0.7) times the median of the OTHER nodes' figures. With two nodes that is the other
node, so a slow one is judged against the faster; with many, one slow node cannot drag its own
reference down. One node alone is never judged.

Rank 0 writes every rank's and node's figures and the verdict ("slow": each slow node with the
median it was judged against) to `<run_dir>/preflight/<job id>-<SLURM_RESTART_COUNT>.json` and
logs one line per node, then
`preflight: node2 is slow: 0.0064 TFLOP/s matmul vs 0.064 on the others (below 0.7x); ...`.
With `slurm.exclude_slow_nodes: true` every rank stops before training (nothing to save) and
rank 0 records the stop in control/exit.json (reason "slow_node", requeued, with `exclude`: the
slow nodes plus those the job already excluded). Slurm refuses to change a running job's
ExcNodeList, and a requeue ends the batch script at once, so train.slurm does not requeue the
job in place: it submits a continuation job with `--exclude` (login/slurm.py), which counts
against slurm.max_requeues like a requeue.

Test hook, read once here: LLMTRAIN_TEST_SLOW_HOST=node2 makes the ranks on node2 sleep inside
each timed matmul for 9 times its length, so they report a tenth of their speed.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import Config
from ..data.sources import HOME_VAR
from ..rundir import Log, RunPaths, hostname, latest_checkpoint
from ..files import write_atomic
from .control import write_exit
from ..parallel.world import World

REPEATS = 5  # timed repetitions after a warm-up, at least; the best one counts
MATMUL_S = 0.1  # ... and the matmul repeats for this long: one undisturbed repetition is enough
MATMUL = {"cuda": (8192, torch.bfloat16), "cpu": (256, torch.float32)}  # size, dtype
ALL_REDUCE_BYTES = {"cuda": 64 << 20, "cpu": 4 << 20}
SLOW_FACTOR = 9  # the test hook's sleep, in multiples of the product's own time


def node_name() -> str:
    """Slurm's name for this node (what --exclude takes), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or hostname()


def run(cfg: Config, world: World, log: Log) -> str:
    """Measure, gather, judge, record. Returns "stop" when every rank must stop before training
    (slurm.exclude_slow_nodes and a slow node), else "go"."""
    job = os.environ.get("SLURM_JOB_ID")
    if not cfg.slurm.preflight or not job:
        return "go"
    me = node_name()
    slowed = os.environ.get("LLMTRAIN_TEST_SLOW_HOST") == me
    mine = {"rank": world.rank, "local_rank": world.local_rank, "node": me,
            "threads": torch.get_num_threads(),  # training's; a CPU matmul is timed on one
            "matmul_tflops": matmul_tflops(world.device, slowed),
            **links_busbw(world.device, world.world_size, local_world_size(world.world_size))}
    if world.device.type == "cuda":  # its matrices freed: the run's peak memory is the run's own
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(world.device)
    ranks: list = [None] * world.world_size
    dist.all_gather_object(ranks, mine)
    nodes = by_node(ranks)
    ratio = cfg.slurm.slow_node_ratio
    slow = slow_nodes({node: n["matmul_tflops"] for node, n in nodes.items()}, ratio)
    stop = bool(slow) and cfg.slurm.exclude_slow_nodes
    if world.is_main:
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        path = cfg.run_dir / "preflight" / f"{job}-{restart}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        size, dtype = MATMUL[world.device.type]
        write_atomic(path, json.dumps({
            "job_id": job, "restart": int(restart), "time": time.time(), "device": world.device.type,
            "matmul": {"size": size, "dtype": str(dtype).removeprefix("torch."), "seconds": MATMUL_S},
            "all_reduce_bytes": ALL_REDUCE_BYTES[world.device.type], "slow_node_ratio": ratio,
            "nodes": nodes, "ranks": ranks, "slow": slow, "stopped": stop}, indent=2) + "\n")
        record_cluster(world.device, job, nodes, ranks)
        for node, n in nodes.items():
            log.info(f"preflight: {node} ({len(n['ranks'])} rank{'s' * (len(n['ranks']) != 1)}): "
                     f"matmul {n['matmul_tflops']:.3g} TFLOP/s (slowest rank; median "
                     f"{n['matmul_tflops_median']:.3g}), all-reduce {describe_bw(n)}")
        log.info(verdict(nodes, slow, ratio, cfg.slurm.exclude_slow_nodes, path))
        if stop:
            exclude = sorted(set(slow) | set(job_excluded_nodes(job)))
            write_exit(RunPaths(cfg.run_dir).control, "slow_node", resumed_step(cfg.run_dir), exclude=exclude)
    return "stop" if stop else "go"


def matmul_tflops(device: torch.device, slowed: bool = False) -> float:
    """The fastest of at least REPEATS timed products on `device`, repeated for MATMUL_S, in
    TFLOP/s (after one warm-up product: cuBLAS handles). On a CPU, on one thread. A rank's count
    of repetitions is its own: no collective in between."""
    n, dtype = MATMUL[device.type]
    # CPU: one thread, the process's own setting back after. A product on T threads waits for
    # its slowest thread, so where threads outnumber free cores (the local cluster's fake nodes
    # sharing one machine; a job with more OMP threads than cores; a neighbour's load) one
    # preempted thread makes every product look slow, and a node was named slow for that alone
    # (measured here on 2 cores: 16 threads 0.05 TFLOP/s, 2 threads 0.19 or 0.002 by luck, one
    # thread 0.10 every time). One thread times the core, the same quantity on every node, and the
    # best of the repetitions is an undisturbed one.
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        return _timed_products(device, n, dtype, slowed)
    finally:
        if device.type == "cpu":
            torch.set_num_threads(threads)


def _timed_products(device: torch.device, n: int, dtype: torch.dtype, slowed: bool) -> float:
    # Constant operands: the timing does not depend on the values, and the run's random state
    # (seeded just before) stays as it was.
    a = torch.full((n, n), 1 / n, device=device, dtype=dtype)
    b = a.clone()
    torch.mm(a, b)
    best, done, start = math.inf, 0, time.perf_counter()
    while done < REPEATS or time.perf_counter() - start < MATMUL_S:
        done += 1
        sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        if slowed:  # the test hook: the node looks SLOW_FACTOR + 1 times slower
            time.sleep(SLOW_FACTOR * (time.perf_counter() - t0))
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e12


def local_world_size(world_size: int) -> int:
    """The ranks of a node (torchrun's LOCAL_WORLD_SIZE; the world where it is not set)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def links_busbw(device: torch.device, world_size: int, per_node: int) -> dict:
    """{"intra_node_busbw_gbps": inside this node, "inter_node_busbw_gbps": across nodes}, each
    None where its groups are of one rank (or the ranks do not fill whole nodes). Every rank
    makes every group (node-major ranks, as torchrun numbers them) and drops its own after."""
    out = {"intra_node_busbw_gbps": None, "inter_node_busbw_gbps": None}
    if world_size == 1 or per_node < 1 or world_size % per_node:
        return out
    rank = dist.get_rank()
    nodes = [list(range(n, n + per_node)) for n in range(0, world_size, per_node)]
    columns = [list(range(local, world_size, per_node)) for local in range(per_node)]
    for key, groups in (("intra_node_busbw_gbps", nodes), ("inter_node_busbw_gbps", columns)):
        if len(groups[0]) == 1:
            continue
        made = [(members, dist.new_group(members)) for members in groups]
        mine = next(group for members, group in made if rank in members)
        out[key] = all_reduce_busbw(device, len(groups[0]), mine)
        dist.destroy_process_group(mine)
    return out


def all_reduce_busbw(device: torch.device, size: int, group=None) -> float | None:
    """The best of REPEATS timed all-reduces (sums) of one fp32 buffer over `group` (`size`
    ranks), as bus bandwidth in GB/s; None for a group of one. The warm-up also lines the ranks
    up after their matmuls."""
    if size == 1:
        return None
    nbytes = ALL_REDUCE_BYTES[device.type]
    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)  # zeros: sums stay finite
    dist.all_reduce(buf, group=group)
    best = math.inf
    for _ in range(REPEATS):
        sync(device)
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * (size - 1) / size * nbytes / best / 1e9


def record_cluster(device: torch.device, job: str, nodes: dict, ranks: list[dict]) -> None:
    """The cluster's figures for the planner: $LLMTRAIN_HOME/cluster/<device name>.json."""
    home = os.environ.get(HOME_VAR)
    if not home:
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    size, dtype = MATMUL[device.type]

    def median(key: str):
        values = [r[key] for r in ranks if r.get(key) is not None]
        return statistics.median(values) if values else None
    path = Path(home) / "cluster" / f"{re.sub(r'[^A-Za-z0-9.-]+', '-', name).strip('-')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({
        "device_name": name, "job_id": job, "time": time.time(), "nodes": len(nodes),
        "ranks_per_node": max(len(n["ranks"]) for n in nodes.values()),
        "matmul": {"size": size, "dtype": str(dtype).removeprefix("torch.")},
        "matmul_tflops": statistics.median(n["matmul_tflops"] for n in nodes.values()),
        "intra_node_busbw_gbps": median("intra_node_busbw_gbps"),
        "inter_node_busbw_gbps": median("inter_node_busbw_gbps")}, indent=2) + "\n")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def by_node(ranks: list[dict]) -> dict[str, dict]:
    """Each node's ranks and figures: its slowest rank's matmul (the one it is judged by), the
    median of its ranks', and the median of its ranks' all-reduce bandwidth."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in ranks:
        groups[r["node"]].append(r)
    nodes = {}
    for node, rs in sorted(groups.items()):
        nodes[node] = {"ranks": [r["rank"] for r in rs],
                       "matmul_tflops": min(r["matmul_tflops"] for r in rs),
                       "matmul_tflops_median": statistics.median(r["matmul_tflops"] for r in rs)}
        for key in ("intra_node_busbw_gbps", "inter_node_busbw_gbps"):
            bws = [r[key] for r in rs if r.get(key) is not None]
            nodes[node][key] = statistics.median(bws) if bws else None
    return nodes


def slow_nodes(figures: dict[str, float], ratio: float) -> dict[str, float]:
    """The slow nodes, each with its reference: the median of the other nodes' figures, which a
    slow node's is below `ratio` times. With one node there is nothing to compare."""
    slow = {}
    for node, figure in figures.items():
        others = [f for other, f in figures.items() if other != node]
        if others and figure < ratio * statistics.median(others):
            slow[node] = statistics.median(others)
    return slow


def verdict(nodes: dict[str, dict], slow: dict[str, float], ratio: float, exclude: bool,
            path) -> str:
    """The log line that says whether a node is slow, and what happens about it."""
    if len(nodes) == 1:
        return f"preflight: one node, nothing to compare; figures in {path}"
    if not slow:
        return (f"preflight: no slow node ({len(nodes)} nodes, each within {ratio:g}x of the "
                f"others' median matmul); figures in {path}")
    named = "; ".join(f"{node} is slow: {nodes[node]['matmul_tflops']:.3g} TFLOP/s matmul vs "
                      f"{ref:.3g} on the others (below {ratio:g}x)" for node, ref in slow.items())
    them = "it" if len(slow) == 1 else "them"
    then = (f"stopping before training (slurm.exclude_slow_nodes): the job asks to come back "
            f"without {them}" if exclude else
            f"training on {them} anyway (slurm.exclude_slow_nodes: true leaves {them} out)")
    return f"preflight: {named}; {then}; figures in {path}"


def describe_bw(node: dict) -> str:
    """'187 GB/s inside the node, 41.2 across nodes (bus bandwidth)'."""
    intra, inter = node["intra_node_busbw_gbps"], node["inter_node_busbw_gbps"]
    if intra is None and inter is None:
        return "none (one rank)"
    inside = "none inside the node (one rank)" if intra is None else f"{intra:.3g} GB/s inside the node"
    across = "one node" if inter is None else f"{inter:.3g} across nodes"
    return f"{inside}, {across} (bus bandwidth)"


def job_excluded_nodes(job: str) -> list[str]:
    """The nodes this job excludes already (its ExcNodeList, expanded), so that a continuation
    keeps leaving them out; [] where scontrol cannot say."""
    try:
        out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True,
                             timeout=20).stdout
        listed = next((w.split("=", 1)[1] for w in out.split() if w.startswith("ExcNodeList=")), "")
        if listed in ("", "(null)"):
            return []
        names = subprocess.run(["scontrol", "show", "hostnames", listed], capture_output=True,
                               text=True, timeout=20).stdout
        return names.split()
    except (OSError, subprocess.TimeoutExpired):
        return []


def resumed_step(run_dir) -> int:
    """The step the run stands at: its newest complete checkpoint's (0 before any)."""
    name = latest_checkpoint(run_dir / "checkpoints") or ""
    return int(name.removeprefix("step-")) if name.removeprefix("step-").isdigit() else 0
