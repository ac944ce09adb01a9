"""Memory in the cost model: activations saved per layer and per micro-batch, the bytes per
pipeline rank the solver constrains (`memory_coefficients`, affine in the rank's layer count),
the exact schedule walk `predict` reports (`schedule_activation_bytes`), and the lower bounds
the search prunes with.

- Memory per pipeline rank: weights/grads/optimizer per ZERO_TRAITS, activations per layer per
  recompute mode (2205.05198) times the micro-batches the schedule keeps in flight
  (SCHEDULE_TRAITS, equal to autopar.schedules.peak_inflight on the action lists:
  breadth-first all m micro-batches of all v chunks, v·m; interleaved
  2(p−r−1) + (v−1)·N + 1; interleaved-zb torch's ZeroBubble bound (v−1)·N + p, a micro-batch in flight until its W),
  embedding on the first and head (+ tied embedding copy) on the last rank, and the cluster's
  reserve. Sharded weights keep no 16-bit weights at rest (the fp32 master shard is cast for
  each gather) and add the plan's gathered working set: its most chunks gathered at once
  (16-bit) and the fp32 gradient accumulators of its most chunks with unreduced gradients plus
  one fp32 reduce-scatter buffer.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Iterable

from autopar.cost.config import (SCHEDULE_TRAITS, ZERO_TRAITS, Config, ConfigCosts, inflight,
                                 pending_weight_grads)
from autopar.cost.context import context_rank_profile
from autopar.cost.dp_terms import EXTRAPOLATE_START, weight_gather_stats
from autopar.cost.exchanges import hybrid_saved_excess_bytes
from autopar.cost.hardware import Cluster
from autopar.cost.layout import chunk_times_ms
from autopar.cost.precision import gathered_bytes_ratio, weight_elem_bytes
from autopar.cost.profile import ModelProfile, RegionProfile
from autopar.cost.shares import (RankParams, expert_params_elems, op_checkpoint,
                                 rank_attention_bytes, shard_params_elems, tp_fallback,
                                 vocab_pad_ratio)
from autopar.plan import Memory
from autopar.schedules import (GROUPED, SPLIT_BACKWARD, compute_order, first_group_size,
                               peak_held)
from autopar.weight_gathers import GatherCounts, settled_walks

if TYPE_CHECKING:
    from autopar.cost.memo import CostMemo


def gemm_outputs_bytes(profile: ModelProfile, region: RegionProfile, t: int, b: int,
                       indices: Iterable[int], whole: Iterable[int] = ()) -> float:
    """Bytes of the outputs of `region.gemms[i]` for i in `indices`, b sequences, on one
    tensor rank: a GEMM split over its output columns or its batch (the heads) holds 1/t of
    its output, unless the tensor-parallel pass keeps it whole (`whole`: the fallback's
    replicated GEMMs, cost/shares.tp_fallback)."""
    kept, gemms = set(whole), region.gemms
    return b * profile.activation_bytes_per_elem * sum(
        gemms[i].batch * gemms[i].m * gemms[i].n
        / (t if gemms[i].tp_split in ("n", "batch") and i not in kept else 1) for i in indices)


def _weight_gemm_outputs_bytes(profile: ModelProfile, region: RegionProfile, t: int, b: int,
                               whole: Iterable[int]) -> float:
    """The outputs of the region's weight GEMMs: the gradients at them are what a deferred W
    keeps (split_backward's recorded gradients)."""
    return gemm_outputs_bytes(profile, region, t, b,
                              (i for i, g in enumerate(region.gemms) if g.has_weight_grad),
                              whole)


def pending_w_layer_bytes(profile: ModelProfile, t: int, b: int, sp: bool) -> float:
    """Per layer per micro-batch, what a deferred W keeps besides the layer's saved
    activations (held until the W, counted by `inflight`): the recorded output gradients of
    its weight GEMMs, whole where the tensor-parallel pass keeps a GEMM whole. Recomputed
    activations are not kept from B to W: a checkpointed region recomputes again in the W
    (torch.utils.checkpoint unpacks each recomputed tensor once)."""
    return _weight_gemm_outputs_bytes(profile, profile.block, t, b,
                                      tp_fallback(profile, "block", t, sp).replicated_gemms)


def layer_activation_bytes(profile: ModelProfile, t: int, b: int, recompute: str,
                           sp: bool) -> float:
    """Activations kept per layer per micro-batch (2205.05198 §4 per recompute mode; op: the
    block's input and the GEMM / attention-kernel outputs it keeps, cost/shares.op_checkpoint)."""
    blk = profile.block
    if recompute == "full":
        return b * blk.input_bytes / (t if sp else 1)
    fix = tp_fallback(profile, "block", t, sp)
    if recompute == "op":   # the block's input and the outputs the policy keeps
        return (b * blk.input_bytes / (t if sp else 1)
                + gemm_outputs_bytes(profile, blk, t, b, op_checkpoint(profile, blk)[0],
                                     fix.replicated_gemms))
    repl = blk.act_replicated_bytes / (t if sp else 1)
    kept = (blk.act_split_bytes - fix.act_split_bytes) / t + repl + fix.act_split_bytes
    if recompute == "none":
        kept += rank_attention_bytes(blk, t, fix)
    return b * kept


@dataclass(frozen=True, kw_only=True)
class MicrobatchActivations:
    """Bytes one micro-batch keeps on one rank of a configuration (`microbatch_activations`):
    per layer (under its recompute mode), in the embedding and in the head regions; under a
    split backward what a deferred W keeps per layer and in the head; and `work`, what one
    layer's backward needs besides (its activations recomputed: full; its attention tensors:
    selective); `head_work`, what the loss's backward needs besides on the last stage: the
    gradient into and out of the head's vocabulary-wide saved tensor (its log-softmax), two
    more of its size at once (measured on an H100, benchmarks/gpu.py 2026-11-26: with it the
    predicted activations of a 12-layer GPT, vocabulary 50,304, were within 1% of the
    allocator's peak at micro-batches 1, 2 and 4; without it 29% short)."""
    layer: float
    embedding: float
    head: float
    pending_layer: float = 0.0
    pending_head: float = 0.0
    work: float = 0.0
    head_work: float = 0.0


def microbatch_activations(profile: ModelProfile, cfg: Config,
                           cluster: Cluster | None = None) -> MicrobatchActivations:
    """The activation bytes of one micro-batch of cfg; `profile` is the rank's. The hybrid
    context method's saved K/V beyond the least the restated profile charges (cost/context.py)
    is added here: its inner degree is the cluster's node, so it needs `cluster`."""
    t, b = cfg.t, cfg.micro_batch_size
    sp = cfg.sequence_parallel and t > 1
    act_layer = layer_activation_bytes(profile, t, b, cfg.recompute, sp)
    full_layer = layer_activation_bytes(profile, t, b, "none", sp)
    if cfg.cp_attention == "hybrid" and cluster is not None:   # the profile charges its least
        act_layer += hybrid_saved_excess_bytes(profile, cluster, cfg)
        full_layer += hybrid_saved_excess_bytes(profile, cluster, replace(cfg, recompute="none"))
    # working memory while one layer runs its backward: its full activations when recomputed
    # (full; op: at most those, since what it keeps need not be what a layer saves: a row-
    # parallel GEMM's partial sums) or its attention tensors (selective)
    work = {"full": full_layer, "op": full_layer,
            "selective": rank_attention_bytes(profile.block, t,
                                              tp_fallback(profile, "block", t, sp), b),
            "none": 0.0}[cfg.recompute]
    efix, hfix = tp_fallback(profile, "embedding", t, sp), tp_fallback(profile, "head", t, sp)
    emb_act = b * ((profile.embedding.act_split_bytes - efix.act_split_bytes) / t
                   + profile.embedding.act_replicated_bytes / (t if sp else 1)
                   + efix.act_split_bytes)
    vpad_ratio = vocab_pad_ratio(profile.vocab, t)
    head_split = b * ((profile.head.act_split_bytes - hfix.act_split_bytes) * vpad_ratio / t
                      + hfix.act_split_bytes)
    head_act = head_split + b * profile.head.act_replicated_bytes / (t if sp else 1)
    # deferred weight gradients (split backward): held on top, per pending chunk-micro-batch
    pend_layer = pend_head = 0.0
    if SCHEDULE_TRAITS[cfg.schedule].pending is not None:
        pend_layer = pending_w_layer_bytes(profile, t, b, sp)
        pend_head = _weight_gemm_outputs_bytes(profile, profile.head, t, b,
                                               hfix.replicated_gemms) * vpad_ratio
    return MicrobatchActivations(layer=act_layer, embedding=emb_act, head=head_act,
                                 pending_layer=pend_layer, pending_head=pend_head, work=work,
                                 head_work=2 * head_split)


def _gathered_bytes_per_param(cfg: Config, gathers: GatherCounts | None,
                              weight_bytes: int = 2) -> tuple[float, float, float, float]:
    """Sharded weights (zero 2 / 3): the gathered working set of the weight-gather plan, bytes
    per parameter (per layer: weights, gradients; embedding / head: weights, gradients). Per
    layer of the rank: its most chunks gathered at once in 16-bit (2·gathered/v B per
    parameter), and the fp32 gradient accumulators of the chunks holding unreduced gradients
    plus one fp32 reduce-scatter buffer ((4·pending + 4)/v: the runtime reduces in fp32, as
    FSDP2's reduce_dtype=fp32); the embedding / head are gathered whole (2 B weights + 4 B
    grads). An fp32 run gathers `weight_bytes` = 4. At d = 1 the runtime still gathers
    (copies) and releases each chunk. Zeros when the weights are not sharded; gathers:
    `weight_gather_stats(cfg)`, computed if not given."""
    if not ZERO_TRAITS[cfg.zero].sharded_weights:
        return 0.0, 0.0, 0.0, 0.0
    st = gathers if gathers is not None else weight_gather_stats(cfg)
    w = float(weight_bytes)
    return w * st.peak_gathered / cfg.v, 4.0 * (st.peak_pending + 1) / cfg.v, w, 4.0


def memory_coefficients(profile: ModelProfile, cluster: Cluster, cfg: Config,
                        params: RankParams, gathers: GatherCounts | None = None
                        ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[float, ...], ...],
                                   tuple[tuple[float, ...], ...], MicrobatchActivations]:
    """Per rank: bytes per layer held and fixed bytes (rounded up), with their breakdown
    ((weights, grads, optimizer, activations) per layer; (weights, grads, optimizer,
    activations, recompute, reserve) fixed), and the micro-batch's activations they count.
    profile: the rank's; params: `rank_params` (the experts' ZeRO shards over the c·d/ep
    ranks holding the same experts); gathers: the weight-gather plan of sharded weights."""
    p, d, v = cfg.p, cfg.replicas, cfg.v
    zt, width = ZERO_TRAITS[cfg.zero], weight_elem_bytes(profile)
    wb, gb, ob = zt.bytes_per_param(d, width)
    wbe, gbe, obe = zt.bytes_per_param(d // cfg.ep, width)
    acts = microbatch_activations(profile, cfg, cluster)
    chunk_w, chunk_g, edge_w, edge_g = _gathered_bytes_per_param(cfg, gathers, width)
    block_p, block_e = params.block, params.experts
    chunk_w *= gathered_bytes_ratio(profile, cfg.t, block_p, True)   # FP8 gathers: 1 B/elem
    mem_layer, mem_fixed, parts, fparts = [], [], [], []
    # the step's inputs besides the tokens (packed documents' masks), on every rank
    inputs_bytes = step_input_bytes(profile, cfg.micro_batch_size, cfg.num_microbatches)
    for r in range(p):
        held, pending = inflight(cfg, r), pending_weight_grads(cfg, r)
        mb = -(-held // v)  # micro-batches of the edge regions in flight
        a = (acts.layer * held + acts.pending_layer * pending) / v
        fresh = chunk_g * (block_p + block_e)   # ZeRO-2/3's accumulators, per layer
        # one micro-batch, one chunk: the one backward fills them as it frees `a`, so a layer
        # holds the larger of the two (a bound on gradients done + activations to go); not
        # with more, whose finished gradients wait beside later activations
        if cfg.num_microbatches == 1 and v == 1:
            fresh = max(0.0, fresh - a)
        parts.append(((wb + chunk_w) * block_p + (wbe + chunk_w) * block_e,
                      gb * block_p + gbe * block_e + fresh, ob * block_p + obe * block_e, a))
        edge_p = (params.embedding if r == 0 else 0.0) + (params.head if r == p - 1 else 0.0) \
            + (params.middle if 0 < r < p - 1 else 0.0)
        edge_a = (inputs_bytes + (acts.embedding * mb if r == 0 else 0.0)
                  + ((acts.head * mb + acts.pending_head * -(-pending // v))
                     if r == p - 1 else 0.0))
        fparts.append(((wb + edge_w) * edge_p, (gb + edge_g) * edge_p, ob * edge_p, edge_a,
                       backward_work(acts.work, acts.head_work, r == p - 1),
                       cluster.reserved_bytes))
        mem_layer.append(int(math.ceil(sum(parts[-1]))))
        mem_fixed.append(int(math.ceil(sum(fparts[-1][:5]))))
    return tuple(mem_layer), tuple(mem_fixed), tuple(parts), tuple(fparts), acts


def backward_work(layer_work: float, head_work: float, last: bool) -> float:
    """A rank's backward working set beside what it holds: a recomputed layer's (full,
    selective), or on the last stage the loss's gradients over the vocabulary; they are not
    alive at once (the head's backward ends before the first layer's starts)."""
    return max(layer_work, head_work) if last else layer_work


def state_bytes_lower_bound(profile: ModelProfile, cfg: Config) -> float:
    """Weights + grads + optimizer bytes per GPU if the layers were spread perfectly evenly
    (embedding and head included): no partition of this configuration needs less."""
    zt, width = ZERO_TRAITS[cfg.zero], weight_elem_bytes(profile)
    per_param = lambda n: sum(zt.bytes_per_param(n, width))  # noqa: E731
    n = cfg.replicas
    block_p, emb_p, head_p = shard_params_elems(profile, cfg.t,
                                                cfg.sequence_parallel and cfg.t > 1, cfg.p)
    experts = 0.0
    if cfg.ep > 1:   # the experts over ep ranks, their ZeRO shards over c·d/ep
        spread = expert_params_elems(profile, cfg.t, cfg.ep)
        block_p -= cfg.ep * spread
        experts = per_param(n // cfg.ep) * spread
    return (per_param(n) * (block_p * profile.num_layers + emb_p + head_p)
            + experts * profile.num_layers) / cfg.p


def activation_bytes_lower_bound(profile: ModelProfile, cfg: Config,
                                 memo: CostMemo | None = None) -> float:
    """Block activations per GPU that no partition avoids, plus the step's inputs every rank
    holds (packed documents' masks): the busiest rank holds at least the average of y_r · a_r, and that is >= (l/p) · min_r a_r (a_r = activation bytes per layer on
    rank r: kept bytes per micro-batch × its in-flight micro-batches per chunk). `memo`
    (optional) caches the context rank's profile (one per c and method)."""
    sp = cfg.sequence_parallel and cfg.t > 1
    if memo is None:
        profile = context_rank_profile(profile, cfg.c, cfg.cp_attention)
    else:
        profile = memo.context_profile(profile, cfg)
    act = layer_activation_bytes(profile, cfg.t, cfg.micro_batch_size, cfg.recompute, sp)
    return least_activation_bytes(act, cfg.schedule, cfg.p, cfg.v, cfg.num_microbatches,
                                  cfg.microbatch_group, profile.num_layers) + step_input_bytes(
        profile, cfg.micro_batch_size, cfg.num_microbatches)


def step_input_bytes(profile: ModelProfile, micro_batch_size: int,
                     num_microbatches: int) -> float:
    """The step's inputs besides the tokens, held on every rank for the step (packed
    documents' masks: `ModelProfile.input_bytes_per_sequence`)."""
    return profile.input_bytes_per_sequence * micro_batch_size * num_microbatches


def least_activation_bytes(layer_bytes: float, schedule: str, p: int, v: int, m: int,
                           group: int | None, num_layers: int) -> float:
    """`activation_bytes_lower_bound` from a layer's activation bytes per micro-batch
    (`layer_activation_bytes` on the context rank's profile) and the schedule's knobs: what
    the search asks per configuration without building one."""
    return layer_bytes * _least_inflight(schedule, p, v, m, group) / v * num_layers / p


@functools.lru_cache(maxsize=4096)
def _least_inflight(schedule: str, p: int, v: int, m: int, group: int | None) -> int:
    # memoised: the search asks ~10^5 times for a few thousand (schedule, p, v, m, N)
    traits, g0 = SCHEDULE_TRAITS[schedule], first_group_size(p, m, group)
    # every schedule's in-flight count is non-increasing in r (rank 0 warms up longest)
    return min(traits.inflight(p, v, m, r, g0) for r in (0, p - 1))


def schedule_activation_bytes(cc: ConfigCosts, layers_per_chunk: tuple[int, ...] | list[int],
                              *, deferred: bool = True,
                              chunk_bytes: list[tuple[float, float]] | None = None
                              ) -> list[float]:
    """Per pipeline rank, the activation bytes at its peak, found by walking the schedule's
    compute order (the lists the runtime executes) with each chunk's own size: its layers ×
    the per-layer bytes, plus the embedding's (chunk 0) and the head's (last chunk). Exact
    where the solver's linear form `mem_parts` (in-flight chunk-micro-batches × the rank's
    mean layers per chunk, `inflight`) approximates: with uneven chunks, or an edge chunk
    held for fewer micro-batches than the rank's other chunks under interleaving, and a
    split backward's deferred W's (the linear form bounds their count by
    `pending_weight_grads`). With one chunk per rank (v = 1) and no split backward the linear
    form is exact and no schedule is built. `deferred=False`: without the deferred W's
    recorded gradients (the saved tensors alone, what a saved-tensor hook sees).
    `chunk_bytes`: per chunk, (its layers' activation bytes per micro-batch, a deferred W's)
    where its layers differ from the profile's one layer (a stack of several kinds:
    cost/kinds.py `kinds_rank_memory`); default: its layer count × the per-layer bytes."""
    cfg = cc.cfg
    if chunk_bytes is None:
        if cfg.v == 1 and SCHEDULE_TRAITS[cfg.schedule].pending is None:
            return [cc.mem_parts[r][3] * n + cc.mem_fixed_parts[r][3]
                    for r, n in enumerate(layers_per_chunk)]
        chunk_bytes = [(cc.act_layer_bytes * n, cc.pending_layer_bytes * n)
                       for n in layers_per_chunk]
    elif cfg.v == 1 and SCHEDULE_TRAITS[cfg.schedule].pending is None:
        return [a * inflight(cfg, r) + cc.mem_fixed_parts[r][3]
                for r, (a, _) in enumerate(chunk_bytes)]
    last = len(layers_per_chunk) - 1
    weight = [a + (cc.act_embed_bytes if c == 0 else 0.0) + (cc.act_head_bytes if c == last
                                                             else 0.0)
              for c, (a, _) in enumerate(chunk_bytes)]
    # chunk 0 receives no input gradient: its B is empty and its W the whole backward
    pending = [0.0 if c == 0 else w + (cc.pending_head_bytes if c == last else 0.0)
               for c, (_, w) in enumerate(chunk_bytes)]
    group = cfg.microbatch_group if cfg.schedule in GROUPED else None
    # a split backward's W's are placed by the chunks' times, as the runtime places them from
    # the Plan's stages (the same `chunk_times_ms`): the equal-chunk order held up to 8% more
    # on rank 0 of an uneven cut than it predicted (2026-11-28)
    times = (tuple(chunk_times_ms(cc, layers_per_chunk)) if cfg.schedule in SPLIT_BACKWARD
             else None)

    def peaks(m: int, by: tuple | None) -> list[float]:
        order = _compute_order(cfg.schedule, cfg.p, cfg.v, m, group, by)
        return peak_held(order, weight, pending if deferred else None)
    period = cfg.p * (group or 1)
    m, start = cfg.num_microbatches, EXTRAPOLATE_START + period
    timed = _extrapolated_peaks(lambda n: peaks(n, times), m, period, start,
                                whole=times is None)
    if timed is not None:
        return timed
    # a long schedule whose timed W placement did not settle into periods in the three short
    # walks: the equal-chunk order's peaks, which do (a walk of every micro-batch of a
    # billion-sequence batch would not end)
    return _extrapolated_peaks(lambda n: peaks(n, None), m, period, start)


@functools.lru_cache(maxsize=32)
def _compute_order(schedule: str, p: int, v: int, m: int, group: int | None,
                   chunk_times: tuple[tuple[float, float], ...] | None = None) -> tuple:
    """`compute_order`, memoised (read only): one solve predicts a plan's walk several times
    (the tie-break, the memory fit, the plan) and its alternatives share their walks; a
    split backward's order is a list-scheduling simulation, by its chunks' times."""
    return tuple(tuple(acts) for acts in compute_order(schedule, p, v, m, group=group,
                                                       chunk_times=chunk_times))


def _extrapolated_peaks(peaks: Callable[[int], list[float]], m: int, period: int,
                        start: int, whole: bool = True) -> list[float] | None:
    """peaks(m), from three short walks where the schedule has settled (as
    weight_gathers.extrapolated: m0 ≡ m mod period, m0 + period, m0 + 2·period): a depth-first
    rank's peak stops growing after its warm-up, a breadth-first one grows by the same bytes
    per period; walked whole when m is short or the three disagree (beyond a relative 1e-9;
    `whole` False: None when they disagree, for the caller's other walk)."""
    walks = settled_walks(m, period, start)
    if walks is None:
        return peaks(m)
    (a, b, c), k = [peaks(n) for n in walks[0]], walks[1]
    if not all(math.isclose(z - y, y - x, rel_tol=1e-9, abs_tol=1e-12 * max(1.0, abs(z)))
               for x, y, z in zip(a, b, c)):
        return peaks(m) if whole else None
    return [x + k * (y - x) for x, y in zip(a, b)]


def rank_memory_parts(cc: ConfigCosts, r: int, y_r: int) -> Memory:
    """Pipeline rank r's predicted memory, by part, holding y_r layers."""
    lp, fp = cc.mem_parts[r], cc.mem_fixed_parts[r]
    return Memory(weights_bytes=lp[0] * y_r + fp[0], gradients_bytes=lp[1] * y_r + fp[1],
                  optimizer_bytes=lp[2] * y_r + fp[2], activations_bytes=lp[3] * y_r + fp[3],
                  recompute_bytes=fp[4], other_bytes=fp[5])
