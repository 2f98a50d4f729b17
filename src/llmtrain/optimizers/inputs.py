"""What our optimizers read of a parameter, the same way in each (lion.py, muon.py,
schedule_free.py): this rank's local tensor of a sharded one, its gradient summed where it is
still a per-rank partial sum, and the factor that makes a skipped step change nothing."""

from __future__ import annotations

import torch


def local(x: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2's shard, tensor parallel's slice); a tensor as it is."""
    return x.to_local() if hasattr(x, "to_local") else x


def whole_grad(p: torch.Tensor) -> torch.Tensor:
    """p's gradient with p's own placements. Elementwise updates take each rank's shard of a
    sharded parameter on its own, but a replicated parameter's gradient may still be a per-rank
    partial sum (tensor parallel's norms, LoRA's A on a column-parallel layer): summed first."""
    grad = p.grad
    if hasattr(grad, "placements") and grad.placements != p.placements:
        grad = grad.redistribute(p.device_mesh, p.placements)
    return grad


def keep_factor(found_inf: torch.Tensor | None):
    """1.0, or 1 - found_inf (a 0-dim device tensor: no host read) to scale every change of a
    step by: a skipped step changes nothing."""
    return 1.0 if found_inf is None else 1 - found_inf.float()


def zeroed_if_skipped(found_inf: torch.Tensor | None, g: torch.Tensor) -> torch.Tensor:
    """A skipped step's gradient is NaN or inf: zeroed, since 0 x NaN would still be NaN."""
    return g if found_inf is None else torch.where(found_inf.bool(), 0.0, g)
