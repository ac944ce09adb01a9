"""Context parallelism in the cost model: a profile restated for one of c context ranks.

With context parallelism of degree c every sequence is cut into 2c equal chunks and context
rank i holds chunks i and 2c−1−i (Llama 3, 2407.21783 §3.3.2; Megatron-Core's load-balanced
split). Everything token-wise — projections, MLP, norms, embedding, the loss, their saved
activations, elementwise traffic, tensor-parallel collectives, the pipeline's boundary
activation — runs on the rank's s/c tokens. Attention is the one place that needs the other
ranks' tokens: the rank all-gathers K and V along the sequence and attends with its local
queries to all s keys (Llama 3's method: works with any mask, cheap with grouped-query
attention because K and V have kv_heads ≪ heads). Under a causal mask the two-chunk split gives
every rank the same number of unmasked (query, key) pairs: 1/c of the whole, so the rank's
fused-kernel FLOPs are the sequence's / c and the fraction of active tiles of its
(s/c) × s score block is the sequence's own.

`context_rank_profile(profile, c, attention)` returns the profile per context rank (seq_len s/c), so the
cost model's formulas price one context rank as they price any rank; what only context
parallelism adds is written into the regions:
  - `RegionProfile.cp_gather_elems`: elements of K and V, at full length and all kv heads, one
    sequence's attention gathers in the region (its all-gather in forward, the reduce-scatter
    of their gradients in backward: the same bytes);
  - under the all-gather the gathered K and V (the other ranks' (c−1)/c of them) are saved for
    the backward with the layer's activations (the kernel's backward reads them), split by t like
    the kv heads; ring attention (attention="ring", autopar/runtime/ring_attention.py) saves only
    the rank's own K/V and passes the blocks round again in backward; all-to-all attention
    (attention="all-to-all", autopar/runtime/ulysses.py) saves its heads/c of the whole
    sequence, as many elements as the rank's own q, k, v (more only where kv heads are
    repeated to divide by c, not charged); the hybrid (k inner ranks) saves heads/k of the
    whole sequence: charged here at its least (k = c/2), the rest by cost/memory.py where
    its k is known (a cluster's node).
Llama 3 runs the all-gather on the critical path ("the all-gather communication latency is
exposed", 2407.21783 §3.3.2): cost/model.py charges it exposed, and prices the ring's transfers
overlapped with its steps' attention (`ring_attention_s`).
"""
from __future__ import annotations

from dataclasses import replace

from autopar.cost.profile import (AttentionCall, FusedAttention, Gemm, ModelProfile,
                                  RegionProfile, TPCorrection, TPRegionFallback)
from autopar.plan import CP_ATTENTION_PINNED


def _div(x: int, c: int) -> int:
    """x / c rounded up (token-linear quantities of one context rank)."""
    return -(-int(x) // c)


def _kv_elems(region: RegionProfile, kv_heads: int, heads: int) -> int:
    """Elements of K and V at full length (all kv heads) the region's attention reads, per
    sequence: from its attention calls, or (attention written out with matmuls) from the
    scores / context GEMMs, whose key and value operands repeat the kv heads heads/kv times."""
    if region.fused is not None and region.fused.calls:
        return sum(c.kv_heads * c.kv_len * (c.head_dim + c.v_head_dim) for c in region.fused.calls)
    total = 0
    for g in region.gemms:
        if g.batch_scales:  # scores: keys (batch, n = s, k = hd); context: values (k = s, n)
            total += g.batch * g.n * g.k
    return total * kv_heads // max(heads, 1)


def _gemm(g: Gemm, c: int) -> Gemm:
    # the token (query) dimension m is local; attention's key dimension stays whole
    return replace(g, m=_div(g.m, c))


def _call(call: AttentionCall, c: int) -> AttentionCall:
    # local queries against every key; the balanced split keeps the active-tile fraction
    return replace(call, q_len=_div(call.q_len, c),
                   materialized_bytes=_div(call.materialized_bytes, c))


def _region(r: RegionProfile, c: int, kv_heads: int, heads: int, e: int,
            attention: str) -> RegionProfile:
    kv = _kv_elems(r, kv_heads, heads)
    # the other ranks' K and V, saved for the backward under the all-gather (the ring sends
    # them again instead; the all-to-all's kernel saves heads/c of the whole sequence, the
    # same size as the rank's own q, k, v); the hybrid saves heads/k of the whole sequence, k
    # its inner degree, which the cluster decides: the restated profile charges its least,
    # 1/c of the whole at m = c/k = 2 outer ranks (what the search's memory bound reads), and
    # cost/memory.py the rest (exchanges.context_saved_kv_bytes)
    gathered = {"all-gather": kv - _div(kv, c), "hybrid": _div(kv, c)}.get(attention, 0) * e
    fused = r.fused
    if fused is not None:
        fused = FusedAttention(
            calls=tuple(_call(k, c) for k in fused.calls),
            act_split_bytes=_div(fused.act_split_bytes, c) + gathered,
            act_replicated_bytes=_div(fused.act_replicated_bytes, c),
            act_attention_bytes=_div(fused.act_attention_bytes, c))
    return replace(
        r, gemms=tuple(_gemm(g, c) for g in r.gemms),
        act_split_bytes=_div(r.act_split_bytes, c) + gathered,
        act_replicated_bytes=_div(r.act_replicated_bytes, c),
        act_attention_bytes=_div(r.act_attention_bytes, c),
        input_bytes=_div(r.input_bytes, c), other_bytes=_div(r.other_bytes, c),
        other_split_bytes=_div(r.other_split_bytes, c),
        tp_allreduce_elems=_div(r.tp_allreduce_elems, c), fused=fused, cp_gather_elems=kv,
        expert_dispatch_elems=_div(r.expert_dispatch_elems, c),
        expert_sets=tuple((e, p, _div(d, c)) for e, p, d in r.expert_sets))


def _fallback(f: TPRegionFallback, c: int) -> TPRegionFallback:
    return replace(
        f, act_split_bytes=_div(f.act_split_bytes, c),
        act_attention_bytes=_div(f.act_attention_bytes, c),
        other_split_bytes=_div(f.other_split_bytes, c),
        allreduce_elems_removed=_div(f.allreduce_elems_removed, c),
        collectives=tuple(replace(x, elems=_div(x.elems, c)) if x.per_sequence else x
                          for x in f.collectives))   # a weight's gradient keeps its size


def _correction(t: TPCorrection, c: int) -> TPCorrection:
    return replace(t, **{k: _fallback(t.region(k), c) for k in ("embedding", "block", "head")})


def context_rank_profile(profile: ModelProfile, c: int,
                         attention: str = "all-gather") -> ModelProfile:
    """The profile as one of c context ranks sees it (module docstring), its attention meeting
    the other ranks' K/V by `attention` (autopar.plan.CP_ATTENTION); the profile itself for
    c = 1, and idempotent for the same c and attention."""
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise ValueError(f"c={c!r}: the context-parallel degree must be a positive int; use c=1 "
                         f"for no context parallelism")
    if attention not in CP_ATTENTION_PINNED:
        raise ValueError(f"attention={attention!r}: context parallelism's attention is one of "
                         f"{CP_ATTENTION_PINNED}")
    if profile.context == c and (c == 1 or profile.context_attention == attention):
        return profile
    if profile.context != 1:
        raise ValueError(f"profile {profile.name!r} is already restated for c={profile.context} "
                         f"({profile.context_attention}) and cannot be restated for c={c} "
                         f"({attention}); restate the whole-sequence profile")
    if c == 1:
        return profile
    if profile.seq_len % (2 * c):
        raise ValueError(f"c={c} with seq_len={profile.seq_len}: context parallelism cuts each "
                         f"sequence into 2c = {2 * c} equal chunks; use a sequence length "
                         f"divisible by {2 * c} or a smaller c")
    e = profile.activation_bytes_per_elem
    regions = {k: _region(getattr(profile, k), c, profile.kv_heads, profile.heads, e,
                          attention)
               for k in ("embedding", "block", "head")}
    return replace(profile, **regions, seq_len=profile.seq_len // c, context=c,
                   context_attention=attention,
                   tp_fallbacks=tuple(_correction(t, c) for t in profile.tp_fallbacks))
