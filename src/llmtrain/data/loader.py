"""Prepared token data: where it lives, how it is read, and which rank reads what.

A prepared dataset is a folder of memory-mapped token shards plus manifest.json, made by
`llmtrain prepare` (data/prepare.py). Its folder name carries a fingerprint of everything that
decides its contents (source files, split, text field and unit, BOS, validation source or
share, tokenizer), so the trainer finds it without loading the source dataset, and a changed
source, option or tokenizer gets a new folder instead of stale tokens.

Sampling: sample i is the window tokens[i*seq_len : (i+1)*seq_len + 1] of the train stream
(fine-tuning data, data/samples.py: row i, seq_len + 1 tokens holding one or more samples).
Each epoch draws a seeded permutation of all samples; an optimizer step takes the next
global_batch_size of it, and rank r reads its own contiguous slice of that step's samples. The
position (epoch, samples consumed) is global, so the set of samples in a step does not depend
on the world size, and a resumed run on another world size skips and repeats nothing.

Open files: a shard is mapped when a read first needs it, and a bounded number stay mapped
(`ShardMaps`), so that a corpus of thousands of shard files needs neither thousands of file
descriptors per rank nor thousands of opens per rank at start-up.
"""

from __future__ import annotations

import copy
import math
import queue
import resource
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..config import Config, UserError
from ..parallel.dims import ParallelDims
from .sources import prepared_path, read_manifest

if TYPE_CHECKING:
    import torch

MAX_MAPPED_FILES = 4096  # per split reader, whatever the open-file limit (each map is also a kernel mapping)
# Unpacked fine-tuning rows are cut to the micro-batch's longest sample, rounded up to this many
# inputs (or to the layout's sequence split where that is coarser: row_multiple): at most 7
# padded tokens a row where a full row pads up to seq_len, and whole tiles of the tensor-core
# matmuls. The model sees several lengths, not one: torch.compile (train.compile's layers, flex
# attention) marks the length dynamic when it sees a second one (automatic_dynamic_shapes), so it
# compiles twice however many there are.
PAD_MULTIPLE = 8


class DataNotPrepared(UserError):
    pass


# ---------------------------------------------------------------------------------------------
# Prepared data


def open_prepared(cfg: Config) -> tuple[Path, dict]:
    folder = prepared_path(cfg)
    manifest = read_manifest(folder)
    if manifest is None:
        raise DataNotPrepared(
            f"data: {cfg.data.dataset} is not prepared for this tokenizer and settings "
            f"(expected {folder}); run: llmtrain prepare --config {cfg.path} (with the same --set options)"
        )
    return folder, manifest


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass
class Batch:
    """A micro-batch of samples, on the host (numpy) or a device (tensors).

    tokens: [n, width] token windows: inputs are [:, :-1], targets [:, 1:]; width is seq_len + 1,
        or less for unpacked fine-tuning rows (cut after the batch's longest sample)
    trained: [n, width] flags, 1 where the token is a target the loss covers; None: all
    positions: [n, width] each token's position within its own document or sample, where
        a sequence holds several that must not attend to each other; None: 0..width - 1, one
    """

    tokens: "np.ndarray | torch.Tensor"
    trained: "np.ndarray | torch.Tensor | None" = None
    positions: "np.ndarray | torch.Tensor | None" = None

    def fields(self) -> dict:
        return {k: v for k, v in vars(self).items() if v is not None}

    def pinned(self, device) -> "Batch":
        """As tensors, in pinned memory where they go to a GPU (see pinned())."""
        return Batch(**{k: pinned(v, device) for k, v in self.fields().items()})

    def to(self, device, non_blocking: bool = True) -> "Batch":
        return Batch(**{k: v.to(device, non_blocking=non_blocking) for k, v in self.fields().items()})

    def targets(self) -> int:
        """The targets the loss covers (host arrays)."""
        n, length = self.tokens.shape
        return int(self.trained[:, 1:].sum()) if self.trained is not None else n * (length - 1)


class ShardMaps:
    """A split's shard files, memory-mapped when a read first needs one, at most `capacity` at a
    time: the least recently read is unmapped to make room (and mapped again if read again).

    A map holds a file descriptor as long as it lives (numpy's memmap closes its file, but
    CPython's mmap keeps a dup of the descriptor: Modules/mmapmodule.c). A 100B-token corpus is
    ~1,600 shard files: mapped all at start-up they exceed the 1024 open files a Slurm job
    often inherits as its soft limit, and each of hundreds of ranks opens every one of them on
    the shared filesystem before its first step. `open_shard(i)` maps shard i (an array, or a
    dict of arrays: one entry may be several files). Reads on the prefetch thread and the
    training thread may meet: a lock guards the table."""

    def __init__(self, open_shard: Callable[[int], object], capacity: int):
        self.open_shard, self.capacity = open_shard, max(2, capacity)  # a window spans 2 shards
        self.maps: OrderedDict[int, object] = OrderedDict()
        self.lock = threading.Lock()

    def __getitem__(self, shard: int):
        with self.lock:
            if shard in self.maps:
                self.maps.move_to_end(shard)
                return self.maps[shard]
            if len(self.maps) >= self.capacity:
                # Unmapped, its descriptor closed, once no array still views it (batches are copies).
                self.maps.popitem(last=False)
            self.maps[shard] = self.open_shard(shard)
            return self.maps[shard]


def map_capacity(files_per_shard: int) -> int:
    """How many shards a split reader keeps mapped: a quarter of the open-file soft limit (the
    train and validation readers together half; the rest for the process group, checkpoint
    writers and the libraries), at most MAX_MAPPED_FILES files."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    files = MAX_MAPPED_FILES if soft == resource.RLIM_INFINITY else min(MAX_MAPPED_FILES, soft // 4)
    return files // files_per_shard


def raise_open_file_limit() -> None:
    """The open-file soft limit up to the hard limit: what the process may do anyway. Slurm
    passes a job the soft limit of the shell that submitted it (PropagateResourceLimits), often
    1024, where the node allows far more; more open files let more shards stay mapped."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a hard limit above what the kernel takes (nr_open): keep it
            pass


class TokenStream:
    """One split of a prepared text dataset as a single read-only token array over its shards.
    `document_eos`: the EOS id that ends each document, where attention must stay within one
    (data.document_masking): batches then carry each token's position within its document."""

    def __init__(self, folder: Path, manifest: dict, split: str, document_eos: int | None = None):
        self.document_eos = document_eos
        files = [folder / s["file"] for s in manifest["splits"][split]["shards"]]
        dtype = np.dtype(manifest["dtype"])
        self.shards = ShardMaps(lambda i: np.memmap(files[i], dtype=dtype, mode="r"), map_capacity(1))
        # Each shard's length from the manifest (a stat where it has none): nothing opened here.
        lengths = [s["tokens"] if "tokens" in s else f.stat().st_size // dtype.itemsize
                   for s, f in zip(manifest["splits"][split]["shards"], files)]
        self.starts = np.cumsum([0] + lengths)
        self.num_tokens = int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        out, pos, end = [], start, start + length
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while pos < end:
            local = pos - self.starts[shard]
            take = min(end - pos, self.starts[shard + 1] - pos)
            out.append(self.shards[shard][local:local + take])
            pos += take
            shard += 1
        return np.concatenate(out) if len(out) > 1 else np.asarray(out[0])

    def num_samples(self, seq_len: int) -> int:
        return max(0, (self.num_tokens - 1) // seq_len)

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        return self.read(index * seq_len, seq_len + 1)

    def batch(self, indices: np.ndarray, seq_len: int) -> Batch:
        tokens = batch_tokens(self, indices, seq_len)
        if self.document_eos is None:
            return Batch(tokens)
        return Batch(tokens, positions=document_positions(tokens, self.document_eos))

    def targets(self, indices: np.ndarray, seq_len: int) -> int:
        """The targets the loss covers in these samples: every one."""
        return len(indices) * seq_len


def document_positions(tokens: np.ndarray, eos: int) -> np.ndarray:
    """Each token's position within its document: a document starts at a window's first token
    and after every EOS."""
    index = np.arange(tokens.shape[1])
    starts = np.zeros(tokens.shape, dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eos
    return index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)


class SampleRows:
    """One split of prepared fine-tuning data (data/samples.py): rows of seq_len + 1 tokens, each
    holding one or several samples, with their trained flags and positions. A batch of unpacked
    rows (one sample each) is cut to its longest sample (see batch())."""

    def __init__(self, folder: Path, manifest: dict, split: str, multiple: int = PAD_MULTIPLE):
        info = manifest["splits"][split]
        self.multiple = multiple  # an unpacked batch's inputs are rounded up to this (row_multiple)
        width = info["row_tokens"]
        self.row_tokens = width
        self.packed = manifest["samples"]["packing"]
        files = [{key: (folder / s[name], dtype) for key, name, dtype in (
            ("tokens", "file", manifest["dtype"]), ("trained", "trained", np.uint8),
            ("positions", "positions", info["positions_dtype"]))} for s in info["shards"]]
        self.shards = ShardMaps(lambda i: {key: np.memmap(path, dtype=dtype, mode="r").reshape(-1, width)
                                           for key, (path, dtype) in files[i].items()}, map_capacity(3))
        self.starts = np.cumsum([0] + [s["rows"] for s in info["shards"]])
        self.row_targets = np.load(folder / info["targets"])

    def num_samples(self, seq_len: int) -> int:
        if seq_len + 1 != self.row_tokens:  # the fingerprint includes seq_len: cannot happen
            raise ValueError(f"rows of {self.row_tokens} tokens read with seq_len {seq_len}")
        return int(self.starts[-1])

    def batch(self, indices: np.ndarray, seq_len: int, whole: bool = False) -> Batch:
        """The rows as a Batch. Unpacked rows are cut after the longest sample's last token,
        rounded up (`unpacked_width`): every token cut is padding, which no target covers and no
        sample attends to, so the loss is the same and the model does less work (at seq_len
        4096, a batch of 300-token chats holds ~1/13 of the full rows' tokens)."""
        rows = []
        for i in indices:
            shard = int(np.searchsorted(self.starts, i, side="right")) - 1
            rows.append((self.shards[shard], int(i) - self.starts[shard]))
        positions = np.stack([maps["positions"][r] for maps, r in rows])
        width = self.row_tokens if self.packed or whole else unpacked_width(positions, self.multiple)
        tokens, trained = (np.stack([maps[key][r, :width] for maps, r in rows]) for key in ("tokens", "trained"))
        return Batch(tokens.astype(np.int64), trained.astype(bool), positions[:, :width].astype(np.int64))

    def rows(self, indices: np.ndarray) -> Batch:
        """The rows whole, never cut (a mixture cuts a batch of several sources' rows at once)."""
        return self.batch(indices, self.row_tokens - 1, whole=True)

    def targets(self, indices: np.ndarray, seq_len: int) -> int:
        return int(self.row_targets[np.asarray(indices, dtype=np.int64)].sum())


def unpacked_width(positions: np.ndarray, multiple: int = PAD_MULTIPLE) -> int:
    """How many tokens of rows holding one sample each a batch needs: the longest sample's,
    its inputs rounded up to a multiple of `multiple`, at most the whole row. A row's sample
    is its first segment: its padding restarts the positions at 0 (data/samples.py), read
    here on the host, where the rows are."""
    restart = positions[:, 1:] == 0
    length = np.where(restart.any(axis=1), restart.argmax(axis=1) + 1, positions.shape[1])
    inputs = -(-(int(length.max()) - 1) // multiple) * multiple
    return min(positions.shape[1], inputs + 1)


def row_multiple(cfg: Config) -> int:
    """What an unpacked batch's inputs are rounded up to: PAD_MULTIPLE, or a multiple of it that
    the layout's sequence split divides (tensor and context parallel cut every batch's length
    into ParallelDims.seq_len_divisor pieces)."""
    return math.lcm(PAD_MULTIPLE, ParallelDims.from_config(cfg, cfg.world_size).seq_len_divisor)


def open_split(folder: Path, manifest: dict, split: str, cfg: Config) -> "TokenStream | SampleRows":
    """A split of prepared data, as the trainer reads it (the open-file limit raised first)."""
    raise_open_file_limit()
    if "samples" in manifest:
        return SampleRows(folder, manifest, split, row_multiple(cfg))
    eos = manifest["tokenizer"]["eos_token_id"] if cfg.data.document_masking else None
    return TokenStream(folder, manifest, split, document_eos=eos)


@dataclass
class SamplerState:
    """The data position: plain numbers, saved in checkpoints. Global, not per rank."""

    epoch: int = 0
    consumed: int = 0  # samples of this epoch's permutation already used

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.consumed = int(sd["epoch"]), int(sd["consumed"])


class StepSampler:
    """Hands out each optimizer step's sample indices, this rank's share, micro-batch by micro-batch."""

    def __init__(self, num_samples: int, global_batch: int, seed: int, rank: int, world_size: int):
        if num_samples < global_batch:
            raise UserError(
                f"train.global_batch_size: larger than the {num_samples} samples in the data "
                f"(got {global_batch}); use more data or a smaller batch or data.seq_len"
            )
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self.rank, self.world_size = rank, world_size
        self.state = SamplerState()
        self._perm_epoch, self._perm = -1, None

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch  # the remainder is dropped

    def epochs_done(self) -> float:
        """Epochs done so far, fractional: 1.5 is halfway through the second."""
        return self.state.epoch + self.state.consumed / (self.steps_per_epoch * self.global_batch)

    def fork(self) -> "StepSampler":
        """An independent sampler at the same position (for reading ahead)."""
        other = copy.copy(self)
        other.state = SamplerState(self.state.epoch, self.state.consumed)
        return other

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def next_global(self) -> np.ndarray:
        """All ranks' sample indices for the next optimizer step (advances the position)."""
        if self.state.consumed + self.global_batch > self.num_samples:
            self.state.epoch, self.state.consumed = self.state.epoch + 1, 0  # drop the remainder
        start = self.state.consumed
        step = self.permutation(self.state.epoch)[start:start + self.global_batch]
        self.state.consumed += self.global_batch
        return step

    def share(self, step: np.ndarray) -> np.ndarray:
        """This rank's contiguous slice of a step's indices."""
        per_rank = self.global_batch // self.world_size
        return step[self.rank * per_rank:(self.rank + 1) * per_rank]

    def next_step(self) -> np.ndarray:
        """This rank's sample indices for the next optimizer step (advances the position)."""
        return self.share(self.next_global())

    # What the loop and the report ask of any sampler (MixtureSampler answers them for a mixture).

    def position(self) -> dict:
        """Where the data stands, for a train record: the fractional epoch."""
        return {"epoch": round(self.epochs_done(), 4)}

    def progress(self, max_steps: int) -> tuple[int, int]:
        """The progress line's epoch: this one (from 1) of how many max_steps takes."""
        return self.state.epoch + 1, -(-max_steps // self.steps_per_epoch)

    def eval_record(self, losses: dict) -> dict:
        """An eval record's values from the loss on each source's validation split: the one
        dataset's (its source has no name)."""
        return {"eval_loss": losses[None]}

    def resumed(self) -> list[str]:
        """Log lines on what a resume changed in the data: nothing can."""
        return []


def batch_tokens(stream: TokenStream, indices: np.ndarray, seq_len: int) -> np.ndarray:
    """[len(indices), seq_len + 1] int64 windows: inputs are [:, :-1], targets [:, 1:]."""
    return np.stack([stream.sample(int(i), seq_len) for i in indices]).astype(np.int64)


def pinned(batch: np.ndarray, device) -> "torch.Tensor":
    """A host batch as a tensor, in pinned memory where it goes to a GPU (the copy can then run
    without the host waiting: `.to(device, non_blocking=True)`)."""
    import torch
    tensor = torch.from_numpy(batch)
    return tensor.pin_memory() if device.type == "cuda" else tensor


class Prefetcher:
    """Each step's micro-batches, read ahead on a background thread.

        prefetch = Prefetcher(stream, sampler, accum, seq_len, device, depth=2)
        batches, targets = prefetch.next(sampler.next_global())   # on the device, copies under way

    The thread follows a fork of the sampler (the trainer's own stays where a checkpoint must
    find it) and keeps up to `depth` steps ready, pinned on CUDA; next() hands the step over and
    starts its copies to the device without waiting for them. It checks the thread's indices
    against the trainer's, so reading ahead can never change what trains. depth 0 reads on the
    training thread. `targets` counts the targets the loss covers in the whole step, all ranks'
    samples (read from the host, never a collective): the loss is normalised by it.
    """

    def __init__(self, stream: "TokenStream | SampleRows", sampler: StepSampler, accum: int, seq_len: int,
                 device, depth: int = 2):
        self.stream, self.accum, self.seq_len, self.device = stream, accum, seq_len, device
        self.sampler = sampler
        self.queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self.stopping = threading.Event()
        self.thread = None
        if depth > 0:
            self.thread = threading.Thread(target=self._run, args=(sampler.fork(),), daemon=True,
                                           name="llmtrain-prefetch")
            self.thread.start()

    def _read(self, step: np.ndarray) -> tuple[list[Batch], int]:
        mine = self.sampler.share(step)
        return ([self.stream.batch(part, self.seq_len).pinned(self.device) for part in np.split(mine, self.accum)],
                self.stream.targets(step, self.seq_len))

    def _run(self, ahead: StepSampler) -> None:
        if self.device.type == "cuda":  # pinning from a new thread must not touch GPU 0
            import torch
            torch.cuda.set_device(self.device)
        try:
            while not self.stopping.is_set():
                step = ahead.next_global()
                self.queue.put((step, self._read(step)))  # blocks, asleep, while full
        except BaseException as e:  # handed to the training thread, raised there
            self.queue.put((None, e))

    def next(self, step: np.ndarray) -> tuple[list[Batch], int]:
        """This rank's micro-batches of the step on the device, and the step's count of trained
        targets over all ranks; `step` holds the trainer's sampler's indices for all ranks."""
        if self.thread is None:
            host, targets = self._read(step)
        else:
            ahead, host = self.queue.get()
            if ahead is None:
                raise host
            if not np.array_equal(ahead, step):
                raise RuntimeError("the prefetch thread is out of step with the sampler")
            host, targets = host
        return [batch.to(self.device) for batch in host], targets

    def close(self) -> None:
        """Stop the thread: take what it has queued so that its blocked put returns."""
        self.stopping.set()
        while self.thread is not None and self.thread.is_alive():
            try:
                while True:
                    self.queue.get_nowait()
            except queue.Empty:
                pass
            self.thread.join(timeout=0.05)
