"""The preflight's verdict (training/preflight.py) and what a slow_node stop asks of Slurm
(login/slurm.py, the CLI train.slurm runs), in-process; the jobs: tests/test_slurm.py."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import yaml

from conftest import tiny_config
from llmtrain.cli import main
from llmtrain.training.preflight import by_node, describe_bw, matmul_tflops, record_cluster, slow_nodes, verdict


@pytest.mark.parametrize("figures,slow", [
    ({"node1": 1.05, "node2": 0.21}, {"node2": 1.05}),  # two nodes: against the other one
    ({"node1": 1.0, "node2": 0.75}, {}),  # within 0.7x
    ({"node1": 1.0, "node2": 0.7}, {}),  # at the ratio is not below it
    ({"node1": 0.3}, {}),  # one node: nothing to compare
    # many: against the median of the others, which one slow node does not drag down
    ({"a": 1.0, "b": 1.1, "c": 0.9, "d": 1.0, "e": 0.5}, {"e": 1.0}),
    ({"a": 1.0, "b": 1.0, "c": 0.2, "d": 0.2}, {"c": 1.0, "d": 1.0}),  # the others: 1, 1, 0.2
])
def test_a_node_below_the_ratio_times_the_other_nodes_median_is_slow(figures, slow):
    assert slow_nodes(figures, 0.7) == pytest.approx(slow)


def test_more_threads_than_cores_alone_do_not_make_a_node_slow():
    """Two CPU nodes alike but for their processes' thread counts: one thread, and eight times as
    many threads as this machine has cores (the local cluster's two fake nodes given 8 CPUs each
    on a 2-core box). Timed on their training threads, the crowded one looked about half as fast
    and was named slow; timed on one thread each, neither is, and training keeps its threads."""
    import torch
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = matmul_tflops(torch.device("cpu"))
        crowded_threads = 8 * len(os.sched_getaffinity(0))
        torch.set_num_threads(crowded_threads)
        crowded = matmul_tflops(torch.device("cpu"))
        assert torch.get_num_threads() == crowded_threads
    finally:
        torch.set_num_threads(before)
    assert slow_nodes({"node1": crowded, "node2": alone}, 0.7) == {}, (crowded, alone)
    assert slow_nodes({"node1": alone, "node2": crowded}, 0.7) == {}, (crowded, alone)


def test_a_node_is_as_fast_as_its_slowest_rank_and_the_line_names_it(tmp_path):
    """One throttled GPU sets the pace of a synchronous job: node2's rank 3 makes node2 slow."""
    ranks = [{"rank": r, "local_rank": r % 2, "node": f"node{r // 2 + 1}", "matmul_tflops": tf,
              "intra_node_busbw_gbps": 10.0, "inter_node_busbw_gbps": 2.0} for r, tf in enumerate([1.0, 1.1, 1.0, 0.3])]
    nodes = by_node(ranks)
    assert nodes["node2"]["ranks"] == [2, 3] and nodes["node2"]["matmul_tflops"] == 0.3
    assert nodes["node2"]["matmul_tflops_median"] == pytest.approx(0.65)
    slow = slow_nodes({node: n["matmul_tflops"] for node, n in nodes.items()}, 0.7)
    path = tmp_path / "preflight" / "7-0.json"
    assert verdict(nodes, slow, 0.7, False, path) == (
        f"preflight: node2 is slow: 0.3 TFLOP/s matmul vs 1 on the others (below 0.7x); training on "
        f"it anyway (slurm.exclude_slow_nodes: true leaves it out); figures in {path}")
    assert "stopping before training (slurm.exclude_slow_nodes): the job asks to come back without it" \
        in verdict(nodes, slow, 0.7, True, path)
    assert describe_bw(nodes["node1"]) == "10 GB/s inside the node, 2 across nodes (bus bandwidth)"


def test_the_cluster_record_gives_the_planner_the_nodes_median_figures(home, monkeypatch):
    """$LLMTRAIN_HOME/cluster/<device>.json: the median node's matmul and the median rank's
    bandwidths, which llmtrain plan takes over the datasheet's (tests/test_plan.py)."""
    ranks = [{"rank": r, "node": f"node{r // 2 + 1}", "matmul_tflops": tf, "intra_node_busbw_gbps": 10.0 + r,
              "inter_node_busbw_gbps": 2.0} for r, tf in enumerate([1.0, 1.1, 0.9, 0.3, 0.8, 0.8])]
    record_cluster(torch.device("cpu"), "17", by_node(ranks), ranks)
    record = json.loads((home / "cluster" / "cpu.json").read_text())
    assert (record["device_name"], record["job_id"], record["nodes"], record["ranks_per_node"]) == ("cpu", "17", 3, 2)
    assert record["matmul_tflops"] == 0.8  # nodes at 1.0, 0.3 and 0.8: their slowest ranks
    assert (record["intra_node_busbw_gbps"], record["inter_node_busbw_gbps"]) == (12.5, 2.0)


@pytest.fixture
def stopped(tmp_path, home):
    """A frozen config with a user's --exclude, and its run's record of a slow_node stop in job 7."""
    cfg = tiny_config(run={"name": "slurm", "dir": str(tmp_path / "runs")},
                      data={"prepared_dir": str(tmp_path / "prepared")},
                      slurm={"nodes": 2, "procs_per_node": 1, "max_requeues": 2,
                             "extra_args": ["--exclude=node3"]})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cfg))
    control = tmp_path / "runs" / "slurm" / "control"
    control.mkdir(parents=True)
    (control / "exit.json").write_text(json.dumps(
        {"reason": "slow_node", "step": 40, "requeue": True, "job_id": "7",
         "exclude": ["node2", "node3"]}))
    return path, control.parent


def test_a_slow_node_stop_comes_back_as_a_continuation_without_it(stopped, tmp_path, monkeypatch, capfd):
    """What train.slurm runs after its step (`llmtrain requeue`), with sbatch and scontrol
    recording their calls: no requeue in place (Slurm keeps a running job's ExcNodeList), a
    continuation job with the trainer's list after the user's own --exclude (the last one wins)."""
    config, run_dir = stopped
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, reply in (("sbatch", "99;cluster"), ("scontrol", "")):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "$@" >>"{tmp_path}/{tool}.calls"\necho "{reply}"\n')
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")

    def requeue(job: str, restarts: int) -> str:
        capfd.readouterr()
        assert main(["requeue", str(run_dir), job, "--config", str(config), "--script", "train.slurm",
                     "--restarts", str(restarts), "--max-requeues", "2", "--", "--resume-hint"]) == 0
        return re.sub(r"^\d\d:\d\d:\d\d ", "", capfd.readouterr().out, flags=re.MULTILINE)

    assert requeue("7", 1) == (
        "requeueing job 7 without node2, node3 (slow in the preflight) as a continuation job (requeue 2 "
        "of at most 2)\nslow node left out; submitted continuation job 99 (starts when this job ends)\n")
    assert not (tmp_path / "scontrol.calls").exists()
    sbatch = (tmp_path / "sbatch.calls").read_text()
    assert "--exclude=node3 --exclude=node2,node3 --dependency=afterany:7 train.slurm --resume-hint" in sbatch
    # Out of requeues, nothing comes back; another job's stop is not this job's to act on.
    assert requeue("7", 2).startswith("not requeueing: the job was requeued 2 times already")
    assert requeue("8", 0) == ""
    assert (tmp_path / "sbatch.calls").read_text() == sbatch and not (tmp_path / "scontrol.calls").exists()
