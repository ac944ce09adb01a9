"""Local shards of tensor-parallel parameters, and the vocab-parallel ops of the rewritten graph.

A `ParamSplit(dim, blocks, padded)` says how one parameter is split over t ranks: along `dim`
the parameter is cut into consecutive blocks of global sizes `blocks` (q, k, v of a fused
projection are three blocks), and rank r holds the r-th 1/t of every block, concatenated:

    W (3C, C), blocks (C, C, C), t = 2:   rank r holds rows [rC/2, (r+1)C/2) of each of q, k, v
                                           → local (3C/2, C)

`padded` > 0 (vocab dims only): the dim is zero-padded to `padded` rows first; rank r holds rows
[r·padded/t, (r+1)·padded/t). Padding is invisible outside: `unshard` drops it, the
vocab-parallel cross-entropy masks padded logits to -inf.

The functions below are FX `call_function` targets; each takes the tensor-parallel group
explicitly and reads the rank from it, so every rank runs the same graph code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.runtime.collectives import group_rank, group_size


class UnboundGroup:
    """Stands in for the process group of a graph rewritten for inspection only (group=None);
    running such a graph fails in the first collective."""

    def __init__(self, t: int):
        self.t = t

    def __repr__(self) -> str:
        return f"UnboundGroup(t={self.t})"


@dataclass(frozen=True)
class ParamSplit:
    dim: int
    blocks: tuple[int, ...]
    padded: int = 0

    def local_size(self, t: int) -> int:
        return self.padded // t if self.padded else sum(b // t for b in self.blocks)

    def ranges(self, rank: int, t: int) -> list[tuple[int, int]]:
        """(start, length) of this rank's pieces in global coordinates (may pass the end of an
        unpadded dim: the rows there are padding)."""
        if self.padded:
            n = self.padded // t
            return [(rank * n, n)]
        out, offset = [], 0
        for b in self.blocks:
            out.append((offset + rank * (b // t), b // t))
            offset += b
        return out


def local_shard(full: torch.Tensor, split: ParamSplit, rank: int, t: int) -> torch.Tensor:
    """This rank's shard of `full` (a copy; padded rows are zeros)."""
    return _pieces(full, split, rank, t).clone()


def unshard(pieces: list[torch.Tensor], split: ParamSplit, full_size: int) -> torch.Tensor:
    """The full tensor from every rank's shard (rank order), padding dropped."""
    t = len(pieces)
    if split.padded:
        return torch.cat(pieces, dim=split.dim).narrow(split.dim, 0, full_size)
    out = []
    offset = 0
    for b in split.blocks:
        n = b // t
        out += [p.narrow(split.dim, offset, n) for p in pieces]
        offset += n
    return torch.cat(out, dim=split.dim)


def materialize_local(module: torch.nn.Module, name: str, split: ParamSplit | None, rank: int,
                      t: int, init: Callable[[torch.nn.Module], None] | None,
                      seed: int) -> torch.Tensor:
    """This rank's shard of parameter `name` of a meta-device `module`, initialised by the
    module's own code — `module.reset_parameters()` if it has one, then `init(module)` (the
    model's _init_weights) — run on the module with that parameter local-shaped, under the
    reproducible seed (seed, name, rank). The full parameter is never allocated.
    Caveat: shape-dependent inits (kaiming's fan-in) see the local shape."""
    full = getattr(module, name)
    shape = list(full.shape)
    if split is not None:
        shape[split.dim] = split.local_size(t)
    local = torch.nn.Parameter(torch.empty(shape, dtype=full.dtype, device="cpu"),
                               requires_grad=full.requires_grad)
    saved = {n: p for n, p in module.named_parameters(recurse=False)}
    for n, p in saved.items():  # only `name` is real; siblings stay meta (init skips nothing)
        setattr(module, n, local if n == name else torch.nn.Parameter(
            torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad))
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(_stable_seed(seed, name, rank if split is not None else 0))
        with torch.no_grad():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            if init is not None:
                init(module)
    finally:
        torch.random.set_rng_state(gen_state)
        for n, p in saved.items():
            setattr(module, n, p)
    return local.detach()


def _stable_seed(seed: int, name: str, rank: int) -> int:
    h = 1469598103934665603
    for ch in f"{name}#{rank}".encode():
        h = ((h ^ ch) * 1099511628211) % (1 << 61)
    return (seed * 1000003 + h) % (1 << 62)


# ----- layout helpers used by the rewritten graph ----------------------------------------------

def local_blocks(x: torch.Tensor, group: Any, dim: int, blocks: list[int],
                 padded: int = 0) -> torch.Tensor:
    """This rank's pieces of a replicated `x` under Shard(dim, blocks); no communication (the
    caller puts copy_to_tp before it when gradients must be summed)."""
    t, rank = group_size(group), group_rank(group)
    split = ParamSplit(dim % x.dim(), tuple(blocks), padded)
    return _pieces(x, split, rank, t)


def _pieces(x: torch.Tensor, split: ParamSplit, rank: int, t: int) -> torch.Tensor:
    """Differentiable gather of this rank's ranges of `x` along split.dim, zeros past its end."""
    out, size = [], x.shape[split.dim]
    for start, length in split.ranges(rank, t):
        real = max(0, min(length, size - start))
        if real:
            out.append(x.narrow(split.dim, start, real))
        if real < length:
            pad = list(x.shape)
            pad[split.dim] = length - real
            out.append(x.new_zeros(pad))
    return torch.cat(out, dim=split.dim)


def unshuffle_blocks(x: torch.Tensor, group: Any, dim: int, blocks: list[int],
                     padded: int = 0) -> torch.Tensor:
    """Reorder a rank-major all-gather of Shard(dim, blocks) pieces into the global order
    (and drop vocab padding)."""
    t = group_size(group)
    dim = dim % x.dim()
    if padded:
        return x.narrow(dim, 0, sum(blocks))
    local = [b // t for b in blocks]
    per_rank = sum(local)
    out = []
    offset = 0
    for n in local:
        out += [x.narrow(dim, r * per_rank + offset, n) for r in range(t)]
        offset += n
    return torch.cat(out, dim=dim)


# ----- vocab-parallel embedding and cross-entropy ----------------------------------------------

def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, group: Any,
                             padding_idx: int = -1) -> torch.Tensor:
    """Partial sums of embedding(ids): rank r looks up the ids in its rows
    [r·V/t, (r+1)·V/t) and contributes zeros for the others (reduce_from_tp sums them)."""
    rows = weight.shape[0]
    start = group_rank(group) * rows
    outside = (ids < start) | (ids >= start + rows)
    local = (ids - start).masked_fill(outside, 0)
    pad = padding_idx - start if 0 <= padding_idx - start < rows else None
    out = F.embedding(local, weight, padding_idx=pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy of logits split over the vocab (Megatron): max, target logit and sum of
    exponentials are all-reduced; the full logits are never gathered."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index, reduction):
        n_local = logits.shape[-1]
        start = group_rank(group) * n_local
        logits = logits.float()
        cols = torch.arange(start, start + n_local, device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))  # vocab padding
        lmax = logits.max(dim=-1).values
        _all_reduce(lmax, group, dist.ReduceOp.MAX)
        shifted = logits - lmax.unsqueeze(-1)
        outside = (target < start) | (target >= start + n_local)
        local_t = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        _all_reduce(picked, group, dist.ReduceOp.SUM)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        _all_reduce(sum_exp, group, dist.ReduceOp.SUM)
        loss = sum_exp.log() - picked
        valid = target != ignore_index
        loss = loss.masked_fill(~valid, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_t, outside, valid)
        ctx.reduction, ctx.count = reduction, valid.sum().clamp(min=1)
        if reduction == "mean":
            return loss.sum() / ctx.count
        return loss.sum() if reduction == "sum" else loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, outside, valid = ctx.saved_tensors
        g = softmax
        g.scatter_add_(-1, local_t.unsqueeze(-1), -(~outside).to(g.dtype).unsqueeze(-1))
        scale = valid.to(g.dtype)
        if ctx.reduction == "mean":
            scale = scale * (grad / ctx.count)
        elif ctx.reduction == "sum":
            scale = scale * grad
        else:
            scale = scale * grad
        return g * scale.unsqueeze(-1), None, None, None, None, None


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Any,
                                 vocab_size: int, ignore_index: int = -100,
                                 reduction: int = 1) -> torch.Tensor:
    """F.cross_entropy(full_logits, target) from this rank's vocab slice of the logits (N, V/t);
    `reduction` as in aten.cross_entropy_loss (0 none, 1 mean, 2 sum)."""
    out = _VocabParallelCE.apply(logits, target, group, vocab_size, ignore_index,
                                 _REDUCTIONS[reduction])
    return out.to(logits.dtype)


def _all_reduce(x: torch.Tensor, group: Any, op: Any) -> None:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)


# ----- dropout streams --------------------------------------------------------------------------

def tp_dropout(x: torch.Tensor, p: float, train: bool, group: Any, seed: int) -> torch.Tensor:
    """Dropout on a split value: each tensor rank draws from its own stream (seed + rank,
    advanced per call), like Megatron's model-parallel RNG tracker; the default generator,
    which replicated regions use, is left untouched so it stays identical across ranks."""
    if not train or p == 0.0:
        return x
    gen = _tracker(group, seed)
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=gen)
    return x * keep / (1.0 - p)


_GENERATORS: dict[tuple[int, int], torch.Generator] = {}


def _tracker(group: Any, seed: int) -> torch.Generator:
    key = (seed, group_rank(group))
    if key not in _GENERATORS:
        gen = torch.Generator()
        gen.manual_seed(2718 + seed + 1_000_003 * group_rank(group))
        _GENERATORS[key] = gen
    return _GENERATORS[key]
