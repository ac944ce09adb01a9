"""Ring attention over the context group: K/V blocks travel, partial results merge by log-sum-exp.

    softmax(q·Kᵀ/√E)·V over the whole sequence, with K = [K_0; …; K_{c−1}] held by the c
    context ranks, is the log-sum-exp merge of the per-block partials (online softmax):
        lse_r = log Σ_j exp(s_rj),   o_r = softmax(s_r)·V_r         (block r's scores s_r)
        lse   = log Σ_r exp(lse_r),  o   = Σ_r exp(lse_r − lse)·o_r

Each context rank keeps its queries (its two sequence chunks i and 2c−1−i, local order) and
passes its K/V block round the ring (send to the next context rank, receive from the previous),
starting the next block's exchange before computing on the current one so the two overlap
(Liu et al. 2310.01889; zhuzilin/ring-flash-attention; torch's `_templated_ring_attention`,
torch/distributed/tensor/experimental/_context_parallel/_attention.py, whose step structure
and round-robin causal cases this follows). Under is_causal the 2c-chunk layout makes every
step the same work: at step s the rank holds the block of rank r = (i − s) mod c and
  - r = i:   its own two chunks, a causal (lower-triangular) block — the only masked one;
  - r < i:   both query chunks against key chunk r only (chunk 2c−1−r is in their future);
  - r > i:   only query chunk 2c−1−i, against both key chunks, unmasked;
derived below from the chunk ids (`_causal_tiles`), never a masked (T/c) × T block. An explicit
mask (its query rows this rank's, its key columns global) is cut at the block owner's positions
each step; blocks it masks whole are skipped.

Backward (the same ring again, flash-attention's backward per block): with the output o and
lse saved, each block's p = exp(s − lse) is recomputed, dQ accumulates locally, and each
block's dK/dV accumulator travels with it and is added to on every rank it visits, ending back
at its owner after c hops. Exact: it is the gradient of the single-device attention.

Grouped-query attention rings the kv heads (K/V of Hk heads for Hq = g·Hk query heads, query
head h reading kv head h // g, as repeat_kv and enable_gqa do): the block product runs on a
(B, Hk, g, L, E) view of the queries, so the repeated heads are never sent. Point-to-point is
dist.isend / dist.irecv with tags, never batch_isend_irecv (it hangs on gloo, as the pipeline
executor notes). c = 1 (or no group) is plain scaled-dot-product attention.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.runtime import groups as G
from autopar.runtime.dist import peer_guard

_KV_TAG, _GRAD_TAG = 7100, 7200   # message tags: K/V blocks forward, dK/dV accumulators back


@dataclass(frozen=True)
class _Tile:
    """One product of a ring step: local query rows [q0, q0 + qn) against the block's key rows
    [0, kn); `diagonal`: a square tile of the rank's own block, causal inside (its local order
    is increasing in global position, so the square causal mask is the global one)."""
    q0: int
    qn: int
    kn: int
    diagonal: bool


@functools.lru_cache(maxsize=None)   # pure in its ints; asked once per ring step per layer
def _causal_tiles(rank: int, owner: int, c: int, n: int) -> tuple[_Tile, ...]:
    """The tiles of query chunks (chunk ids of `rank`) against key chunks (of `owner`), each
    chunk n tokens. The own block is one square causal tile (torch's step 0); otherwise no chunk
    is shared, and a query chunk reads the owner's key chunks before it — a prefix of the two,
    which are in increasing order — unmasked. Query chunks reading the same keys merge."""
    if owner == rank:
        return (_Tile(q0=0, qn=2 * n, kn=2 * n, diagonal=True),)
    qs, ks = G.sequence_chunks(rank, c), G.sequence_chunks(owner, c)
    tiles: list[_Tile] = []
    for a, qa in enumerate(qs):
        kn = sum(kb < qa for kb in ks)
        if not kn:
            continue
        last = tiles[-1] if tiles else None
        if last is not None and last.kn == kn * n and last.q0 + last.qn == a * n:
            tiles[-1] = _Tile(q0=last.q0, qn=last.qn + n, kn=kn * n, diagonal=False)
        else:
            tiles.append(_Tile(q0=a * n, qn=n, kn=kn * n, diagonal=False))
    return tuple(tiles)


def _acc(x: torch.Tensor) -> torch.dtype:
    """The accumulation dtype of lse and merged outputs: fp32, or x's if wider."""
    return torch.promote_types(x.dtype, torch.float32)


def _block_bias(mask: torch.Tensor | None, cols: torch.Tensor | None, tile: _Tile,
                like: torch.Tensor) -> torch.Tensor | None:
    """The explicit mask's additive bias (…, qn, kn) for one tile, in like's dtype: its rows
    the tile's queries, its columns the block owner's keys; None without a mask."""
    if mask is None:
        return None
    m = mask.narrow(-2, tile.q0, tile.qn) if mask.shape[-2] != 1 else mask
    m = m.index_select(-1, cols)
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=like.dtype, device=m.device).masked_fill(
            ~m, float("-inf"))
    return m.to(like.dtype)


def _skipped(bias: torch.Tensor | None) -> bool:
    """A tile whose explicit mask masks every (query, key) pair contributes nothing."""
    return bias is not None and bool(torch.isneginf(bias).all())


def _repeat(x: torch.Tensor, g: int) -> torch.Tensor:
    """(B, Hk, S, E) -> (B, Hk·g, S, E): kv head j serves query heads j·g … j·g + g − 1."""
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _group_sum(x: torch.Tensor, g: int) -> torch.Tensor:
    """The conjugate of _repeat: (B, Hk·g, S, E) -> (B, Hk, S, E), summed over each group."""
    return x if g == 1 else x.unflatten(1, (x.shape[1] // g, g)).sum(2)


# The fused kernel with its log-sum-exp, forward and backward, on CPU (what
# scaled_dot_product_attention runs there); elsewhere the tile is written out (`_math_*`).
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _math_scores(q, k, bias, diagonal, scale):
    """Scores (B, H, qn, kn) of one tile in the accumulation dtype, masked."""
    s = (q @ k.transpose(-1, -2)).to(_acc(q)) * scale
    if diagonal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device
                                     ).triu(1), float("-inf"))
    return s if bias is None else s + bias.to(s.dtype)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with fully masked rows (−inf) read as 0, so exp(s − lse) is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _fused(q: torch.Tensor, fused: bool | None) -> bool:
    return q.device.type == "cpu" if fused is None else fused


def _tile_forward(q, k, v, bias, diagonal, scale, fused=None):
    """(out (B, H, qn, Ev), lse (B, H, qn)) of one tile, both in the accumulation dtype; a row
    the mask hides whole has lse −inf (weight 0 in the merge) and out 0. fused: the CPU
    kernel (None: on CPU) or the written-out product."""
    if _fused(q, fused):
        out, lse = _FLASH_CPU(q, k, v, 0.0, diagonal, attn_mask=bias, scale=scale)
        if bias is not None:   # the kernel reports lse 0 for a row with no key: it has none
            dead = torch.isneginf(bias).all(-1).expand(lse.shape)
            lse = lse.masked_fill(dead, float("-inf"))
        return out.to(_acc(q)), lse.to(_acc(q))
    s = _math_scores(q, k, bias, diagonal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return (p.to(v.dtype) @ v).to(_acc(q)), lse


def _tile_backward(dout, q, k, v, out, lse, bias, diagonal, scale, fused=None):
    """(dq, dk, dv) of one tile given the merged output and lse of its query rows: with them
    exp(s − lse) is the tile's share of the whole softmax, so the fused kernel's backward (or
    the written-out one) gives exactly the tile's terms of the whole gradient.
    Why this size: one tile's inputs and the merged output, lse and output gradient the exact tile
    gradient needs."""
    if _fused(q, fused):   # lse is the kernel's dtype: fp32, or fp64 for fp64 inputs
        return _FLASH_CPU_BWD(dout.contiguous(), q.contiguous(), k, v, out.contiguous(),
                              lse.contiguous(), 0.0, diagonal, attn_mask=bias, scale=scale)
    acc = _acc(q)
    s = _math_scores(q, k, bias, diagonal, scale)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    do = dout.to(acc)
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ v.to(acc).transpose(-1, -2)
              - (do * out.to(acc)).sum(-1, keepdim=True)) * scale
    return ds @ k.to(acc), ds.transpose(-1, -2) @ q.to(acc), dv


def merge_partials(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                   block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge of two partial attentions over disjoint key sets:
    lse = log(e^lse + e^block_lse), out = e^(lse_a − lse)·out_a + e^(lse_b − lse)·out_b
    (−inf lse: no key yet, weight 0). out: (…, L, E), lse: (…, L), the accumulation dtype."""
    new = torch.logaddexp(lse, block_lse)
    base = _finite(new)
    merged = (out * torch.exp(lse - base).unsqueeze(-1)
              + block_out * torch.exp(block_lse - base).unsqueeze(-1))
    return merged, new


class _Ring:
    """The K/V (or dK/dV) exchange of one ring step: send to the next context rank, receive
    from the previous, started at once and waited for later (so it overlaps the step's compute)."""

    def __init__(self, group: Any, rank: int, c: int):
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % c)
        self.prev = dist.get_global_rank(group, (rank - 1) % c)

    def start(self, tensors: tuple[torch.Tensor, ...], tag: int):
        bufs = tuple(torch.empty_like(x) for x in tensors)
        sends = [x.contiguous() for x in tensors]
        with peer_guard("ring attention exchange with", self.group, [self.prev, self.next]):
            if dist.get_backend(self.group) == "gloo":
                # one isend / irecv each, matched by tag (batch_isend_irecv hangs on gloo)
                works = [dist.irecv(b, src=self.prev, group=self.group, tag=tag + i)
                         for i, b in enumerate(bufs)]
                works += [dist.isend(x, dst=self.next, group=self.group, tag=tag + i)
                          for i, x in enumerate(sends)]
            else:
                # NCCL runs separate p2p calls in order on one stream: a ring of receives
                # first would wait on each other; batched, they start together (untested here)
                works = dist.batch_isend_irecv(
                    [dist.P2POp(dist.irecv, b, self.prev, self.group) for b in bufs]
                    + [dist.P2POp(dist.isend, x, self.next, self.group) for x in sends])

        def wait() -> tuple[torch.Tensor, ...]:
            with peer_guard("ring attention exchange with", self.group, [self.prev, self.next]):
                for w in works:
                    w.wait()
            del sends[:]   # the sent tensors stayed alive (referenced here) until now
            return bufs
        return wait


def _step_tiles(cp: Any, owner: int, causal: bool, length: int) -> tuple[_Tile, ...]:
    if causal:
        return _causal_tiles(cp.cp_rank, owner, cp.c, length // 2)
    return (_Tile(q0=0, qn=length, kn=length, diagonal=False),)


def _tiles(cp, owner, causal, mask, q):
    """(tile, its bias) of one ring step, fully masked tiles left out."""
    cols = _cols(cp, owner, mask)
    for tile in _step_tiles(cp, owner, causal, q.shape[2]):
        bias = _block_bias(mask, cols, tile, q)
        if not _skipped(bias):
            yield tile, bias


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, cp, causal, scale):   # noqa: D401 - autograd signature
        B, Hq, L, _ = q.shape
        g = Hq // k.shape[1]
        acc = _acc(q)
        out = q.new_zeros((B, Hq, L, v.shape[-1]), dtype=acc)
        lse = torch.full((B, Hq, L), float("-inf"), dtype=acc, device=q.device)
        ring = _Ring(cp.group, cp.cp_rank, cp.c)
        kb, vb = k, v
        for s in range(cp.c):
            owner = (cp.cp_rank - s) % cp.c
            pending = ring.start((kb, vb), _KV_TAG + 2 * s) if s < cp.c - 1 else None
            for tile, bias in _tiles(cp, owner, causal, mask, q):
                rows = slice(tile.q0, tile.q0 + tile.qn)
                bout, blse = _tile_forward(
                    q[:, :, rows], _repeat(kb[:, :, :tile.kn], g),
                    _repeat(vb[:, :, :tile.kn], g), bias, tile.diagonal, scale)
                out[:, :, rows], lse[:, :, rows] = merge_partials(
                    out[:, :, rows], lse[:, :, rows], bout, blse)
            if pending is not None:
                kb, vb = pending()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.cp, ctx.causal, ctx.scale = cp, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, out, lse = ctx.saved_tensors
        cp, causal, scale = ctx.cp, ctx.causal, ctx.scale
        g = q.shape[1] // k.shape[1]
        acc = _acc(q)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        ring = _Ring(cp.group, cp.cp_rank, cp.c)
        kb, vb = k, v
        incoming = None
        for s in range(cp.c):
            owner = (cp.cp_rank - s) % cp.c
            pending = ring.start((kb, vb), _KV_TAG + 2 * s) if s < cp.c - 1 else None
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
            for tile, bias in _tiles(cp, owner, causal, mask, q):
                rows = slice(tile.q0, tile.q0 + tile.qn)
                tq, tk, tv = _tile_backward(
                    dout[:, :, rows], q[:, :, rows], _repeat(kb[:, :, :tile.kn], g),
                    _repeat(vb[:, :, :tile.kn], g), out[:, :, rows], lse[:, :, rows], bias,
                    tile.diagonal, scale)
                dq[:, :, rows] += tq
                dk[:, :, :tile.kn] += _group_sum(tk.to(acc), g)
                dv[:, :, :tile.kn] += _group_sum(tv.to(acc), g)
            if incoming is not None:      # the block's gradient from the ranks it visited
                got_k, got_v = incoming()
                dk, dv = dk + got_k, dv + got_v
            incoming = ring.start((dk, dv), _GRAD_TAG + 2 * s)
            if pending is not None:
                kb, vb = pending()
        dk, dv = incoming()               # this rank's own block, back from its round
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _cols(cp: Any, owner: int, mask: torch.Tensor | None) -> torch.Tensor | None:
    """The block owner's global key positions (the explicit mask's columns), or None."""
    if mask is None:
        return None
    return cp.rank_positions[owner].to(mask.device)


def context_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: Any,
                           attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                           scale: float | None = None, enable_gqa: bool = False,
                           kv_group: int = 1) -> torch.Tensor:
    """Scaled-dot-product attention of this rank's queries q (B, Hq, T/c, E) against the whole
    sequence, K/V (B, Hk, T/c, E) of every context rank travelling round the ring (module
    docstring). attn_mask: its query rows this rank's, its key columns in global order
    (…, T/c or 1, T). kv_group: k and v are a grouped-query head repeat, each kv head repeated
    kv_group times consecutively (repeat_kv's layout): only every kv_group-th head travels.
    enable_gqa: k and v already hold Hk < Hq heads. Output in the fused kernels' layout.
    Why this size: the sdpa arguments plus the rank's context group facts."""
    if kv_group > 1:      # the repeat's copies carry no information: the gradient of the one
        k, v = k[:, ::kv_group], v[:, ::kv_group]   # read sums as the repeat's backward would
    scale = 1.0 / (q.shape[-1] ** 0.5) if scale is None else scale
    if cp.c == 1 or cp.group is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              scale=scale,
                                              enable_gqa=enable_gqa or k.shape[1] != q.shape[1])
    if q.dim() != 4 or k.dim() != 4 or q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention: q {tuple(q.shape)} and k {tuple(k.shape)} must be "
                         f"(batch, heads, tokens, head_dim) with kv heads dividing the query "
                         f"heads; use cp_attention='all-gather' for this model")
    if is_causal and attn_mask is not None:
        raise ValueError("ring attention: is_causal together with an attn_mask (as in "
                         "scaled_dot_product_attention); pass one of them")
    if attn_mask is not None and attn_mask.dim() == 3:   # (heads, T/c, T): the tile
        attn_mask = attn_mask.unsqueeze(0)               # kernels take 2 or 4 dims
    out = _RingAttention.apply(q, k.contiguous(), v.contiguous(), attn_mask, cp,
                               bool(is_causal), float(scale))
    # the fused kernels' layout, (B, L, H, E) in memory: callers view it after transpose(1, 2)
    return out.transpose(1, 2).contiguous().transpose(1, 2)
