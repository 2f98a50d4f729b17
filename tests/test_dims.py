"""parallel/dims.py, in one process: every degree of parallelism decided in one place, the
data-parallel ranks the batch is shared over, and the one-line refusals."""

from __future__ import annotations

import contextlib

import pytest
import yaml

from conftest import cli, tiny_config
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


@pytest.mark.parametrize("parallel,replicate,shard,text", [
    ({"strategy": "fsdp", "tp": 2}, 1, 4, "fsdp over 8 ranks (mesh: dp_shard 4 x tp 2)"),
    ({"strategy": "hsdp", "tp": 2}, 2, 2, "hsdp over 8 ranks (mesh: dp_replicate 2 x dp_shard 2 x tp 2)"),
])
def test_tensor_parallel_takes_its_ranks_from_the_data_parallel_degree(tmp_path, parallel, replicate, shard, text):
    """parallel.tp ranks of a node form a group; the data-parallel degree is world / tp (hsdp's
    default shard group: a node's 4 processes / tp 2 = 2), and ranks of a group share samples."""
    cfg = config(tmp_path, **parallel)
    dims = ParallelDims.from_config(cfg, cfg.world_size)
    tp = parallel["tp"]
    assert (dims.replicate, dims.shard, dims.tensor, dims.dp, dims.problems()) == (replicate, shard, tp, 8 // tp, [])
    assert dims.describe() == text
    assert [dims.dp_rank(r) for r in range(8)] == [r // tp for r in range(8)]


def tp_config(tmp_path, *sets, nodes=2, procs=4, **sections):
    path = tmp_path / "config.yaml"
    cfg = tiny_config(slurm={"nodes": nodes, "procs_per_node": procs, "gpus_per_node": 0},
                      train={"global_batch_size": 16, "micro_batch_size": 2}, **sections)
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path, list(sets))


@pytest.mark.parametrize("sets,line", [
    (["parallel.strategy=fsdp", "parallel.tp=8"],  # 2 nodes x 4: a group of 8 would cross nodes
     "parallel.tp: must divide a node's 4 processes (got 8); a tensor-parallel group talks every layer and "
     "stays inside a node"),
    (["parallel.strategy=fsdp", "parallel.tp=3"], "parallel.tp: must divide the world size 8 (got 3)"),
    (["parallel.tp=2"],
     "parallel.tp: with 4 data-parallel ranks, tensor parallel needs parallel.strategy fsdp or hsdp (got ddp); "
     "or set parallel.tp to the world size 8"),
    (["parallel.strategy=fsdp", "parallel.tp=2", "data.seq_len=63"],
     "data.seq_len: must be divisible by parallel.tp 2 (got 63); between layers each rank of a tensor-parallel "
     "group holds seq_len / tp tokens"),
    (["parallel.strategy=fsdp", "parallel.tp=2", "train.global_batch_size=12"],
     "train.global_batch_size: must be divisible by micro_batch_size x data-parallel ranks (world size / "
     "parallel.tp) = 2 x 4 = 8 (got 12)"),
    (["parallel.strategy=fsdp", "parallel.tp=2", "train.chunked_loss=false"],
     "train.chunked_loss: tensor parallel computes the loss from each rank's slice of the vocabulary, chunk by "
     "chunk; set train.chunked_loss: true (got false)"),
    (["parallel.strategy=fsdp", "parallel.tp=4"],  # the tiny model: 4 heads, 2 kv heads
     "parallel.tp: must divide the model's num_key_value_heads 2 (got 4); each rank holds num_key_value_heads "
     "/ tp of them"),
    (["parallel.strategy=fsdp", "parallel.tp=4", "model.architecture.num_attention_heads=6",
      "model.architecture.head_dim=16"],  # the first key (head_dim: 6 heads of 16 from a 64-wide stream)
     "parallel.tp: must divide the model's num_attention_heads 6 (got 4); each rank holds num_attention_heads "
     "/ tp of them"),
    # context parallel
    (["parallel.strategy=fsdp", "parallel.cp=2", "parallel.tp=2", "data.seq_len=36"],
     "data.seq_len: must be divisible by 2 x parallel.cp x parallel.tp = 8 (got 36); each context-parallel "
     "rank takes 2 of 2 x cp chunks of a sequence"),
    (["parallel.strategy=fsdp", "parallel.cp=3"], "parallel.cp: must divide the world size / parallel.tp = 8 (got 3)"),
    (["parallel.strategy=fsdp", "parallel.cp=2", "model.attn_implementation=eager"],
     "model.attn_implementation: context parallel attends with sdpa over the gathered keys and values (got "
     "eager); set model.attn_implementation: sdpa"),
    (["parallel.strategy=fsdp", "parallel.cp=2", "train.compile=true"],
     "train.compile: not with context parallel yet (its attention gathers keys and values between ranks); set "
     "train.compile: false with parallel.cp > 1"),
    (["parallel.cp=2", "parallel.tp=2"],
     "parallel.tp: with 4 data-parallel and context-parallel ranks, tensor parallel needs parallel.strategy fsdp "
     "or hsdp (got ddp); or set parallel.tp to the world size 8"),
])
def test_a_layout_that_cannot_work_is_one_line_from_check_config(tmp_path, sets, line):
    with pytest.raises(ConfigError) as e:
        tp_config(tmp_path, *sets)
    assert e.value.problems == [line]


def test_context_parallel_ranks_sit_between_the_shards_and_tensor_parallel(tmp_path):
    """16 ranks (2 nodes x 8), fsdp x cp 2 x tp 2: 4 data-parallel ranks; a step's loss adds
    the 4 x 2 ranks' parts (each half of its sequences)."""
    cfg = tp_config(tmp_path, "parallel.strategy=fsdp", "parallel.cp=2", "parallel.tp=2", procs=8)
    dims = ParallelDims.from_config(cfg, 16)
    assert (dims.shard, dims.context, dims.tensor, dims.dp, dims.loss_ranks) == (4, 2, 2, 4, 8)
    assert dims.describe() == "fsdp over 16 ranks (mesh: dp_shard 4 x cp 2 x tp 2)"
    assert [dims.dp_rank(r) for r in range(16)] == [r // 4 for r in range(16)]


def test_a_model_without_a_tensor_parallel_plan_is_refused(tmp_path):
    arch = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}
    with pytest.raises(ConfigError) as e:
        tp_config(tmp_path, "parallel.strategy=fsdp", "parallel.tp=2", model={"architecture": arch})
    assert e.value.problems == ["parallel.tp: no tensor-parallel plan for model type 'gpt2' (known: llama, mistral, "
                                "mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe); set parallel.tp: 1"]


def test_a_local_run_takes_any_tp_dividing_its_processes(tmp_path):
    """A local run (--nproc) is one node: no Slurm per-node count to respect."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tiny_config(parallel={"tp": 2})))
    cfg = load_config(path, world_size=2)
    assert ParallelDims.from_config(cfg, 2).describe() == "tensor parallel over 2 ranks (mesh: tp 2; no data parallelism)"


EIGHT_HEADS = {"architecture": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8,
                                "max_position_embeddings": 128, "tie_word_embeddings": False}}  # tp 8 divides


@pytest.mark.parametrize("sets,line", [
    # 8 nodes x 8, tp 8: a node holds one data-parallel rank, its default group would shard nothing
    (["parallel.tp=8"],
     "parallel.shard_size: must be set for hsdp when a node holds fewer than 2 data-parallel ranks (its 8 "
     "processes / (tp 8 x cp 1) = 1; not set); set a divisor of the 8 data-parallel ranks: 2, 4 or 8 shard "
     "across nodes (8: as fsdp), 1 replicates the whole model on every GPU"),
    # cp 2 x tp 8 spans two nodes: before, "must divide the 4 data-parallel ranks (...; got 0)"
    (["parallel.tp=8", "parallel.cp=2"],
     "parallel.shard_size: must be set for hsdp when a node holds fewer than 2 data-parallel ranks (its 8 "
     "processes / (tp 8 x cp 2) = 0.5; not set); set a divisor of the 4 data-parallel ranks: 2 or 4 shard across "
     "nodes (4: as fsdp), 1 replicates the whole model on every GPU"),
    # no tp: nodes of one GPU each
    (["slurm.procs_per_node=1", "slurm.nodes=4"],
     "parallel.shard_size: must be set for hsdp when a node holds fewer than 2 data-parallel ranks (its 1 "
     "process / (tp 1 x cp 1) = 1; not set); set a divisor of the 4 data-parallel ranks: 2 or 4 shard across "
     "nodes (4: as fsdp), 1 replicates the whole model on every GPU"),
])
def test_hsdp_asks_for_a_shard_size_where_a_nodes_default_would_shard_nothing(tmp_path, sets, line):
    """hsdp's default shard group is a node's data-parallel ranks; where tp x cp fill the node it
    would be one rank (every GPU the whole optimizer state) or none, so check-config asks for the
    key in one line, with the values that work, rather than replicate silently."""
    with pytest.raises(ConfigError) as e:
        tp_config(tmp_path, "parallel.strategy=hsdp", "train.global_batch_size=128", "train.eval_samples=64", *sets,
                  nodes=8, procs=8, model=EIGHT_HEADS)
    assert e.value.problems == [line]


@pytest.mark.parametrize("sets,replicate,shard,text", [
    ([], 8, 1, "hsdp over 64 ranks (mesh: dp_replicate 8 x dp_shard 1 x tp 8)"),  # replicas only: stated
    (["parallel.shard_size=4"], 2, 4, "hsdp over 64 ranks (mesh: dp_replicate 2 x dp_shard 4 x tp 8)"),
    (["parallel.shard_size=8"], 1, 8, "hsdp over 64 ranks (mesh: dp_replicate 1 x dp_shard 8 x tp 8)"),
    (["parallel.shard_size=2", "parallel.cp=2"], 2, 2,
     "hsdp over 64 ranks (mesh: dp_replicate 2 x dp_shard 2 x cp 2 x tp 8)"),
])
def test_the_start_up_line_states_hsdps_shard_group_under_tensor_parallel(tmp_path, sets, replicate, shard, text):
    """The shard size the run uses, set by the user, in the start-up log line; 1 too."""
    cfg = tp_config(tmp_path, "parallel.strategy=hsdp", "parallel.tp=8", "parallel.shard_size=1", *sets,
                    nodes=8, procs=8, model=EIGHT_HEADS)
    dims = ParallelDims.from_config(cfg, 64, procs_per_node=8)
    assert (dims.replicate, dims.shard, dims.problems()) == (replicate, shard, [])
    assert dims.describe() == text


def test_hsdps_default_still_shards_over_a_nodes_data_parallel_ranks(tmp_path, home):
    """tp 2 on nodes of 8: 4 data-parallel ranks a node, the default group; check-config says so.
    One data-parallel rank in all (tp 2 on 2 ranks) has nothing to shard: a group of 1, no refusal."""
    sets = ["parallel.strategy=hsdp", "parallel.tp=2", "train.global_batch_size=64", "train.eval_samples=32"]
    cfg = tp_config(tmp_path, *sets, nodes=8, procs=8, model=EIGHT_HEADS)
    dims = ParallelDims.from_config(cfg, 64)
    assert dims.describe() == "hsdp over 64 ranks (mesh: dp_replicate 8 x dp_shard 4 x tp 2)"
    proc = cli("check-config", "--config", tmp_path / "config.yaml", *(a for k in sets for a in ("--set", k)))
    assert proc.returncode == 0 and ", hsdp x tp 2 (4-way shards), fp32; run_dir: " in proc.stdout, proc.stderr
    assert (ParallelDims.from_config(cfg, 2, procs_per_node=2).shard, ParallelDims.from_config(cfg, 2).shard) == (1, 1)


@pytest.fixture
def fake_world(request):
    """A process group of `request.param` ranks in this process (torch's fake backend: the
    collectives' planning runs, none moves data), this process rank 1."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from llmtrain.parallel import dims
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=request.param)
    yield request.param
    dist.destroy_process_group()
    dims._meshes.cache_clear()  # its meshes hold this group's subgroups


@contextlib.contextmanager
def logged(name: str):
    """The records logger `name` handles meanwhile (after its filters: what reaches stderr)."""
    import logging
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("fake_world,dims,placements", [
    (4, ParallelDims(4, "fsdp", shard=2, tensor=2), ("S", "S")),
    (8, ParallelDims(8, "hsdp", replicate=2, shard=2, tensor=2), ("R", "S", "S")),
], indirect=["fake_world"])
def test_the_gradient_norm_under_fsdp2_x_tp_is_one_all_reduce_and_no_warning(fake_world, dims, placements):
    """A weight split by FSDP2 and tensor parallel (as step.py clips it): its gradient's norm is
    partial over both mesh dimensions; over the flattened (shard, tensor) dimension DTensor sums it
    in one all-reduce. Unflattened it took two in a row and torch warned on every rank at the first
    step ("2 sequential all_reduce operations ... flatten mesh dimensions")."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    from llmtrain.parallel.dims import Layout

    layout = Layout(dims, 1, "cpu")
    mesh = DeviceMesh._concatenate([layout.fsdp_mesh(), layout.mesh("tp")])  # where FSDP2 x tp puts the weights
    placed = [Replicate() if p == "R" else Shard(i % 2) for i, p in enumerate(placements)]
    params = [DTensor.from_local(torch.ones(4, 8), mesh, placed) for _ in range(2)]
    for p in params:
        p.grad = DTensor.from_local(torch.ones(4, 8), mesh, placed)
    with logged("torch.distributed.tensor._redistribute") as warned, CommDebugMode() as comm:
        torch.nn.utils.clip_grad_norm_(params, 1.0).full_tensor()
    assert {str(op): n for op, n in comm.get_comm_counts().items()} == {"c10d_functional.all_reduce": 1}
    assert [r.getMessage() for r in warned] == []


@pytest.mark.parametrize("fake_world", [2], indirect=True)
def test_the_cpu_all_to_all_fallback_is_not_announced_other_warnings_are(fake_world):
    """DTensor's Shard(0) -> Shard(1) on a CPU mesh all-gathers and chunks, and torch says so on
    every rank ("CPU process group does not support alltoall yet"): the trainer's start-up
    (distributed.init) drops that line, and only that one, from its logger."""
    import logging

    import torch
    from torch._logging._internal import warning_once
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from llmtrain.training.distributed import quiet_cpu_all_to_all

    logger = logging.getLogger("torch.distributed.tensor._collective_utils")
    saved = list(logger.filters)
    try:
        with logged(logger.name) as seen:
            quiet_cpu_all_to_all()
            warning_once.cache_clear()  # torch says it once per process: this test's must be the first
            mesh = init_device_mesh("cpu", (2,))
            DTensor.from_local(torch.ones(4, 4), mesh, [Shard(0)]).redistribute(mesh, [Shard(1)])
            logger.warning("another warning")
    finally:
        logger.filters[:] = saved
    assert [r.getMessage() for r in seen] == ["another warning"]


def test_the_layout_of_2048_ranks_cuts_every_role_from_one_mesh_with_groups_per_dimension_not_per_rank():
    """pp 2 x dp 64 x cp 2 x tp 8 (fsdp, so dp is the shard group) on torch's fake process group,
    rank 1234 in this process: each role's mesh holds the ranks the layout's order gives
    (rank = ((p x 64 + s) x 2 + c) x 8 + t), and the process groups this rank takes part in are
    as many as at 64 ranks: they grow with the mesh's dimensions, not with the ranks (today's
    context-parallel groups, enumerated by hand, were world / (cp x tp) = 128 world-wide splits)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from llmtrain.parallel import dims
    from llmtrain.parallel.dims import Layout

    def run(world, rank, shard):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            before = len(_world.pg_map)
            layout = Layout(ParallelDims(world, "fsdp", shard=shard, context=2, tensor=8, pipeline=2), rank, "cpu")
            meshes = {role: layout.mesh(role) for role in ("batch", "loss", "fsdp", "fsdp_tp", "pp", "cp", "tp")}
            roles = {role: f"{mesh.mesh.flatten().tolist()} {mesh.get_local_rank()} {layout.coordinate(role)}"
                     for role, mesh in meshes.items()}
            roles["fsdp_mesh"] = str(layout.fsdp_mesh().mesh.flatten().tolist())
            return len(_world.pg_map) - before, roles
        finally:
            dist.destroy_process_group()
            dims._meshes.cache_clear()  # its meshes hold this group's subgroups

    groups, roles = run(2048, 1234, 64)
    p, rest = divmod(1234, 1024)
    s, rest = divmod(rest, 16)
    c, t = divmod(rest, 8)
    assert (p, s, c, t) == (1, 13, 0, 2)
    rank = lambda p, s, c, t: ((p * 64 + s) * 2 + c) * 8 + t  # noqa: E731
    expected = {
        "batch": ([rank(p, x, c, t) for x in range(64)], s),
        "loss": ([rank(p, x, y, t) for x in range(64) for y in range(2)], s * 2 + c),
        "fsdp": ([rank(p, x, y, t) for x in range(64) for y in range(2)], s * 2 + c),
        "fsdp_tp": ([rank(p, x, y, z) for x in range(64) for y in range(2) for z in range(8)], (s * 2 + c) * 8 + t),
        "pp": ([rank(x, s, c, t) for x in range(2)], p),
        "cp": ([rank(p, s, y, t) for y in range(2)], c),
        "tp": ([rank(p, s, c, z) for z in range(8)], t),
    }
    for role, (ranks, place) in expected.items():
        assert roles[role] == f"{ranks} {place} {place}", role
    assert roles["fsdp_mesh"] == str(expected["fsdp"][0])  # fsdp shards within a stage, never over the world
    small, _ = run(64, 37, 2)
    assert groups == small <= 2 * len(expected)


def test_the_valid_layouts_of_64_gpus_are_the_layouts_check_config_accepts(tmp_path):
    """8 nodes of 8 GPUs, a Llama whose 8 key/value heads tp 16 cannot split: every candidate
    passes the layout's rules, tp stays inside a node, the pipeline and expert slots are 1, and
    a layout the rules refuse (ddp x tp 2 over 32 replicas, hsdp x tp 8 with no shard size) is not
    among them."""
    cfg = tp_config(tmp_path, "train.global_batch_size=128", "train.eval_samples=64", "data.seq_len=64", nodes=8,
                    procs=8)
    model = {"model_type": "llama", "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
             "intermediate_size": 28672}
    layouts = ParallelDims.candidates(cfg, 64, 8, "llama", model)
    names = [(d.strategy, d.tensor, d.context) for d in layouts]
    assert ("fsdp", 8, 2) in names and ("hsdp", 4, 1) in names and ("ddp", 1, 1) in names
    assert ("ddp", 2, 1) not in names and ("hsdp", 8, 1) not in names
    assert all(d.tensor <= 8 and d.pipeline == d.expert == 1 and d.world_size == 64 for d in layouts)
    assert all(not d.problems() and not d.model_problems("llama", model) for d in layouts)
    assert len(set(names)) == len(names)
