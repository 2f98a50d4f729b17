"""llmtrain's training throughput against a minimal PyTorch loop, interleaved in one run.

    python bench/throughput.py [--rounds 5] [--nproc 1 2]

For each process count, alternates rounds of bench/plain_loop.py and `llmtrain train` on the
same model (Llama, 4 layers x 256 hidden), micro batch 8, seq_len 256, fp32, AdamW, clipping,
and compares the median tokens/s of the steady-state windows (the first window, with warm-up, is
dropped from both). Target: ratio >= 0.97. Needs an environment from setup.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LAYERS, HIDDEN, SEQ, MICRO, STEPS, WINDOW = 4, 256, 256, 8, 50, 10


def llmtrain_config(tmp: Path, nproc: int) -> Path:
    """The demo's data and tokenizer, the benchmark's model and batch."""
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    demo["model"]["tokenizer"] = str(REPO / "configs" / "demo" / "tokenizer")
    demo["model"]["architecture"] = {
        "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": 3 * HIDDEN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HIDDEN // 64, "vocab_size": 512,
        "max_position_embeddings": SEQ, "tie_word_embeddings": False}
    demo["data"].update(dataset=str(REPO / "configs" / "demo" / "stories.txt"), seq_len=SEQ)
    demo["train"].update(max_steps=STEPS, global_batch_size=MICRO * nproc, micro_batch_size=MICRO,
                         log_every=WINDOW, eval_every=0, warmup_steps=1, precision="fp32")
    demo["run"] = {"name": f"bench-{nproc}", "dir": str(tmp / "runs")}
    path = tmp / f"bench-{nproc}.yaml"
    path.write_text(yaml.safe_dump(demo))
    return path


def launcher(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def run_plain(nproc: int) -> list[float]:
    out = subprocess.run(launcher(nproc) + [str(REPO / "bench" / "plain_loop.py"), "--layers", str(LAYERS),
                         "--hidden", str(HIDDEN), "--seq-len", str(SEQ), "--micro-batch", str(MICRO),
                         "--steps", str(STEPS), "--window", str(WINDOW)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["tokens_per_sec"][1:]


def run_llmtrain(config: Path, nproc: int) -> list[float]:
    subprocess.run(launcher(nproc) + ["-m", "llmtrain", "train", "--config", str(config)],
                   capture_output=True, text=True, check=True)
    run_dir = Path(yaml.safe_load(config.read_text())["run"]["dir"]) / f"bench-{nproc}"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["tokens_per_sec"] for x in lines if x["kind"] == "train"][1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    if "LLMTRAIN_HOME" not in os.environ:
        sys.exit("bench: source the env.sh that setup.sh wrote first")
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.nproc:
            config = llmtrain_config(Path(tmp), nproc)
            subprocess.run([sys.executable, "-m", "llmtrain", "prepare", "--config", str(config)],
                           capture_output=True, check=True)
            plain, ours = [], []
            for _ in range(args.rounds):  # interleaved: drift in machine speed hits both alike
                plain += run_plain(nproc)
                ours += run_llmtrain(config, nproc)
            p, o = statistics.median(plain), statistics.median(ours)
            label = "1 process" if nproc == 1 else f"{nproc}-process DDP"
            print(f"{label}: plain loop {p:,.0f} tok/s, llmtrain {o:,.0f} tok/s, "
                  f"ratio {o / p:.3f} (medians of {len(plain)} and {len(ours)} windows of {WINDOW} steps)",
                  flush=True)


if __name__ == "__main__":
    main()
