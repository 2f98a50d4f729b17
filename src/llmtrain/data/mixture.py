"""Weighted mixtures of prepared sources (data.mixture): the sources' train splits as one index
space, and the global blend that decides which source each sample of the run comes from.

    train = Mixture(names, readers, seq_len)       # source k's sample j is index offsets[k] + j
    sampler = MixtureSampler(train, weights, global_batch, seed, rank, world_size)
    step = sampler.next_global()                   # as StepSampler: all ranks' indices of a step

Each source is prepared on its own (data/prepare.py, its folder named by its own fingerprint), so
a source that two mixtures share, or a mixture and a plain data.dataset run, is tokenized once.

The blend sits under the global sampler. Sample g of the run (counted over all ranks since the
weights took over) comes from the source whose count is furthest below its share:
argmax_k  w_k * (g + 1) - n_k  (ties: the first source), n_k the samples source k gave so far:
the largest-sampling-error rule of Megatron-LM (megatron/core/datasets/helpers.cpp,
build_blending_indices) and nanotron (nanoset.py). Every prefix of the run then holds each
source within about one sample of its share: a 3:1 blend is exact every 4 samples. A sample is
seq_len tokens of text, so text weights count tokens; for fine-tuning it is a row (one sample,
or several packed).

Within a source the samples follow its own epochs: epoch e of source k is a seeded permutation
of its samples (numpy.random.default_rng([seed, crc32(name), e])), read front to back; a small
source repeats, each time in another order, and nothing of it is dropped. The position is
global and plain (`MixtureState`: the samples drawn, each source's count, and where the current
weights took over), so a resume on another number of processes reads the same samples in the
same order. Changed weights continue each source where it stopped: the blend starts over from
the position at which they took over, with the new shares.
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import Config, UserError
from .loader import Batch, DataNotPrepared, SampleRows, open_split, unpacked_width
from .sources import by_source, prepared_path, read_manifest


BLEND_ROWS = 128  # samples the blend works out together: one search for contenders serves them all


def blend(weights: np.ndarray, n: int, drawn) -> np.ndarray:
    """The sources of the next `n` samples (largest-error rule), after `drawn[k]` samples of
    each source under these weights (normalised: they sum to 1).

    Sample by sample as the rule says, but each sample compares only the sources that can win
    it (`contenders`: a few hundred of 1,000 sources, found once for 128 samples), in numpy:
    w_k * (g + 1) - n_k in float64, the same two roundings as Python floats, and argmax keeps
    the first of equal errors, as the rule does. 1,000 sources x 2,048 samples: 4-9 ms, where a
    Python loop over every source took 0.4-0.7 s (CPU time, bench/mixture.py, a 2-core CPU)."""
    w = np.asarray(weights, dtype=np.float64)
    counts = np.array(drawn, dtype=np.int64)
    done, out = int(counts.sum()), np.empty(n, dtype=np.int64)
    for start in range(0, n, BLEND_ROWS):
        g1 = np.arange(done + start + 1, done + min(n, start + BLEND_ROWS) + 1, dtype=np.float64)  # g + 1
        able = contenders(w, counts, g1)
        able_drawn = counts[able].astype(np.float64)
        out[start:start + len(g1)] = able[largest_errors(g1[:, None] * w[able], able_drawn)]
        counts[able] = able_drawn.astype(np.int64)
    return out


def contenders(w: np.ndarray, drawn: np.ndarray, g1: np.ndarray) -> np.ndarray:
    """The sources that can have the largest error at one of the samples g1 (g + 1 of each), in
    source order. A source's error w * (g + 1) - n only grows until it is chosen, so of the
    len(g1) largest at the first sample one at least is still unchosen at each sample: every
    sample's largest error is at least the len(g1)-th largest of the first, and a source whose
    error at the last sample (its largest here) is below that is never chosen."""
    if len(g1) >= len(w):
        return np.arange(len(w))
    floor = np.partition(w * g1[0] - drawn, len(w) - len(g1))[len(w) - len(g1)]
    return np.flatnonzero(w * g1[-1] - drawn >= floor)


def largest_errors(wg: np.ndarray, drawn: np.ndarray) -> list:
    """Row by row of wg (w_k * (g + 1) of each source for consecutive samples g), the source with
    the largest error w_k * (g + 1) - drawn_k (the first of equal ones); `drawn` is counted on."""
    if wg.shape[1] <= 8:  # a few sources: Python floats cost less than two numpy calls a sample
        counts, chosen, few = drawn.tolist(), [], range(wg.shape[1])
        for row in wg.tolist():
            k = max(few, key=lambda k: row[k] - counts[k])
            counts[k] += 1
            chosen.append(k)
        drawn[:] = counts
        return chosen
    errors, chosen = np.empty(wg.shape[1]), []
    # Bound once, and the count through a memoryview (a numpy scalar costs more): 2,048 times a step.
    subtract, argmax, choose, count = np.subtract, errors.argmax, chosen.append, memoryview(drawn)
    for row in wg:
        subtract(row, drawn, out=errors)
        k = argmax()
        count[k] += 1
        choose(k)
    return chosen


def open_sources(cfg: Config) -> list[tuple[str, Path, dict]]:
    """Each source's (name, prepared folder, manifest); a source not prepared is one line."""
    opened = []
    for source in cfg.data.sources:
        folder = prepared_path(cfg.for_source(source))
        manifest = read_manifest(folder)
        if manifest is None:
            raise DataNotPrepared(
                f"data.mixture[{source.index}]: {source.data.dataset} ({source.name}) is not prepared for this "
                f"tokenizer and settings (expected {folder}); run: llmtrain prepare --config {cfg.path} "
                f"(with the same --set options)")
        opened.append((source.name, folder, manifest))
    return opened


def summary_manifest(opened: list[tuple[str | None, Path, dict]]) -> dict:
    """What the trainer checks the model and a checkpoint against, for the whole mixture: the
    tokenizer (alike for all: prepared with the model's), and each source's fingerprint by name
    (data.dataset's unnamed one: its fingerprint, as it is)."""
    return {"tokenizer": max((m["tokenizer"] for _, _, m in opened), key=lambda t: t["vocab_size"]),
            "fingerprint": by_source({name: m["fingerprint"] for name, _, m in opened})}


class Mixture:
    """The sources' train splits (TokenStream or SampleRows, all of one kind) as one index
    space: index offsets[k] + j is sample j of source k."""

    def __init__(self, names: list[str], readers: list, seq_len: int):
        self.names, self.readers, self.seq_len = names, readers, seq_len
        self.sizes = np.array([r.num_samples(seq_len) for r in readers], dtype=np.int64)
        for name, size in zip(names, self.sizes):
            if size == 0:
                raise UserError(f"data.mixture: source {name!r} has no training sample of {seq_len + 1} "
                                f"tokens; give it more documents, or lower data.seq_len")
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])

    def num_samples(self, seq_len: int) -> int:
        return int(self.offsets[-1])

    def source_of(self, indices: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, indices, side="right") - 1

    def batch(self, indices: np.ndarray, seq_len: int) -> Batch:
        """The samples in the order given, each read from its source; unpacked fine-tuning rows
        cut after the batch's longest sample, as SampleRows.batch cuts them."""
        indices = np.asarray(indices, dtype=np.int64)
        source = self.source_of(indices)
        fields: dict[str, np.ndarray] = {}
        for k in np.unique(source):
            where = np.flatnonzero(source == k)
            reader, local = self.readers[k], indices[where] - self.offsets[k]
            part = reader.rows(local) if isinstance(reader, SampleRows) else reader.batch(local, seq_len)
            for key, value in part.fields().items():
                fields.setdefault(key, np.empty((len(indices), *value.shape[1:]), dtype=value.dtype))[where] = value
        batch = Batch(**fields)
        first = self.readers[0]
        if isinstance(first, SampleRows) and not first.packed:
            width = unpacked_width(batch.positions, first.multiple)
            batch = Batch(**{k: v[:, :width] for k, v in batch.fields().items()})
        return batch

    def targets(self, indices: np.ndarray, seq_len: int) -> int:
        indices = np.asarray(indices, dtype=np.int64)
        source = self.source_of(indices)
        return sum(self.readers[k].targets(indices[source == k] - self.offsets[k], seq_len)
                   for k in np.unique(source))


@dataclass
class MixtureState:
    """The data position of a mixture: plain numbers, saved in checkpoints. Global, not per rank."""

    samples: int = 0  # samples drawn in the run, all sources
    counts: dict = field(default_factory=dict)  # {source: samples it gave}: where it continues
    since: int = 0  # the sample at which the current weights took over
    since_counts: dict = field(default_factory=dict)  # each source's count then
    weights: dict = field(default_factory=dict)  # {source: weight} the blend uses (normalised)
    changed: dict | None = None  # at a resume with other weights: the checkpoint's (for the log)

    def state_dict(self) -> dict:
        return {"samples": self.samples, "counts": dict(self.counts), "since": self.since,
                "since_counts": dict(self.since_counts), "weights": dict(self.weights)}

    def load_state_dict(self, sd: dict) -> None:
        """The checkpoint's position; with other weights than the config's, the blend starts over
        here with the config's, and each source continues where it stopped. The sources are the
        config's: a checkpoint with others is refused before (data_fingerprint, by source name)."""
        self.samples = int(sd["samples"])
        self.counts = {name: int(sd["counts"][name]) for name in self.weights}
        saved = {name: float(w) for name, w in sd["weights"].items()}
        if all(abs(saved[n] - w) < 1e-9 for n, w in self.weights.items()):
            self.since = int(sd["since"])
            self.since_counts = {name: int(sd["since_counts"][name]) for name in self.weights}
        else:
            self.since, self.since_counts, self.changed = self.samples, dict(self.counts), saved


class MixtureSampler:
    """StepSampler's interface over a Mixture: each optimizer step's global batch, drawn by the
    blend, each source read through its own epochs; this rank's contiguous slice of it."""

    def __init__(self, data: Mixture, weights: list[float], global_batch: int, seed: int, rank: int,
                 world_size: int):
        self.data, self.global_batch, self.seed = data, global_batch, seed
        self.rank, self.world_size = rank, world_size
        self.weights = np.array(weights, dtype=np.float64) / sum(weights)
        names = data.names
        self.state = MixtureState(counts=dict.fromkeys(names, 0), since_counts=dict.fromkeys(names, 0),
                                  weights=dict(zip(names, self.weights.tolist())))
        self._sizes = data.sizes.tolist()
        # Each source's order in its newest epoch read so far: {k: (epoch, read-only array)}, shared
        # with forks (one copy of the largest thing the sampler holds, however many read).
        self._perms: dict[int, tuple[int, np.ndarray]] = {}
        # Steps a fork reading ahead worked out, left for this sampler: {position: (indices, counts)}.
        self._ahead: dict[tuple, tuple[np.ndarray, list[int]]] = {}
        self._owner_ahead: dict | None = None  # on a fork: its owner's _ahead

    @property
    def num_samples(self) -> int:
        return self.data.num_samples(0)

    def fork(self) -> "MixtureSampler":
        """An independent sampler at the same position (for reading ahead). It shares the sources'
        orders, and leaves each step it works out for this sampler, which takes it when it gets to
        the same position instead of working it out again: a step is worked out once, on the
        reading thread (the indices are a function of the position alone)."""
        other = copy.copy(self)
        other.state, other._ahead, other._owner_ahead = copy.deepcopy(self.state), {}, self._ahead
        return other

    def permutation(self, k: int, epoch: int) -> np.ndarray:
        """Source k's order of samples in its epoch `epoch`."""
        newest, perm = self._perms.get(k, (-1, None))
        if newest != epoch:
            key = zlib.crc32(self.data.names[k].encode())  # by name: another source list keeps it
            perm = np.random.default_rng([self.seed, key, epoch]).permutation(self._sizes[k])
            perm.flags.writeable = False
            if epoch > newest:  # a reader behind the other (the trainer, its fork ahead) keeps none
                self._perms[k] = epoch, perm
        return perm

    def next_global(self) -> np.ndarray:
        """All ranks' sample indices for the next optimizer step (advances the position)."""
        st, names = self.state, self.data.names
        counts = [st.counts[n] for n in names]
        position = (st.samples, st.since, tuple(counts), tuple(st.since_counts[n] for n in names))
        handed = self._ahead.pop(position, None)  # worked out from this very position by a fork
        step, counts = handed or self.work_out(counts, position[3])
        if self._owner_ahead is not None:  # this is such a fork: leave the step for the owner
            if len(self._owner_ahead) >= 64:  # an owner that stopped taking them (it moved elsewhere)
                self._owner_ahead.clear()  # one call: the owner pops from the other thread meanwhile
            self._owner_ahead[position] = step, counts
        st.samples += self.global_batch
        st.counts = dict(zip(names, counts))
        return step.copy()

    def work_out(self, counts: list[int], since_counts: tuple) -> tuple[np.ndarray, list[int]]:
        """The step's indices from each source's counts, and the counts after it."""
        sources = blend(self.weights, self.global_batch, np.subtract(counts, since_counts))
        drawn = np.bincount(sources, minlength=len(counts))
        here = np.flatnonzero(drawn)
        # Each source's draws of the step are the next stretch of its epochs: read source by source,
        # then put back in the step's order (a stable sort keeps each source's draws in order).
        parts = [self.read(k, counts[k], n) for k, n in zip(here.tolist(), drawn[here].tolist())]
        step = np.empty(self.global_batch, dtype=np.int64)
        step[np.argsort(sources, kind="stable")] = np.concatenate(parts) + np.repeat(self.data.offsets[here],
                                                                                     drawn[here])
        return step, (np.array(counts) + drawn).tolist()

    def read(self, k: int, start: int, n: int) -> np.ndarray:
        """Source k's samples `start` to `start + n` of its run through its epochs (its own indices)."""
        epoch, at = divmod(start, self._sizes[k])
        if at + n <= self._sizes[k]:  # within one epoch: nearly always
            return self.permutation(k, epoch)[at:at + n]
        parts = []
        while n > 0:  # split where an epoch ends: the next one is another order
            epoch, at = divmod(start, self._sizes[k])
            parts.append(self.permutation(k, epoch)[at:at + n])
            start, n = start + len(parts[-1]), n - len(parts[-1])
        return np.concatenate(parts)

    def share(self, step: np.ndarray) -> np.ndarray:
        """This rank's contiguous slice of a step's indices."""
        per_rank = self.global_batch // self.world_size
        return step[self.rank * per_rank:(self.rank + 1) * per_rank]

    def next_step(self) -> np.ndarray:
        return self.share(self.next_global())

    def source_tokens(self) -> dict[str, int]:
        """The tokens each source gave so far (seq_len a sample, as the run counts its tokens)."""
        return {name: n * self.data.seq_len for name, n in self.state.counts.items()}

    def source_epochs(self) -> dict[str, float]:
        """Each source's epochs so far, fractional: 2.5 is halfway through its third pass."""
        return {name: round(self.state.counts[name] / int(size), 4)
                for name, size in zip(self.data.names, self.data.sizes)}

    # What the loop and the report ask of any sampler (StepSampler answers them for one dataset).

    def position(self) -> dict:
        """Where the data stands, for a train record: each source's tokens and epochs."""
        return {"source_tokens": self.source_tokens(), "source_epochs": self.source_epochs()}

    def progress(self, max_steps: int) -> None:
        """No epoch in the progress line: each source has its own (in metrics only)."""
        return None

    def eval_record(self, losses: dict) -> dict:
        """An eval record's values from the loss on each source's validation split (eval_samples
        each): eval_loss_by_source, and as eval_loss their mean weighted by the sources' weights
        (the loss on the blend the run trains on)."""
        weights = {name: self.state.weights[name] for name in losses}
        mean = sum(weights[n] * loss for n, loss in losses.items()) / sum(weights.values())
        return {"eval_loss": mean, "eval_loss_by_source": losses}

    def resumed(self) -> list[str]:
        """Log lines on what a resume changed in the data: the weights, if they did."""
        return [weights_changed(self)] if self.state.changed else []


def open_mixture(cfg: Config, opened: list[tuple[str, Path, dict]], global_batch: int, rank: int,
                 world_size: int) -> tuple[Mixture, dict, MixtureSampler]:
    """The mixture's train data, its sources' validation splits ({name: reader}; a source without
    one is left out) and its sampler."""
    train, validation = open_splits(cfg, opened)
    return train, validation, mixture_sampler(cfg, train, global_batch, rank, world_size)


def open_splits(cfg: Config, opened: list[tuple[str, Path, dict]]) -> tuple[Mixture, dict]:
    """The mixture's train data and its sources' validation splits (see open_mixture)."""
    names = [name for name, _, _ in opened]
    train = Mixture(names, [open_split(folder, manifest, "train", cfg) for _, folder, manifest in opened],
                    cfg.data.seq_len)
    validation = {name: open_split(folder, manifest, "validation", cfg) for name, folder, manifest in opened
                  if "validation" in manifest["splits"]}
    return train, validation


def mixture_sampler(cfg: Config, train: Mixture, global_batch: int, rank: int, world_size: int) -> MixtureSampler:
    weights = [s.weight for s in cfg.data.sources]
    return MixtureSampler(train, weights, global_batch, cfg.train.seed, rank, world_size)


def describe(cfg: Config, sampler: MixtureSampler) -> str:
    """The start-up line: each source's samples (fine-tuning: rows), share and the epochs
    max_steps takes of it."""
    total = (cfg.train.max_steps or 0) * sampler.global_batch
    unit = "rows" if cfg.data.samples else "samples"
    parts = [f"{name} {int(size):,} {unit}, {w:.1%}, ~{w * total / int(size):.2f} epochs"
             for name, size, w in zip(sampler.data.names, sampler.data.sizes, sampler.weights)]
    return f"data.mixture: {'; '.join(parts)} (weights count {'rows' if cfg.data.samples else 'tokens'})"


def weights_changed(sampler: MixtureSampler) -> str:
    """The log line of a resume with other weights than the checkpoint's."""
    st = sampler.state
    was = ", ".join(f"{name} {w:.1%}" for name, w in st.changed.items())
    now = ", ".join(f"{name} {w:.1%}" for name, w in st.weights.items())
    return (f"data.mixture: the weights changed since the checkpoint ({was} -> {now}); each source "
            f"continues where it stopped, blended by the new weights from sample {st.since:,} on")
