"""Fine-tuning data: chat and prompt/completion masks, rows of packed samples that never see each
other, and a loss that is the mean over every trained token of the step however it is split."""

from __future__ import annotations

import dataclasses
import json
import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from conftest import DEMO, assert_same_curve, cli, read_metrics, tiny_config, torchrun
from llmtrain.config import load_config
from llmtrain.data.loader import Batch, document_positions, open_prepared, open_split
from llmtrain.data.samples import chat_sample, columns, plan_rows, prompt_completion_sample, trained_targets
from llmtrain.model.attention import causal_attention, document_mask
from llmtrain.model.loss import IGNORE, lm_loss

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# No generation prompt, no end-of-turn token: a turn ends with its newline.
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
# Closes the whole conversation only: a prefix rendered alone ends with an EOS the whole lacks there.
CLOSED = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{{ eos_token }}"

CONVERSATION = [
    {"role": "system", "content": "Answer in one sentence."},
    {"role": "user", "content": "Where is Anna?"},
    {"role": "assistant", "content": "In the park."},
    {"role": "user", "content": "And Tom?"},
    {"role": "assistant", "content": "At school."},
]


def chat_tokenizer(folder, template=CHATML):
    """The demo tokenizer with ChatML's turn markers and a chat template."""
    tok = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template
    tok.save_pretrained(folder)
    return tok


def trained_spans(tok, ids, trained) -> list[str]:
    """The trained tokens, decoded run by run."""
    spans, run = [], []
    for i, t in zip(ids, trained):
        if t:
            run.append(i)
        elif run:
            spans.append(tok.decode(run))
            run = []
    return spans + ([tok.decode(run)] if run else [])


@pytest.mark.parametrize("template,expected", [
    (CHATML, ["In the park.<|im_end|>\n", "At school.<|im_end|>\n"]),
    (PLAIN, ["In the park.\n", " At school.\n"]),  # " At": the token holds the header's space
    (CLOSED, ["In the park.\n", " At school.\n<|endoftext|>"]),
])
def test_chat_masks_cover_exactly_the_assistant_turns(tmp_path, template, expected):
    tok = chat_tokenizer(tmp_path, template)
    ids, trained = chat_sample(tok, CONVERSATION, "completion")
    assert ids == tok(tok.apply_chat_template(CONVERSATION, tokenize=False), add_special_tokens=False)["input_ids"]
    assert trained_spans(tok, ids, trained) == expected
    assert chat_sample(tok, CONVERSATION, "all")[1] == [1] * len(ids)


def test_prompt_completion_trains_the_completion_and_eos(tmp_path):
    tok = chat_tokenizer(tmp_path)
    eos = tok.eos_token_id
    ids, trained = prompt_completion_sample(tok, "What is 2 plus 3?", " 5.", bos=None, eos=eos,
                                            train_on="completion")
    assert tok.decode(ids) == "What is 2 plus 3? 5.<|endoftext|>"
    assert trained_spans(tok, ids, trained) == [" 5.<|endoftext|>"]
    ids, trained = prompt_completion_sample(tok, "Hi", " there", bos=7, eos=eos, train_on="all")
    assert ids[0] == 7 and trained == [1] * len(ids)


def test_trained_targets_are_counted_the_same_in_chunks_of_samples():
    """Each sample's targets (flags after its first token, within its kept length), summed a
    chunk of samples at a time, equal the plain per-sample sums, empty samples included; the
    columns prepare stores are int32 ids and uint8 flags in lists with 64-bit offsets."""
    rng = np.random.default_rng(0)
    full = rng.integers(0, 12, size=50)
    offsets = np.concatenate([[0], np.cumsum(full)])
    trained = rng.integers(0, 2, size=int(offsets[-1])).astype(np.uint8)
    lengths = np.minimum(full, 7)
    want = [int(trained[offsets[i] + 1:offsets[i] + lengths[i]].sum()) for i in range(50)]
    for chunk in (1, 3, 16384):
        assert trained_targets(trained, offsets, lengths, chunk=chunk).tolist() == want
    table = columns([([5, 6, 7], [0, 1, 1]), ([], [])])
    assert [str(table.schema.field(c).type) for c in ("ids", "trained")] == ["large_list<item: int32>",
                                                                            "large_list<item: uint8>"]


def test_best_fit_packing_fills_rows_and_keeps_every_sample_once():
    lengths = np.array([60, 10, 30, 65, 5, 40, 25, 1, 64, 35])
    rows = plan_rows(lengths, 65, packing=True)
    assert sorted(i for r in rows for i in r) == list(range(10))
    assert all(lengths[r].sum() <= 65 for r in rows)
    assert len(rows) == -(-lengths.sum() // 65)  # as few rows as the tokens need, here
    assert plan_rows(lengths, 65, packing=False) == [[i] for i in range(10)]


# ---------------------------------------------------------------------------------------------
# Prepared rows


def write_chat(path, n, seed=0):
    """n conversations of one or two exchanges: uneven lengths and uneven trained shares."""
    rng = random.Random(seed)
    names, things = ["Tom", "Anna", "Ben", "Lily", "Max"], ["ball", "kite", "box", "book", "hat"]
    colors = ["red", "blue", "green", "yellow"]
    with open(path, "w") as f:
        for i in range(n):
            who, what, color = rng.choice(names), rng.choice(things), rng.choice(colors)
            msgs = [{"role": "user", "content": f"{who} has a {color} {what}. What color is the {what}?"},
                    {"role": "assistant", "content": f"The {what} is {color}."}]
            if i % 3 == 0:
                msgs = ([{"role": "system", "content": "Answer in one short sentence, please."}] + msgs +
                        [{"role": "user", "content": "Who has it?"},
                         {"role": "assistant", "content": f"{who} has the {what}, and it is {color}."}])
            f.write(json.dumps({"messages": msgs}) + "\n")


def sft_config(root, **data) -> dict:
    tok = root / "tok"
    if not tok.exists():
        chat_tokenizer(tok)
    if not (root / "chat.jsonl").exists():
        write_chat(root / "chat.jsonl", 120)
    cfg = tiny_config(data={"dataset": str(root / "chat.jsonl"), "format": "chat", "seq_len": 96,
                            "validation_fraction": 0.1, **data},
                      train={"eval_samples": 8, "max_steps": 4, "checkpoint_every": 0, "eval_every": 2})
    cfg["model"]["tokenizer"] = str(tok)
    return cfg


def prepared_rows(root, monkeypatch, name, **data):
    monkeypatch.setenv("LLMTRAIN_HOME", str(root / "home"))
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(sft_config(root, **data)))
    proc = cli("prepare", "--config", path, check=True)
    cfg = load_config(path)
    folder, manifest = open_prepared(cfg)
    return cfg, manifest, open_split(folder, manifest, "train", cfg), proc.stdout + proc.stderr


def test_prepare_lays_samples_out_in_rows_with_their_flags(tmp_path, monkeypatch):
    cfg, manifest, rows, out = prepared_rows(tmp_path, monkeypatch, "packed")
    part = manifest["splits"]["train"]
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert manifest["source"]["format"] == "chat" and manifest["samples"]["packing"] is True
    assert f"train: {part['samples']} samples in {part['rows']} rows of 96 tokens" in out
    assert part["samples"] == 108 and part["rows"] < 0.7 * part["samples"]  # rows shared
    batch = rows.batch(np.arange(part["rows"]), 96)
    assert batch.targets() == part["trained_tokens"] == rows.targets(np.arange(part["rows"]), 96)
    # Each row: samples one after another, positions restarting at each, then padding.
    samples = []
    for tokens, trained, positions in zip(batch.tokens, batch.trained, batch.positions):
        starts = list(np.flatnonzero(positions == 0)) + [len(tokens)]
        for a, b in zip(starts, starts[1:]):
            assert list(positions[a:b]) == list(range(b - a)) and not trained[a]
            if tokens[a] != tok.pad_token_id:  # not the row's padding
                samples.append(tokens[a:b])
    conversations = [json.loads(line)["messages"] for line in open(tmp_path / "chat.jsonl")]
    rendered = {tok.apply_chat_template(c, tokenize=False) for c in conversations}
    whole = [tok.decode(s) for s in samples if len(s) < 97]
    cut = [tok.decode(s) for s in samples if len(s) == 97]
    assert len(samples) == part["samples"] and len(cut) == part["truncated"] > 0
    assert set(whole) <= rendered and all(any(r.startswith(c) for r in rendered) for c in cut)


def test_samples_prepared_by_two_processes_are_the_same_rows(tmp_path, monkeypatch):
    _, manifest, one, _ = prepared_rows(tmp_path, monkeypatch, "one")
    environ = os.environ
    _, again, two, _ = prepared_rows(tmp_path, monkeypatch, "two", num_proc=2,
                                     prepared_dir=str(tmp_path / "again"))
    assert os.environ is environ  # datasets' map(num_proc=2) leaves a copy in its place: put back
    n = manifest["splits"]["train"]["rows"]
    assert again["splits"]["train"]["rows"] == n
    a, b = one.batch(np.arange(n), 96), two.batch(np.arange(n), 96)
    assert all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("tokens", "trained", "positions"))


def test_truncation_cuts_or_leaves_out_long_samples_and_says_so(tmp_path, monkeypatch):
    *_, cut = prepared_rows(tmp_path, monkeypatch, "cut", seq_len=64)
    _, manifest, _, dropped = prepared_rows(tmp_path, monkeypatch, "drop", seq_len=64, truncation="drop")
    n_long = manifest["splits"]["train"]["dropped_long"]
    assert n_long > 0
    assert f"{n_long} truncated to fit a row" in cut
    assert f"{n_long} left out as longer than a row (data.truncation: drop)" in dropped
    assert manifest["splits"]["train"]["samples"] == 108 - n_long



def test_a_conversation_record_without_messages_is_one_line(tmp_path, monkeypatch):
    """Record 6 names its conversation `msgs`: one line naming the file, the record and the
    column (was the chat template's TypeError traceback), and nothing left prepared."""
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    write_chat(tmp_path / "chat.jsonl", 40)
    lines = (tmp_path / "chat.jsonl").read_text().splitlines()
    lines[5] = json.dumps({"msgs": json.loads(lines[5])["messages"]})
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    path = tmp_path / "chat.yaml"
    path.write_text(yaml.safe_dump(sft_config(tmp_path)))
    proc = cli("prepare", "--config", path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"error: data.messages_field: record 6 of {tmp_path}/chat.jsonl has no 'messages' (1 record "
        f"in all: the field is missing, or null); give every record a 'messages', or remove those records")
    prepared = tmp_path / "home" / "prepared"
    assert prepared.is_dir() and not list(prepared.iterdir())

def test_rows_in_more_shard_files_than_open_files_read_whole(tmp_path, monkeypatch):
    """Rows a shard each (3 files: tokens, flags, positions), ~200 files, read under a limit of
    64 open files: the same rows as one shard holds."""
    from test_data import read_under_limit
    from llmtrain.data import prepare as prepare_mod

    _, manifest, one, _ = prepared_rows(tmp_path, monkeypatch, "one")
    monkeypatch.setattr(prepare_mod, "SHARD_TOKENS", 97)  # a row of 97 tokens per shard
    prepared_rows(tmp_path, monkeypatch, "many", prepared_dir=str(tmp_path / "many"))
    n = manifest["splits"]["train"]["rows"]
    assert 3 * n > 192
    rows, line = read_under_limit(tmp_path / "many.yaml", 64, 64, tmp_path / "rows.npz")
    assert line == {"soft": 64, "samples": n}
    want = one.batch(np.arange(n), 96)
    assert all(np.array_equal(rows[k], getattr(want, k)) for k in ("tokens", "trained", "positions"))


def test_unpacked_rows_are_cut_to_the_longest_sample_and_lose_the_same(tmp_path, monkeypatch):
    """data.packing: false: a micro-batch of rows is cut after its longest sample, rounded up to
    a multiple of 8 inputs (the full row at most); the tokens cut are padding, the loss and
    gradients the same."""
    cfg, manifest, rows, _ = prepared_rows(tmp_path, monkeypatch, "unpacked", packing=False, seq_len=128)
    folder, _ = open_prepared(cfg)
    [shard] = manifest["splits"]["train"]["shards"]
    full = Batch(*(np.fromfile(folder / shard[key], dtype=dtype).reshape(-1, 129).astype(np.int64)
                   for key, dtype in (("file", manifest["dtype"]), ("trained", np.uint8),
                                      ("positions", manifest["splits"]["train"]["positions_dtype"]))))
    full.trained = full.trained.astype(bool)
    restart = full.positions[:, 1:] == 0  # a row's padding restarts the positions
    length = np.where(restart.any(axis=1), restart.argmax(axis=1) + 1, 129)
    short, longest = np.argsort(length)[:8], np.argsort(length)[-8:]
    assert length[short].max() + 8 < length[longest].max()  # two different widths
    model = tiny_llama()
    for indices in (short, longest):
        batch = rows.batch(indices, 128)
        # The longest sample's inputs (its last token is a target only) rounded up to a multiple
        # of 8: at most 7 padded inputs past it; the whole row of 129 at most.
        inputs = int(length[indices].max()) - 1
        width = min(129, -(-inputs // 8) * 8 + 1)
        assert 0 <= width - 1 - inputs < 8 and width < 129
        assert batch.tokens.shape == batch.trained.shape == batch.positions.shape == (8, width)
        uncut = Batch(full.tokens[indices], full.trained[indices], full.positions[indices])
        assert batch.targets() == uncut.targets() == rows.targets(indices, 128)
        losses, grads = [], []
        for b in (batch, uncut):
            model.zero_grad()
            loss = lm_loss(model, batch_to_torch(b), normaliser=b.targets())
            loss.backward()
            losses.append(loss.item())
            grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
        assert abs(losses[0] - losses[1]) < 1e-6
        assert torch.allclose(grads[0], grads[1], atol=1e-7, rtol=1e-5)
    # Tensor and context parallel cut each batch's length into 2 x cp x tp pieces: under cp 2 x
    # tp 4 the width is rounded up to a multiple of 16 instead (8 under cp 2 x tp 2).
    for cp, tp, multiple in ((2, 2, 8), (2, 4, 16)):
        layout = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp=cp, tp=tp))
        inputs = int(length[short].max()) - 1
        width = open_split(folder, manifest, "train", layout).batch(short, 128).tokens.shape[1]
        assert width == min(129, -(-inputs // multiple) * multiple + 1), (cp, tp, width)


# ---------------------------------------------------------------------------------------------
# Attention within a sample, loss over the trained tokens


def tiny_llama(attn="sdpa", seed=0):
    config = AutoConfig.for_model("llama", vocab_size=512, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    if attn == "sdpa":
        causal_attention(model)
    return model


def token_losses(model, batch: Batch, flex: bool = False) -> torch.Tensor:
    """Each target's loss (IGNORE targets: 0)."""
    b = batch_to_torch(batch)
    extra = {}
    if b.positions is not None:
        positions = b.positions[:, :-1]
        extra = {"position_ids": positions, "attention_mask": document_mask(model, positions, flex=flex)}
    logits = model(input_ids=b.tokens[:, :-1], **extra).logits
    targets = b.tokens[:, 1:]
    if b.trained is not None:
        targets = targets.masked_fill(~b.trained[:, 1:], IGNORE)
    return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")


@pytest.mark.parametrize("attn", ["sdpa", "eager", pytest.param("flex", marks=pytest.mark.slow)])
def test_a_sample_loses_the_same_alone_or_packed_with_others(attn):
    """sdpa's boolean mask, eager's additive one, and flex attention's BlockMask (what sdpa uses
    on GPUs; compiled, also on this CPU)."""
    flex = attn == "flex"
    model = tiny_llama("sdpa" if flex else attn)
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(1, 512, n) for n in (20, 30, 14))
    packed = np.concatenate([b, a, c])[None]
    alone = np.concatenate([a, np.zeros(64 - 20, dtype=a.dtype)])[None]
    pos = lambda *ns: np.concatenate([np.arange(n) for n in ns])[None]  # noqa: E731
    with torch.no_grad():
        in_row = token_losses(model, Batch(packed, positions=pos(30, 20, 14)), flex)[0, 30:49]
        by_itself = token_losses(model, Batch(alone, positions=pos(20, 44)), flex)[0, :19]
        unmasked = token_losses(model, Batch(packed))[0, 30:49]
    assert torch.allclose(in_row, by_itself, atol=1e-5, rtol=0)
    assert not torch.allclose(unmasked, by_itself, atol=1e-3)  # without the mask, b leaks into a


def test_text_document_masking_restarts_at_every_eos():
    tokens = np.array([[5, 6, 0, 7, 8, 9, 0, 4]])
    assert document_positions(tokens, eos=0).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]


def test_packed_and_unpacked_rows_give_the_same_loss_and_gradients(tmp_path, monkeypatch):
    results = {}
    for packing in (True, False):
        _, manifest, rows, _ = prepared_rows(tmp_path, monkeypatch, f"p{packing}", packing=packing)
        n = manifest["splits"]["train"]["rows"]
        model = tiny_llama()
        batch = rows.batch(np.arange(n), 96)
        loss = lm_loss(model, batch_to_torch(batch), normaliser=batch.targets())
        loss.backward()
        results[packing] = (n, loss.item(), model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    assert results[True][0] < 0.7 * results[False][0]
    assert abs(results[True][1] - results[False][1]) < 1e-5
    assert torch.allclose(results[True][2], results[False][2], atol=1e-6, rtol=1e-4)


def batch_to_torch(batch: Batch) -> Batch:
    return Batch(**{k: torch.as_tensor(v) for k, v in batch.fields().items()})


# ---------------------------------------------------------------------------------------------
# The loss of a step: the mean over all its trained tokens, however the step is split


@pytest.mark.slow
def test_loss_does_not_depend_on_micro_batch_accumulation_or_world_size(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    cfg = sft_config(tmp_path, packing=False)  # one sample per row: the most uneven masks
    cfg["train"].update(max_steps=3, log_every=1, eval_every=3, eval_samples=4)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli("prepare", "--config", path, check=True)
    runs = {"mb8": ["--set", "train.micro_batch_size=8"], "mb2x4": ["--set", "train.micro_batch_size=2"]}
    for name, extra in runs.items():
        cli("train", "--config", path, "--set", f"run.name={name}", *extra, check=True)
    torchrun(2, "train", "--config", path, "--set", "run.name=w2", "--set", "train.micro_batch_size=1")
    home = tmp_path / "home" / "runs"
    for name in ("mb2x4", "w2"):
        assert_same_curve(home / name, home / "mb8", tol=1e-5)
    first = read_metrics(home / "mb8")[0]
    assert first["step"] == 1 and 5.0 < first["loss"] < 7.0  # ~ln(vocab): the trained tokens' mean


# ---------------------------------------------------------------------------------------------
# LoRA


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """A pretrained base (a tiny Llama with the chat tokenizer, saved as HF saves models), chat
    data prepared for it, and three LoRA runs of 6 steps on two ranks: DDP, FSDP2 with activation
    checkpointing, and HSDP over two replicas."""
    root = tmp_path_factory.mktemp("lora")
    mp = pytest.MonkeyPatch()
    mp.setenv("LLMTRAIN_HOME", str(root / "home"))
    try:
        tok = chat_tokenizer(root / "base")
        base = tiny_llama(seed=1)
        base.config.update({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                            "pad_token_id": tok.pad_token_id})
        base.save_pretrained(root / "base")
        write_chat(root / "chat.jsonl", 120)
        cfg = sft_config(root)
        cfg["model"] = {"name_or_path": str(root / "base"), "lora": {"rank": 4, "alpha": 8}}
        cfg["train"].update(max_steps=6, checkpoint_every=3, eval_every=3, lr=1e-2, min_lr=1e-3, warmup_steps=1)
        config = root / "lora.yaml"
        config.write_text(yaml.safe_dump(cfg))
        cli("prepare", "--config", config, check=True)
        torchrun(2, "train", "--config", config, "--set", "run.name=ddp")
        torchrun(2, "train", "--config", config, "--set", "run.name=fsdp", "--set", "parallel.strategy=fsdp",
                 "--set", "model.activation_checkpointing=true")
        torchrun(2, "train", "--config", config, "--set", "run.name=hsdp", "--set", "parallel.strategy=hsdp",
                 "--set", "parallel.shard_size=1")  # 2 replicas of 1 shard: HSDP's replicate dimension
        yield root, config
    finally:
        mp.undo()


@pytest.mark.slow
def test_lora_trains_the_adapters_alone_the_same_on_ddp_fsdp_and_hsdp(lora):
    root, _ = lora
    runs = root / "home" / "runs"
    # rank x (in + out) of q, k, v, o (32 -> 32, 32 -> 16, 32 -> 16, 32 -> 32) in each of 2 layers
    analytic = 2 * 4 * ((32 + 32) + (32 + 16) + (32 + 16) + (32 + 32))
    for run in ("ddp", "fsdp", "hsdp"):
        log = (runs / run / "logs" / "rank-0.log").read_text()
        assert f"LoRA: {analytic:,} trainable parameters" in log
    assert_same_curve(runs / "fsdp", runs / "ddp", tol=1e-5)
    assert_same_curve(runs / "hsdp", runs / "ddp", tol=1e-5)
    train = [r["loss"] for r in read_metrics(runs / "ddp") if r["kind"] == "train"]
    assert train[-1] < train[0] - 0.05
    # The checkpoint holds the adapters and their optimizer state, nothing of the frozen base.
    import torch.distributed.checkpoint as dcp
    keys = dcp.FileSystemReader(runs / "fsdp" / "checkpoints" / "step-00000006").read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("model.")]
    assert len(weights) == 2 * 4 * 2 and all(".lora_A." in k or ".lora_B." in k for k in weights)


@pytest.mark.slow
def test_lora_killed_and_restarted_resumes_bit_identically(lora):
    """Killed while its last rank hangs at step 5 (after the step-3 checkpoint), restarted: every
    loss equals the uninterrupted FSDP run's, bit for bit."""
    from test_checkpoint import kill_when, logged_step
    from conftest import torchrun_popen, env_with, losses

    root, config = lora
    run_dir = root / "home" / "runs" / "killed"
    sets = ["--set", "run.name=killed", "--set", "parallel.strategy=fsdp"]
    proc = torchrun_popen(2, "train", "--config", config, *sets, env=env_with(LLMTRAIN_INJECT_HANG_STEP="5"))
    kill_when(proc, lambda: (run_dir / "checkpoints" / "latest").exists() and logged_step(run_dir) >= 4)
    assert logged_step(run_dir) < 6
    torchrun(2, "train", "--config", config, *sets)
    assert losses(run_dir) == losses(root / "home" / "runs" / "fsdp")
    assert "resumed from" in (run_dir / "logs" / "rank-0.log").read_text()


@pytest.mark.slow
def test_lora_exports_load_in_peft_and_plain_transformers_with_the_trained_logits(lora):
    from peft import PeftModel

    from llmtrain.training.export import load_checkpoint_model

    root, _ = lora
    run = root / "home" / "runs" / "fsdp"
    cli("export", "--run-dir", run, "--out", root / "adapter", check=True)
    merged = cli("export", "--run-dir", run, "--out", root / "merged", "--merge", check=True)
    assert "(fp32 weights)" in merged.stdout
    assert sorted(p.name for p in (root / "adapter").glob("adapter_*")) == ["adapter_config.json",
                                                                          "adapter_model.safetensors"]
    trained, tok = load_checkpoint_model(run)
    ids = torch.tensor([tok("<|im_start|>user\nTom has a red ball.<|im_end|>\n").input_ids])
    with torch.no_grad():
        want = trained(ids).logits
        base = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
        plain = base(ids).logits
        peft = PeftModel.from_pretrained(base, root / "adapter").eval()(ids).logits
        folded = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32)(ids).logits
    assert (want - plain).abs().max() > 1e-3  # the adapters changed something
    assert torch.allclose(peft, want, atol=1e-5, rtol=0)
    assert torch.allclose(folded, want, atol=1e-5, rtol=0)

    # Generation from the run itself, no export first; --chat renders the template.
    chat = cli("generate", "--run-dir", run, "--prompt", "What color is the ball?", "--chat",
               "--max-new-tokens", "5", "--temperature", "0", check=True)
    plain_out = cli("generate", "--run-dir", run, "--prompt", "Tom", "--max-new-tokens", "3", check=True)
    assert chat.stdout.strip() and "user" not in chat.stdout and plain_out.stdout.startswith("Tom")


def test_text_with_document_masking_trains_each_document_as_if_alone(tmp_path, monkeypatch):
    """data.document_masking: the first step's loss equals the loss of the same windows with
    every document run through the model on its own (positions from 0, nothing before it)."""
    monkeypatch.setenv("LLMTRAIN_HOME", str(tmp_path / "home"))
    model = tiny_llama(seed=3)
    tok = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    model.config.update({"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id})
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    cfg = tiny_config(data={"document_masking": True},
                      train={"max_steps": 1, "warmup_steps": 0, "eval_every": 0, "micro_batch_size": 8})
    cfg["model"] = {"name_or_path": str(tmp_path / "model")}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli("prepare", "--config", path, check=True)
    cli("train", "--config", path, check=True)

    from llmtrain.data.loader import StepSampler
    c = load_config(path, world_size=1)
    folder, manifest = open_prepared(c)
    data = open_split(folder, manifest, "train", c)
    batch = data.batch(StepSampler(data.num_samples(64), 8, c.train.seed, 0, 1).next_step(), 64)
    assert (batch.positions[:, :-1] == 0).sum() > 8  # documents start inside the windows
    total = 0.0
    with torch.no_grad():
        for tokens, positions in zip(torch.as_tensor(batch.tokens), torch.as_tensor(batch.positions)):
            starts = [int(i) for i in torch.nonzero(positions[:-1] == 0)] + [64]
            logits = torch.cat([model(input_ids=tokens[None, a:b]).logits[0] for a, b in zip(starts, starts[1:])])
            total += F.cross_entropy(logits, tokens[1:], reduction="sum").item()
    first = read_metrics(c.run_dir)[0]
    assert first["step"] == 1 and abs(first["loss"] - total / (8 * 64)) < 1e-5


@pytest.mark.slow
def test_lora_layers_compile_to_the_eager_loss_and_gradients(monkeypatch):
    """train.compile compiles each decoder layer's forward, adapters included: dynamo captures
    the adapted layer and AOTAutograd differentiates it. Inductor's code generation, the same
    with or without adapters (and 30 s more on 2 cores), is checked in test_train.py."""
    import copy
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))

    from llmtrain.config import LoraSpec
    from llmtrain.model.lora import apply_lora, init_adapters
    from llmtrain.parallel.weights import local_slices
    from llmtrain.parallel.wrap import compile_layers

    eager = tiny_llama()
    apply_lora(eager, LoraSpec(rank=4, alpha=8))
    init_adapters(eager, 0, local_slices)
    with torch.no_grad():  # B starts at zero; give A's gradient something to flow through
        for name, p in eager.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)
    compiled = copy.deepcopy(eager)
    compile_layers(compiled)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    losses = [m(input_ids=ids, labels=ids).loss for m in (eager, compiled)]
    for loss in losses:
        loss.backward()
    assert abs(losses[0].item() - losses[1].item()) < 1e-5
    grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in (eager, compiled)]
    assert len(grads[0]) == 2 * 4 * 2 and all(not p.requires_grad or ".lora_" in n
                                             for n, p in compiled.named_parameters())
    for name, g in grads[0].items():
        assert torch.allclose(grads[1][name], g, atol=1e-5, rtol=1e-4), name
