"""An export as a user of the model meets it: it generates (KV cache, a generation config that
runs as it is), in the dtype asked for, and the group can read it; the export of a LoRA run on a
bf16 base holds its adapters or one layer, never the model. The FSDP-written export and
`llmtrain generate` are in test_checkpoint.py, the LoRA exports' peft loading in test_finetune.py."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import DEMO, cli, prepared_home, tiny_config

pytestmark = pytest.mark.slow

# The model config's special tokens differ from the tokenizer's (a fine-tune with another
# tokenizer): the tokenizer's are the ones the model saw in training, so generation uses those.
ARCH = {**tiny_config()["model"]["architecture"], "bos_token_id": 7, "eos_token_id": 7,
        "pad_token_id": None}
PROMPT = "Once upon a time, Tom had a red ball."


def with_umask(mask: int, *args):
    old = os.umask(mask)  # the command runs in this process, under this umask
    try:
        return cli(*args, check=True)
    finally:
        os.umask(old)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A 2-step run and its exports: fp32 under a private umask into new nested folders, bf16
    under the usual one, fp16 as it comes."""
    cfg = tiny_config(model={"architecture": ARCH},
                      train={"max_steps": 2, "warmup_steps": 1, "eval_every": 0,
                             "checkpoint_every": 2})
    with prepared_home(tmp_path_factory, "export", cfg) as (root, config):
        cli("train", "--config", config, check=True)
        run_dir = root / "home" / "runs" / "test"
        out = {"fp32": root / "shared" / "team" / "fp32", "bf16": root / "bf16",
               "fp16": root / "fp16"}
        with_umask(0o077, "export", "--run-dir", run_dir, "--out", out["fp32"])
        with_umask(0o022, "export", "--run-dir", run_dir, "--out", out["bf16"], "--dtype", "bf16")
        cli("export", "--run-dir", run_dir, "--out", out["fp16"], "--dtype", "fp16",
                 check=True)
        yield root, run_dir, out


def modes(folder):
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode)
            for p in [folder, *folder.rglob("*")]}


def test_export_is_readable_by_the_group_whatever_the_umask(exports):
    root, _, out = exports
    # umask 077: the group reads files and enters folders, the folders export created included;
    # others get nothing, as the umask asks.
    private = modes(out["fp32"])
    assert {"model.safetensors", "config.json", "generation_config.json",
            "tokenizer.json"} <= set(private)
    assert private == {name: 0o750 if (out["fp32"] / name).is_dir() else 0o640 for name in private}
    created = [root / "shared", root / "shared" / "team"]
    assert [stat.S_IMODE(p.stat().st_mode) for p in created] == [0o750, 0o750]
    # umask 022: everyone reads (safetensors alone used to write its file 0600).
    usual = modes(out["bf16"])
    assert usual == {name: 0o755 if (out["bf16"] / name).is_dir() else 0o644 for name in usual}


def test_export_generates_with_the_kv_cache_and_no_warnings(exports):
    _, _, out = exports
    model = AutoModelForCausalLM.from_pretrained(out["fp32"])
    tokenizer = AutoTokenizer.from_pretrained(out["fp32"])
    gen = model.generation_config
    assert model.config.use_cache is True and gen.use_cache is True
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) != (7, 7, None)
    assert (gen.do_sample, gen.temperature, gen.max_new_tokens) == (True, 0.8, 64)

    inputs = tokenizer(PROMPT, return_tensors="pt")
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught, capture_log("transformers") as logged:
        warnings.simplefilter("always")
        result = model.generate(**inputs, return_dict_in_generate=True)
    assert [str(w.message) for w in caught] + logged == []
    assert result.sequences.shape[1] > inputs.input_ids.shape[1]  # new tokens
    assert result.past_key_values is not None  # the KV cache was used


class capture_log(logging.Handler):
    """Warnings a library logs (transformers' own handler prints them to stderr)."""

    def __init__(self, name: str):
        super().__init__(logging.WARNING)
        self.logger, self.lines = logging.getLogger(name), []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        self.logger.addHandler(self)
        return self.lines

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


@pytest.mark.parametrize("dtype,torch_dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                               ("fp16", torch.float16)])
def test_export_dtype_logits_identical_in_fp32_and_close_in_half(exports, dtype, torch_dtype):
    _, run_dir, out = exports
    from llmtrain.training.export import load_checkpoint_model
    trained, tokenizer = load_checkpoint_model(run_dir)
    exported = AutoModelForCausalLM.from_pretrained(out[dtype])  # as saved: config.json's dtype
    assert exported.dtype == torch_dtype
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected, got = trained(input_ids=ids).logits, exported(input_ids=ids).logits.float()
    if dtype == "fp32":
        assert torch.equal(got, expected)
    else:
        error = (got - expected).abs().max() / expected.abs().max()
        assert error < 0.02, f"{dtype}: logits off by {error:.1%} of their range"  # bf16: ~0.6%


# ---------------------------------------------------------------------------------------------
# Memory: a LoRA run on a bf16 base of 103M parameters (206 MB; 412 MB in fp32), 8 layers of
# 51 MB in fp32.

BASE = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
        "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 512,
        "max_position_embeddings": 128, "tie_word_embeddings": False}
BASE_PARAMS = 8 * (4 * 1024 * 1024 + 3 * 1024 * 2816 + 2 * 1024) + 2 * 512 * 1024 + 1024
LAYER_FP32 = 4 * (4 * 1024 * 1024 + 3 * 1024 * 2816 + 2 * 1024)


@pytest.fixture(scope="module")
def lora_bf16(tmp_path_factory):
    """A bf16 base model folder, a 1-step LoRA run on it, and the peak memory of a process that
    only imports what export imports (the baseline)."""
    from transformers import AutoConfig
    base = tmp_path_factory.mktemp("bf16-base")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **BASE), dtype=torch.bfloat16)
    model.save_pretrained(base)
    del model
    assert sum(p.stat().st_size for p in base.glob("*.safetensors")) > 2 * BASE_PARAMS
    cfg = tiny_config(data={"seq_len": 16},
                      train={"global_batch_size": 1, "micro_batch_size": 1, "max_steps": 1,
                             "warmup_steps": 0, "eval_every": 0, "checkpoint_every": 1})
    cfg["model"] = {"name_or_path": str(base), "tokenizer": str(DEMO / "tokenizer"),
                    "lora": {"rank": 4, "alpha": 8}}
    with prepared_home(tmp_path_factory, "lora-bf16", cfg) as (root, config):
        cli("train", "--config", config, check=True)
        baseline = peak_rss("-c", "import llmtrain.cli, llmtrain.training.export")
        yield base, root / "home" / "runs" / "test", root, baseline


def peak_rss(*args: str) -> int:
    """The peak resident memory, in bytes, of `python ARGS` run as a user runs it (a process of
    its own: this one's children so far are not counted); fails if it fails."""
    wrapper = ("import json, resource, subprocess, sys; "
               "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
               "print(json.dumps([r.returncode, r.stdout + r.stderr, "
               "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024]))")
    # Large blocks mmapped and returned at free: the peak follows the live tensors. glibc's heap
    # keeps freed blocks below its adaptive mmap threshold (at most 32 MB; these layers' tensors
    # are 4-12 MB, a 70B's are above it), which added 60-80 MiB of noise to the merged export.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    proc = subprocess.run([sys.executable, "-c", wrapper, sys.executable, *args], capture_output=True,
                          text=True, timeout=300, check=True, env=env)
    code, output, peak = json.loads(proc.stdout.splitlines()[-1])
    assert code == 0, output
    return peak


def test_adapter_export_reads_the_adapters_alone(lora_bf16):
    """Before: the base was built in fp32 to write 1 MB of adapters (642 MiB over the baseline,
    1.6x the base's fp32 size); now 8 MiB."""
    _, run, root, baseline = lora_bf16
    out = root / "adapter"
    used = peak_rss("-m", "llmtrain", "export", "--run-dir", str(run), "--out", str(out)) - baseline
    assert used < 0.25 * 2 * BASE_PARAMS, f"{used / 2**20:.0f} MiB over the baseline"
    assert sorted(p.name for p in out.glob("adapter_*")) == ["adapter_config.json",
                                                            "adapter_model.safetensors"]


def test_merged_export_holds_one_layer_and_merges_in_fp32(lora_bf16):
    """Before: the whole base in fp32 and its merged copy (640 MiB over the baseline); now about
    one layer in fp32 (120 MiB with the modules and tokenizer export loads). The written weights
    are the bf16 base's upcast, the adapters' B A alpha/rank added to the targets."""
    from safetensors import safe_open
    base, run, root, baseline = lora_bf16
    out = root / "merged"
    used = peak_rss("-m", "llmtrain", "export", "--run-dir", str(run), "--out", str(out),
                    "--merge") - baseline
    assert used < 3 * LAYER_FP32, f"{used / 2**20:.0f} MiB over the baseline"

    cli("export", "--run-dir", run, "--out", root / "adapter-fp32", check=True)
    q = "model.layers.3.self_attn.q_proj"
    with safe_open(out / "model.safetensors", "pt") as merged, \
            safe_open(base / "model.safetensors", "pt") as stored, \
            safe_open(root / "adapter-fp32" / "adapter_model.safetensors", "pt") as adapter:
        a, b = (adapter.get_tensor(f"base_model.model.{q}.lora_{m}.weight") for m in "AB")
        assert b.abs().max() > 0  # trained: B starts at zero
        expected = stored.get_tensor(f"{q}.weight").float() + b @ a * (8 / 4)
        assert torch.equal(merged.get_tensor(f"{q}.weight"), expected)
        down = "model.layers.3.mlp.down_proj.weight"  # not a target
        assert torch.equal(merged.get_tensor(down), stored.get_tensor(down).float())
        assert len(list(merged.keys())) == len(list(stored.keys()))
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_generate_from_a_lora_run_loads_the_base_as_stored(lora_bf16):
    """bf16 on disk, bf16 in memory (before: fp32, 636 MiB over the baseline; now 266)."""
    from llmtrain.training.export import load_checkpoint_model
    _, run, _, baseline = lora_bf16
    model, _ = load_checkpoint_model(run)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    del model
    used = peak_rss("-m", "llmtrain", "generate", "--run-dir", str(run), "--prompt", "Once upon",
                    "--max-new-tokens", "3") - baseline
    assert used < 4 * BASE_PARAMS, f"{used / 2**20:.0f} MiB over the baseline: more than the base in fp32"
