"""llmtrain's training throughput against a minimal PyTorch loop and the Hugging Face Trainer,
interleaved in one run; and each one's start-up.

    python bench/throughput.py [--rounds 5] [--nproc 1 2] [--startup 5] [--variant KEY=VALUE,...]

For each process count, alternates rounds of bench/plain_loop.py, bench/hf_trainer.py and
`llmtrain train` on the same model (Llama, 4 layers x 256 hidden), micro batch 8, seq_len 256,
fp32, fused AdamW, clipping, and compares the median tokens/s of the steady-state windows (the
first window of each round, with warm-up, is dropped). Targets: >= 0.98x the plain loop, >= 1.0x
the HF Trainer. --startup N: the wall time of N one-step runs of each, process start to exit
(median). --variant adds a side: llmtrain with those `--set` overrides (an A/B of its settings,
interleaved with the rest). --checkout DIR adds a side: llmtrain from another checkout's src/ (a
`git worktree add DIR REV`), with its own prepared data, in the same environment (an A/B of two
commits). Needs an environment from setup.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LAYERS, HIDDEN, SEQ, MICRO, STEPS, WINDOW = 4, 256, 256, 8, 50, 10


def llmtrain_config(tmp: Path, nproc: int, name: str = "") -> Path:
    """The demo's data and tokenizer, the benchmark's model and batch; `name` keeps a checkout's
    run and prepared data apart from this one's."""
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    demo["model"]["tokenizer"] = str(REPO / "configs" / "demo" / "tokenizer")
    demo["model"]["architecture"] = {
        "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": 3 * HIDDEN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HIDDEN // 64, "vocab_size": 512,
        "max_position_embeddings": SEQ, "tie_word_embeddings": False}
    demo["data"].update(dataset=str(REPO / "configs" / "demo" / "stories.txt"), seq_len=SEQ)
    demo["train"].update(max_steps=STEPS, global_batch_size=MICRO * nproc, micro_batch_size=MICRO,
                         log_every=WINDOW, eval_every=0, warmup_steps=1, precision="fp32")
    demo["data"]["prepared_dir"] = str(tmp / f"prepared{name}")
    demo["run"] = {"name": f"bench-{nproc}{name}", "dir": str(tmp / "runs")}
    path = tmp / f"bench-{nproc}{name}.yaml"
    path.write_text(yaml.safe_dump(demo))
    return path


def launcher(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def peer_command(script: str, nproc: int, steps: int) -> list[str]:
    return launcher(nproc) + [str(REPO / "bench" / script), "--layers", str(LAYERS), "--hidden", str(HIDDEN),
                              "--seq-len", str(SEQ), "--micro-batch", str(MICRO), "--steps", str(steps),
                              "--window", str(min(WINDOW, steps))]


def run_peer(script: str, nproc: int) -> list[float]:
    out = subprocess.run(peer_command(script, nproc, STEPS), capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["tokens_per_sec"][1:]


def llmtrain_command(config: Path, nproc: int, steps: int, overrides: tuple[str, ...] = ()) -> list[str]:
    cmd = launcher(nproc) + ["-m", "llmtrain", "train", "--config", str(config), "--set", f"train.max_steps={steps}"]
    for override in overrides:
        cmd += ["--set", override]
    if steps == 1:  # as the peers' one step: no warmup to speak of, no checkpoint at the end
        cmd += ["--set", "train.warmup_steps=0", "--set", "train.checkpoint_every=0"]
    return cmd


def checkout_env(checkout: Path | None) -> dict[str, str] | None:
    """The environment that imports llmtrain from `checkout`'s src/ (None: this one's)."""
    if checkout is None:
        return None
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout / "src"), os.environ.get("PYTHONPATH", "")])}


def run_llmtrain(config: Path, nproc: int, overrides: tuple[str, ...] = (), checkout: Path | None = None) -> list[float]:
    run = yaml.safe_load(config.read_text())["run"]
    run_dir = Path(run["dir"]) / run["name"]
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each round, not a resume of the last
    subprocess.run(llmtrain_command(config, nproc, STEPS, overrides), capture_output=True, text=True, check=True,
                   env=checkout_env(checkout))
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["tokens_per_sec"] for x in lines if x["kind"] == "train"][1:]


def wall(cmd: list[str], before=lambda: None) -> float:
    before()
    t0 = time.perf_counter()
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--startup", type=int, default=0, help="one-step runs of each to time (0: none)")
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE,...",
                    help="another llmtrain side with these overrides (repeatable)")
    ap.add_argument("--checkout", action="append", default=[], type=Path, metavar="DIR",
                    help="another llmtrain side from DIR/src, a checkout of another commit (repeatable)")
    args = ap.parse_args()
    if "LLMTRAIN_HOME" not in os.environ:
        sys.exit("bench: source the env.sh that setup.sh wrote first")
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.nproc:
            config = llmtrain_config(Path(tmp), nproc)
            subprocess.run([sys.executable, "-m", "llmtrain", "prepare", "--config", str(config)],
                           capture_output=True, check=True)
            runs = {"plain loop": lambda: run_peer("plain_loop.py", nproc),
                    "HF Trainer": lambda: run_peer("hf_trainer.py", nproc),
                    "llmtrain": lambda: run_llmtrain(config, nproc)}
            for variant in args.variant:
                runs[f"llmtrain {variant}"] = lambda v=variant: run_llmtrain(config, nproc, tuple(v.split(",")))
            for i, checkout in enumerate(args.checkout):
                other = llmtrain_config(Path(tmp), nproc, name=f"-checkout{i}")
                subprocess.run([sys.executable, "-m", "llmtrain", "prepare", "--config", str(other)],
                               capture_output=True, check=True, env=checkout_env(checkout))
                runs[f"llmtrain at {checkout}"] = lambda c=checkout, o=other: run_llmtrain(o, nproc, checkout=c)
            windows = {name: [] for name in runs}
            order = list(runs)
            for r in range(args.rounds):  # interleaved, each side first in turn: drift hits all alike
                for name in order[r % len(order):] + order[:r % len(order)]:
                    windows[name] += runs[name]()
            median = {name: statistics.median(w) for name, w in windows.items()}
            label = "1 process" if nproc == 1 else f"{nproc}-process DDP"
            print(f"{label}: " + ", ".join(f"{name} {m:,.0f} tok/s" for name, m in median.items())
                  + f"; llmtrain / plain loop {median['llmtrain'] / median['plain loop']:.3f}, "
                  f"llmtrain / HF Trainer {median['llmtrain'] / median['HF Trainer']:.3f} "
                  f"(medians of {len(windows['llmtrain'])} windows of {WINDOW} steps each)", flush=True)
            for variant in args.variant:
                m = median[f"llmtrain {variant}"]
                print(f"  llmtrain with {variant}: {m / median['llmtrain']:.3f}x the default, "
                      f"{m / median['plain loop']:.3f}x the plain loop", flush=True)
            for checkout in args.checkout:
                m = median[f"llmtrain at {checkout}"]
                print(f"  llmtrain at {checkout}: this checkout is {median['llmtrain'] / m:.3f}x it; it is "
                      f"{m / median['plain loop']:.3f}x the plain loop", flush=True)
            if args.startup:
                run_dir = Path(tmp) / "runs" / f"bench-{nproc}"
                starts = {"plain loop": lambda: wall(peer_command("plain_loop.py", nproc, 1)),
                          "HF Trainer": lambda: wall(peer_command("hf_trainer.py", nproc, 1)),
                          "llmtrain": lambda: wall(llmtrain_command(config, nproc, 1),
                                                   lambda: shutil.rmtree(run_dir, ignore_errors=True))}
                times = {name: [] for name in starts}
                for _ in range(args.startup):
                    for name, run in starts.items():
                        times[name].append(run())
                print(f"{label}, one step from process start to exit: " + ", ".join(
                    f"{name} {statistics.median(t):.2f} s" for name, t in times.items())
                    + f" (medians of {args.startup})", flush=True)


if __name__ == "__main__":
    main()
