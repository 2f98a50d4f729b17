"""A GPU's facts, from the vendors' datasheets: its memory, its dense peaks at each precision (no
sparsity) and its links. One table, which the MFU figure (metrics.py, by the name torch reports:
"NVIDIA H100 80GB HBM3"), the memory estimate and the planner (login/, by the name a Slurm config
or a user spells: `--gres=gpu:h100:8`, `a100_80gb`, `--gpu h200`) read.

The patterns match lowercased text and the first match wins, so variants come before the plain
name (H100 NVL and PCIe before H100, GH200 before H200), and \\b keeps L4 from matching L40 and
A10 from A100 or the A10G (whose peaks are not published).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Of the datasheet's bf16 peak, what the preflight's 8192 x 8192 bf16 product reaches on an H100:
# a cluster's measured GEMM rate is read against this (GPU.compute_scale).
GEMM_EFFICIENCY = 0.72


@dataclass(frozen=True)
class GPU:
    """A GPU's datasheet figures: memory, dense tensor-core peaks, and the bandwidth one GPU has
    to its node's others (NVLink or PCIe, one direction) and to other nodes (its share of the
    network; None where the planner has no figure). Where a job's preflight measured the cluster
    (training/preflight.record_cluster), its bf16 GEMM rate and its all-reduce bus bandwidths
    inside and across nodes, which replace them (login/plan.measured)."""
    name: str
    memory_gib: float
    bf16_tflops: float | None  # bf16/fp16 tensor cores (V100: fp16 alone); None: not published
    fp8_tflops: float | None  # None: no FP8 tensor cores
    nvlink_gbs: float | None
    network_gbs: float | None
    gemm_tflops: float | None = None
    intra_gbs: float | None = None
    inter_gbs: float | None = None
    measured: str = ""  # where the measurements come from; "": the datasheet alone
    tf32_tflops: float | None = None  # None: no TF32 units
    fp32_tflops: float | None = None
    host_serial: bool = False  # the host is the device (a CPU): its dispatch and collectives hide behind nothing
    # What an all-gather or reduce-scatter reaches of the all-reduce's bus bandwidth on the same
    # links: about 1 under NCCL; gloo's are slower (its reduce-scatter is an all-reduce), measured
    # by bench/plan.py on a CPU.
    gather_scale: float = 1.0
    # The host's time for a layer's dispatch against the CPU login/plan.py's host figures were
    # measured on: 2 where two processes share each core (bench/plan.py's four on two).
    host_scale: float = 1.0

    @property
    def compute_scale(self) -> float:
        """The measured GEMM rate against the datasheet's expectation (1: none measured)."""
        return self.gemm_tflops / (self.bf16_tflops * GEMM_EFFICIENCY) if self.gemm_tflops else 1.0

    @property
    def plannable(self) -> bool:
        """Whether the planner can cost it: a bf16 peak and a network figure."""
        return self.bf16_tflops is not None and self.network_gbs is not None

    def peak_tflops(self, precision: str, tf32: bool) -> float | None:
        """The peak a step in `precision` can reach (fp32 with TF32 allowed: the TF32 units)."""
        if precision in ("bf16", "fp16"):
            return self.bf16_tflops
        return (tf32 and self.tf32_tflops) or self.fp32_tflops


# Network: one 400 Gb/s InfiniBand NIC per GPU (50 GB/s) on H100/H200/B200 nodes, 200 Gb/s on
# A100s; PCIe cards see each other at PCIe 4.0 x16 (32 GB/s).
# name, GiB, bf16, fp8, NVLink, network, then TF32 and fp32 (TFLOP/s; GB/s)
GPUS = [
    (r"h100[-_ ]?nvl", GPU("H100 NVL", 94, 835, 1670, 300, 50, tf32_tflops=418, fp32_tflops=60)),
    (r"h100[-_ ]?pcie", GPU("H100 PCIe", 80, 756, 1513, 64, 25, tf32_tflops=378, fp32_tflops=51)),
    (r"gh200", GPU("GH200", 96, 989, 1979, 450, 50, tf32_tflops=495, fp32_tflops=67)),
    (r"h200[-_ ]?nvl", GPU("H200 NVL", 141, 835, 1670, 450, 50, tf32_tflops=418, fp32_tflops=60)),
    (r"h200", GPU("H200", 141, 989, 1979, 450, 50, tf32_tflops=495, fp32_tflops=67)),
    (r"h100", GPU("H100", 80, 989, 1979, 450, 50, tf32_tflops=495, fp32_tflops=67)),
    (r"b200", GPU("B200", 180, 2250, 4500, 900, 50, tf32_tflops=1100, fp32_tflops=75)),
    (r"a100[-_ ]?((sxm4?|pcie)[-_ ]?)?80", GPU("A100 80GB", 80, 312, None, 300, 25, tf32_tflops=156,
                                                fp32_tflops=19.5)),
    (r"a100", GPU("A100 40GB", 40, 312, None, 300, 25, tf32_tflops=156, fp32_tflops=19.5)),
    (r"l40s", GPU("L40S", 48, 362, 733, 32, 25, tf32_tflops=183, fp32_tflops=91.6)),
    (r"l40\b", GPU("L40", 48, 181, 362, 32, None, tf32_tflops=90.5, fp32_tflops=90.5)),
    (r"a40\b", GPU("A40", 48, 150, None, 56, None, tf32_tflops=75, fp32_tflops=37.4)),
    (r"\bl4\b", GPU("L4", 24, 121, 242, 32, None, tf32_tflops=60, fp32_tflops=30.3)),
    (r"\ba10\b", GPU("A10", 24, 125, None, 32, None, tf32_tflops=62.5, fp32_tflops=31.2)),
    (r"\ba10g\b", GPU("A10G", 24, None, None, 32, None)),
    (r"v100[-_ ]?((sxm2|pcie)[-_ ]?)?32", GPU("V100 32GB", 32, 125, None, 150, None, fp32_tflops=15.7)),
    (r"v100", GPU("V100 16GB", 16, 125, None, 150, None, fp32_tflops=15.7)),
    (r"mi300x", GPU("MI300X", 192, 1307, 2615, 448, 50, tf32_tflops=654, fp32_tflops=163)),
    # torch sees each of an MI250's two dies as a device (64 GiB); AMD publishes the package's peaks
    (r"mi250x?", GPU("MI250", 64, None, None, None, None)),
]


def gpu_called(text: str) -> GPU | None:
    """The first GPU whose pattern `text` (a device name, a Slurm spelling, a config's slurm
    section) matches; None for one not listed."""
    text = text.lower()
    return next((gpu for pattern, gpu in GPUS if re.search(pattern, text)), None)

