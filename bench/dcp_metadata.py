"""What a resume costs each rank at 256-2048 ranks: the DCP `.metadata` of a 405B checkpoint,
built as torch writes it, without the ranks.

    source workspace/llmtrain/env.sh
    python bench/dcp_metadata.py --layers 16 [--layouts 256x1 512x1 1024x1 2048x1 256x8]  # fsdp x tp
    python bench/dcp_metadata.py --layouts 256x1 512x1          # all 126 layers (2.2 / 4 GiB here)
    torchrun --standalone --nproc-per-node 2 bench/dcp_metadata.py --check 1   # vs a real save; 2: tp 2
    python bench/dcp_metadata.py --check-mesh                   # FSDP2 x TP chunks, fake 4 x 3 mesh

`.metadata` lists every saved chunk: for each sharded tensor (the parameters, AdamW's exp_avg and
exp_avg_sq) one per rank that holds a distinct shard, with its file, offset and length. torch's
dcp.load reads and unpickles it on every rank (2.13, state_dict_loader._load_state_dict:
`read_metadata()` in `local_step`), then gathers every rank's load plan on rank 0 and scatters
them back. Here each rank's items are those DefaultSavePlanner makes on it (the chunk DTensor
computes for FSDP2's Shard(0), or _StridedShard over tensor parallel's Shard(0) for parallel/
tensor.py's column-parallel layers, Shard(1) for the row-parallel ones), deduplicated and merged
as dedup_save_plans and create_default_global_save_plan do, with the objects the gathers'
unpickling leaves (each rank its own strings), the storage entries FileSystemWriter.finish adds,
pickled to a file as DCP pickles it. Fresh processes then load it (pickle.load, with Python's
collector on as in a training process, and off), plan one rank's reads
(create_default_local_load_plan), and price rank 0's gather of all plans from one plan. Memory
limits this machine to fewer layers at 1024+ ranks: every figure grows with the chunks, and the
"x" line scales a run of `--layers N` to all 126 by their count.

`--check` saves the demo Llama with llmtrain's Checkpointer on 2 ranks and compares its
.metadata with the simulation's (keys, chunks, bytes) and the simulation's merge with torch's
own merge of the same plans; `--check-mesh` compares the chunks of FSDP2 x TP DTensors with the
simulation's on torch's fake process group.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections import ChainMap
from functools import lru_cache
from pathlib import Path

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan, create_default_local_load_plan
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

REPO = Path(__file__).resolve().parents[1]
TORCH_SAVE_BYTES = 1577  # torch.save's zip around one tensor in a .distcp file (measured: 34,345 for 32 KiB)
PICKLED_VALUE_BYTES = 1100  # a param_groups value, torch.save'd
GATHER_SAMPLE = 32  # plans unpickled to price rank 0's gather of them all


@dataclasses.dataclass(frozen=True)
class Llama:
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    def parameters(self) -> list[tuple[str, tuple[int, ...], str | None]]:
        """(name, shape, how tp splits it) in named_parameters order: "rows" Shard(0) (column-parallel
        q/k/v/gate/up, the vocabulary of the embedding and head), "cols" Shard(1) (row-parallel o/down),
        None replicated (the norms, sequence-parallel)."""
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        out = [("model.embed_tokens.weight", (self.vocab, h), "rows")]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            f = self.ffn
            out += [(p + "self_attn.q_proj.weight", (h, h), "rows"), (p + "self_attn.k_proj.weight", (kv, h), "rows"),
                    (p + "self_attn.v_proj.weight", (kv, h), "rows"), (p + "self_attn.o_proj.weight", (h, h), "cols"),
                    (p + "mlp.gate_proj.weight", (f, h), "rows"), (p + "mlp.up_proj.weight", (f, h), "rows"),
                    (p + "mlp.down_proj.weight", (h, f), "cols"), (p + "input_layernorm.weight", (h,), None),
                    (p + "post_attention_layernorm.weight", (h,), None)]
        return out + [("model.norm.weight", (h,), None), ("lm_head.weight", (self.vocab, h), "rows")]


LLAMA_405B = Llama(hidden=16384, ffn=53248, layers=126, heads=128, kv_heads=8, vocab=128256)
DEMO = Llama(hidden=128, ffn=384, layers=2, heads=4, kv_heads=4, vocab=512)  # configs/demo.yaml
GROUP_KEYS = [k for k in torch.optim.AdamW([torch.zeros(1)]).param_groups[0] if k != "params"] + ["params"]


def placements(split: str | None, tp: int) -> list:
    """A parameter's placements on the (dp, tp) mesh as FSDP2 leaves them (_fsdp_param.py: a
    dp Shard(0) over a tp Shard(0) becomes _StridedShard(0, split_factor=tp))."""
    if tp == 1:
        return [Shard(0)]
    return {"rows": [_StridedShard(0, split_factor=tp), Shard(0)], "cols": [Shard(0), Shard(1)],
            None: [Shard(0), Replicate()]}[split]


@lru_cache(maxsize=None)
def chunk(shape: tuple, split: str | None, dp: int, tp: int, i: int, j: int) -> tuple[tuple, tuple]:
    """(sizes, offsets) of rank (dp i, tp j)'s shard: DTensor's own computation (what DCP calls)."""
    mesh, coord = ((dp,), [i]) if tp == 1 else ((dp, tp), [i, j])
    return _compute_local_shape_and_global_offset(shape, mesh, coord, placements(split, tp))


def rank_state(model: Llama, dp: int, tp: int, rank: int):
    """llmtrain's state on `rank` as DCP flattens it: {"model": get_state_dict's model, "optim":
    AdamW's (2 groups: the matrices, then the rest)}. Yields (key, path, kind, global shape, tp
    split, chunk sizes, chunk offsets); kind: "shard" (a DTensor's local chunk), "step" (a plain
    0-d tensor on every rank), "bytes" (a param_groups value)."""
    i, j = divmod(rank, tp)
    params = model.parameters()
    for name, shape, split in params:
        yield (f"model.{name}", ("model", name), "shard", shape, split, *chunk(shape, split, dp, tp, i, j))
    groups = [[p for p in params if len(p[1]) >= 2], [p for p in params if len(p[1]) < 2]]
    for group in groups:
        for name, shape, split in group:
            name = _own(name)  # the optimizer's state dict names it with a string of its own
            yield (f"optim.state.{name}.step", ("optim", "state", name, "step"), "step", (), None, (), ())
            for state in ("exp_avg", "exp_avg_sq"):
                yield (f"optim.state.{name}.{state}", ("optim", "state", name, state), "shard", shape, split,
                       *chunk(shape, split, dp, tp, i, j))
    for g in range(len(groups)):
        for key in GROUP_KEYS:
            yield (f"optim.param_groups.{g}.{key}", ("optim", "param_groups", g, key), "bytes", None, None, None, None)


def rank_plan(model: Llama, dp: int, tp: int, rank: int) -> SavePlan:
    """The SavePlan DefaultSavePlanner.create_local_plan makes on `rank` (its mappings: planner_data)."""
    items, mappings = [], {}
    for key, path, kind, shape, _, sizes, offsets in rank_state(model, dp, tp, rank):
        mappings[key] = path
        if kind == "bytes":
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
            continue
        offsets = torch.Size(offsets)
        items.append(WriteItem(index=MetadataIndex(key, offsets),
                               type=WriteItemType.SHARD if kind == "shard" else WriteItemType.TENSOR,
                               tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, torch.Size(sizes)),
                                                           properties=TensorProperties(dtype=torch.float32),
                                                           size=torch.Size(shape))))
    return SavePlan(items, planner_data=mappings)


def _roundtrip(obj):
    """What a gather or scatter of DCP's object collectives hands the other side."""
    return pickle.loads(pickle.dumps(obj))


def _length(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return PICKLED_VALUE_BYTES
    return item.tensor_data.chunk.sizes.numel() * 4 + TORCH_SAVE_BYTES


def _results(plan: SavePlan, rank: int) -> list[WriteResult]:
    """FileSystemWriter's WriteResults for the rank's final plan, one file per rank (thread_count 1)."""
    plan = _roundtrip(plan)  # the central plan, scattered back
    path, offset, results = f"__{rank}_0.distcp", 0, []
    for item in plan.items:
        length = _length(item)
        results.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=_StorageInfo(path, offset, length)))
        offset += length
    return _roundtrip(results)  # gathered on the coordinator


def _finish(md: dict, planner_data: dict, storage: dict, path: Path) -> Metadata:
    return Metadata(state_dict_metadata=md, planner_data=planner_data, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=path, save_id=str(uuid.uuid4())),
                    version=CURRENT_DCP_VERSION)


def metadata_by_torch(model: Llama, dp: int, tp: int, path: Path) -> Metadata:
    """DefaultSavePlanner.create_global_plan's own dedup and merge over every rank's plan: exact,
    but it holds every plan at once (use for small rank counts)."""
    plans = [_roundtrip(rank_plan(model, dp, tp, r)) for r in range(dp * tp)]
    plans, md = create_default_global_save_plan(dedup_save_plans(plans))
    merged = dict(ChainMap(*[p.planner_data for p in plans]))
    storage = {}
    for r, plan in enumerate(plans):
        storage.update({wr.index: wr.storage_data for wr in _results(plan, r)})
    return _finish(md.state_dict_metadata, merged, storage, path)


def metadata_streamed(model: Llama, dp: int, tp: int, path: Path) -> Metadata:
    """The same metadata built directly, one rank at a time, with the objects the gathers' unpickling
    leaves (each rank its own strings and sizes, one file name per rank): memory for the metadata
    alone. A duplicate goes where dedup_save_plans puts it: to the holder with the fewest bytes
    planned so far (WriteItem.tensor_storage_size: the global tensor's), in first-seen order."""
    world = dp * tp
    md, storage, planned, owners, paths, last_keys = {}, {}, [0] * world, {}, [], []
    for r in range(world):
        file, offset = f"__{r}_0.distcp", 0
        for key, path_, kind, shape, split, sizes, offsets in rank_state(model, dp, tp, r):
            if r == 0:
                paths.append(path_)
            if r == world - 1:
                last_keys.append(key)
            holders = _holders(model, dp, tp, r, kind, shape, split, sizes, offsets)
            weight = 1 if kind == "bytes" else max(1, torch.Size(shape).numel() * 4)
            if len(holders) == 1:
                planned[r] += weight
            else:
                if holders[0] == r:  # first seen here
                    owner = min(holders, key=planned.__getitem__)
                    planned[owner] += weight
                    owners[key, offsets] = owner
                if owners[key, offsets] != r:
                    continue
            if kind == "bytes":
                md[key] = BytesStorageMetadata()
                index, length = MetadataIndex(_own(key)), PICKLED_VALUE_BYTES
            else:
                entry = md.setdefault(key, TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                                 torch.Size(shape), []))
                index = MetadataIndex(_own(key), offsets, index=len(entry.chunks))
                entry.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
                length = torch.Size(sizes).numel() * 4 + TORCH_SAVE_BYTES
            storage[index] = _StorageInfo(file, offset, length)
            offset += length
    # dict(ChainMap(*the plans' mappings)): the last rank's keys, the first rank's paths
    return _finish(md, dict(zip(last_keys, paths)), storage, path)


def _holders(model: Llama, dp: int, tp: int, r: int, kind, shape, split, sizes, offsets):
    """The ranks whose plans hold the same item (fqn and offset) as rank r's."""
    if kind != "shard":
        return range(dp * tp)
    if torch.Size(sizes).numel() == 0:  # empty shards all start at the end
        return [q for q in range(dp * tp) if chunk(shape, split, dp, tp, *divmod(q, tp)) == (sizes, offsets)]
    if split is None and tp > 1:  # replicated over tp
        return range(r - r % tp, r - r % tp + tp)
    return (r,)


def _own(text: str) -> str:
    """An equal string that is another object, as each rank's unpickled copy is (pickle shares
    only the same object)."""
    return (text + " ")[:-1]


def count_chunks(model: Llama, dp: int, tp: int) -> int:
    """The chunks the layout's .metadata lists, counted without building it: each tensor's
    distinct shards, three times (the parameter, exp_avg, exp_avg_sq), and one per step count."""
    n = 0
    for _, shape, split in model.parameters():
        n += 3 * len({chunk(shape, split, dp, tp, *divmod(r, tp)) for r in range(dp * tp)}) + 1
    return n


def chunks(md: Metadata) -> int:
    return sum(len(v.chunks) for v in md.state_dict_metadata.values() if isinstance(v, TensorStorageMetadata))


class _Shard:
    """A rank's DTensor as create_default_local_load_plan sees it: its global size, its chunk."""

    def __init__(self, shape, sizes, offsets):
        self.shape, self.chunk = torch.Size(shape), ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))

    def size(self):
        return self.shape

    def __create_chunk_list__(self):
        return [self.chunk]


def load_and_plan(file: Path, model: Llama, dp: int, tp: int, rank: int, collect: bool) -> dict:
    """In a fresh process: read_metadata (pickle.load) and the rank's local load plan. collect:
    with Python's cyclic garbage collector on, as in a training process."""
    if not collect:
        gc.disable()
    rss0, c0 = _resident_gib(), time.process_time()
    with open(file, "rb") as f:
        md = pickle.load(f)
    load_cpu = time.process_time() - c0
    rss1 = _resident_gib()
    i, j = divmod(rank, tp)
    state = {}
    for fqn, value in md.state_dict_metadata.items():
        if isinstance(value, BytesStorageMetadata):
            state[fqn] = None
        elif len(value.size) == 0:
            state[fqn] = torch.zeros(())
        else:
            state[fqn] = _Shard(value.size, *chunk(tuple(value.size), _split_of(model, fqn), dp, tp, i, j))
    c1 = time.process_time()
    plan = create_default_local_load_plan(state, md)
    plan_cpu = time.process_time() - c1
    # DCP gathers every rank's plan on rank 0 (unpickled there) and scatters them back (pickled
    # again): what one plan costs rank 0, in CPU and memory, from a few copies.
    sent = pickle.dumps(plan)
    c2 = time.process_time()
    for _ in range(GATHER_SAMPLE):
        pickle.dumps(pickle.loads(sent))
    gather_cpu = (time.process_time() - c2) / GATHER_SAMPLE
    tracemalloc.start()
    copy = pickle.loads(sent)
    gather_gib = tracemalloc.get_traced_memory()[0] / 2**30
    tracemalloc.stop()
    del copy
    return {"load_cpu": load_cpu, "rss_gib": rss1 - rss0, "peak_gib": _resident_gib("VmHWM"),
            "plan_cpu": plan_cpu, "reads": len(plan.items), "plan_bytes": len(sent),
            "gather_cpu": gather_cpu * dp * tp, "gather_gib": gather_gib * dp * tp}


def _resident_gib(field: str = "VmRSS") -> float:
    """This process's resident memory now (VmRSS) or at its peak (VmHWM, which exec resets;
    ru_maxrss keeps the parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"no {field} in /proc/self/status")


@lru_cache(maxsize=1)
def _splits(model: Llama) -> dict:
    return {name: split for name, _, split in model.parameters()}


def _split_of(model: Llama, fqn: str):
    name = fqn.removeprefix("model.") if fqn.startswith("model.") else fqn.split(".", 2)[2].rsplit(".", 1)[0]
    return _splits(model)[name]


def measure(model: Llama, dp: int, tp: int, folder: Path, layers: int) -> dict:
    """Build and write the layout's .metadata, then load it in fresh processes (collector on, off)."""
    file = folder / ".metadata"
    t0 = time.perf_counter()
    md = metadata_streamed(model, dp, tp, folder)
    built_s = time.perf_counter() - t0
    n = chunks(md)
    with open(file, "wb") as f:
        pickle.dump(md, f)
    del md
    figures = {"chunks": n, "bytes": file.stat().st_size, "built_s": built_s}
    rank = dp * tp // 2 + 1  # a rank with whole shards (the last ranks' may be empty)
    for collect in (True, False):
        out = subprocess.run([sys.executable, __file__, "--load", str(file), "--dp", str(dp), "--tp", str(tp),
                              "--rank", str(rank), "--gc", "on" if collect else "off", "--layers", str(layers)],
                             capture_output=True, text=True, check=True)
        figures["gc" if collect else "nogc"] = json.loads(out.stdout)
    file.unlink()
    return figures


def check(tp: int) -> None:
    """Under torchrun, 2 ranks: a real save of the demo Llama (fsdp 2 / tp 1, or fsdp 1 / tp 2) by
    llmtrain's Checkpointer against the simulation of the same; and the simulation's merge
    against torch's own (dedup_save_plans + create_default_global_save_plan)."""
    import yaml

    from llmtrain.config import load_config
    from llmtrain.data.tokenizer import load_tokenizer
    from llmtrain.model.build import model_config
    from llmtrain.optimizers import build_optimizer
    from llmtrain.parallel.wrap import parallelize
    from llmtrain.rundir import Log
    from llmtrain.training import distributed
    from llmtrain.training.checkpoint import Checkpointer

    root = Path(tempfile.gettempdir()) / "llmtrain-dcp-metadata"
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    demo["model"]["tokenizer"] = str(REPO / "configs" / "demo" / "tokenizer")
    demo["data"]["dataset"] = str(REPO / "configs" / "demo" / "stories.txt")
    demo["run"] = {"name": f"tp{tp}", "dir": str(root)}
    demo["parallel"] = {"strategy": "fsdp", "tp": tp}
    config_path = root / f"tp{tp}-rank{os.environ['RANK']}.yaml"  # one each: no rank reads a half-written one
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(demo))
    cfg = load_config(config_path, world_size=2)
    world = distributed.init(cfg)
    try:
        config = model_config(cfg, load_tokenizer(cfg))
        model = parallelize(cfg, config, world)
        optimizer = build_optimizer(model, cfg.train, world.device)
        for param in model.parameters():  # one step makes AdamW's state; what it holds does not matter
            param.grad = torch.zeros_like(param)
        optimizer.step()
        ckpt = Checkpointer(cfg, world, Log(world.rank), {})
        shutil.rmtree(cfg.run_dir / "checkpoints" / "step-00000001", ignore_errors=True)
        ckpt.save(1, model, optimizer, {})
        if world.is_main:
            real_file = cfg.run_dir / "checkpoints" / "step-00000001" / ".metadata"
            real = pickle.loads(real_file.read_bytes())
            dp, n = 2 // tp, real_file.stat().st_size
            sim = metadata_streamed(DEMO, dp, tp, real_file.parent)
            sim_n = len(pickle.dumps(sim))
            torch_n = len(pickle.dumps(metadata_by_torch(DEMO, dp, tp, real_file.parent)))
            same = {k: sorted(map(str, getattr(v, "chunks", []))) for k, v in real.state_dict_metadata.items()} == \
                   {k: sorted(map(str, getattr(v, "chunks", []))) for k, v in sim.state_dict_metadata.items()}
            print(f"fsdp {dp} x tp {tp}, the demo Llama: real .metadata {n:,} bytes, {chunks(real)} chunks; "
                  f"simulated {sim_n:,} bytes ({sim_n / n - 1:+.2%}), {chunks(sim)} chunks, "
                  f"{'the same' if same else 'OTHER'} keys and chunks; torch's merge of the simulated plans "
                  f"{torch_n:,} bytes ({torch_n / sim_n - 1:+.2%})", flush=True)
    finally:
        distributed.teardown(world, True)


def check_mesh_rank(dp: int, tp: int, rank: int) -> int:
    """On torch's fake process group, as `rank` of a dp x tp mesh: a column- and a row-parallel
    linear and a sequence-parallel norm (parallel/tensor.py's styles), under FSDP2; how many of
    their chunks (what DCP saves) differ from chunk()'s."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_from_dtensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dp * tp)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    layers = torch.nn.Sequential(torch.nn.Linear(24, 37, bias=False), torch.nn.Linear(37, 24, bias=False),
                                 torch.nn.LayerNorm(24, bias=False))  # uneven: 37 rows over 12 ranks
    parallelize_module(layers, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel(), "2": SequenceParallel()})
    fully_shard(layers, mesh=mesh["dp"])
    wrong = 0
    for param, split in zip(layers.parameters(), ("rows", "cols", None)):
        real = _create_chunk_from_dtensor(param)
        wrong += (tuple(real.sizes), tuple(real.offsets)) != chunk(tuple(param.shape), split, dp, tp, *divmod(rank, tp))
    dist.destroy_process_group()
    return wrong


def check_mesh(dp: int = 4, tp: int = 3) -> None:
    """check_mesh_rank for every rank, each in a process of its own (DTensor caches a process's
    first coordinate)."""
    wrong = sum(int(subprocess.run([sys.executable, __file__, "--mesh-rank", str(r), "--dp", str(dp), "--tp", str(tp)],
                                   capture_output=True, text=True, check=True).stdout) for r in range(dp * tp))
    print(f"fsdp {dp} x tp {tp} on torch's fake process group: {wrong} of {3 * dp * tp} chunks differ from the "
          f"simulation's", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=["256x1", "512x1", "1024x1", "2048x1", "256x8"],
                    help="fsdp x tp, 405B")
    ap.add_argument("--layers", type=int, default=LLAMA_405B.layers,
                    help="of the 405B's 126: fewer to measure many ranks in less memory")
    ap.add_argument("--check", type=int, metavar="TP",
                    help="under torchrun, 2 ranks: against a real save at tp TP (1 or 2)")
    ap.add_argument("--check-mesh", action="store_true", help="FSDP2 x TP chunks on a fake 4 x 3 mesh")
    ap.add_argument("--mesh-rank", type=int, help=argparse.SUPPRESS)  # one process of --check-mesh
    ap.add_argument("--load", type=Path, help=argparse.SUPPRESS)  # the fresh process of measure()
    ap.add_argument("--dp", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--gc", choices=["on", "off"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = dataclasses.replace(LLAMA_405B, layers=args.layers)
    if args.load:
        print(json.dumps(load_and_plan(args.load, model, args.dp, args.tp, args.rank, args.gc == "on")))
        return
    if args.check:
        check(args.check)
        return
    if args.mesh_rank is not None:
        print(check_mesh_rank(args.dp, args.tp, args.mesh_rank))
        return
    if args.check_mesh:
        check_mesh()
        return
    gc.disable()  # building millions of objects: the collector's passes over them would cost minutes
    print(f"405B Llama (16384 wide, ffn 53248, vocab 128256), {model.layers} of its {LLAMA_405B.layers} layers, "
          f"AdamW. Per rank, on resume: read_metadata (pickle.load; CPU seconds with Python's collector on, "
          f"as in training / off), then its local load plan", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts:
            dp, tp = map(int, layout.split("x"))
            f = measure(model, dp, tp, Path(tmp), args.layers)
            on, off = f["gc"], f["nogc"]
            print(f"{dp * tp:5d} ranks (fsdp {dp} x tp {tp}): {f['chunks']:,} chunks, .metadata "
                  f"{f['bytes'] / 1e6:,.0f} MB; pickle.load {on['load_cpu']:.1f} s / {off['load_cpu']:.1f} s, "
                  f"+{on['rss_gib']:.2f} GiB resident (peak {on['peak_gib']:.2f}); local load plan "
                  f"{on['plan_cpu']:.1f} s / {off['plan_cpu']:.1f} s ({on['reads']:,} reads, "
                  f"{on['plan_bytes'] / 1e6:.1f} MB pickled); rank 0's gather and scatter of all plans "
                  f"{on['gather_cpu']:.0f} s / {off['gather_cpu']:.0f} s, +{off['gather_gib']:.1f} GiB", flush=True)
            if model.layers != LLAMA_405B.layers:
                k = count_chunks(LLAMA_405B, dp, tp) / f["chunks"]
                print(f"      x {k:.2f} for all {LLAMA_405B.layers} layers (chunks): {f['chunks'] * k:,.0f} chunks, "
                      f"{f['bytes'] * k / 1e6:,.0f} MB; pickle.load {on['load_cpu'] * k:.1f} s / "
                      f"{off['load_cpu'] * k:.1f} s, +{on['rss_gib'] * k:.2f} GiB; local load plan "
                      f"{on['plan_cpu'] * k:.1f} s / {off['plan_cpu'] * k:.1f} s; rank 0's gather "
                      f"{on['gather_cpu'] * k:.0f} s / {off['gather_cpu'] * k:.0f} s, +{off['gather_gib'] * k:.1f} GiB",
                      flush=True)
    print(f"(built and written by one process, peak {_resident_gib('VmHWM'):.1f} GiB)")

if __name__ == "__main__":
    main()
