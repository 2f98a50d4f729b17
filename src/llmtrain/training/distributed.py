"""Process-group setup from the torchrun environment, or as a plain single process.

    world = init(cfg)       # reads RANK / WORLD_SIZE / LOCAL_RANK; nccl on GPUs, gloo on CPUs
    ...
    teardown(world, ok)     # always, in a finally: a process that exits with the group alive
                            # can abort with "terminate called without an active exception"
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import Config, UserError
from ..parallel.dims import ParallelDims
from ..parallel.world import World


def die_with_launcher() -> None:
    """Under torchrun, end this worker when its agent ends. torchrun starts each worker in a
    session of its own, so when the agent is killed (kill -9, the OOM killer) nothing reaches
    the workers: they trained on with no launcher, held the run directory's lock and the GPU, and
    a restart found the run "in use by a live run". Linux: the kernel sends SIGKILL at the
    parent's death (prctl PR_SET_PDEATHSIG), as a lost node would; the restart resumes from the
    last checkpoint. (Under Slurm the job step's cgroup ends them anyway; on one machine the
    agent itself gets SIGTERM when `llmtrain submit --local` dies: login/submit.py
    `child_of_this_launcher`.)"""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the agent died before the call
        os._exit(1)


def init(cfg: Config) -> World:
    die_with_launcher()
    quiet_cpu_all_to_all()
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dims = ParallelDims.from_config(cfg, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None)
    if problems := dims.problems():
        raise UserError(problems[0])
    # The CUDA caching allocator maps growing segments instead of carving fixed blocks: less
    # fragmentation as tensor sizes vary (evaluation, the loss's last chunk, FSDP2's buffers).
    # Before the first allocation; a setting of the user's wins.
    if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    device = pick_device(cfg, local_rank)
    if device.type == "cpu":
        keep_freed_heap()
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if cfg.parallel.socket_ifname:
        os.environ.setdefault("NCCL_SOCKET_IFNAME", cfg.parallel.socket_ifname)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", cfg.parallel.socket_ifname)
    if backend == "nccl":
        for key, value in nccl_flight_recorder(cfg.run_dir).items():
            os.environ.setdefault(key, value)
    # Start-up (loading a large checkpoint) may take longer than a training collective should:
    # the group starts with the longer timeout; the watchdog sets the collective timeout after.
    timeout = timedelta(seconds=max(cfg.parallel.collective_timeout_s, cfg.parallel.startup_timeout_s))
    if "MASTER_ADDR" in os.environ:
        # Our own handle on the store, as env:// would make it: rank 0 hosts it unless torchrun
        # shares its agent's; teardown keeps it up until every rank has closed its group.
        hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=hosts, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    else:  # a plain `llmtrain train`: a group of one, so FSDP2 and collectives still work
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return World(rank, local_rank, world_size, device, store, dims)


# glibc's malloc gives the top of its heap back to the system whenever more than its trim threshold
# lies free there, a threshold it raises only to twice the largest mmapped block freed so far:
# a CPU step, which frees and takes again tens of MB of tensors, then faults their pages back in
# every step (bench/throughput.py's model: ~7,000 page faults a step, ~60 with these; GPU
# tensors live in CUDA's caching allocator instead). doc/benchmarks.md has the A/B.
MALLOC_MMAP_THRESHOLD = 32 << 20  # blocks below this come from the heap (glibc's own ceiling)
MALLOC_TRIM_THRESHOLD = 128 << 20  # free memory the heap keeps at its top


def keep_freed_heap() -> None:
    """Set glibc's malloc to keep a CPU step's freed memory for the next step, unless the
    environment tunes malloc already (MALLOC_*_, GLIBC_TUNABLES, a preloaded jemalloc or
    tcmalloc) or the C library is not glibc."""
    if (not sys.platform.startswith("linux") or "malloc" in os.environ.get("LD_PRELOAD", "")
            or "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") for k in os.environ)):
        return
    import ctypes
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc's: musl has no mallopt
        libc.mallopt(-3, MALLOC_MMAP_THRESHOLD)  # M_MMAP_THRESHOLD (fixed: no moving threshold)
        libc.mallopt(-1, MALLOC_TRIM_THRESHOLD)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):  # not glibc: its defaults stand
        pass


class _CpuAllToAll(logging.Filter):
    """torch's "CPU process group does not support alltoall yet, falling back with allgather +
    chunk!" (logging's, once per process, so once per rank): DTensor's Shard(i) -> Shard(j) on a
    CPU mesh (gloo runs only) all-gathers and keeps its chunk instead of an all-to-all
    (torch/distributed/tensor/_collective_utils.py, shard_dim_alltoall). The same numbers, more
    traffic, on CPUs only, and nothing a user can change (Muon's redistributed stacks met it)."""
    MESSAGE = re.compile(r"CPU process group does not support alltoall yet, falling back with allgather")

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.MESSAGE.match(record.getMessage())


def quiet_cpu_all_to_all() -> None:
    """Drop only that message, from only its logger (once per process)."""
    logger = logging.getLogger("torch.distributed.tensor._collective_utils")
    if not any(isinstance(f, _CpuAllToAll) for f in logger.filters):
        logger.addFilter(_CpuAllToAll())


def pick_device(cfg: Config, local_rank: int) -> torch.device:
    """This rank's GPU, or the CPU where the config asks for none. A config that asks for GPUs
    on a node where CUDA is unusable stops here instead of training on CPU at 1/100 the speed."""
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} has no GPU: this node shows "
                            f"{torch.cuda.device_count()}; set slurm.procs_per_node to at most that")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    if cfg.slurm.gpus_per_node > 0:
        build = torch.version.cuda and f"CUDA {torch.version.cuda} build" or "CPU-only build"
        raise UserError(f"slurm.gpus_per_node is {cfg.slurm.gpus_per_node} but CUDA is unusable on "
                        f"{socket.gethostname()} (torch {torch.__version__}, a {build}; check "
                        f"nvidia-smi and the torch build setup.sh installed); to train on CPUs set "
                        f"slurm.gpus_per_node: 0 and slurm.procs_per_node")
    return torch.device("cpu")


def nccl_flight_recorder(run_dir) -> dict[str, str]:
    """NCCL's flight recorder: the last collectives of each rank, dumped on a timeout into the
    run's logs/ (nccl-trace-rank-N), for `python -m torch.distributed.flight_recorder`."""
    prefix = f"{run_dir}/logs/nccl-trace-rank-"  # the file is this prefix + the global rank
    return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": prefix,
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}


def teardown(world: World | None, finished: bool) -> None:
    """Close the group. After a finished run rank 0 leaves last: it hosts the store, and a rank
    whose group still polls a store that is gone (NCCL's heartbeat monitor does) prints a C++
    "recvValue failed" dump at the end of a run that went well."""
    if not dist.is_initialized():
        return
    dist.destroy_process_group()
    if not finished or world is None or world.world_size == 1 or world.store is None:
        return
    world.store.add(CLOSED_KEY, 1)
    deadline = time.monotonic() + 60
    while world.rank == 0 and world.store.add(CLOSED_KEY, 0) < world.world_size:
        if time.monotonic() > deadline:
            break  # a rank that never closes is not worth holding the job for
        time.sleep(0.05)


CLOSED_KEY = "llmtrain/closed"


def gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values`, indexed by rank (one collective for all of them)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return torch.stack(out).tolist()
