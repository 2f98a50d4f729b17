"""The peer: the same training in the Hugging Face Trainer, as a user would write it.

    [torchrun --nproc-per-node 2] python bench/hf_trainer.py --layers 4 --hidden 256 --seq-len 256 \
        --micro-batch 8 --steps 50 --window 10

Same model class, fused AdamW, clipping at 1.0, precision and batch as bench/plain_loop.py, on
random tokens generated up front; prints one JSON line with the tokens/s of each window of steps
(timed by a callback at step ends) and the peak memory (on CUDA). --arch and --precision as in
bench/plain_loop.py (bf16: the Trainer's own `bf16=True`, autocast).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from plain_loop import model_config, parse_args


class Windows(TrainerCallback):
    def __init__(self, window: int, tokens_per_step: int):
        self.window, self.tokens_per_step = window, tokens_per_step
        self.tokens_per_sec: list[float] = []
        self.start = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.start is None:
            self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.window == 0:
            now = time.perf_counter()
            self.tokens_per_sec.append(self.window * self.tokens_per_step / (now - self.start))
            self.start = now


class Windows1D(torch.utils.data.Dataset):
    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, :-1]}


def main() -> None:
    args = parse_args()

    world = int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(0)
    config = model_config(args)
    model = AutoModelForCausalLM.from_config(config)
    data = Windows1D(torch.randint(0, config.vocab_size, (args.steps * args.micro_batch * world, args.seq_len + 1)))
    timer = Windows(args.window, args.micro_batch * args.seq_len * world)
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.micro_batch, max_steps=args.steps,
            learning_rate=1e-4, adam_beta2=0.95, weight_decay=0.1, max_grad_norm=1.0,
            lr_scheduler_type="cosine", warmup_steps=1, optim="adamw_torch_fused", use_cpu=not torch.cuda.is_available(),
            save_strategy="no", logging_strategy="no", report_to=[], disable_tqdm=True,
            dataloader_num_workers=0, seed=0, bf16=args.precision == "bf16")
        Trainer(model=model, args=training, train_dataset=data, callbacks=[timer]).train()
    if int(os.environ.get("RANK", 0)) == 0:
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        print(json.dumps({"tokens_per_sec": timer.tokens_per_sec, "peak_mem_gib": peak}), flush=True)


if __name__ == "__main__":
    main()
