"""Throughput and MFU arithmetic, on a clock the test controls."""

from __future__ import annotations

import json

import pytest

from llmtrain import metrics
from llmtrain.metrics import MetricsWriter, Throughput, peak_flops, peak_tflops


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    return now


def test_evaluation_between_two_readings_neither_inflates_nor_deflates_tokens_per_sec(clock):
    meter = Throughput(tokens_per_step=1000, flops_per_step=1e12, peak=1e14, world_size=2,
                       first_step=0, total_steps=100)
    for _ in range(2):  # two steps of 1 s
        clock[0] += 1
        meter.step()
    with meter.paused():  # a 5-second evaluation
        clock[0] += 5
    for _ in range(2):
        clock[0] += 1
        meter.step()
    out = meter.read(4)
    # 4 steps in 4 s of training: 1000 tok/s (counting only the steps after the pause gave 2x).
    assert out["tokens_per_sec"] == pytest.approx(1000)
    assert out["mfu"] == pytest.approx(1e12 / 2e14)
    clock[0] += 2
    meter.step()
    assert meter.read(5)["tokens_per_sec"] == pytest.approx(500)  # a new window, no pause in it


@pytest.mark.parametrize("name,precision,tf32,expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", True, 989),  # the SXM part
    ("NVIDIA H100 PCIe", "bf16", True, 756),
    ("NVIDIA H100 NVL", "fp16", True, 835),
    ("NVIDIA H200", "bf16", True, 989),
    ("NVIDIA GH200 480GB", "bf16", True, 989),
    ("NVIDIA A100-SXM4-80GB", "fp32", True, 156),  # TF32 tensor cores
    ("NVIDIA A100 80GB PCIe", "fp32", False, 19.5),  # plain fp32
    ("NVIDIA L40S", "bf16", True, 362),
    ("NVIDIA L40", "bf16", True, 181),  # not the L4's
    ("NVIDIA L4", "bf16", True, 121),
    ("NVIDIA A10", "bf16", True, 125),
    ("NVIDIA A10G", "bf16", True, None),  # not the A10's: unpublished
    ("Tesla V100-SXM2-32GB", "fp32", True, 15.7),  # no TF32 units
    ("NVIDIA GeForce RTX 4090", "bf16", True, None),
])
def test_the_peak_is_the_exact_parts_at_the_precision_trained(name, precision, tf32, expected):
    assert peak_tflops(name, precision, tf32) == expected


def test_a_peak_set_in_the_config_wins_on_any_device():
    import torch
    assert peak_flops(torch.device("cpu")) is None
    assert peak_flops(torch.device("cpu"), "bf16", True, override_tflops=2.5) == 2.5e12


def test_a_failing_tracker_is_dropped_with_a_warning_and_the_jsonl_goes_on(tmp_path):
    class Broken:
        def log(self, record):
            raise OSError("disk quota exceeded")

        def close(self, failed=False):
            raise AssertionError("a dropped tracker is not closed")

    warnings = []
    writer = MetricsWriter(tmp_path / "metrics.jsonl", 0, [Broken()], warn=warnings.append)
    for step in (1, 2):
        writer.write({"kind": "train", "step": step, "loss": 1.0})
    writer.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert warnings == ["warning: Broken failed (OSError: disk quota exceeded); training goes on without "
                        "it (metrics.jsonl has every step)"]

    # After a stop signal (scancel, preemption) the tracker's service died of the same SIGTERM:
    # a plain line, not a failure warning in a log that should read as a clean stop.
    said = []
    writer = MetricsWriter(tmp_path / "again.jsonl", 0, [Broken()], warn=said.append, stopping=lambda: True)
    writer.write({"kind": "train", "step": 1, "loss": 1.0})
    assert said == ["Broken: its service ended with the stop signal; the steps from here on are in "
                    "metrics.jsonl only"]

    # The service may also die between the last step and the close (scancel during the save).
    class Unfinished:
        def log(self, record):
            pass

        def close(self, failed=False):
            raise ConnectionResetError(104, "Connection reset by peer")

    said = []
    writer = MetricsWriter(None, 0, [Unfinished()], warn=said.append, stopping=lambda: True)
    writer.write({"kind": "train", "step": 1, "loss": 1.0})
    writer.close()
    assert said == ["Unfinished: its service ended with the stop signal before it closed; metrics.jsonl "
                    "has every step (the next launch logs them again)"]
    said = []
    writer = MetricsWriter(None, 0, [Unfinished()], warn=said.append)
    writer.close()
    assert said == ["warning: Unfinished did not close cleanly (ConnectionResetError: [Errno 104] Connection "
                    "reset by peer)"]


def test_provenance_never_carries_a_value_exported_to_the_job(monkeypatch):
    from llmtrain.rundir import provenance

    monkeypatch.setenv("SLURM_EXPORT_ENV", "ALL,WANDB_API_KEY=abc123secret,HF_TOKEN=hf_xyz")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    slurm = provenance(1, ["node1"])["slurm"]
    assert slurm["SLURM_EXPORT_ENV"] == "ALL,WANDB_API_KEY=<redacted>,HF_TOKEN=<redacted>"
    assert slurm["SLURM_JOB_ID"] == "4242" and "abc123secret" not in json.dumps(slurm)


def test_a_collapse_of_tokens_per_second_is_flagged_once_until_it_recovers():
    """Windows of tokens/s, 10 s each: the first (start-up, compilation) is no reference; windows
    under a third of the typical one (the median so far), 3 in a row and for 60 s, are flagged,
    once; a short slow stretch, as a shared machine gives (3,824 against 11,715 in one window of
    a CI run of the demo), is not; after the speed came back above half the typical one, a new
    collapse is flagged again."""
    from llmtrain.metrics import Slowdown
    watch = Slowdown()
    speeds = (100, 17_000, 3_824, *[17_000] * 5, *[900] * 7, *[17_000] * 10, *[900] * 6)
    said = [watch.check(speed, 10.0 * (i + 1)) for i, speed in enumerate(speeds)]
    assert [i for i, line in enumerate(said) if line] == [13, 30]  # 60 s in (not window 2), once; again
    assert said[13] == ("warning: 900 tokens/s for 60 s, under 1/3 of this run's typical 17,000: is another job "
                        "using the same cores or GPUs (top, nvidia-smi)? See doc/operations.md, 'A slow or shared "
                        "machine'")
