"""Compute in the cost model: GEMMs, attention kernels and elementwise traffic, priced per
micro-batch for one block (`block_times_s`, with its tensor-parallel collectives) and for the
embedding and the head (`edge_times_s`), and the FLOPs a step counts (`flops_per_seq`).

- GEMM time: `gemm_time_s`, the shape-dependent efficiency + roofline of cost/hardware.py.
  Backward = 2 GEMMs of the forward's size (dX and dW / both attention operands).
  Recompute adds forward work: full = the whole block forward (GEMMs, elementwise, and its
  tensor-parallel collectives); selective = the attention core (activation-activation GEMMs,
  or the fused kernel's forward) plus re-materialising the dropped attention tensors (under
  flash only the logsumexp: selective recompute then costs a kernel forward and saves little).
- Attention: the cluster's kernel (`Cluster.attention`; the profile is priced with
  `ModelProfile.with_attention`). "materialized": the scores and context GEMMs at GEMM
  efficiency, the softmax over the scores at HBM bandwidth, the s² tensors saved. "flash": each
  scaled-dot-product-attention call is one fused kernel (`fused_attention_time_s`): the FLOPs of
  the tiles its mask leaves at the cluster's fused-attention efficiency, a backward of 2.5x the
  forward FLOPs, no score traffic, q/k/v/output/logsumexp saved. FLOP counts (TFLOP/s, MFU)
  keep the papers' convention: attention counted in full, whatever the kernel skips. Attention
  written out with matmuls in the model's code is materialized under either kind.
- Non-GEMM ops: RegionProfile.other_bytes at HBM bandwidth; backward moves 2x the forward bytes.
  An eager runtime also pays each op's dispatch, whatever its size (`dispatch_s`).
- The optimizer step (Adam, memory bound: `optimizer_step_s`) over the parameters the rank
  owns (1/(c·d) of them under a sharded optimizer, its experts' 1/(c·d/ep)); an eager runtime
  also adds each micro-batch's weight gradients after the first into their accumulators
  (`GRAD_ACCUMULATE_BYTES`, every weight the rank holds).
- Tensor-parallel collectives of a block: its forward all-reduces (SP: all-gather +
  reduce-scatter, the same bytes), the same in backward, once more under full recompute
  (cost/comm.py prices them; `Cluster.tp_overlap`: what cost/overlap.py leaves exposed).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from autopar.cost.comm import (allgather_s, allreduce_s, inserted_collectives_s, pieces_s,
                               reducescatter_s)
from autopar.cost.config import BLOCK_CHECKPOINTED, ZERO_TRAITS, Config
from autopar.cost.hardware import Cluster
from autopar.cost.overlap import ROW_PIECES, block_tp_exposed_s
from autopar.cost.precision import weight_elem_bytes
from autopar.cost.profile import AttentionCall, Gemm, ModelProfile, RegionProfile, TPRegionFallback
from autopar.cost.shares import (RankParams, fused_calls, op_checkpoint, rank_attention_bytes,
                                 rank_other_bytes, tp_fallback, vocab_pad_ratio)

# Backward of the non-GEMM ops (norms, softmax, dropout, GeLU) per forward byte: it reads the
# incoming gradient and the saved input and writes one gradient, ~2x the forward traffic.
BWD_ELEMENTWISE_FACTOR = 2.0
# Adam step traffic per parameter it owns: read fp32 grad, master, m, v (16 B), write master,
# m, v (12 B) and the 16-bit weight (2 B).
ADAM_BYTES_PER_PARAM = 30
# Traffic per weight of adding one more micro-batch's gradient into its fp32 accumulator
# (autograd's AccumulateGrad, or main_grad += grad): read the accumulator and the new
# gradient, write the accumulator — 8 B plus the gradient's own (4 fp32, 2 16-bit). A fused
# stack (the presets' elementwise "fused": Megatron-Core's gradient_accumulation_fusion) adds
# it inside the weight-gradient GEMM, so only an eager runtime pays it.
GRAD_ACCUMULATE_BYTES = 8


def gemm_efficiency(cluster: Cluster, m: float, n: float, k: float) -> float:
    """Achieved / peak FLOP rate of an (m x k)·(k x n) GEMM: e_max · f(m) f(n) f(k)."""
    x = cluster.gemm_half_dim
    return cluster.gemm_max_efficiency * (m / (m + x)) * (n / (n + x)) * (k / (k + x))


def gemm_time_s(cluster: Cluster, batch: float, m: float, n: float, k: float,
                bytes_per_elem: int = 2, fp8: bool = False) -> float:
    """One (batched) GEMM: max(compute at shape efficiency, operand traffic at HBM) + launch.
    fp8: at the cluster's FP8 rate (its FP8 e_max, the same shape factors), operands of 1 byte
    (the casts are priced apart: fp8_cast_time_s)."""
    flops = 2.0 * batch * m * n * k
    rate = cluster.peak_flops * gemm_efficiency(cluster, m, n, k)
    if fp8:
        rate *= (cluster.fp8_flops / cluster.peak_flops) * (
            (cluster.fp8_gemm_max_efficiency or cluster.gemm_max_efficiency)
            / cluster.gemm_max_efficiency)
    traffic_s = (batch * (m * k + k * n + m * n) * (1 if fp8 else bytes_per_elem)
                 / (cluster.hbm_bandwidth_Bps * cluster.elementwise_efficiency))
    return max(flops / rate, traffic_s) + cluster.kernel_launch_s


# An FP8 GEMM's casts (autopar/runtime/fp8.py), per element of an operand cast: the amax pass
# reads it (2 B), the cast reads it again and writes 1 B. Forward casts x and W, backward dY
# twice (dX and dW) and x, W again (rowwise needs the other axis).
FP8_CAST_BYTES_PER_ELEM = 5.0
FP8_AMAX_ALLREDUCES = 6      # the six casts' amaxes (tensorwise: each over the tensor group)


def fp8_cast_time_s(cluster: Cluster, batch: float, m: float, n: float, k: float,
                    t: int, tp_inter: bool) -> float:
    """The casts and amax reductions of one FP8 GEMM's forward and backward (elementwise
    traffic; at t > 1 latency-bound all-reduces of one fp32 each)."""
    elems = batch * (2 * (m * k + k * n) + 2 * m * n)
    cast_s = elementwise_time_s(cluster, FP8_CAST_BYTES_PER_ELEM * elems)
    comm_s = FP8_AMAX_ALLREDUCES * cluster.tp_comm_scale * allreduce_s(
        cluster, 4.0, t, tp_inter) if t > 1 else 0.0
    return cast_s + FP8_AMAX_ALLREDUCES * cluster.kernel_launch_s + comm_s


# Backward of a fused attention kernel per forward FLOP: five GEMMs (the scores recomputed, dV,
# dP, dQ, dK) against the forward's two (FlashAttention-2 §3.2; its benchmark convention).
FLASH_BWD_FLOPS_FACTOR = 2.5


def flash_shape_fraction(kv_len: float, head_dim: float, half_len: float,
                         half_head_dim: float) -> float:
    """The fraction of its long-sequence rate a fused attention kernel keeps over kv_len keys
    with heads of head_dim: L/(L + L_half) · D/(D + D_half), D_half 0 leaving the head dim
    out (Cluster.flash_half_len / flash_half_head_dim, cost/hardware.py's module doc; the
    form `autopar calibrate` fits them with)."""
    heads = head_dim / (head_dim + half_head_dim) if half_head_dim else 1.0
    return kv_len / (kv_len + half_len) * heads


def fused_attention_time_s(cluster: Cluster, call: AttentionCall, b: float,
                           t: int) -> tuple[float, float]:
    """(forward, backward) seconds of one attention call run as a fused kernel on b sequences,
    its heads split over t ranks: the FLOPs of the tiles its mask leaves at the cluster's
    fused-attention efficiency (lower for short keys and small heads), or its q/k/v/output
    traffic at HBM bandwidth if that is longer, + a launch each."""
    flops = call.fwd_flops * b / t
    shape = flash_shape_fraction(call.kv_len, (call.head_dim + call.v_head_dim) / 2,
                                 cluster.flash_half_len, cluster.flash_half_head_dim)
    io_s = call.io_bytes * b / t / (cluster.hbm_bandwidth_Bps * cluster.elementwise_efficiency)
    fwd = flops / (cluster.peak_flops * cluster.flash_fwd_efficiency * shape)
    bwd = FLASH_BWD_FLOPS_FACTOR * flops / (
        cluster.peak_flops * cluster.flash_bwd_efficiency * shape)
    # backward reads q, k, v, output, its gradient and the logsumexp, writes dq, dk, dv: ~2x
    return (max(fwd, io_s) + cluster.kernel_launch_s,
            max(bwd, 2 * io_s) + cluster.kernel_launch_s)


def fused_times_s(cluster: Cluster, calls: tuple[AttentionCall, ...], fix: TPRegionFallback,
                  t: int, b: int) -> tuple[float, float, frozenset[int]]:
    """(forward, backward) seconds of a region's fused attention calls per micro-batch (a call
    the tensor-parallel pass keeps whole runs all heads on every rank), and the indices of the
    GEMMs they replace."""
    fwd = bwd = 0.0
    for c in calls:
        whole = set(c.gemms) <= set(fix.replicated_gemms)
        f, bw = fused_attention_time_s(cluster, c, b, 1 if whole else t)
        fwd, bwd = fwd + f, bwd + bw
    return fwd, bwd, frozenset(i for c in calls for i in c.gemms)


def local_gemm_time_s(cluster: Cluster, g: Gemm, t: int, b: int, e: int,
                      whole_n: int = 0, fp8: bool = False) -> float:
    """One rank's GEMM time; `whole_n` of a column-split GEMM's n columns computed whole;
    fp8: a weight GEMM (passes/fp8.py's rule) at the FP8 rate (the backward's two GEMMs too),
    its casts added once here, a third of them per GEMM of the forward + backward triple."""
    batch = g.batch * (b if g.batch_scales else 1)
    m = g.m * (1 if g.batch_scales else b)
    n, k = g.n, g.k
    if g.tp_split == "batch":
        batch = batch / t
    elif g.tp_split == "n":
        n = (n - whole_n) / t + whole_n
    elif g.tp_split == "k":
        k = k / t
    fp8 = fp8 and g.has_weight_grad and not g.batch_scales and min(n, k) >= 16
    if not fp8:
        return gemm_time_s(cluster, batch, m, n, k, e)
    return (gemm_time_s(cluster, batch, m, n, k, e, fp8=True)
            + fp8_cast_time_s(cluster, batch, m, n, k, t, False) / 3)


def elementwise_time_s(cluster: Cluster, nbytes: float) -> float:
    """Streaming nbytes through HBM at the cluster's elementwise efficiency."""
    return nbytes / (cluster.hbm_bandwidth_Bps * cluster.elementwise_efficiency)


def dispatch_s(cluster: Cluster, region: RegionProfile) -> tuple[float, float]:
    """(forward, backward) seconds an eager runtime spends dispatching a region's ops one by
    one per micro-batch, whatever their size: `RegionProfile.eager_ops` × the cluster's
    measured kernel_launch_s forward and autograd_op_s backward (GEMMs and attention kernels
    carry their own launch). 0 unless the cluster runs elementwise ops "eager" (the fused
    stacks of the presets launch kernel chains whose dispatch hides behind the GPU)."""
    if cluster.elementwise != "eager":
        return 0.0, 0.0
    return (region.eager_ops * cluster.kernel_launch_s,
            region.eager_ops * cluster.autograd_op_s)


def split_backward_s(cluster: Cluster, region: RegionProfile, compute_s: float,
                     saved_bytes: float = 0.0) -> float:
    """Seconds the B/W split of interleaved-zb adds to a region's backward per micro-batch:
    every forward op of the region (its eager ops, GEMMs and attention kernels) × the cluster's
    measured split_backward_op_s, its `split_backward_frac` of the region's compute
    (`compute_s`, forward + backward; older cluster files), and `split_backward_s_per_byte` ×
    the micro-batch's saved activations in the region (`saved_bytes`, recompute "none": the
    gradients B makes beside the retained graph). Like `dispatch_s`, 0 unless the cluster
    runs elementwise ops "eager": a fused GPU stack's caching allocator and kernels hide it."""
    if cluster.elementwise != "eager":
        return 0.0
    return (forward_ops(region) * cluster.split_backward_op_s
            + cluster.split_backward_frac * compute_s
            + cluster.split_backward_s_per_byte * saved_bytes)


def selective_checkpoint_s(cluster: Cluster, region: RegionProfile) -> float:
    """Seconds recompute op's selective checkpoint adds to a region per micro-batch: every
    forward op × the cluster's measured checkpoint_op_s (its dispatch mode sees each op in the
    forward and again in the recomputation). Like `dispatch_s`, 0 unless the cluster runs
    elementwise ops "eager": it is host work, which a fused GPU stack's kernels hide."""
    if cluster.elementwise != "eager":
        return 0.0
    return forward_ops(region) * cluster.checkpoint_op_s


def checkpoint_regions_s(cluster: Cluster, region: RegionProfile, recompute: str) -> float:
    """Seconds torch.utils.checkpoint's own work adds to a block per micro-batch (the
    cluster's measured checkpoint_region_s a region): one region a block under full and op,
    one per attention core under selective (a fused kernel's call, or two batched GEMMs of a
    written-out core). Like `dispatch_s`, 0 unless the cluster runs elementwise ops "eager":
    host work, which a fused GPU stack's kernels hide."""
    if cluster.elementwise != "eager":
        return 0.0
    if recompute in BLOCK_CHECKPOINTED:
        return cluster.checkpoint_region_s
    if recompute != "selective":
        return 0.0
    fused = region.fused
    cores = len(fused.calls) if fused is not None and fused.calls else sum(
        1 for g in region.gemms if g.batch_scales) // 2
    return cores * cluster.checkpoint_region_s


def forward_ops(region: RegionProfile) -> int:
    """The ops a region's forward dispatches: its eager ops, GEMMs and attention kernels."""
    fused = region.fused
    return region.eager_ops + len(region.gemms) + (
        len(fused.calls) - len(fused.gemm_indices) if fused else 0)


def block_times_s(profile: ModelProfile, cluster: Cluster, t: int, b: int, recompute: str,
                  sp: bool, tp_inter: bool) -> tuple[float, float, float]:
    """(compute_s, tp_comm_s, forward_pass_s) of one block for one micro-batch: compute_s is
    forward + backward + recompute; forward_pass_s the forward with its TP collectives."""
    blk, e = profile.block, profile.activation_bytes_per_elem
    fix = tp_fallback(profile, "block", t, sp)
    k_fwd, k_bwd, fused = fused_times_s(cluster, fused_calls(profile, blk), fix, t, b)
    fp8 = profile.gemm_precision == "fp8"
    gemm = [0.0 if i in fused else
            local_gemm_time_s(cluster, g, 1 if i in fix.replicated_gemms else t, b, e,
                              dict(fix.whole_columns).get(i, 0), fp8)
            for i, g in enumerate(blk.gemms)]
    fwd_gemm = sum(gemm)
    attn_gemm = sum(tm for tm, g in zip(gemm, blk.gemms) if g.batch_scales)
    fwd_other = elementwise_time_s(cluster, rank_other_bytes(blk, t, b, sp, fix))
    d_fwd, d_bwd = dispatch_s(cluster, blk)
    fwd = fwd_gemm + k_fwd + fwd_other + d_fwd
    bwd = 2 * fwd_gemm + k_bwd + BWD_ELEMENTWISE_FACTOR * fwd_other + d_bwd
    if recompute == "full":
        rec = fwd
    elif recompute == "selective":  # the attention core again: GEMMs or the fused kernel
        rec = attn_gemm + k_fwd + elementwise_time_s(
            cluster, rank_attention_bytes(blk, t, fix, 2 * b))
    elif recompute == "op":   # every other GEMM, all the elementwise work and its dispatch,
        # and the selective checkpoint's own per-op work
        rec = (sum(gemm[i] for i in op_checkpoint(profile, blk)[1]) + fwd_other + d_fwd
               + selective_checkpoint_s(cluster, blk))
    else:
        rec = 0.0
    rec += checkpoint_regions_s(cluster, blk, recompute)
    # tensor-parallel collectives: the forward all-reduces (SP: all-gather + reduce-scatter,
    # the same bytes), the same in backward, once more for a full recompute; minus those of
    # row-parallel GEMMs the pass keeps replicated, plus the collectives it inserts
    ar_elems = blk.tp_allreduce_elems - fix.allreduce_elems_removed
    ar_bytes = b * ar_elems * e
    n_coll = max(1, round(ar_elems / (profile.seq_len * profile.hidden)))
    # the forward's row-parallel reductions are issued in `tp_row_pieces` calls each (the
    # runtime's collective matmul), each paying the link's latency, waited for once
    one_b, pieces = ar_bytes / n_coll, cluster.tp_row_pieces
    if sp:
        gather = n_coll * allgather_s(cluster, one_b, t, tp_inter)
        one = gather + n_coll * pieces_s(cluster, reducescatter_s, one_b, pieces, t, tp_inter)
        back = gather + n_coll * reducescatter_s(cluster, one_b, t, tp_inter)
        # SP keeps only the sequence shard of each column-parallel input, so backward
        # all-gathers it again for the weight gradient (Megatron-LM 2205.05198 §4.2.2)
        extra = gather
    else:
        one = n_coll * pieces_s(cluster, allreduce_s, one_b, pieces, t, tp_inter)
        back = n_coll * allreduce_s(cluster, one_b, t, tp_inter)
        extra = 0.0
    scale = cluster.tp_comm_scale          # fitted by autopar tune (1: as measured)
    one, back, extra = scale * one, scale * back, scale * extra
    passes = 3 if recompute in BLOCK_CHECKPOINTED else 2
    tp = (passes - 1) * one + back + extra if ar_elems else 0.0
    if cluster.tp_overlap and ar_elems:   # collective matmuls; dx reduction under dW
        tp = _overlapped_tp_s(blk.gemms, gemm, one, back + extra, passes - 1,
                             cluster.tp_comm_overlap)
    x_fwd, x_bwd = (scale * x for x in inserted_collectives_s(cluster, fix, t, b, e, tp_inter))
    tp += (2 if recompute in BLOCK_CHECKPOINTED else 1) * x_fwd + x_bwd
    return fwd + bwd + rec, tp, fwd + (one if ar_elems else 0.0) + x_fwd


def _overlapped_tp_s(gemms: Sequence[Gemm], times_s: Sequence[float], fwd_comm_s: float,
                     bwd_comm_s: float, forward_passes: int, overlap: float) -> float:
    """The block's TP communication left exposed by the runtime's overlap (cost/overlap.py):
    forward collectives pipelined with the row-parallel ("k"-split) GEMMs, backward ones
    under the column-parallel ("n"-split) projections' weight gradients."""
    row = sum(s for g, s in zip(gemms, times_s) if g.tp_split == "k" and g.has_weight_grad)
    col = sum(s for g, s in zip(gemms, times_s) if g.tp_split == "n" and g.has_weight_grad)
    return block_tp_exposed_s(fwd_comm_s, bwd_comm_s, row, col, ROW_PIECES, forward_passes,
                              overlap)


def edge_times_s(profile: ModelProfile, cluster: Cluster, t: int, b: int, sp: bool,
                 tp_inter: bool) -> tuple[float, float]:
    """(embedding_s, head_s) per micro-batch incl. their collectives; never recomputed."""
    e = profile.activation_bytes_per_elem
    vpad_ratio = vocab_pad_ratio(profile.vocab, t)
    emb, head = profile.embedding, profile.head
    efix, hfix = tp_fallback(profile, "embedding", t, sp), tp_fallback(profile, "head", t, sp)
    emb_s = 3 * elementwise_time_s(cluster, rank_other_bytes(emb, t, b, sp, efix)) + sum(
        dispatch_s(cluster, emb))
    emb_ar = b * (emb.tp_allreduce_elems - efix.allreduce_elems_removed) * e
    scale = cluster.tp_comm_scale          # fitted by autopar tune (1: as measured)
    emb_s += scale * ((reducescatter_s if sp else allreduce_s)(cluster, emb_ar, t, tp_inter)
                      + sum(inserted_collectives_s(cluster, efix, t, b, e, tp_inter)))
    k_fwd, k_bwd, fused = fused_times_s(cluster, fused_calls(profile, head), hfix, t, b)
    head_s = k_fwd + k_bwd + sum(dispatch_s(cluster, head))
    for i, g in enumerate(head.gemms):
        if i in fused:
            continue
        if i in hfix.replicated_gemms:  # kept whole by the tensor-parallel pass: no padding
            head_s += 3 * local_gemm_time_s(cluster, g, 1, b, e)
            continue
        n = g.n * vpad_ratio if g.tp_split == "n" else g.n
        g2 = Gemm(name=g.name, batch=g.batch, m=g.m, n=round(n), k=g.k, tp_split=g.tp_split,
                  batch_scales=g.batch_scales)
        head_s += 3 * local_gemm_time_s(cluster, g2, t, b, e)
    whole = b * hfix.other_split_bytes
    head_s += 3 * elementwise_time_s(
        cluster, (rank_other_bytes(head, t, b, sp, hfix) - whole) * vpad_ratio + whole)
    # column-parallel head: identity forward, all-reduce of the input gradient in backward
    # (SP: all-gather forward + reduce-scatter backward, the same bytes)
    in_bytes = b * (head.input_bytes - hfix.allreduce_elems_removed * e)
    head_s += scale * ((allgather_s(cluster, in_bytes, t, tp_inter)
                        + reducescatter_s(cluster, in_bytes, t, tp_inter) if sp
                        else allreduce_s(cluster, in_bytes, t, tp_inter))
                       + sum(inserted_collectives_s(cluster, hfix, t, b, e, tp_inter)))
    return emb_s, head_s


def _keys_cut(g: Gemm, whole: int, parts: int) -> Gemm:
    """A scores (n = keys) or context (k = keys) GEMM of attention over whole / parts keys."""
    if g.n == whole:
        return dataclasses.replace(g, n=max(1, whole // parts))
    if g.k == whole:
        return dataclasses.replace(g, k=max(1, whole // parts))
    return g


def attention_core_s(profile: ModelProfile, cluster: Cluster, cfg: Config,
                     keys_over: int = 1) -> tuple[float, float]:
    """(forward, backward) seconds of a block's attention core (its fused kernels, or the
    scores / context GEMMs written out) per micro-batch on one rank, with each call's keys
    cut to kv_len / keys_over (one ring step's kernel)."""
    sp = cfg.sequence_parallel and cfg.t > 1
    blk, e, t, b = profile.block, profile.activation_bytes_per_elem, cfg.t, cfg.micro_batch_size
    fix = tp_fallback(profile, "block", t, sp)
    calls = tuple(dataclasses.replace(call, kv_len=max(1, call.kv_len // keys_over))
                  for call in fused_calls(profile, blk))
    k_fwd, k_bwd, fused = fused_times_s(cluster, calls, fix, t, b)
    whole = profile.seq_len * profile.context
    written = sum(local_gemm_time_s(cluster, _keys_cut(g, whole, keys_over),
                                    1 if i in fix.replicated_gemms else t, b, e,
                                    dict(fix.whole_columns).get(i, 0))
                  for i, g in enumerate(blk.gemms) if g.batch_scales and i not in fused)
    return k_fwd + written, k_bwd + 2 * written


def flops_per_seq(profile: ModelProfile, t: int, recompute: str) -> tuple[float, float]:
    """(model forward FLOPs incl. the padded vocabulary, recompute FLOPs) per sequence (per
    context rank's share of one, on a profile restated for c)."""
    fwd = profile.fwd_flops_per_seq()
    fwd += profile.head.fwd_flops * (vocab_pad_ratio(profile.vocab, t) - 1)
    blk = profile.block
    if recompute == "op":
        rec = profile.num_layers * sum(blk.gemms[i].fwd_flops
                                       for i in op_checkpoint(profile, blk)[1])
    else:
        rec = {"none": 0.0, "full": profile.num_layers * blk.fwd_flops,
               "selective": profile.num_layers * sum(
                   g.fwd_flops for g in blk.gemms if g.batch_scales)}[recompute]
    return fwd, rec


def optimizer_step_s(cluster: Cluster, cfg: Config, params: RankParams,
                     profile: ModelProfile, accumulate: bool = True
                     ) -> tuple[float, float, float]:
    """(per layer, embedding on rank 0, head on rank p-1) seconds of the Adam step over the
    parameters one rank of cfg owns (`shares.rank_params`): the cluster's measured seconds per
    parameter (`Cluster.optimizer_param_s`), else its bytes at elementwise HBM bandwidth; and
    the cluster's seconds per tensor (`Cluster.optimizer_tensor_s`) for each tensor it steps:
    the region's (`RegionProfile.param_tensors`), 1/d of them under a sharded optimizer (ZeRO
    hands a rank's shard to the optimizer as one segment per parameter piece it holds); and
    where ops run eagerly the step's gradient accumulation over every weight the rank holds
    (`grad_accumulate_s`; `accumulate` False: without it, a bound for every m)."""
    d = cfg.replicas   # the weights' replicas: ZeRO shards over c·d
    sharded = ZERO_TRAITS[cfg.zero].sharded_optimizer
    own = 1.0 / d if sharded else 1.0
    own_e = cfg.ep / d if sharded else 1.0   # experts sharded over c·d/ep
    per_param_s = cluster.optimizer_param_s or ADAM_BYTES_PER_PARAM / (
        cluster.hbm_bandwidth_Bps * cluster.elementwise_efficiency)
    acc_s = grad_accumulate_s(cluster, cfg, profile) if accumulate else 0.0
    adam = lambda params, region: own * (params * per_param_s  # noqa: E731
                                         + region.param_tensors * cluster.optimizer_tensor_s
                                         ) + params * acc_s
    return (adam(params.block, profile.block) + params.experts * (own_e * per_param_s + acc_s),
            adam(params.embedding, profile.embedding), adam(params.head, profile.head))


def grad_accumulate_s(cluster: Cluster, cfg: Config, profile: ModelProfile) -> float:
    """Seconds per weight a rank holds of a step's gradient accumulation: each micro-batch
    after the first adds its gradients into the fp32 accumulators (`GRAD_ACCUMULATE_BYTES`
    plus the gradient's bytes, at elementwise bandwidth), m − 1 times a step, whatever the
    ZeRO level (ZeRO-2/3 accumulate a gathered chunk's full gradients before reducing them).
    0 for a fused stack (elementwise "fused") or one micro-batch."""
    if cluster.elementwise != "eager" or cfg.num_microbatches <= 1:
        return 0.0
    return (cfg.num_microbatches - 1) * (GRAD_ACCUMULATE_BYTES + weight_elem_bytes(profile)) / (
        cluster.hbm_bandwidth_Bps * cluster.elementwise_efficiency)
