"""Data preparation against the tokenizer alone: `llmtrain prepare` end to end vs the tokenizers
library's batch encoder on the same text.

    source workspace/llmtrain/env.sh
    python bench/prepare.py [--mb 50] [--rounds 2]

Writes `--mb` MiB of English-like text (the demo stories, lines shuffled with a fixed seed, one
document per line) and prepares it with a byte-level BPE of 8,192 tokens trained on it, as a user's
`llmtrain prepare` does (load, split off validation, tokenize in data.num_proc processes, pack
into shards; a fresh folder each round). The reference, measured in the same run: the backend
tokenizer's `encode_batch_fast` over the same lines in one process (it threads internally),
plus the BOS/EOS the prepared stream carries. Prints tokens/s for each and their ratio; the
target is >= 2.0M tokens/s end to end on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import time
from pathlib import Path

import yaml

from llmtrain.config import load_config
from llmtrain.data.loader import read_manifest
from llmtrain.data.prepare import prepare

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
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
    cfg = load_config(config)

    from tokenizers import Tokenizer
    backend = Tokenizer.from_file(str(tok / "tokenizer.json"))
    docs = [x for x in text.read_text().splitlines() if x]

    ours, theirs = [], []
    for _ in range(args.rounds):  # interleaved: each pair sees the same machine state
        # The reference first: after prepare's worker processes fork, tokenizers turns its own
        # threads off in this process's children, not here, but keep the order fixed anyway.
        t0 = time.perf_counter()
        n = sum(len(e.ids) for e in backend.encode_batch_fast(docs, add_special_tokens=False))
        theirs.append((n + len(docs)) / (time.perf_counter() - t0))  # + the EOS per document

        shutil.rmtree(WORK / "prepared", ignore_errors=True)
        shutil.rmtree(os.environ["HF_DATASETS_CACHE"], ignore_errors=True)
        t0 = time.perf_counter()
        folder = prepare(cfg, log=lambda *_: None)
        seconds = time.perf_counter() - t0
        manifest = read_manifest(folder)
        tokens = sum(s["tokens"] for s in manifest["splits"].values())
        ours.append(tokens / seconds)

    print(f"{text.stat().st_size / 2**20:.0f} MiB, {len(docs):,} documents, {tokens:,} tokens prepared")
    print(f"llmtrain prepare (end to end): {statistics.median(ours) / 1e6:.2f}M tokens/s "
          f"(rounds: {', '.join(f'{x / 1e6:.2f}' for x in ours)})")
    print(f"encode_batch_fast (tokenizing only): {statistics.median(theirs) / 1e6:.2f}M tokens/s "
          f"(rounds: {', '.join(f'{x / 1e6:.2f}' for x in theirs)})")
    print(f"ratio: {statistics.median(ours) / statistics.median(theirs):.2f}")


if __name__ == "__main__":
    main()
