"""Regenerate the demo's shipped assets: stories.txt and the tokenizer/ folder.

    python configs/demo/make_demo_assets.py [--docs 4000] [--vocab 512]

The demo must train offline on a fresh machine, so the repo ships a small corpus of simple,
generated stories (deterministic: seeded) and a byte-level BPE tokenizer trained on it with
`tokenizers`, saved as a Hugging Face fast-tokenizer folder. Tests use the same generator.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

NAMES = ["Tom", "Anna", "Ben", "Lily", "Max", "Mia", "Sam", "Zoe", "Leo", "Ella"]
PETS = ["dog", "cat", "bird", "fish", "rabbit", "frog"]
THINGS = ["ball", "kite", "box", "book", "hat", "cake", "boat", "car", "flower", "apple"]
COLORS = ["red", "blue", "green", "yellow", "big", "small", "old", "new"]
PLACES = ["park", "garden", "house", "forest", "river", "school", "beach", "shop"]
FEELINGS = ["happy", "sad", "tired", "hungry", "scared", "proud"]


def story(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    pet, thing, color = rng.choice(PETS), rng.choice(THINGS), rng.choice(COLORS)
    place, place2, feeling = rng.choice(PLACES), rng.choice(PLACES), rng.choice(FEELINGS)
    he = "she" if a in ("Anna", "Lily", "Mia", "Zoe", "Ella") else "he"
    lines = [
        f"Once upon a time, {a} had a {color} {thing}.",
        f"{a} went to the {place} with a {pet}.",
        rng.choice([
            f"At the {place}, {a} met {b}.",
            f"{b} was at the {place} too.",
            f"The {pet} ran to {b}.",
        ]),
        rng.choice([
            f"{b} wanted to play with the {thing}, so {a} gave the {thing} to {b}.",
            f"{a} and {b} played with the {thing} all day.",
            f"The {thing} fell in the {place2}, and {b} helped {a} find it.",
        ]),
        f"{a} was {feeling}, and {he} said, \"Thank you, {b}!\"",
        rng.choice(["The end.", f"Then they went home to the {place2}.", "They were friends."]),
    ]
    return " ".join(lines)


def stories(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [story(rng) for _ in range(n)]


def train_tokenizer(texts: list[str], vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = ap.parse_args()
    texts = stories(args.docs)
    (args.out / "stories.txt").write_text("\n".join(texts) + "\n")
    train_tokenizer(texts, args.vocab, args.out / "tokenizer")


if __name__ == "__main__":
    main()
