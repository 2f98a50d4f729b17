"""Regenerate the fine-tuning demo's shipped assets: chat.jsonl and the tokenizer/ folder.

    python configs/sft-demo/make_sft_assets.py [--conversations 3000]

The demo fine-tunes the story model that configs/demo.yaml trains (exported as its base) with
LoRA on generated question-answer chats about the same little world: the user tells a fact and
asks about it, the assistant answers in one sentence of a fixed shape ("The kite was red.").
Deterministic (seeded). The tokenizer is the demo's, with a chat template that adds no token
(the base model's vocabulary stays as it is): "Question: ..." and "Answer: ..." turns, each
answer ending with the EOS token the base model already knows as the end of a story.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "demo"))
from make_demo_assets import COLORS, NAMES, PETS, PLACES, THINGS  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}Answer: {{ m['content'] }}{{ eos_token }}\n"
    "{% else %}Question: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Answer:{% endif %}"
)


def exchange(rng: random.Random) -> tuple[str, str]:
    name, thing, color = rng.choice(NAMES), rng.choice(THINGS), rng.choice(COLORS)
    pet, place = rng.choice(PETS), rng.choice(PLACES)
    return rng.choice([
        (f"{name} had a {color} {thing}. What color was the {thing}?", f"The {thing} was {color}."),
        (f"{name} went to the {place} with a {pet}. Where did {name} go?", f"{name} went to the {place}."),
        (f"{name} went to the {place} with a {pet}. What pet did {name} have?", f"{name} had a {pet}."),
        (f"{name} had a {color} {thing}. Who had the {thing}?", f"{name} had the {thing}."),
    ])


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = []
        for _ in range(rng.choice([1, 1, 2])):
            question, answer = exchange(rng)
            turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append(turns)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=3000)
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args()
    with open(args.out / "chat.jsonl", "w") as f:
        for messages in conversations(args.conversations):
            f.write(json.dumps({"messages": messages}) + "\n")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(HERE.parent / "demo" / "tokenizer")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(args.out / "tokenizer")


if __name__ == "__main__":
    main()
