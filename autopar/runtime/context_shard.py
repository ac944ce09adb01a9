"""Context parallelism at run time: this rank's share of each sequence and the K/V exchange.

Each sequence of T tokens is cut into 2c equal chunks; context rank i holds chunks i and
2c−1−i (autopar/runtime/groups.py `sequence_positions`), so under a causal mask every rank
attends to the same number of (query, key) pairs. The generated chunks (passes/context_parallel.py)
call the functions below on the graph attribute `cp`, a `ContextShard` the runtime binds:

  context_gather(x, cp, dim)    all-gather a value along its sequence dim over the context
                                group and put it in global token order (keys and values before
                                attention: Llama 3's all-gather method, 2407.21783 §3.3.2);
                                backward reduce-scatters the gradient (the conjugate pair
                                collectives.all_gather_sp), then undoes the order
  context_select(x, cp, dim)    the rows of a whole-sequence value (a rotary table, a position
                                embedding, a mask built from arange(T)) at this rank's global
                                positions
  context_causal_attention(q, k, v, cp)
                                is_causal attention of the rank's two query chunks against the
                                gathered keys: chunk j only reads keys [0, (j+1)·T/2c), so the
                                rank computes (2c+1)/(2c²) of the whole sequence's causal tiles
                                (5/8 at c = 2) instead of a masked (T/c) × T block; attention
                                dropout from this context rank's stream (shard.DropoutStreams)
  context_loss_mean(sum, target, cp, ignore_index)
                                c · the rank's summed token loss / the tokens counted on every
                                context rank (a forward all-reduce of one count): averaged over
                                the c ranks, the mean over every counted token of the sequence,
                                however unevenly ignored targets fall between the chunks
  context_sum(x, cp)            the sum over the context ranks of each rank's summand of a
                                sum over the tokens (a router's load-balancing statistics); the
                                backward sums the gradients as well (every rank's loss reads it)
  context_cut(x, cp, dim)       this rank's tokens of a whole input (Runner.train_step)

Under plan.cp_attention == "ring" attention is autopar/runtime/ring_attention.py's
`context_ring_attention` instead: no K/V gather, the blocks passed round the context group;
under "all-to-all", "hybrid" and "hybrid-ring" autopar/runtime/ulysses.py's (the hybrid's
queries are its inner group's chunks: `causal_chunks` with their chunk list).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from autopar.runtime import groups as G
from autopar.runtime.collectives import all_gather_sp, all_reduce, all_reduce_
from autopar.runtime.shard import as_default_stream


@dataclass(frozen=True, eq=False)
class ContextShard:
    """This rank's place in the sequence split: its context group, c, its context rank and the
    sequence length; `positions` (its global positions, local order), `rank_positions` (every
    context rank's, (c, T/c): ring attention's key columns of each block's owner) and `order`
    (where each global position sits in the all-gathered, rank-major concatenation) are
    derived."""
    group: Any
    c: int
    cp_rank: int
    seq_len: int
    # the hybrid context method (ulysses.context_hybrid_attention): {inner degree k: (inner
    # group, outer group)} of this rank (ProcessGroups.context_subgroups), and the context
    # ranks one node holds, from which the degree is chosen (groups.hybrid_inner_degree)
    subgroups: Any = None
    node_ranks: int = 1

    def __post_init__(self) -> None:
        G.check_sequence(self.seq_len, self.c)
        pos = G.sequence_positions(self.seq_len, self.cp_rank, self.c)
        per_rank = [G.sequence_positions(self.seq_len, r, self.c) for r in range(self.c)]
        gathered = [x for ranks in per_rank for x in ranks]
        inverse = [0] * self.seq_len
        for i, x in enumerate(gathered):
            inverse[x] = i
        object.__setattr__(self, "positions", torch.tensor(pos, dtype=torch.long))
        object.__setattr__(self, "rank_positions", torch.tensor(per_rank, dtype=torch.long))
        object.__setattr__(self, "order", torch.tensor(inverse, dtype=torch.long))

    @property
    def local_len(self) -> int:
        return self.seq_len // self.c


def hybrid_node_ranks(plan: Any) -> int | None:
    """The context ranks one node holds when `plan` runs the hybrid context method (c > 1,
    cp_attention "hybrid" or "hybrid-ring"): the launcher's ranks per node (torchrun's
    LOCAL_WORLD_SIZE; the whole world when unset) over t, context ranks being strided by t;
    None otherwise. The inner all-to-all's degree is chosen from it
    (groups.hybrid_inner_degree), as the cost model chooses it from the cluster's GPUs per
    node."""
    if plan.c == 1 or plan.cp_attention not in ("hybrid", "hybrid-ring"):
        return None
    raw = os.environ.get("LOCAL_WORLD_SIZE", str(plan.gpus))
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE={raw!r}: the hybrid context method reads the ranks "
                         f"per node from it; launch with torchrun (it sets it) or set it to a "
                         f"positive int")
    return max(1, int(raw) // plan.t)


def _index(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return idx if idx.device == x.device else idx.to(x.device)


def context_gather(x: torch.Tensor, cp: ContextShard, dim: int) -> torch.Tensor:
    """The whole sequence of `x` (this rank's tokens along `dim`), in global order."""
    if cp.c == 1:
        return x
    dim = dim % x.dim()
    full = all_gather_sp(x.contiguous(), cp.group, dim)
    return full.index_select(dim, _index(full, cp.order))


def context_select(x: torch.Tensor, cp: ContextShard, dim: int) -> torch.Tensor:
    """This rank's rows (global positions) of a whole-sequence value along `dim`."""
    if cp.c == 1:
        return x
    return x.index_select(dim % x.dim(), _index(x, cp.positions))


def context_cut(x: torch.Tensor, cp: ContextShard, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a whole input; a ValueError if its `dim` is not the sequence."""
    if cp.c == 1:
        return x
    if x.dim() <= dim or x.shape[dim] != cp.seq_len:
        raise ValueError(f"context parallelism: an input of shape {tuple(x.shape)} has no "
                         f"sequence dim {dim} of length {cp.seq_len}; pass the replica's whole "
                         f"sequences (batch, {cp.seq_len}, ...) to train_step")
    return context_select(x, cp, dim)


class _ContextSum(torch.autograd.Function):
    """All-reduce forward; all-reduce backward: the sum feeds every context rank's loss, and
    the gradient of their sum with respect to this rank's summand is the sum of theirs."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.group), None


def context_sum(x: torch.Tensor, cp: ContextShard) -> torch.Tensor:
    """The sum over the c context ranks of `x`, each rank's summand of a sum over the tokens
    (its partial sum along them, its count of them): whole, the same on every rank."""
    if cp.c == 1:
        return x
    if not x.requires_grad:   # a count: no gradient
        return all_reduce(x.contiguous(), cp.group)
    return _ContextSum.apply(x.contiguous(), cp.group)


def context_loss_mean(loss_sum: torch.Tensor, target: torch.Tensor, cp: ContextShard,
                      ignore_index: int = -100) -> torch.Tensor:
    """c · loss_sum / (targets other than ignore_index on all c context ranks): the runtime's
    average over the context ranks is then the whole sequences' token mean; 0 when no token
    counts (the count taken as 1, as the vocabulary-parallel cross-entropy does: a 0/0 would
    send NaN through the backward of every rank, which the runtime weighs 0)."""
    counted = (target != ignore_index).sum().reshape(1)
    if cp.c > 1:
        all_reduce_(counted, cp.group)     # a count: no gradient flows through it
    return loss_sum * (cp.c / counted.clamp(min=1).to(loss_sum.dtype)).reshape(())


def _chunk_mask(cp: ContextShard, j: int, like: torch.Tensor) -> torch.Tensor | None:
    """Additive mask of global chunk j's queries against keys [0, (j+1)·n): None for j = 0
    (a square causal block: is_causal), cached on `cp` (shared by every layer)."""
    if j == 0:
        return None
    n = cp.seq_len // (2 * cp.c)
    cache = cp.__dict__.setdefault("_chunk_masks", {})
    key = (j, like.dtype, str(like.device))
    if key not in cache:
        q = torch.arange(j * n, (j + 1) * n, device=like.device)
        k = torch.arange((j + 1) * n, device=like.device)
        cache[key] = torch.zeros((n, (j + 1) * n), dtype=like.dtype, device=like.device
                                 ).masked_fill(~(q[:, None] >= k[None, :]), float("-inf"))
    return cache[key]


def context_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cp: ContextShard, scale: float | None = None,
                             enable_gqa: bool = False, dropout_p: float = 0.0,
                             streams: Any = None, seed: int = 0,
                             per_tensor_rank: bool = False) -> torch.Tensor:
    """Causal scaled-dot-product attention of this rank's queries (local order: chunk i, then
    chunk 2c−1−i, along dim −2) against the whole sequence's keys and values (global order).
    Attention dropout draws from this rank's stream of `streams` (a shard.DropoutStreams:
    the context rank's, or with per_tensor_rank the tensor rank's too under split heads).
    Why this size: the sdpa arguments (q, k, v, mask, dropout, causal, scale, gqa) plus the rank's
    context and split-heads facts."""
    if dropout_p:
        with as_default_stream(streams.generator(seed, q.device, per_tensor_rank), q.device):
            return causal_chunks(q, k, v, cp, scale, enable_gqa, dropout_p)
    return causal_chunks(q, k, v, cp, scale, enable_gqa, 0.0)


def causal_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextShard,
            scale: float | None, enable_gqa: bool, dropout_p: float,
            chunks: tuple[int, ...] | None = None) -> torch.Tensor:
    """Causal attention of the query chunks `chunks` (global chunk indices of the 2c, in q's
    order along dim −2; default this rank's two) against the whole sequence's keys."""
    if cp.c == 1:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                              scale=scale, enable_gqa=enable_gqa)
    n = cp.seq_len // (2 * cp.c)
    outs = []
    for part, j in enumerate(chunks or G.sequence_chunks(cp.cp_rank, cp.c)):
        end = (j + 1) * n
        mask = _chunk_mask(cp, j, q)
        outs.append(F.scaled_dot_product_attention(
            q.narrow(-2, part * n, n), k.narrow(-2, 0, end), v.narrow(-2, 0, end),
            attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None, scale=scale,
            enable_gqa=enable_gqa))
    out = torch.cat(outs, dim=-2)
    if out.dim() == 4:   # the fused kernels' layout, (B, L, H, E) in memory: callers view it
        out = out.transpose(1, 2).contiguous().transpose(1, 2)   # after transpose(1, 2)
    return out
