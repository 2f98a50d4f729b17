"""The data a training run reads, whatever its kind: data.dataset is a mixture of one source.

    prepared = locate(cfg)               # each source's prepared folder and manifest
    data = prepared.open()               # data.train; data.validation: {source: split}, {} for none
    sampler = data.sampler(global_batch, dp_rank, dp)
    lines = data.describe(sampler)       # the start-up lines on the sources

The trainer never asks which kind it has: what differs lives here and in the two samplers, which
answer alike (position, progress, eval_record, resumed). data.dataset keeps the plain
StepSampler (a seeded permutation an epoch; {epoch, consumed} in a checkpoint's meta.json), so it
draws exactly the samples it drew before mixtures, and its checkpoints resume; data.mixture, of
however many sources, the blend of data/mixture.py. data.dataset's one source has no name
(None): what is kept by source name (metrics' per-source keys, the checkpoint's data
fingerprint: data/sources.py's by_source) is a mixture's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import Config
from . import mixture
from .loader import SampleRows, StepSampler, TokenStream, open_prepared, open_split

Sampler = StepSampler | mixture.MixtureSampler  # either answers the trainer's questions
TrainData = TokenStream | SampleRows | mixture.Mixture  # what a sampler's indices read


@dataclass(frozen=True)
class Prepared:
    """Each source's name (None: data.dataset's), prepared folder and manifest, in source order."""

    cfg: Config
    sources: list[tuple[str | None, Path, dict]]

    @property
    def manifest(self) -> dict:
        """What the model and a checkpoint are checked against: the tokenizer and the data
        fingerprint (a mixture's by source name)."""
        return mixture.summary_manifest(self.sources)

    def train_samples(self) -> int:
        """The training samples of all sources (train.epochs counts them: data.dataset's)."""
        return sum(open_split(folder, manifest, "train", self.cfg).num_samples(self.cfg.data.seq_len)
                   for _, folder, manifest in self.sources)

    def open(self) -> "RunData":
        return RunData(self)


def locate(cfg: Config) -> Prepared:
    """The run's prepared data; a source not prepared is one line naming it and the fix."""
    if cfg.data.mixture:
        return Prepared(cfg, mixture.open_sources(cfg))
    return Prepared(cfg, [(None, *open_prepared(cfg))])


class RunData:
    """The sources' train splits as one (`train`) and their validation splits by source name
    (`validation`: a source without one is left out)."""

    def __init__(self, prepared: Prepared):
        self.cfg, self.prepared = prepared.cfg, prepared
        self.train: TrainData
        if prepared.cfg.data.mixture:
            self.train, self.validation = mixture.open_splits(prepared.cfg, prepared.sources)
        else:
            [(name, folder, manifest)] = prepared.sources
            self.train = open_split(folder, manifest, "train", self.cfg)
            self.validation = ({name: open_split(folder, manifest, "validation", self.cfg)}
                               if "validation" in manifest["splits"] else {})

    def sampler(self, global_batch: int, rank: int, world_size: int) -> Sampler:
        """The sampler of `train`: each step's global batch, this data-parallel rank's share."""
        if self.cfg.data.mixture:
            return mixture.mixture_sampler(self.cfg, self.train, global_batch, rank, world_size)
        return StepSampler(self.train.num_samples(self.cfg.data.seq_len), global_batch, self.cfg.train.seed,
                           rank, world_size)

    def describe(self, sampler: Sampler) -> list[str]:
        """The start-up lines on the sources: a mixture's shares and epochs; none for one dataset."""
        return [mixture.describe(self.cfg, sampler)] if self.cfg.data.mixture else []

    def unit(self) -> str:
        """What a training sample is, for the start-up line: a sample, or a row of fine-tuning
        samples with their counts (a mixture's sources are all of one kind)."""
        manifests = [manifest for _, _, manifest in self.prepared.sources]
        if "samples" not in manifests[0]:  # open_split's test: a text stream
            return "samples"
        samples, trained = (sum(m["splits"]["train"][key] for m in manifests) for key in ("samples", "trained_tokens"))
        return f"rows ({samples:,} {self.cfg.data.format} samples, {trained:,} trained tokens)"
