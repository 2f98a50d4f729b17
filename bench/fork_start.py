"""What a training process's start costs: a fresh interpreter against one forked from a process
that has imported the trainer already.

    python bench/fork_start.py [--rounds 3] [--steps 4] [--nproc 2]

First, torchrun launches of `--nproc` processes (`python -m llmtrain.training.torchrun
--standalone ... -m llmtrain train`) with the workers forked from the agent after its one import
of the trainer (the default, training/workers.py) against workers started as new interpreters
(LLMTRAIN_FORK_WORKERS=0), alternated: wall and CPU seconds of the whole launch, agent included.
Then one process, as `python -m llmtrain train` (a fresh interpreter: Python, torch,
transformers, the trainer) and as a child forked from this process after it imported the same
modules (the run itself only), alternated (the model's own module, which the trainer imports as
it builds, is each child's to import: the trainer decides how, keeping torchao out of runs
without FP8). Each part checks that both sides trained the same losses. The test model trains
the demo's data: a 2-layer, 64-wide Llama, a few steps. Needs an environment from setup.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "configs" / "demo"


def config(tmp: Path, steps: int) -> Path:
    cfg = {
        "run": {"name": "fork", "dir": str(tmp / "runs")},
        "model": {"tokenizer": str(DEMO / "tokenizer"),
                  "architecture": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                   "max_position_embeddings": 128, "tie_word_embeddings": False}},
        "data": {"dataset": str(DEMO / "stories.txt"), "seq_len": 64, "prepared_dir": str(tmp / "prepared")},
        "train": {"max_steps": steps, "global_batch_size": 8, "micro_batch_size": 4, "warmup_steps": 1,
                  "precision": "fp32", "log_every": 1, "eval_every": 0, "checkpoint_every": 0},
        "metrics": {"plot_every_eval": False},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def losses(tmp: Path, name: str) -> list[float]:
    lines = (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


def timed(start) -> tuple[float, float]:
    """(wall s, CPU s of the children) of start(), which runs one child to its end."""
    t0, c0 = time.perf_counter(), os.times()
    start()
    c1 = os.times()
    return time.perf_counter() - t0, c1.children_user - c0.children_user + c1.children_system - c0.children_system


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nproc", type=int, default=2, help="processes of the torchrun launches")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = config(tmp, args.steps)
        subprocess.run([sys.executable, "-m", "llmtrain", "prepare", "--config", str(cfg)], check=True,
                       capture_output=True)
        argv = ["train", "--config", str(cfg)]

        def fresh(name: str):
            subprocess.run([sys.executable, "-m", "llmtrain", *argv, "--set", f"run.name={name}"], check=True,
                           capture_output=True)

        t0 = time.perf_counter()
        import llmtrain.cli  # noqa: F401: what a fresh process imports before its first step
        import llmtrain.training.loop  # noqa: F401
        preload = time.perf_counter() - t0

        def forked(name: str):
            pid = os.fork()
            if pid == 0:
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
                os.dup2(1, 2)
                code = 1
                try:
                    code = llmtrain.cli.main([*argv, "--set", f"run.name={name}"])
                finally:
                    os._exit(code or 0)
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                sys.exit(f"the forked run {name} failed")

        def launch(name: str, fork: str):
            subprocess.run([sys.executable, "-m", "llmtrain.training.torchrun", "--standalone", "--nproc-per-node",
                            str(args.nproc), "-m", "llmtrain", *argv, "--set", f"run.name={name}"], check=True,
                           capture_output=True, env={**os.environ, "LLMTRAIN_FORK_WORKERS": fork})

        compare(f"torchrun, {args.nproc} processes, {args.steps} steps, {args.rounds} rounds (agent and workers)",
                {"workers started (fork off)": lambda n: launch(n, "0"),
                 "workers forked (default)": lambda n: launch(n, "1")}, args.rounds, tmp, "torchrun")
        compare(f"{args.steps} steps, one process, {args.rounds} rounds; the imports in this process took {preload:.2f} s",
                {"fresh interpreter": fresh, "forked after the imports": forked}, args.rounds, tmp, "one")


def compare(title: str, sides: dict, rounds: int, tmp: Path, prefix: str) -> None:
    """Run each side `rounds` times, alternated (run names PREFIX-SIDE-ROUND); print each side's
    median wall and CPU seconds and whether all trained the same losses."""
    times: dict[str, list] = {label: [] for label in sides}
    names = {label: f"{prefix}-{i}" for i, label in enumerate(sides)}
    for r in range(rounds):
        for label, start in sides.items():
            times[label].append(timed(lambda: start(f"{names[label]}-{r}")))
    first = list(sides)[0]
    same = all(losses(tmp, f"{names[label]}-{r}") == losses(tmp, f"{names[first]}-{r}")
               for label in sides for r in range(rounds))
    print(title)
    for label in sides:
        wall = statistics.median(t[0] for t in times[label])
        cpu = statistics.median(t[1] for t in times[label])
        print(f"{label:26s} wall {wall:5.2f} s  CPU {cpu:5.2f} s  (medians)")
    print("the same losses on both sides:", same)

if __name__ == "__main__":
    main()
