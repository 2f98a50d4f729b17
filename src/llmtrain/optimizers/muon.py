"""Muon (Jordan et al. 2024; "Muon is Scalable for LLM Training", Liu et al. 2025):
`train.optimizer: muon`.

Each hidden weight matrix W (attention and MLP projections) steps along the orthogonalised
Nesterov momentum of its gradient:

    m <- mu m + (1 - mu) g;  u = (1 - mu) g + mu m;  O = NewtonSchulz5(u) ~ U V^T of u's SVD
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(rows, cols)) O

A Mixture-of-Experts layer's experts are matrices each: every expert's gate, up and down is
orthogonalised apart (transformers fuses gate and up into one [2I, H] per expert: its rows are
split back, groups.row_blocks), and the routers take AdamW.

0.2 sqrt(max(rows, cols)) gives O the update RMS AdamW's updates have (Moonlight's scaling), so
train.lr and train.weight_decay mean what they mean for AdamW and one lr serves both parts. The
embeddings, the output head, norms and biases take AdamW (the standard split), at lr x
optimizer_args.adamw_lr_scale.

Newton-Schulz needs each matrix whole, in fp32 here. Under FSDP2/HSDP and tensor parallel every
rank holds a shard of every matrix: orthogonalising shards is wrong, and gathering every matrix
on every rank (torch.optim.Muon on DTensors) moves the whole model to every rank and repeats the
work there. Here the matrices of one shape and layout (one per layer) are stacked and the stack
is moved from "every rank a shard of every matrix" to "every rank whole matrices of its share of
the stack": one all-to-all per mesh dimension that splits the matrix (FSDP2: one; FSDP2 x tp:
over the shard ranks, then the tp ranks), each gathering that dimension's part of the matrices
while it hands the stack out; each rank orthogonalises its own matrices; the same all-to-alls
backwards bring each rank its shards of the results. A rank never holds more than its shards or
its share of whole matrices (DTensor's redistribute to the same placements all-gathers a
row-parallel weight's tp slices first: tp x the shards, 6.4 GiB of down_proj per rank at 405B on
64 x 8 ranks), receives about as many bytes as its shards hold, and does 1/n of the Newton-Schulz
work (n: the ranks a matrix is sharded over; replicas of HSDP repeat it).

A step with `found_inf` (0-dim, on the device) set to 1 changes nothing: every change is scaled
by (1 - found_inf), no host read.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from .inputs import keep_factor, local, whole_grad, zeroed_if_skipped

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as torch.optim.Muon's


def newton_schulz(u: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The orthogonalised matrices of a stack [k, rows, cols] (fp32; rows > cols transposed in)."""
    a, b, c = NS_COEFFICIENTS
    x = u.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """Param groups: {"params", "muon": True} for the hidden matrices, AdamW's for the rest."""

    def __init__(self, groups: list, lr: float, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, betas=(0.9, 0.95), eps: float = 1e-8):
        super().__init__(groups, {"lr": lr, "weight_decay": 0.0, "momentum": momentum, "nesterov": nesterov,
                                  "ns_steps": ns_steps, "betas": betas, "eps": eps, "muon": False})

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)  # 1: skip, on the device
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            (self._muon if group["muon"] else self._adamw)(group, params, found_inf, keep_factor(found_inf))
        return None

    def _muon(self, group: dict, params: list, found_inf, keep) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        given = dict(zip(map(id, group["params"]), group.get("row_blocks") or ()))
        blocks = [given.get(id(p), 1) for p in params]
        updates = []
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            g, m = zeroed_if_skipped(found_inf, local(whole_grad(p))), local(state["momentum_buffer"])
            m.lerp_(g, (1 - mu) * keep)
            updates.append(g.lerp(m, mu) if group["nesterov"] else m.clone())
        for p, o, b in zip(params, orthogonalised(params, updates, group["ns_steps"], blocks), blocks):
            w = local(p)
            w.mul_(1 - lr * wd * keep)
            w.add_(o.to(w.dtype) * keep, alpha=-lr * 0.2 * math.sqrt(max(p.shape[-2] // b, p.shape[-1])))

    def _adamw(self, group: dict, params: list, found_inf, keep) -> None:
        """AdamW, elementwise (so shard by shard), with its step count on the device."""
        lr, wd, (beta1, beta2), eps = group["lr"], group["weight_decay"], group["betas"], group["eps"]
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=local(p).device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            w, m, v = local(p), local(state["exp_avg"]), local(state["exp_avg_sq"])
            g = zeroed_if_skipped(found_inf, local(whole_grad(p)))
            state["step"].add_(keep)
            step = state["step"].clamp(min=1)
            m.lerp_(g, (1 - beta1) * keep)
            v.lerp_(g * g, (1 - beta2) * keep)
            denom = (v / (1 - beta2 ** step)).sqrt_().add_(eps)
            w.mul_(1 - lr * wd * keep)
            w.add_(m / denom * (keep * -lr / (1 - beta1 ** step)))


def orthogonalised(params: list, updates: list, steps: int, blocks: list[int] | None = None) -> list[torch.Tensor]:
    """NewtonSchulz5 of each parameter's update (this rank's local part in, its local part of
    the orthogonalised whole matrix out). Plain tensors (DDP, one process) are whole already;
    sharded ones (DTensors) go by shape and layout, a stack each (see the module's docstring).
    A Mixture-of-Experts layer's experts ([experts, rows, cols], FSDP2 shards them by expert:
    each rank holds whole matrices) are orthogonalised each apart where the rank holds them;
    `blocks`: how many matrices each parameter's rows stack (2: an expert's fused [gate; up]).
    Each stack is handed out from the rank where the last one ended: started at rank 0 every
    time, the few ranks that got a matrix of one stack got one of every stack (405B on 64 x 8
    ranks: the busiest rank 3x the mean work, half the ranks idle)."""
    out: list = [None] * len(params)
    stacks = defaultdict(list)
    for i, p in enumerate(params):
        if p.ndim == 3 and all(pl.is_replicate() or getattr(pl, "dim", None) == 0 for pl in getattr(p, "placements", ())):
            b = blocks[i] if blocks else 1
            u = updates[i]
            out[i] = newton_schulz(u.reshape(-1, u.shape[1] // b, u.shape[2]), steps).reshape(u.shape)
        elif hasattr(p, "placements"):
            stacks[(tuple(p.shape), p.device_mesh, tuple(p.placements))].append(i)
        else:
            out[i] = newton_schulz(updates[i][None], steps)[0]
    first = 0
    for (shape, mesh, placements), members in stacks.items():
        inputs = [updates[i] for i in members]
        layout = _layout(shape, mesh, placements)
        done = (_orthogonalise_stack(shape, mesh, *layout, inputs, steps, first) if layout is not None
                else _orthogonalise_by_redistribute(shape, mesh, placements, inputs, steps))
        first += len(members)
        for i, o in zip(members, done):
            out[i] = o
    return out


def _layout(shape, mesh, placements):
    """(parts, cuts): the matrix's dimensions cut into one part per mesh dimension that splits
    them, and (mesh dim, part) of those cuts, in mesh order. An outer split that divides its
    dimension is a part of its own (a column-parallel weight's tp slices, which FSDP2 splits
    again: its _StridedShard), the innermost split takes the rest as torch.chunk does (unevenly).
    None for a layout this does not know: DTensor's redistribute takes it (which may gather)."""
    if not all(pl.is_replicate() or pl.is_shard() or _strided(pl) for pl in placements):
        return None
    parts, cuts = [], []
    for d, size in enumerate(shape):
        plain = [i for i, pl in enumerate(placements) if pl.is_shard(d)]
        strided = [i for i, pl in enumerate(placements) if _strided(pl) and pl.dim == d]
        if strided and (len(strided) > 1 or any(i < strided[0] for i in plain)
                        or placements[strided[0]].split_factor != math.prod(mesh.size(i) for i in plain)):
            return None
        plain, strided = ([i for i in dims if mesh.size(i) > 1] for dims in (plain, strided))  # no cut
        order = plain + strided  # outer to inner: a _StridedShard splits what the later dims left
        outer = math.prod(mesh.size(i) for i in order[:-1])
        if size % outer:
            return None
        for i in order[:-1]:
            cuts.append((i, len(parts)))
            parts.append(mesh.size(i))
        if order:
            cuts.append((order[-1], len(parts)))
        parts.append(size // outer)
    return tuple(parts), tuple(sorted(cuts))


def _orthogonalise_stack(shape, mesh, parts, cuts, locals_: list[torch.Tensor], steps: int,
                         first: int) -> list[torch.Tensor]:
    """Whole matrices on each rank for its share of the stack: one all-to-all per mesh dimension
    that splits the matrix, each gathering that dimension's part of the matrices and handing
    the stack out over its ranks (matrix j to flat rank (first + j) mod n); Newton-Schulz; the
    same all-to-alls backwards. At no time does a rank hold more than its shards or its share
    of whole matrices (no gathered stack of shards)."""
    sizes = [mesh.size(i) for i, _ in cuts]
    n, k = math.prod(sizes), len(locals_)
    owner = [(first + j) % n for j in range(k)]  # flat rank, its digits the cuts' coordinates
    order = sorted(range(k), key=owner.__getitem__)  # a rank's matrices one block, at every cut
    counts = [owner.count(r) for r in range(n)]
    coordinate = mesh.get_coordinate()
    at = [coordinate[i] for i, _ in cuts]
    # per cut: its process group, the part it splits, that part's pieces over its ranks, how
    # many matrices each of them gets, this rank's place among them
    hand_outs = [(mesh.get_group(i), part, _chunks(parts[part], sizes[t]), _held(counts, sizes, at[:t]), at[t])
                 for t, (i, part) in enumerate(cuts)]
    mine = list(parts)  # this rank's shard of a matrix, in parts
    for _, part, pieces, _, me in hand_outs:
        mine[part] = pieces[me]
    x = torch.stack([locals_[j] for j in order]).view(k, *mine)
    for group, part, pieces, sent, me in hand_outs:
        x = _gathered(x, part, pieces, sent, me, group)
    x = newton_schulz(x.reshape(-1, *shape), steps).reshape(x.shape)
    for group, part, pieces, sent, me in reversed(hand_outs):  # back: each rank its shards of the results
        x = _scattered(x, part, pieces, sent, me, group)
    out: list = [None] * k
    for j, o in zip(order, x.reshape(k, *locals_[0].shape).unbind(0)):
        out[j] = o
    return out


def _gathered(x: torch.Tensor, part: int, pieces: list[int], sent: list[int], me: int, group) -> torch.Tensor:
    """One all-to-all over a cut's ranks: each sends rank y its next sent[y] matrices (its piece
    of `part` of them) and joins the pieces all send it of its own matrices along `part`."""
    per, mine = _per_matrix(x, part), sent[me]
    received = [mine * per * p for p in pieces]
    got = _all_to_all(x.reshape(-1), received, [c * per * pieces[me] for c in sent], group)
    return torch.cat([b.view(mine, *_with(x.shape[1:], part, p)) for b, p in zip(got.split(received), pieces)],
                     dim=1 + part)


def _scattered(x: torch.Tensor, part: int, pieces: list[int], sent: list[int], me: int, group) -> torch.Tensor:
    """_gathered backwards: each rank's matrices cut along `part`, each piece back to its rank."""
    per, mine = _per_matrix(x, part), sent[me]
    send = torch.cat([b.reshape(-1) for b in x.split(pieces, dim=1 + part)])
    got = _all_to_all(send, [c * per * pieces[me] for c in sent], [mine * per * p for p in pieces], group)
    return got.view(sum(sent), *_with(x.shape[1:], part, pieces[me]))


def _held(counts: list[int], sizes: list[int], prefix: list[int]) -> list[int]:
    """How many matrices each rank along the next cut gets of those held by the ranks whose
    first cuts' coordinates are `prefix` (flat rank: the cuts' coordinates, the first outermost)."""
    stride = math.prod(sizes[len(prefix) + 1:])
    start = 0
    for s, c in zip(sizes, prefix):
        start = start * s + c
    start *= sizes[len(prefix)]
    return [sum(counts[(start + y) * stride:(start + y + 1) * stride]) for y in range(sizes[len(prefix)])]


def _chunks(size: int, n: int) -> list[int]:
    """The sizes torch.chunk (DTensor's Shard, FSDP2) cuts `size` into over n ranks."""
    step = -(-size // n)
    return [max(0, min(step, size - r * step)) for r in range(n)]


def _per_matrix(x: torch.Tensor, part: int) -> int:
    """Elements of one matrix of stack x per row of its dimension `part`."""
    return math.prod(s for j, s in enumerate(x.shape[1:]) if j != part)


def _with(shape, part: int, size: int) -> tuple:
    return (*shape[:part], size, *shape[part + 1:])


def _all_to_all(send: torch.Tensor, received: list[int], sent: list[int], group) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol
    got = funcol.all_to_all_single(send, received, sent, group)
    return got.wait() if isinstance(got, funcol.AsyncCollectiveTensor) else got


def _orthogonalise_by_redistribute(shape, mesh, placements, locals_: list[torch.Tensor],
                                   steps: int) -> list[torch.Tensor]:
    """DTensor's redistribute of the stack to whole matrices and back: right for any layout, but
    its planner may all-gather a mesh dimension first (a row-parallel weight's tp slices under
    FSDP2: tp times the shards on every rank)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    stride_of_one = torch.empty(shape, device="meta").stride()
    stacked_placements = [_shifted(pl) for pl in placements]
    whole_placements = [Replicate() if pl.is_replicate() else Shard(0) for pl in placements]
    global_shape = torch.Size((len(locals_), *shape))
    stride = (math.prod(shape), *stride_of_one)
    stack = DTensor.from_local(torch.stack(locals_), mesh, stacked_placements, shape=global_shape, stride=stride)
    whole = stack.redistribute(mesh, whole_placements)
    done = DTensor.from_local(newton_schulz(whole.to_local(), steps), mesh, whole_placements,
                              shape=global_shape, stride=stride)
    return list(done.redistribute(mesh, stacked_placements).to_local().unbind(0))


def _strided(placement) -> bool:
    """FSDP2's split of a tensor-parallel shard (torch's private _StridedShard), which is_shard()
    does not claim."""
    return type(placement).__name__ == "_StridedShard"


def _shifted(placement):
    """A matrix's placement as its place in a stack of matrices (one more leading dimension),
    a _StridedShard with its split factor."""
    if _strided(placement):
        return type(placement)(placement.dim + 1, split_factor=placement.split_factor)
    return type(placement)(placement.dim + 1) if placement.is_shard() else placement
