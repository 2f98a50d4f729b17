"""Fine-tuning data: chat and prompt/completion samples with the tokens the loss covers.

    data.format: chat               # a list of {role, content} per record, the tokenizer's chat template
    data.format: prompt_completion  # a prompt and a completion per record

Each sample becomes its token ids and a `trained` flag per token: 1 where the model should
learn to write that token (the assistant turns of a chat with their end-of-turn tokens, or the
completion and its EOS), 0 elsewhere; data.train_on: all sets every flag. A flag belongs to the
token as a *target*: the loss at position j predicts token j + 1 and counts iff token j + 1 is
flagged.

Chat masks come from the chat template itself, rendered prefix by prefix: the conversation up
to turn i with the generation prompt ends where the assistant's words begin, the conversation
up to and including turn i ends where its end-of-turn tokens end. Those character positions,
mapped onto the tokens of the whole rendered conversation (the tokenizer's offsets), give the
flags: exact for any template, with or without generation markers. A token that spans a
boundary (" At" after a header "assistant:") is trained: the model must learn to write it.

Samples are then laid out in rows of seq_len + 1 tokens (`plan_rows`): several per row with
data.packing (best-fit decreasing: few padded tokens), or one per row, padded. Next to each row's
tokens the shards hold its flags and each token's position within its own sample: the trainer
restarts the position ids there and masks attention so that no sample sees another.
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path

import numpy as np

from ..config import Config, UserError


class SampleError(UserError):
    pass


# ---------------------------------------------------------------------------------------------
# Tokens and flags of one sample


def chat_sample(tokenizer, messages: list[dict], train_on: str) -> tuple[list[int], list[int]]:
    """A conversation's token ids and trained flags (see the module docstring)."""
    render = lambda msgs, **kw: tokenizer.apply_chat_template(msgs, tokenize=False, **kw)  # noqa: E731
    text = render(messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    if train_on == "all":
        return ids, [1] * len(ids)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render(messages[:i]) if i else ""
        # Where the conversation so far stops agreeing with the whole: the turn's end (a template
        # may close the conversation, e.g. with an EOS, which the next turn does not follow).
        end = render(messages[:i + 1])
        end = end[:len(os.path.commonprefix([end, text]))]
        start = len(os.path.commonprefix([before, text]))
        if len(end) <= start:
            raise SampleError("data.format: chat: the tokenizer's chat template renders the start of a "
                              "conversation differently from the whole conversation (it may drop "
                              "earlier turns' content); the trained tokens cannot be found; use a "
                              "template that renders each turn the same way, or data.train_on: all")
        prompt = render(messages[:i], add_generation_prompt=True) if i else ""
        if len(prompt) > start and text.startswith(prompt):
            start = len(prompt)  # the assistant header is the prompt's, not trained
        else:  # a template without a generation prompt: the content is where the turn's words are
            found = end.find(str(message.get("content") or "").strip(), start)
            start = found if found >= 0 else start
        spans.append((start, len(end)))
    trained = [int(any(s < b and e > a for a, b in spans)) for s, e in offsets]
    return ids, trained


def prompt_completion_sample(tokenizer, prompt: str, completion: str, bos: int | None, eos: int,
                             train_on: str) -> tuple[list[int], list[int]]:
    """[BOS] prompt completion EOS, each part tokenized on its own; trained: the completion and
    the EOS (all: everything)."""
    head = [bos] if bos is not None else []
    p = tokenizer(prompt or "", add_special_tokens=False)["input_ids"]
    c = tokenizer(completion or "", add_special_tokens=False)["input_ids"]
    ids = head + p + c + [eos]
    if train_on == "all":
        return ids, [1] * len(ids)
    return ids, [0] * (len(head) + len(p)) + [1] * (len(c) + 1)


def encoder(cfg: Config, tokenizer, bos: int | None):
    """The batched `datasets.map` function that turns records into ids and trained flags."""
    d = cfg.data
    if d.format == "chat":
        if not tokenizer.chat_template:
            raise SampleError(f"model.tokenizer: {tokenizer.name_or_path} has no chat template, which "
                              f"data.format chat renders conversations with; use a tokenizer with one "
                              f"(an instruct model's), or data.format prompt_completion")

        def encode(batch):
            return columns([chat_sample(tokenizer, conv, d.train_on) for conv in batch[d.messages_field]])
    else:
        def encode(batch):
            return columns([prompt_completion_sample(tokenizer, p, c, bos, tokenizer.eos_token_id, d.train_on)
                            for p, c in zip(batch[d.prompt_field], batch[d.completion_field])])
    return encode


def columns(samples: list[tuple[list[int], list[int]]]):
    """A batch of (ids, trained flags) as an Arrow table: int32 ids and uint8 flags (5 bytes a
    token, not the 16 of Python ints' int64), in large lists (int64 offsets: a split may hold
    more than 2^31 tokens, where flatten's concatenation of int32-offset lists overflows)."""
    import pyarrow as pa
    return pa.table({"ids": pa.array([s[0] for s in samples], type=pa.large_list(pa.int32())),
                     "trained": pa.array([s[1] for s in samples], type=pa.large_list(pa.uint8()))})


# ---------------------------------------------------------------------------------------------
# Samples into rows


def plan_rows(lengths: np.ndarray, capacity: int, packing: bool) -> list[list[int]]:
    """The samples (their indices, in order) of each row of `capacity` tokens. Packing: best-fit
    decreasing, each sample (longest first) into the fullest row it fits in, else a new row."""
    if not packing:
        return [[i] for i in range(len(lengths))]
    rows: list[list[int]] = []
    spaces: list[tuple[int, int]] = []  # (free tokens, row), sorted
    for i in np.argsort(-np.asarray(lengths), kind="stable"):
        n = int(lengths[i])
        k = bisect.bisect_left(spaces, (n, -1))
        if k == len(spaces):
            rows.append([int(i)])
            free, row = capacity - n, len(rows) - 1
        else:
            free, row = spaces.pop(k)
            rows[row].append(int(i))
            free -= n
        if free > 0:
            bisect.insort(spaces, (free, row))
    return [sorted(r) for r in rows]


def fit(ids: np.ndarray, trained: np.ndarray, offsets: np.ndarray, capacity: int, truncation: str):
    """The samples to keep and their lengths after data.truncation, and what was cut or left out:
    (keep: indices, lengths, counts {truncated, dropped_long, dropped_untrained})."""
    full = np.diff(offsets)
    long = full > capacity
    lengths = np.minimum(full, capacity) if truncation == "truncate" else full
    targets = trained_targets(trained, offsets, lengths)
    keep = ~long if truncation == "drop" else np.ones(len(lengths), dtype=bool)
    untrained = keep & (targets == 0)
    keep &= ~untrained
    counts = {"truncated": int(long.sum()) if truncation == "truncate" else 0,
              "dropped_long": int(long.sum()) if truncation == "drop" else 0,
              "dropped_untrained": int(untrained.sum())}
    return np.flatnonzero(keep), lengths, counts


def trained_targets(trained: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
                    chunk: int = 16384) -> np.ndarray:
    """Each sample's trained targets: its flags after its first token, within its first
    `lengths[i]` tokens. A running sum over `chunk` samples at a time, so that a split of
    billions of tokens never needs an int64 copy of all its flags."""
    out = np.zeros(len(lengths), dtype=np.int64)
    for lo in range(0, len(lengths), chunk):
        hi = min(lo + chunk, len(lengths))
        base = offsets[lo]
        cum = np.concatenate([[0], np.cumsum(trained[base:offsets[hi]], dtype=np.int64)])
        starts = offsets[lo:hi] - base
        ends = starts + lengths[lo:hi]
        out[lo:hi] = cum[ends] - cum[np.minimum(starts + 1, ends)]
    return out


def write_rows(ids: np.ndarray, trained: np.ndarray, offsets: np.ndarray, folder: Path, split: str,
               dtype, capacity: int, pad: int, packing: bool, truncation: str, shard_tokens: int) -> dict:
    """Lay the samples (`ids[offsets[i]:offsets[i + 1]]`, flags alike) out in rows of `capacity`
    tokens, into shards of whole rows: tokens, trained flags (uint8) and positions within each
    sample; plus each row's count of trained targets. Returns the split's manifest part."""
    keep, lengths, counts = fit(ids, trained, offsets, capacity, truncation)
    rows = plan_rows(lengths[keep], capacity, packing)
    pos_dtype = np.uint16 if capacity <= np.iinfo(np.uint16).max + 1 else np.uint32
    per_shard = max(1, shard_tokens // capacity)
    shards, row_targets, used = [], [], 0
    for first in range(0, len(rows), per_shard):
        block = rows[first:first + per_shard]
        tok = np.full((len(block), capacity), pad, dtype=dtype)
        flag = np.zeros((len(block), capacity), dtype=np.uint8)
        pos = np.zeros((len(block), capacity), dtype=pos_dtype)
        for r, members in enumerate(block):
            at = 0
            for m in members:
                s = int(keep[m])
                n, start = int(lengths[s]), int(offsets[s])
                tok[r, at:at + n] = ids[start:start + n]
                flag[r, at + 1:at + n] = trained[start + 1:start + n]  # the first token: no target
                pos[r, at:at + n] = np.arange(n)
                at += n
            pos[r, at:] = np.arange(capacity - at)  # the padding: a segment of its own
            used += at
        row_targets.append(flag[:, 1:].sum(axis=1, dtype=np.int64))
        name = f"{split}-{len(shards):05d}"
        for suffix, array in (("bin", tok), ("trained.bin", flag), ("pos.bin", pos)):
            array.tofile(folder / f"{name}.{suffix}")
        shards.append({"file": f"{name}.bin", "trained": f"{name}.trained.bin",
                       "positions": f"{name}.pos.bin", "rows": len(block)})
    targets = np.concatenate(row_targets) if row_targets else np.zeros(0, dtype=np.int64)
    np.save(folder / f"{split}-targets.npy", targets.astype(np.int32))
    return {"samples": int(len(keep)), "rows": len(rows), "row_tokens": capacity,
            "tokens": int(used), "trained_tokens": int(targets.sum()),
            "padding": int(len(rows) * capacity - used), "positions_dtype": np.dtype(pos_dtype).name,
            "targets": f"{split}-targets.npy", **counts, "shards": shards}


def flatten(ds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A tokenized split's ids and flags as flat arrays and each sample's offsets into them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = ds.with_format("arrow")[:]
    id_col, flag_col = (table.column(c).combine_chunks() for c in ("ids", "trained"))
    if isinstance(id_col, pa.ChunkedArray):  # an empty table
        return np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(1, np.int64)
    offsets = id_col.offsets.to_numpy().astype(np.int64)
    ids = pc.list_flatten(id_col).to_numpy(zero_copy_only=False)
    trained = pc.list_flatten(flag_col).to_numpy(zero_copy_only=False).astype(np.uint8, copy=False)
    return ids, trained, offsets - offsets[0]


def summary(split: str, part: dict, seq_len: int, truncation: str) -> str:
    """prepare's line about a split of samples: kept, cut, left out, rows and padding. A row is
    seq_len tokens, as the trainer counts them (it stores seq_len + 1: the last one's target)."""
    cut = []
    if part["truncated"]:
        cut.append(f"{part['truncated']:,} truncated to fit a row")
    if part["dropped_long"]:
        cut.append(f"{part['dropped_long']:,} left out as longer than a row "
                   f"(data.truncation: {truncation})")
    if part["dropped_untrained"]:
        cut.append(f"{part['dropped_untrained']:,} left out with no token to train")
    fill = part["tokens"] / max(1, part["rows"] * part["row_tokens"])
    return (f"{split}: {part['samples']:,} samples in {part['rows']:,} rows of {seq_len} tokens "
            f"({fill:.0%} filled, {part['trained_tokens']:,} trained tokens)"
            + (f"; {'; '.join(cut)}" if cut else ""))
