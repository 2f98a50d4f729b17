"""Throughput and MFU arithmetic, on a clock the test controls."""

from __future__ import annotations

import pytest

from llmtrain import metrics
from llmtrain.metrics import Throughput


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
