"""Gradient compression for slow interconnects (`parallel.grad_compression`), under DDP: torch's
communication hooks, registered on the DDP model once it exists (parallel/wrap.py).

    bf16       each bucket all-reduced in bf16 and cast back: half the bytes on the wire, the
               sum rounded to bf16's 8 bits of mantissa (the curve follows DDP's within that)
    powersgd   each bucket's matrices approximated by rank-r factors P Q^T (PowerSGD, Vogels
               et al. 2019): (rows + columns) x r numbers a matrix instead of rows x columns,
               the error fed back into the next step's gradient; vectors (norms) all-reduced
               whole. Plain all-reduces until the warmup ends (train.warmup_steps, at least 2).

Both change the numbers (bf16 rounds, PowerSGD approximates): neither is exact. Under FSDP2
(fsdp, hsdp, the ZeRO stages) bf16 is its MixedPrecisionPolicy's reduce dtype (parallel/wrap.py),
not a hook; check-config refuses PowerSGD there, and bf16 where FSDP2 holds the gradients over
micro-batches (it would add them up in bf16: parallel/dims.py config_problems). PowerSGD's error feedback (one fp32 gradient's worth) is not in the
checkpoints: a resumed run starts it again from zero, plain all-reduces first.
"""

from __future__ import annotations


def register(model, cfg, group) -> None:
    """The config's hook on the DDP `model`, its all-reduces over `group`."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    how = cfg.parallel.grad_compression
    if how == "bf16":
        model.register_comm_hook(group, bf16_all_reduce)
    elif how == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=cfg.parallel.powersgd_rank,
                                            start_powerSGD_iter=start(cfg) - 1,  # its count starts at 0
                                            use_error_feedback=True, warm_start=True)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def bf16_all_reduce(group, bucket):
    """A bucket's mean over `group`, summed in bf16 on the wire and cast back into the bucket.
    (torch's own bf16 hook refuses anything but NCCL; this one runs on gloo too.)"""
    import torch
    import torch.distributed as dist
    grads = bucket.buffer()
    sent = grads.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(sent, group=group, async_op=True).get_future()

    def back(done):
        grads.copy_(done.value()[0])
        return grads
    return future.then(back)


def start(cfg) -> int:
    """The first step PowerSGD compresses: the one after the warmup (its 3rd at the earliest:
    torch starts it at its count 2 or later)."""
    return max(3, cfg.train.warmup_steps + 1)


def describe(cfg) -> str:
    """The start-up line."""
    how = cfg.parallel.grad_compression
    if how == "bf16" and cfg.parallel.strategy != "ddp":
        return "gradients: reduce-scattered in bf16 (parallel.grad_compression: FSDP2's reduce dtype)"
    if how == "bf16":
        return "gradients: all-reduced in bf16 (parallel.grad_compression: a DDP communication hook)"
    return (f"gradients: compressed by PowerSGD at rank {cfg.parallel.powersgd_rank} from step {start(cfg)}, with "
            f"error feedback (parallel.grad_compression); plain all-reduces before")
