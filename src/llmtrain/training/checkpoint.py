"""Sharded, crash-consistent checkpoints with torch.distributed.checkpoint (DCP).

    ckpt = Checkpointer(cfg, world, log)
    meta = ckpt.load(model, optimizer)          # newest complete checkpoint, or None
    ckpt.save(step, model, optimizer, extra)    # every checkpoint_every steps and at the end
    ckpt.poll()                                 # every step: completes a finished async save
    ckpt.close()                                # before exit: the last save completes

    <run_dir>/checkpoints/
        step-00000100/          complete: DCP shards + .metadata, rng-rank-N.pt, buffers.pt,
                                the HF config.json and tokenizer files, meta.json (last)
        .tmp-step-00000200/     being written; never loaded, removed at the next start
        latest                  "step-00000100", replaced (write + rename) after each save

A save is written under .tmp-<name>, completed (meta.json last), renamed, and only then does
`latest` move and do old checkpoints go, so a kill at any instant leaves the previous complete
checkpoint in place. meta.json holds the global state: the step, tokens seen, the sampler
position (global, so any world size resumes it), the loss-scaler state, and what must match
on resume (model architecture, tokenizer, data, seq_len, global batch).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..config import Config, UserError
from ..files import read_json
from ..model.build import pretrained_dir, unwrap
from ..optimizers import OPTIMIZERS, checkpoint_meta, held_state_bytes, lr_at
from ..rundir import (ASSUMED_WRITE_BYTES_PER_S_PER_NODE, BUFFERS, CHECKPOINT_FORMAT, CHECKPOINTS, LATEST,
                      META, Log, complete_checkpoints, latest_checkpoint, step_name)
from ..files import write_atomic
from ..parallel.world import World

# Keys that must be equal to continue a run, and keys whose change is only logged.
MUST_MATCH = ("model", "lora", "tokenizer_vocab", "data_fingerprint", "seq_len", "global_batch_size",
              "optimizer", "optimizer_settings")  # another optimizer's state is not this one's
MAY_CHANGE = ("lr", "min_lr", "warmup_steps", "max_steps", "eval_every", "checkpoint_every",
              "weight_decay", "grad_clip", "lr_schedule", "decay_fraction")


DCP_METADATA = ".metadata"  # DCP's index of every saved chunk, next to the shards
BROADCAST_PIECE_BYTES = 256 << 20


class CheckpointMismatch(UserError):
    pass


def will_resume(cfg: Config) -> bool:
    """Whether this start will load a checkpoint (train.resume names one, or `auto` finds a
    complete one): then the starting weights need not be read. Should every candidate turn out
    damaged, Checkpointer.load refuses to start, so no run trains on unread weights."""
    if cfg.train.resume == "none":
        return False
    return cfg.train.resume != "auto" or bool(complete_checkpoints(cfg.run_dir / CHECKPOINTS))


class Checkpointer:
    def __init__(self, cfg: Config, world: World, log: Log, compat: dict, hf_files=()):
        """hf_files: objects with save_pretrained (the HF config, the tokenizer) that make each
        checkpoint self-contained for export."""
        self.cfg, self.world, self.log, self.compat = cfg, world, log, compat
        self.hf_files = hf_files
        self.folder = cfg.run_dir / CHECKPOINTS
        # LoRA: only what trains (the adapters, their optimizer state) is saved and loaded; the
        # frozen base comes from its source at every start.
        self.options = (StateDictOptions(ignore_frozen_params=True, strict=False)
                        if cfg.model.lora is not None else None)
        self.pending = None  # (future, tmp, final, meta, started) of the async save in flight
        self.measured_s: float | None = None  # the last save, start to last shard (or the last launch's)
        self.estimated_s = 0.0  # estimate_save()
        # Async saves upload on their own gloo group: sharing the training group crashed when
        # training collectives overlapped the upload (torch-stack-facts.md).
        self.group = dist.new_group(backend="gloo") if cfg.train.async_checkpoint else None
        # One stager for the whole run: it caches its CPU copies of the state's storages, while
        # a fresh one per save page-faults all of its memory again (under DDP, where each rank
        # stages the full state, that tripled the blocked time). Pinned memory needs CUDA.
        self.stager = self._new_stager() if self.group is not None else None
        if world.is_main:
            self.folder.mkdir(parents=True, exist_ok=True)
            for stale in self.folder.glob(".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()

    # -- saving ---------------------------------------------------------------------------

    def _new_stager(self) -> DefaultStager:
        cuda = self.world.device.type == "cuda"
        return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                            use_async_staging=False, use_non_blocking_copy=cuda))

    def _reusable_stager(self) -> DefaultStager:
        """The run's stager, or a fresh one where the last save closed it: torch 2.11's
        DefaultStager closes itself after each stage (pytorch#183413, fixed after 2.11), and a
        second save with it fails with KeyError: <class 'type'>. There each save stages afresh."""
        inner = getattr(self.stager, "_state_dict_stager", None)
        if inner is not None and not getattr(inner, "_deepcopy_dispatch", True):
            self.stager.close()
            self.stager = self._new_stager()
        return self.stager

    def save_s(self) -> float:
        """How long a save takes: the last one measured, else the estimate."""
        return self.measured_s if self.measured_s is not None else self.estimated_s

    def estimate_save(self, model, optimizer) -> None:
        """A save's seconds until one is measured: what it writes (the trained weights and the
        optimizer's state, optimizers.held_state_bytes) at ASSUMED_WRITE_BYTES_PER_S_PER_NODE on every node."""
        trained = [p for p in model.parameters() if p.requires_grad or self.options is None]
        state = sum(p.numel() * p.element_size() for p in trained)
        state += held_state_bytes(optimizer, self.cfg.train)
        nodes = max(1, self.world.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        self.estimated_s = state / (nodes * ASSUMED_WRITE_BYTES_PER_S_PER_NODE)

    def save(self, step: int, model, optimizer, extra: dict) -> None:
        self.wait()  # at most one save in flight
        started = time.time()
        final = self.folder / step_name(step)
        if final.exists():  # resumed exactly at a checkpoint: it is already there
            return
        tmp = self.folder / f".tmp-{final.name}"
        if self.world.is_main:
            tmp.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self.options)
        meta = {"format": CHECKPOINT_FORMAT, "step": step, "world_size": self.world.world_size, **extra,
                "compat": self.compat, "settings": _settings(self.cfg)}
        if self.options is not None:  # LoRA: where the frozen base comes from (export, generate)
            meta["base_model"] = str(pretrained_dir(self.cfg))
        meta.update(checkpoint_meta(self.cfg.train))  # e.g. how export makes the weights to evaluate
        state = {"model": model_sd, "optim": optim_sd}
        with self._failing_save(tmp, final):
            torch.save(_rng_state(), tmp / f"rng-rank-{self.world.rank}.pt")
            if self.world.is_main:  # buffers (rotary inv_freq, ...): replicated, not all in model_sd
                torch.save({k: v.cpu() for k, v in unwrap(model).named_buffers()}, tmp / BUFFERS)
                for obj in self.hf_files:
                    obj.save_pretrained(tmp)
            if self.group is not None:
                future = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group,
                                        async_stager=self._reusable_stager())
                self.pending = (future, tmp, final, meta, started)
            else:
                dcp.save(state, checkpoint_id=tmp)
                self._complete(tmp, final, meta, started)

    @contextlib.contextmanager
    def _failing_save(self, tmp: Path, final: Path):
        """A save that cannot be written (a full disk, a lost mount) ends the run with one line;
        its partial folder goes, and the previous checkpoint stays the one to resume from."""
        try:
            yield
        except (OSError, CheckpointException, RuntimeError) as e:
            # torch's zip writer reports a full disk as a RuntimeError ("unexpected pos").
            full = shutil.disk_usage(self.folder).free < 1 << 20
            if isinstance(e, RuntimeError) and not full:
                raise
            cause = "No space left on device" if full else _root_cause(e)
            if self.world.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            previous = complete_checkpoints(self.folder)
            keep = f"{previous[0].name} is intact" if previous else "there is no earlier checkpoint"
            raise UserError(f"checkpoint {final.name} could not be written ({cause}); {keep}; "
                            f"free space in {self.folder} and start the run again") from None

    def close(self) -> None:
        """Complete the save in flight and free the staging buffer."""
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def poll(self) -> None:
        """Complete an async save whose upload has finished (cheap; call every step)."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self.pending is not None:
            future, tmp, final, meta, started = self.pending
            self.pending = None
            with self._failing_save(tmp, final):
                future.result()
                self._complete(tmp, final, meta, started)

    def _complete(self, tmp: Path, final: Path, meta: dict, started: float) -> None:
        """Once every shard is written: the save's time; rank 0: meta.json (with that time, for
        the next launch's deadline), rename, move `latest`, prune."""
        self.measured_s = time.time() - started
        if not self.world.is_main:
            return
        write_atomic(tmp / META, json.dumps({**meta, "save_s": round(self.measured_s, 3)}, indent=2) + "\n")
        _fsync_dir(tmp)
        os.rename(tmp, final)
        write_atomic(self.folder / LATEST, final.name + "\n")
        _fsync_dir(self.folder)
        for old in complete_checkpoints(self.folder)[self.cfg.train.keep_checkpoints:]:
            shutil.rmtree(old, ignore_errors=True)
        self.log.info(f"checkpoint saved: {final}")

    # -- loading --------------------------------------------------------------------------

    def load(self, model, optimizer) -> dict | None:
        """Restore model and optimizer; return the checkpoint's meta, or None to start fresh."""
        resume = self.cfg.train.resume
        if resume == "none":
            return None
        if resume == "auto":
            candidates = self._candidates()
        else:
            path = Path(resume)
            if not (path / META).is_file():
                raise UserError(f"train.resume: {path} is not a complete checkpoint (no {META})")
            candidates = [path]
        for ckpt in candidates:
            meta = _read_meta(ckpt)
            if meta is None:
                self.log.info(f"warning: skipping checkpoint {ckpt}: unreadable {META}")
                continue
            self._check_compatible(ckpt, meta)
            model_sd, optim_sd = get_state_dict(model, optimizer, options=self.options)
            state = {"model": model_sd, "optim": optim_sd}
            dims = self.world.dims  # HSDP with replicas: the first reads, the others get a broadcast
            replicas = self.world.layout if dims.strategy == "hsdp" and dims.replicate > 1 else None
            if not self._read(state, ckpt, replicas):
                continue
            if replicas is not None:
                _broadcast_from_first_replica(state, replicas)
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=self.options)
            rng = ckpt / f"rng-rank-{self.world.rank}.pt"
            if rng.exists():  # a new rank (larger world) keeps its fresh seed
                _set_rng_state(torch.load(rng, weights_only=False))
            self.log.info(f"resumed from {ckpt} (step {meta['step']}, saved by "
                          f"{meta['world_size']} ranks)")
            if replicas is not None:
                self.log.info(f"the checkpoint was read by the first replica's "
                              f"{dims.param_shards} rank(s) and broadcast to the other "
                              f"{dims.replicate - 1} replica(s)")
            if isinstance(meta.get("save_s"), (int, float)):  # the last launch's save time
                self.measured_s = float(meta["save_s"])
            return meta
        if candidates:
            raise UserError(f"no loadable checkpoint in {self.folder}: all {len(candidates)} "
                            f"are damaged; set train.resume: none to start over")
        return None

    def _read(self, state: dict, ckpt: Path, replicas) -> bool:
        """dcp.load into `state`; False (logged) for a damaged checkpoint, which then falls back
        to the previous one (which overwrites every key). Under HSDP only the first replica's
        ranks read, as one shard group; the others get the state by broadcast (a 70B's 847 GB
        read once, not once per node). Every rank learns whether the read went well."""
        error = None
        if replicas is None or replicas.coordinate("replicate") == 0:
            reader = _SharedMetadataReader(ckpt, replicas.mesh("fsdp").get_group() if replicas is not None else None,
                                           self.world.device)
            try:
                # no_dist: each rank plans its own reads, as DCP's default planner does anyway, without
                # the gather of every rank's plan on rank 0 and their scatter back (minutes of rank 0's
                # time at 2048 ranks: bench/dcp_metadata.py); the agreement below replaces its errors'.
                with _collector_paused(), warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp.load(state, storage_reader=reader, no_dist=True)
            # DCP wraps a read error into a CheckpointException, a BaseException.
            except (Exception, CheckpointException) as e:
                error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if self.world.world_size > 1:
            ok = torch.tensor([0.0 if error else 1.0], device=self.world.device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            error = error or (None if ok.item() else "another rank could not read it")
        if error:
            self.log.info(f"warning: skipping checkpoint {ckpt}: cannot load it ({error})")
        return error is None

    def _candidates(self) -> list[Path]:
        found = complete_checkpoints(self.folder)
        pointer = latest_checkpoint(self.folder)
        pointed = self.folder / pointer if pointer else None
        if pointed in found:  # newest first, but the pointer wins if it names an older one
            found.remove(pointed)
            found.insert(0, pointed)
        return found

    def _check_compatible(self, ckpt: Path, meta: dict) -> None:
        if meta.get("format", 1) > CHECKPOINT_FORMAT:  # checkpoints before formats had none: 1
            raise CheckpointMismatch(
                f"checkpoint {ckpt} has format {meta['format']}, newer than this llmtrain reads "
                f"({CHECKPOINT_FORMAT}); update llmtrain (git pull, then bash setup.sh)")
        saved = meta.get("compat", {})
        for key in MUST_MATCH:
            if key in saved and saved[key] != self.compat[key]:
                detail = _diff(saved[key], self.compat[key])
                raise CheckpointMismatch(
                    f"checkpoint {ckpt} does not match this config: {key} differs ({detail}); "
                    f"use a new run.name, or set train.resume: none to start over")
        now = _settings(self.cfg)
        for key, before in meta.get("settings", {}).items():
            if now.get(key) != before:
                self.log.info(f"changed since the checkpoint: train.{key} {before} -> {now.get(key)}")
        if (jump := lr_jump(meta.get("step"), meta.get("settings", {}), now)) is not None:
            self.log.info(jump)


def compat_info(cfg: Config, model_config, manifest: dict) -> dict:
    arch = {k: v for k, v in model_config.to_diff_dict().items()
            if not k.startswith("_") and k not in ("transformers_version", "use_cache", "dtype",
                                                    "torch_dtype", "architectures")}
    return {"model": arch, "lora": cfg.model.lora, "tokenizer_vocab": manifest["tokenizer"]["vocab_size"],
            "data_fingerprint": manifest["fingerprint"], "seq_len": cfg.data.seq_len,
            "global_batch_size": cfg.train.global_batch_size, "optimizer": cfg.train.optimizer,
            "optimizer_settings": {k: getattr(cfg.train, k) for k in OPTIMIZERS[cfg.train.optimizer].must_match}}


def lr_jump(step: int | None, saved: dict, now: dict) -> str | None:
    """A warning where the changed settings move the learning rate of the step after `step`
    (the resumed one) by more than 1%: a cosine run extended (max_steps 300 -> 400) climbs back
    from its tail, its decay undone; None where the lr goes on as it was."""
    if step is None or not saved or any(k not in saved for k in ("lr", "max_steps")):
        return None
    from types import SimpleNamespace
    was, will = (lr_at(step, SimpleNamespace(**{**saved, **over})) for over in ({}, now))
    if abs(will - was) <= 0.01 * max(abs(was), 1e-30):
        return None
    changed = ", ".join(f"{k} {saved.get(k)} -> {v}" for k, v in now.items() if saved.get(k, v) != v)
    advice = ("; a cosine schedule decays over max_steps, so extending it raises the lr again: for a run you "
              "may extend, use train.lr_schedule: wsd (it decays only at the end), or keep max_steps"
              if now.get("lr_schedule", "cosine") == "cosine" and saved.get("max_steps") != now.get("max_steps")
              else "")
    return (f"warning: the learning rate of step {step + 1} jumps from {was:.3g} (the checkpoint's schedule) to "
            f"{will:.3g} ({changed}){advice}")


def _settings(cfg: Config) -> dict:
    return {k: getattr(cfg.train, k) for k in MAY_CHANGE}


def _diff(saved, now) -> str:
    if isinstance(saved, dict) and isinstance(now, dict):
        keys = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        return ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in keys[:3])
    return f"{saved!r} -> {now!r}"


def _root_cause(e: BaseException) -> str:
    """The OS error behind DCP's wrapped per-rank failures, as one short phrase."""
    seen = e
    for _ in range(20):  # bounded: exception chains can loop
        if isinstance(seen, tuple):  # CheckpointException.failures: {rank: (exception, traceback)}
            seen = seen[0]
        if not isinstance(seen, BaseException):
            break
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        failures = getattr(seen, "failures", None)
        seen = next(iter(failures.values())) if failures else (seen.__cause__ or seen.__context__)
    text = str(e).strip().splitlines()
    return text[-1][:200] if text else type(e).__name__


class _SharedMetadataReader(FileSystemReader):
    """DCP's file reader, but `.metadata` is read from disk by one rank and its bytes broadcast:
    torch's read_metadata reads it on every rank, and a 405B checkpoint saved by 2048 ranks lists
    6.2M chunks in 1.15 GB (bench/dcp_metadata.py). `group`: the ranks that load (None: all)."""

    def __init__(self, path: Path, group, device: torch.device):
        super().__init__(path)
        self.group, self.device = group, device

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = pickle.loads(_read_on_one_rank(Path(self.path) / DCP_METADATA, self.group, self.device))
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _read_on_one_rank(path: Path, group, device: torch.device):
    """The bytes of `path` (a numpy view) on every rank of `group`, read by its first rank and
    broadcast in pieces (a bounded buffer on the GPU under NCCL). When that rank cannot read the
    file, every rank raises."""
    source = dist.get_global_rank(group, 0) if group is not None else 0
    data, error = None, None
    if dist.get_rank() == source:
        try:
            data = torch.empty(path.stat().st_size, dtype=torch.uint8)
            with open(path, "rb") as f:
                if f.readinto(data.numpy()) != data.numel():
                    raise OSError(f"{path} changed while it was read")
        except OSError as e:
            data, error = None, e
    size = torch.tensor([data.numel() if data is not None else -1], device=device)
    dist.broadcast(size, src=source, group=group)
    if size.item() < 0:
        raise error or OSError(f"rank {source} could not read {path}")
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    for start in range(0, data.numel(), BROADCAST_PIECE_BYTES):
        piece = data[start:start + BROADCAST_PIECE_BYTES]
        moved = piece.to(device)  # the same tensor on the CPU (gloo)
        dist.broadcast(moved, src=source, group=group)
        if moved is not piece:
            piece.copy_(moved)
    return data.numpy()


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while DCP unpickles and plans: its passes over the
    millions of new objects tripled the CPU time of reading a large `.metadata` (16.8 s instead of
    5.7 s for 874k chunks; bench/dcp_metadata.py). They are freed by reference counting."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _broadcast_from_first_replica(state: dict, layout) -> None:
    """Every tensor of `state` (each rank's local shard) and its other values, from the rank of
    the first replica that holds the same shard: one broadcast per tensor over the replicate
    group (between nodes), in the same order on every rank."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    group = layout.mesh("replicate").get_group()
    source = dist.get_global_rank(group, 0)
    leaves, spec = tree_flatten(state)
    values = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    dist.broadcast_object_list(values, src=source, group=group)
    nccl = dist.get_backend(group) == "nccl"
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            leaves[i] = values[i]
            continue
        local = leaf.to_local() if hasattr(leaf, "to_local") else leaf  # a view of the shard
        if nccl and local.device.type == "cpu":  # a host-side value (a step count): via the GPU
            on_device = local.to(layout.device_type)
            dist.broadcast(on_device, src=source, group=group)
            local.copy_(on_device)
        else:
            dist.broadcast(local, src=source, group=group)
    state.update(tree_unflatten(leaves, spec))


def _read_meta(ckpt: Path) -> dict | None:
    return read_json(ckpt / META)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_dir(path: Path) -> None:
    """Make a rename durable: the directory entry must reach the disk, not only the file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
