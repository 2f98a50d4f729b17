"""An export as a user of the model meets it: it generates (KV cache, a generation config that
runs as it is), in the dtype asked for, and the group can read it. The FSDP-written export and
`llmtrain generate` are in test_checkpoint.py."""

from __future__ import annotations

import logging
import os
import stat
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import cli, prepared_home, tiny_config

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
    from llmtrain.model.export import load_checkpoint_model
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
