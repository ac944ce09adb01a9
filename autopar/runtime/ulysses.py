"""All-to-all context parallelism (DeepSpeed-Ulysses, 2309.14509): heads exchanged for tokens.

Each context rank holds its tokens (chunks i and 2c−1−i of the 2c-chunk layout, local order) of
every head. Around attention an all-to-all over the context group trades them: rank r sends
each other rank its tokens of that rank's H/c heads and receives every rank's tokens of its own
H/c heads, so it holds the whole sequence of H/c heads and runs ordinary attention on them; a
second all-to-all trades the output back. Backward is the same exchanges reversed (each
exchange's conjugate is the other), so the pair is exact: the gradient of the single device's
attention. Megatron-Core's `--cp-comm-type a2a` and torchtitan's Ulysses do the same; its
volume per rank does not grow with c (each rank sends (c−1)/c of q, k, v and the output), where
the all-gather's and the ring's K/V traffic does.

After the exchange the rank holds the c ranks' tokens rank-major (rank 0's two chunks, rank
1's, …); `ContextShard.order` puts them in global order, so a causal mask is the plain
is_causal of the whole sequence (the fused kernel's fast path) and an explicit mask is read
whole (its query rows and key columns global, its head dim cut to the rank's heads). The output
goes back to rank-major order (`ContextShard.rank_positions`) before the return exchange.

Heads must divide by c (the pass and the solver refuse otherwise). Grouped-query K/V: with
kv_group g (a head repeat in the graph, each kv head repeated g times consecutively) only every
g-th head is exchanged when the kv heads divide by c; with fewer kv heads than c (or not a
multiple), the kv heads are repeated up to the query heads first, which is exact and moves more
(what cost/exchanges.py `alltoall_attention_s` prices). c = 1 (or no group) is plain attention.

`context_hybrid_attention` (plan.cp_attention "hybrid"; Megatron-Core's a2a+p2p,
TransformerEngine's cp_group [a2a group, p2p group], here with the all-gather across): the
all-to-all above over k consecutive context ranks only (inside a node), then the K/V
all-gather of Llama 3's method over the c/k ranks at the same place in the other inner groups
(across nodes), on heads/k heads; the inverse all-to-all after. k: groups.hybrid_inner_degree.

`context_hybrid_ring_attention` (plan.cp_attention "hybrid-ring": Megatron-Core's a2a+p2p as
TransformerEngine runs it, the p2p ring across): the same inner all-to-all, then ring
attention (ring_attention.py) over the c/k outer ranks instead of the all-gather. After the
inner exchange a rank holds its inner group's 2k chunks, which are the two super-chunks b and
2m−1−b (b its inner group, m = c/k) of the sequence cut into 2m: put in that order they are
exactly ring attention's balanced layout at c = m, so the ring runs unchanged on an outer
`ContextShard` (m ranks, context rank b) and its blocks never hold more than the rank's own
K/V size (nothing of the other nodes' K/V is saved for the backward). No attention dropout
(the ring kernel draws none).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.runtime import groups as G
from autopar.runtime.collectives import all_gather_sp
from autopar.runtime.context_shard import ContextShard, causal_chunks
from autopar.runtime.dist import peer_guard
from autopar.runtime.ring_attention import context_ring_attention
from autopar.runtime.shard import as_default_stream


def _exchange(x: torch.Tensor, group: Any, what: str) -> torch.Tensor:
    """all_to_all_single of x (n, ...): out[r] is rank r's x[this rank]."""
    x = x.contiguous()
    out = torch.empty_like(x)
    with peer_guard(f"context all-to-all ({what}) with", group):
        dist.all_to_all_single(out, x, group=group)
    return out


def _heads_to_tokens(x: torch.Tensor, group: Any, n: int, what: str) -> torch.Tensor:
    """(B, H, L, E), this rank's L tokens of H heads -> (B, H/n, n·L, E): this rank's H/n
    heads of the n ranks' tokens, rank-major."""
    b, h, length, e = x.shape
    send = x.reshape(b, n, h // n, length, e).transpose(0, 1)      # send[r]: rank r's heads
    got = _exchange(send, group, what)                              # got[r]: rank r's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * length, e)


def _tokens_to_heads(y: torch.Tensor, group: Any, n: int, what: str) -> torch.Tensor:
    """The inverse: (B, H/n, n·L, E) rank-major -> (B, H, L, E), this rank's tokens."""
    b, h, nl, e = y.shape
    send = y.reshape(b, h, n, nl // n, e).permute(2, 0, 1, 3, 4)   # send[r]: rank r's tokens
    got = _exchange(send, group, what)                              # got[r]: rank r's heads
    return got.transpose(0, 1).reshape(b, n * h, nl // n, e)


class _HeadsToTokens(torch.autograd.Function):
    """Forward `_heads_to_tokens`; backward its inverse (the gradient's way home)."""

    @staticmethod
    def forward(ctx, x, group, n):
        ctx.group, ctx.n = group, n
        return _heads_to_tokens(x, group, n, "q/k/v")

    @staticmethod
    def backward(ctx, grad):
        return _tokens_to_heads(grad, ctx.group, ctx.n, "dq/dk/dv"), None, None


class _TokensToHeads(torch.autograd.Function):
    """Forward `_tokens_to_heads`; backward `_heads_to_tokens`."""

    @staticmethod
    def forward(ctx, y, group, n):
        ctx.group, ctx.n = group, n
        return _tokens_to_heads(y, group, n, "output")

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_tokens(grad, ctx.group, ctx.n, "d-output"), None, None


def heads_to_tokens(x: torch.Tensor, group: Any, n: int) -> torch.Tensor:
    """(B, H, L, E) -> (B, H/n, n·L, E) over `group` of n ranks (identity for n = 1)."""
    return x if n == 1 or group is None else _HeadsToTokens.apply(x, group, n)


def tokens_to_heads(y: torch.Tensor, group: Any, n: int) -> torch.Tensor:
    """(B, H/n, n·L, E) -> (B, H, L, E), the conjugate of `heads_to_tokens`."""
    return y if n == 1 or group is None else _TokensToHeads.apply(y, group, n)


def _index(idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return idx if idx.device == like.device else idx.to(like.device)


def _rank_mask(mask: torch.Tensor | None, heads: int, rank: int, n: int) -> torch.Tensor | None:
    """The explicit mask (…, H or 1, T, T), whole, with its head dim cut to this rank's
    H/n heads when it has one."""
    if mask is None or mask.dim() < 3 or mask.shape[-3] == 1:
        return mask
    if mask.shape[-3] != heads:
        raise ValueError(f"all-to-all attention: a mask of shape {tuple(mask.shape)} with "
                         f"{mask.shape[-3]} heads for {heads} query heads; use "
                         f"cp_attention='all-gather' for this model")
    return mask.narrow(-3, rank * (heads // n), heads // n)


def context_alltoall_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: Any,
                               attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                               scale: float | None = None, enable_gqa: bool = False,
                               kv_group: int = 1, dropout_p: float = 0.0, streams: Any = None,
                               seed: int = 0, per_tensor_rank: bool = False) -> torch.Tensor:
    """Scaled-dot-product attention of this rank's tokens q, k, v (B, H, T/c, E) over the
    whole sequence by two all-to-alls (module docstring). attn_mask: whole, (…, T, T), global
    order. kv_group: k and v are a head repeat in the graph (only every kv_group-th head is
    read). Attention dropout draws from this rank's stream of `streams` (shard.DropoutStreams).
    Output in the fused kernels' layout.
    Why this size: the sdpa arguments plus the context group, the heads' split and the exchange's
    facts."""
    if kv_group > 1:     # the repeat's copies carry no information (its backward sums them)
        k, v = k[:, ::kv_group], v[:, ::kv_group]
    n = 1 if cp.group is None else cp.c
    heads, kv_heads = q.shape[1], k.shape[1]
    if q.dim() != 4 or heads % n or heads % kv_heads:
        raise ValueError(f"all-to-all attention: q {tuple(q.shape)} and k {tuple(k.shape)} must "
                         f"be (batch, heads, tokens, head_dim) with heads divisible by c={n} and "
                         f"by the kv heads; use cp_attention='all-gather' or 'ring'")
    if kv_heads % n:     # fewer kv heads than ranks: each rank needs whole groups, repeat them
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    if n > 1:
        order = _index(cp.order, q)
        q, k, v = (heads_to_tokens(x, cp.group, n).index_select(2, order) for x in (q, k, v))
        attn_mask = _rank_mask(attn_mask, heads, cp.cp_rank, n)
    kwargs = dict(attn_mask=attn_mask, is_causal=bool(is_causal), scale=scale,
                  enable_gqa=enable_gqa or k.shape[1] != q.shape[1])
    if dropout_p:
        with as_default_stream(streams.generator(seed, q.device, per_tensor_rank), q.device):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, **kwargs)
    else:
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    if n > 1:
        back = _index(cp.rank_positions, out).reshape(-1)
        out = tokens_to_heads(out.index_select(2, back), cp.group, n)
    # the fused kernels' layout, (B, L, H, E) in memory: callers view it after transpose(1, 2)
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _hybrid_kv(k: torch.Tensor, v: torch.Tensor, heads: int, kv_group: int, n: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as the exchange over n ranks reads them: every kv_group-th head of a graph's
    repeat, repeated up to the query heads when the kv heads do not divide by n."""
    if kv_group > 1:     # the repeat's copies carry no information (its backward sums them)
        k, v = k[:, ::kv_group], v[:, ::kv_group]
    if k.shape[1] % n:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    return k, v


def context_hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: Any,
                             attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                             scale: float | None = None, enable_gqa: bool = False,
                             kv_group: int = 1, dropout_p: float = 0.0, streams: Any = None,
                             seed: int = 0, per_tensor_rank: bool = False) -> torch.Tensor:
    """The hybrid context method (Megatron-Core's a2a+p2p, with the all-gather across):
    attention of this rank's tokens q, k, v (B, H, T/c, E) over the whole sequence. The c
    context ranks are k inner (consecutive, inside a node) × c/k outer; k is
    groups.hybrid_inner_degree(c, H, cp.node_ranks). An all-to-all over the inner group trades
    tokens for heads (the rank then holds its inner group's tokens of H/k heads), the K/V of
    those heads is all-gathered over the outer group (backward: reduce-scatter) and put in
    global order, the rank's queries (its inner group's 2k chunks) attend to it chunk by chunk
    under is_causal (or with the mask's rows at those positions, heads cut to the rank's H/k),
    and the inverse all-to-all brings the output home. Same arguments as
    `context_alltoall_attention`. Why this size: the sdpa arguments plus the context shard, the
    repeat's group and the dropout stream's facts."""
    if cp.group is None or cp.c == 1:   # no other rank (the stand-in shard, c = 1)
        return context_alltoall_attention(q, k, v, cp, attn_mask, is_causal, scale, enable_gqa,
                                          kv_group, dropout_p, streams, seed, per_tensor_rank)
    return _hybrid(q, k, v, cp, attn_mask, is_causal, scale, enable_gqa, kv_group,
                   (dropout_p, streams, seed, per_tensor_rank), ring=False)


def context_hybrid_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: Any,
                                  attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                                  scale: float | None = None, enable_gqa: bool = False,
                                  kv_group: int = 1, dropout_p: float = 0.0, streams: Any = None,
                                  seed: int = 0, per_tensor_rank: bool = False) -> torch.Tensor:
    """The hybrid with the ring across (plan.cp_attention "hybrid-ring"; Megatron-Core's
    a2a+p2p as TransformerEngine runs it): the inner all-to-all of `context_hybrid_attention`,
    then ring attention over the c/k outer ranks on the rank's heads/k heads (module
    docstring), the inverse all-to-all after. Same arguments; attention dropout is refused
    (the ring draws none). Why this size: the sdpa arguments plus the context shard, the
    repeat's group and the dropout stream's facts."""
    if dropout_p:
        raise ValueError(f"hybrid-ring attention with attention dropout {dropout_p}: the ring "
                         f"kernel draws no dropout; use cp_attention='hybrid'")
    if cp.group is None or cp.c == 1:   # no other rank (the stand-in shard, c = 1)
        return context_alltoall_attention(q, k, v, cp, attn_mask, is_causal, scale, enable_gqa,
                                          kv_group)
    return _hybrid(q, k, v, cp, attn_mask, is_causal, scale, enable_gqa, kv_group,
                   (0.0, None, 0, False), ring=True)


def _hybrid(q, k, v, cp, attn_mask, is_causal, scale, enable_gqa, kv_group, rng, ring):
    """The hybrid's body at c > 1: inner all-to-all, the outer all-gather (ring False) or
    ring, the inverse all-to-all. rng: (dropout_p, streams, seed, per_tensor_rank).
    Why this size: the sdpa arguments plus the context shard and the outer exchange's choice."""
    dropout_p, streams, seed, per_tensor_rank = rng
    heads = q.shape[1]
    n = G.hybrid_inner_degree(cp.c, heads, cp.node_ranks)
    if q.dim() != 4 or (n > 1 and n not in (cp.subgroups or {})):
        raise ValueError(f"hybrid attention: q {tuple(q.shape)} over c={cp.c} with {heads} "
                         f"heads per tensor rank needs (batch, heads, tokens, head_dim) and the "
                         f"inner groups made for k={n} (ProcessGroups.create hybrid_node_ranks);"
                         f" use cp_attention='all-gather'")
    k, v = _hybrid_kv(k, v, heads, kv_group, n)
    inner, outer = cp.subgroups[n] if n > 1 else (None, cp.group)
    block = cp.cp_rank // n                      # this rank's inner group, of c/n
    q, k, v = (heads_to_tokens(x, inner, n) for x in (q, k, v))
    if ring:
        out = _ring_across(q, k, v, cp, n, outer, _rank_mask(attn_mask, heads, cp.cp_rank % n, n),
                           is_causal, scale, enable_gqa)
        return tokens_to_heads(out, inner, n).transpose(1, 2).contiguous().transpose(1, 2)
    order = _index(cp.order, k)                  # the outer all-gather, in global order
    k, v = (all_gather_sp(x.contiguous(), outer, 2).index_select(2, order) for x in (k, v))
    attn_mask = _rank_mask(attn_mask, heads, cp.cp_rank % n, n)
    if attn_mask is not None and attn_mask.dim() >= 2:   # the rows of the rank's queries
        rows = cp.rank_positions[block * n:(block + 1) * n].reshape(-1)
        attn_mask = attn_mask.index_select(-2, _index(rows, attn_mask))
    gqa = enable_gqa or k.shape[1] != q.shape[1]
    chunks = tuple(j for r in range(block * n, (block + 1) * n)
                   for j in G.sequence_chunks(r, cp.c))
    with (as_default_stream(streams.generator(seed, q.device, per_tensor_rank), q.device)
          if dropout_p else nullcontext()):
        if is_causal and attn_mask is None:
            out = causal_chunks(q, k, v, cp, scale, gqa, dropout_p, chunks)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                                 dropout_p=dropout_p, is_causal=bool(is_causal),
                                                 scale=scale, enable_gqa=gqa)
    out = tokens_to_heads(out, inner, n)
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _outer_shard(cp: Any, n: int, outer: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """(the outer ring's ContextShard, ring order, rank-major order) of this rank's inner
    group's tokens at inner degree n: the inner group b holds the super-chunks b and 2m−1−b of
    the sequence cut into 2m (m = c/n), ring attention's layout at c = m; `ring order` picks
    them from the rank-major concatenation the all-to-all left, `rank-major order` puts the
    ring's output back. Cached on cp (shared by every layer)."""
    cache = cp.__dict__.setdefault("_hybrid_ring", {})
    if n not in cache:
        block = cp.cp_rank // n
        shard = ContextShard(group=outer, c=cp.c // n, cp_rank=block, seq_len=cp.seq_len)
        held = cp.rank_positions[block * n:(block + 1) * n].reshape(-1)   # rank-major
        where = torch.full((cp.seq_len,), -1, dtype=torch.long)
        where[held] = torch.arange(held.numel())
        pick = where[shard.positions]
        if bool((pick < 0).any()):
            raise RuntimeError(f"hybrid-ring: context rank {cp.cp_rank} of c={cp.c} at k={n} "
                               f"holds tokens outside its outer block {block}: a layout bug")
        cache[n] = (shard, pick, torch.argsort(pick))
    return cache[n]


def _ring_across(q, k, v, cp, n, outer, attn_mask, is_causal, scale, enable_gqa):
    """Ring attention over the outer group of the inner group's tokens (B, H/n, n·L, E),
    rank-major in and out; attn_mask: whole, its heads already the rank's."""
    shard, pick, back = _outer_shard(cp, n, outer)
    q, k, v = (x.index_select(2, _index(pick, x)) for x in (q, k, v))
    if attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] != 1:
        attn_mask = attn_mask.index_select(-2, _index(shard.positions, attn_mask))
    out = context_ring_attention(q, k, v, shard, attn_mask, bool(is_causal), scale,
                                 enable_gqa or k.shape[1] != q.shape[1])
    return out.index_select(2, _index(back, out))
