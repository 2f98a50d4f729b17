"""Data preparation against the tokenizer alone: `llmtrain prepare` end to end vs the tokenizers
library's batch encoder on the same text.

    source workspace/llmtrain/env.sh
    python bench/prepare.py [--mb 50] [--rounds 3]

Writes `--mb` MiB of English-like text (the demo stories, lines shuffled with a fixed seed, one
document per line) and prepares it with a byte-level BPE of 8,192 tokens trained on it, as a user
does: `llmtrain prepare --config FILE` in a process of its own (load, split off validation,
tokenize in data.num_proc processes, pack into shards; a fresh folder and datasets cache each
round). Two figures for it: end to end (process start to exit: Python's and the libraries'
imports included) and prepare's own time after start-up (the manifest's `seconds`: what a
100B-token corpus is made of; it includes whatever of the tokenizer's load, in a forked process
while the source is read, is left when the read is done). The reference, in a fresh process each round, interleaved:
the backend tokenizer's `encode_batch_fast` over the same lines (1,000 a call) with its own threads on every
core (what the tokenizer alone can do on this machine), and on one thread (times the cores:
the ceiling for processes that do nothing but tokenize), plus the EOS the prepared stream
carries. Prints tokens/s for each and the ratios; the target is >= 2.0M tokens/s on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from llmtrain.data.sources import read_manifest

REPO = Path(__file__).resolve().parents[1]
WORK = Path("/tmp/llmtrain-prepare-bench")
# A cache of its own, emptied before each round: a user's first prepare of a corpus reads and
# tokenizes it; a second round must not find the first one's Arrow files.
os.environ["HF_DATASETS_CACHE"] = str(WORK / "hf-datasets-cache")


def corpus(mb: int) -> Path:
    path = WORK / f"stories-{mb}mb.txt"
    if path.exists():
        return path
    lines = [x for x in (REPO / "configs" / "demo" / "stories.txt").read_text().splitlines() if x.strip()]
    rng, out, size = random.Random(0), [], 0
    while size < mb << 20:
        rng.shuffle(lines)
        out.extend(lines)
        size += sum(len(x) + 1 for x in lines)
    path.write_text("\n".join(out) + "\n")
    return path


def tokenizer(text: Path) -> Path:
    """A byte-level BPE of 8,192 tokens trained on the first 10 MiB of the corpus, saved as a
    Hugging Face tokenizer folder (what download_data_model.sh fetches for a real model)."""
    folder = WORK / "tokenizer-8192"
    if (folder / "tokenizer.json").exists():
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    lines = text.read_text()[: 10 << 20].splitlines()
    bpe.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=8192, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


REFERENCE = """
import sys, time
from tokenizers import Tokenizer
backend = Tokenizer.from_file(sys.argv[1])
with open(sys.argv[2]) as f:
    docs = [x for x in f.read().splitlines() if x]
BATCH = 1000  # the batch prepare's tokenizing processes encode at a time (datasets' map)
t0 = time.perf_counter()
n = 0
for i in range(0, len(docs), BATCH):  # one call over every line is 2x slower (236k Encodings)
    n += sum(len(e.ids) for e in backend.encode_batch_fast(docs[i:i + BATCH], add_special_tokens=False))
print((n + len(docs)) / (time.perf_counter() - t0))  # + the EOS after each document
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    text = corpus(args.mb)
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    tok = tokenizer(text)
    demo["model"]["tokenizer"] = str(tok)
    demo["data"]["dataset"] = str(text)
    demo["data"]["prepared_dir"] = str(WORK / "prepared")
    demo["run"] = {"name": "prepare-bench", "dir": str(WORK / "runs")}
    config = WORK / "config.yaml"
    config.write_text(yaml.safe_dump(demo))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true"}

    whole, own, theirs, single = [], [], [], []
    for _ in range(args.rounds):  # interleaved: each pair sees the same machine state
        for parallel, into in (("true", theirs), ("false", single)):
            out = subprocess.run([sys.executable, "-c", REFERENCE, str(tok / "tokenizer.json"), str(text)],
                                 env={**env, "TOKENIZERS_PARALLELISM": parallel}, check=True,
                                 capture_output=True, text=True).stdout
            into.append(float(out))

        shutil.rmtree(WORK / "prepared", ignore_errors=True)
        shutil.rmtree(os.environ["HF_DATASETS_CACHE"], ignore_errors=True)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "llmtrain", "prepare", "--config", str(config)],
                       env=env, check=True, capture_output=True)
        seconds = time.perf_counter() - t0
        manifest = read_manifest(next((WORK / "prepared").iterdir()))
        tokens = sum(s["tokens"] for s in manifest["splits"].values())
        whole.append(tokens / seconds)
        own.append(tokens / manifest["seconds"])

    def show(xs):
        return f"{statistics.median(xs) / 1e6:.2f}M tokens/s (rounds: {', '.join(f'{x / 1e6:.2f}' for x in xs)})"

    ref = statistics.median(theirs)
    print(f"{text.stat().st_size / 2**20:.0f} MiB, {len(text.read_text().splitlines()):,} documents, "
          f"{tokens:,} tokens prepared, {os.cpu_count()} cores")
    print(f"llmtrain prepare, end to end:        {show(whole)}  ratio {statistics.median(whole) / ref:.2f}")
    print(f"llmtrain prepare, after start-up:    {show(own)}  ratio {statistics.median(own) / ref:.2f}")
    print(f"encode_batch_fast (tokenizing only): {show(theirs)}")
    cores = len(os.sched_getaffinity(0))
    ceiling = statistics.median(single) * cores
    print(f"encode_batch_fast on one thread:     {show(single)}; x {cores} cores = {ceiling / 1e6:.2f}M, "
          f"prepare after start-up at {statistics.median(own) / ceiling:.0%} of it")


if __name__ == "__main__":
    main()
