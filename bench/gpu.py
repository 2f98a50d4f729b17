"""One GPU: llmtrain (eager and compiled) against a minimal PyTorch loop and the Hugging Face
Trainer, interleaved in one run, printed as a markdown table.

    python bench/gpu.py [--models llama-1b gpt2-124m] [--rounds 2] [--steps 30] [--out DIR] [--fp8 tensorwise]

Models from config (no download): a Llama-3.2-1B-shaped model (1.24B parameters, bf16 autocast,
seq 2048, micro batch 4) and GPT-2 124M (seq 1024, micro batch 16). Every side trains the same
model class with fused AdamW, clipping at 1.0 and bf16 autocast over fp32 weights, one process,
and reports tokens/s over windows of steps (the first window, with warm-up and compilation,
dropped), and its peak memory (max_memory_allocated). MFU for every side with the same formula
and peak (llmtrain.metrics: the device's dense bf16 peak). Targets (issue 11): llmtrain compiled
>= 45% MFU on the 1B model on H100/H200, >= 1.0x the plain loop, >= 1.3x the HF Trainer.

One more row a model, "planner (predicted)": what `llmtrain plan`'s cost model (login/plan.cost)
predicts for llmtrain's run, with this GPU's datasheet figures and its GEMM rate measured here
(the preflight's 8192 x 8192 bf16 product), and the estimator's memory: the planner's calibration
on one GPU (issue 41), read against "llmtrain eager" (the model knows no compiler).

llmtrain trains on the demo corpus (configs/demo, prepared at the model's seq_len; its tokens
are ids below the model's vocabulary, which is what the compute depends on); the peers on random
tokens. Logs of every run go to --out (default: a temporary folder). Needs torch with CUDA,
transformers, datasets (llmtrain prepare); run from the repo root, src/ importable.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

MODELS = {
    "llama-1b": {"seq": 2048, "micro": 4, "arch": {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 2048, "rope_theta": 500000.0, "tie_word_embeddings": True}},
    "gpt2-124m": {"seq": 1024, "micro": 16, "arch": {
        "model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
        "vocab_size": 50257}},
}
SIDES = ("plain loop", "HF Trainer", "llmtrain eager", "llmtrain compiled")
WINDOW = 5


def run(cmd: list[str], log: Path) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    log.write_text(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    if proc.returncode != 0:
        raise SystemExit(f"bench: failed ({proc.returncode}), see {log}:\n{proc.stderr[-2000:]}")
    return proc.stdout


def peer(script: str, spec: dict, steps: int, log: Path) -> dict:
    out = run([sys.executable, str(REPO / "bench" / script), "--arch", json.dumps(spec["arch"]),
               "--seq-len", str(spec["seq"]), "--micro-batch", str(spec["micro"]), "--steps", str(steps),
               "--window", str(WINDOW), "--precision", "bf16"], log)
    result = json.loads(out.strip().splitlines()[-1])
    return {"tokens_per_sec": result["tokens_per_sec"][1:], "peak_mem_gib": result["peak_mem_gib"]}


def llmtrain_config(tmp: Path, name: str, spec: dict, steps: int) -> Path:
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    demo["model"] = {"tokenizer": str(REPO / "configs" / "demo" / "tokenizer"), "architecture": spec["arch"]}
    demo["data"].update(dataset=str(REPO / "configs" / "demo" / "stories.txt"), seq_len=spec["seq"],
                        validation_fraction=0.0)
    demo["train"].update(max_steps=steps, global_batch_size=spec["micro"], micro_batch_size=spec["micro"],
                         log_every=WINDOW, eval_every=0, checkpoint_every=0, warmup_steps=1,
                         precision="bf16")
    demo["run"] = {"name": name, "dir": str(tmp / "runs")}
    demo["slurm"] = {"nodes": 1, "procs_per_node": 1, "gpus_per_node": 1}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(demo))
    return path


def ours(config: Path, compiled: bool, log: Path, fp8: str = "none") -> dict:
    where = yaml.safe_load(config.read_text())["run"]
    run_dir = Path(where["dir"]) / where["name"]
    shutil.rmtree(run_dir, ignore_errors=True)
    run([sys.executable, "-m", "llmtrain", "train", "--config", str(config),
         "--set", f"train.compile={str(compiled).lower()}", "--set", f"train.fp8={fp8}"], log)
    train = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in train if x["kind"] == "train"]
    return {"tokens_per_sec": [x["tokens_per_sec"] for x in train][1:],
            "peak_mem_gib": max(x["peak_mem_gib"] for x in train), "loss": train[-1]["loss"]}


def flops_per_token(spec: dict) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtrain.model.build import flops_per_token as formula
    arch = dict(spec["arch"])
    config = AutoConfig.for_model(arch.pop("model_type"), **arch)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return formula(config, n_params, spec["seq"]), n_params


def predicted(config: Path, device_name: str, gemm_tflops: float) -> dict | None:
    """The planner's tokens/s and the estimator's GiB for `config` on one GPU called
    `device_name` whose bf16 GEMM reaches `gemm_tflops`; None for a GPU the table lacks."""
    from llmtrain.config import load_config
    from llmtrain.gpus import gpu_called
    from llmtrain.login.estimate import GIB
    from llmtrain.login.plan import predict
    gpu = gpu_called(device_name)
    if gpu is None or not gpu.bf16_tflops:
        return None
    gpu = dataclasses.replace(gpu, gemm_tflops=gemm_tflops, measured="measured here")
    c = predict(load_config(config, [], world_size=1), gpu, 1, 1)
    return {"tokens_per_sec": c.tokens_per_s, "peak_mem_gib": c.memory / GIB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, help="folder for the runs' logs (default: temporary)")
    ap.add_argument("--fp8", choices=("tensorwise", "rowwise"),
                    help="one more side: llmtrain compiled with train.fp8 (its MFU against the bf16 peak)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py: needs a CUDA device (torch.cuda.is_available() is false)")
    from llmtrain.metrics import peak_flops
    device = torch.device("cuda", 0)
    peak = peak_flops(device, "bf16", True, None)
    tmp = Path(tempfile.mkdtemp(prefix="llmtrain-gpu-bench-"))
    logs = args.out or tmp / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("LLMTRAIN_HOME", str(tmp / "home"))
    from llmtrain.training.preflight import matmul_tflops
    gemm = matmul_tflops(device)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, dense bf16 peak "
          f"{peak / 1e12:.0f} TFLOP/s, an 8192 x 8192 bf16 GEMM {gemm:.0f} TFLOP/s; {args.rounds} rounds x "
          f"{args.steps} steps, windows of {WINDOW}")
    rows = []
    for name in args.models:
        spec = MODELS[name]
        config = llmtrain_config(tmp, name, spec, args.steps)
        run([sys.executable, "-m", "llmtrain", "prepare", "--config", str(config)], logs / f"{name}-prepare.log")
        sides = {"plain loop": lambda log: peer("plain_loop.py", spec, args.steps, log),
                 "HF Trainer": lambda log: peer("hf_trainer.py", spec, args.steps, log),
                 "llmtrain eager": lambda log: ours(config, False, log),
                 "llmtrain compiled": lambda log: ours(config, True, log)}
        if args.fp8:
            sides[f"llmtrain compiled fp8 {args.fp8}"] = lambda log: ours(config, True, log, args.fp8)
        windows = {side: [] for side in sides}
        memory = {side: 0.0 for side in sides}
        for r in range(args.rounds):  # interleaved: drift hits every side alike
            for side, fn in sides.items():
                result = fn(logs / f"{name}-{side.replace(' ', '-')}-{r}.log")
                windows[side] += result["tokens_per_sec"]
                memory[side] = max(memory[side], result["peak_mem_gib"] or 0.0)
                if "loss" in result:
                    print(f"{name}, {side}, round {r}: loss {result['loss']:.4f} at step {args.steps}")
        per_token, n_params = flops_per_token(spec)
        speed = {side: statistics.median(w) for side, w in windows.items()}
        guess = predicted(config, torch.cuda.get_device_name(device), gemm)
        if guess:
            speed["planner (predicted)"] = guess["tokens_per_sec"]
            memory["planner (predicted)"] = guess["peak_mem_gib"]
            print(f"{name}: measured / predicted: llmtrain eager {speed['llmtrain eager'] / speed['planner (predicted)']:.2f} "
                  f"tokens/s, {memory['llmtrain eager'] / memory['planner (predicted)']:.2f} memory; llmtrain compiled "
                  f"{speed['llmtrain compiled'] / speed['planner (predicted)']:.2f} tokens/s")
        for side in speed:
            rows.append((name, n_params, side, speed[side], speed[side] * per_token / peak, memory[side],
                         speed[side] / speed["plain loop"], speed[side] / speed["HF Trainer"]))
    print("\n| model | side | tokens/s | MFU | peak memory GiB | vs plain loop | vs HF Trainer |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, n_params, side, tps, mfu, mem, vs_plain, vs_hf in rows:
        print(f"| {name} ({n_params / 1e9:.2f}B) | {side} | {tps:,.0f} | {mfu:.1%} | {mem:.1f} | "
              f"{vs_plain:.2f}x | {vs_hf:.2f}x |")
    print(f"\nlogs: {logs}")


if __name__ == "__main__":
    main()
