"""parallel/dims.py, in one process: every degree of parallelism decided in one place, the
data-parallel ranks the batch is shared over, and the one-line refusals."""

from __future__ import annotations

import pytest
import yaml

from conftest import tiny_config
from llmtrain.config import ConfigError, load_config
from llmtrain.data.loader import StepSampler
from llmtrain.login.estimate import shard_size
from llmtrain.parallel.dims import ParallelDims


def config(tmp_path, nodes=2, procs=4, **parallel):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tiny_config(parallel=parallel, slurm={"nodes": nodes, "procs_per_node": procs,
                                                                         "gpus_per_node": 0},
                                               train={"global_batch_size": 16, "micro_batch_size": 2})))
    return load_config(path)


@pytest.mark.parametrize("parallel,replicate,shard,text", [
    ({"strategy": "ddp"}, 8, 1, "ddp over 8 ranks"),
    ({"strategy": "fsdp"}, 1, 8, "fsdp over 8 ranks"),
    ({"strategy": "hsdp"}, 2, 4, "hsdp over 8 ranks (2 replicas x 4-way shards)"),  # a node's processes
    ({"strategy": "hsdp", "shard_size": 2}, 4, 2, "hsdp over 8 ranks (4 replicas x 2-way shards)"),
])
def test_the_degrees_of_each_strategy(tmp_path, parallel, replicate, shard, text):
    cfg = config(tmp_path, **parallel)
    dims = ParallelDims.from_config(cfg, cfg.world_size)
    assert (dims.replicate, dims.shard, dims.dp, dims.problems()) == (replicate, shard, 8, [])
    assert dims.describe() == text
    assert [dims.dp_rank(r) for r in range(8)] == list(range(8))  # only data parallel: rank = dp rank
    assert shard_size(cfg, cfg.world_size) == shard  # the estimator asks the same object


def test_under_torchrun_a_nodes_processes_are_its_local_world(tmp_path):
    """In a job, hsdp's default shard group is torchrun's LOCAL_WORLD_SIZE (distributed.init
    passes it), which wins over the slurm section's count."""
    cfg = config(tmp_path, strategy="hsdp")
    assert ParallelDims.from_config(cfg, 8, procs_per_node=2).shard == 2
    assert ParallelDims.from_config(cfg, 8).shard == 4


def test_with_tensor_and_context_parallel_the_batch_is_shared_over_data_parallel_ranks_only():
    """The slots for the next wave: 16 ranks as replicate 2 x shard 2 x context 2 x tensor 2.
    Ranks that differ only in their context or tensor coordinate train on the same samples."""
    dims = ParallelDims(16, "hsdp", replicate=2, shard=2, context=2, tensor=2)
    assert dims.problems() == [] and dims.dp == 4
    assert [dims.dp_rank(r) for r in range(16)] == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    sampler = StepSampler(1000, 16, 7, 0, dims.dp)
    batch = sampler.next_global()
    shares = [StepSampler(1000, 16, 7, dims.dp_rank(r), dims.dp).share(batch).tolist() for r in range(16)]
    assert shares[0] == shares[1] == shares[2] == shares[3]  # one data-parallel rank's group
    assert len({tuple(s) for s in shares}) == 4
    assert sorted(i for s in shares[::4] for i in s) == sorted(batch.tolist())  # every sample once


def test_degrees_that_do_not_multiply_to_the_world_are_one_line():
    dims = ParallelDims(8, "fsdp", shard=2, tensor=2)
    assert dims.problems() == [
        "parallel: the degrees multiply to 4 (pipeline 1 x replicate 1 x shard 2 x context 1 x tensor 2), "
        "not the world size 8; change them or the processes (slurm.nodes x slurm.procs_per_node)"]


def test_a_shard_group_that_does_not_divide_the_world_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"parallel.shard_size: must divide the world size 8 \(got 3\); hsdp "
                                          r"shards within groups of shard_size ranks and replicates across them"):
        config(tmp_path, strategy="hsdp", shard_size=3)
