"""LoRA fine-tuning, one epoch, llmtrain against TRL's SFTTrainer, interleaved in one run.

    python bench/sft.py [--rounds 3] [--packing both|true|false]

Same base (the demo's Llama, 2 layers x 128 hidden, vocab 512, random weights: speed does not
depend on them), same data (configs/sft-demo/chat.jsonl, all 3,000 conversations, the loss on the
answers), same LoRA (rank 16, alpha 32, the seven projections), same batch (16 a step, micro
batch 8, so 2 micro-batches a step), seq_len 128, fp32, AdamW, one process. TRL pads each
micro-batch to its longest sample (its default, `padding_free` off, no packing); llmtrain cuts its
unpacked rows to the batch's longest sample (data/loader.py's unpacked_width), or packs them.
Prints each side's epoch: the training loop's seconds (llmtrain: the last train record's
elapsed_s; TRL: its train_runtime), medians over the rounds, and their ratio. TRL is not a
dependency of llmtrain: install it beside the environment, e.g.
`pip install --no-deps --target /tmp/trl trl==1.16.0` and run with `--trl-path /tmp/trl`.
--checkout DIR adds a side: llmtrain's unpacked epoch from another checkout's src/ (a
`git worktree add DIR REV`), its own prepared data, the same environment (an A/B of two commits).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from throughput import checkout_env  # bench/throughput.py: llmtrain from another checkout

REPO = Path(__file__).resolve().parents[1]
MICRO, GLOBAL, SEQ = 8, 16, 128


def make_base(tmp: Path) -> Path:
    """The demo's architecture, random weights, with the fine-tuning demo's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch

    torch.manual_seed(0)
    arch = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())["model"]["architecture"]
    arch.pop("model_type")
    base = tmp / "base"
    LlamaForCausalLM(LlamaConfig(vocab_size=512, **arch)).save_pretrained(base)
    for f in (REPO / "configs" / "sft-demo" / "tokenizer").iterdir():
        shutil.copy(f, base / f.name)
    return base


def llmtrain_config(tmp: Path, base: Path, packing: bool, suffix: str = "") -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "sft-demo.yaml").read_text())
    cfg["model"].update(name_or_path=str(base), tokenizer=str(base))
    cfg["data"].update(dataset=str(REPO / "configs" / "sft-demo" / "chat.jsonl"), packing=packing,
                       validation_fraction=0, prepared_dir=str(tmp / f"prepared{suffix}"))
    cfg["train"].update(epochs=1, global_batch_size=GLOBAL, micro_batch_size=MICRO, eval_every=0,
                        checkpoint_every=0, warmup_steps=10, log_every=10)
    cfg["train"].pop("max_steps")
    cfg["train"].pop("eval_samples")
    name = f"sft-{'packed' if packing else 'unpacked'}{suffix}"
    cfg["run"] = {"name": name, "dir": str(tmp / "runs")}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def prepare(config: Path, checkout: Path | None = None) -> None:
    subprocess.run([sys.executable, "-m", "llmtrain", "prepare", "--config", str(config)],
                   capture_output=True, check=True, env=checkout_env(checkout))


def run_llmtrain(config: Path, checkout: Path | None = None) -> tuple[float, int]:
    """(the epoch's seconds, steps)."""
    run = yaml.safe_load(config.read_text())["run"]
    run_dir = Path(run["dir"]) / run["name"]
    shutil.rmtree(run_dir, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "llmtrain", "train", "--config", str(config)],
                   capture_output=True, text=True, check=True, env=checkout_env(checkout))
    train = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    return train[-1]["elapsed_s"], train[-1]["step"]


TRL_SCRIPT = r"""
import json, sys, time
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

base, data, out = sys.argv[1:4]
torch.manual_seed(0)
rows = [json.loads(x)["messages"] for x in open(data)]
ds = Dataset.from_list([{"prompt": m[:-1], "completion": m[-1:]} for m in rows])
args = SFTConfig(output_dir=out, per_device_train_batch_size=%(micro)d, gradient_accumulation_steps=%(accum)d,
                 num_train_epochs=1, learning_rate=2e-3, lr_scheduler_type="cosine", warmup_steps=10,
                 weight_decay=0.0, max_grad_norm=1.0, max_length=%(seq)d, packing=False, optim="adamw_torch",
                 logging_steps=10, save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False,
                 dataloader_num_workers=0, seed=0)
lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), args=args,
                     train_dataset=ds, processing_class=AutoTokenizer.from_pretrained(base), peft_config=lora)
result = trainer.train()
print(json.dumps({"seconds": result.metrics["train_runtime"], "steps": result.global_step}))
"""


def run_trl(tmp: Path, base: Path, trl_path: str) -> tuple[float, int]:
    script = tmp / "trl_sft.py"
    script.write_text(TRL_SCRIPT % {"micro": MICRO, "accum": GLOBAL // MICRO, "seq": SEQ + 1})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (trl_path, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, str(script), str(base), str(REPO / "configs" / "sft-demo" / "chat.jsonl"),
                          str(tmp / "trl-out")], capture_output=True, text=True, check=True, env=env).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result["seconds"], result["steps"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--packing", choices=["both", "true", "false"], default="both")
    ap.add_argument("--trl-path", default="", help="a folder holding trl, put on TRL's PYTHONPATH")
    ap.add_argument("--checkout", action="append", default=[], type=Path, metavar="DIR",
                    help="another llmtrain unpacked side from DIR/src, a checkout of another commit (repeatable)")
    args = ap.parse_args()
    if "LLMTRAIN_HOME" not in os.environ:
        sys.exit("bench: source the env.sh that setup.sh wrote first")
    packings = {"both": [False, True], "true": [True], "false": [False]}[args.packing]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = make_base(tmp)
        runs = {"TRL SFTTrainer": lambda: run_trl(tmp, base, args.trl_path)}
        for packing in packings:
            config = llmtrain_config(tmp, base, packing)
            prepare(config)
            runs[f"llmtrain {'packed' if packing else 'unpacked'}"] = lambda c=config: run_llmtrain(c)
        for i, checkout in enumerate(args.checkout):
            config = llmtrain_config(tmp, base, False, suffix=f"-checkout{i}")
            prepare(config, checkout)
            runs[f"llmtrain unpacked at {checkout}"] = lambda c=config, d=checkout: run_llmtrain(c, d)
        seconds, steps = {name: [] for name in runs}, {}
        order = list(runs)
        for r in range(args.rounds):  # interleaved, each side first in turn
            for name in order[r % len(order):] + order[:r % len(order)]:
                s, n = runs[name]()
                seconds[name].append(s)
                steps[name] = n
                print(f"  round {r + 1}: {name} {s:.1f} s ({n} steps)", flush=True)
        trl = statistics.median(seconds["TRL SFTTrainer"])
        for name, values in seconds.items():
            m = statistics.median(values)
            print(f"{name}: one epoch in {m:.1f} s ({steps[name]} steps, {m / steps[name]:.3f} s a step); "
                  f"{trl / m:.2f}x TRL's speed (medians of {len(values)})", flush=True)


if __name__ == "__main__":
    main()
