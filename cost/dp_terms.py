"""Data-parallel terms of the step (`dp_terms_s`): the gradient reduction over the replicas
(the c·d ranks holding the same weights), ZeRO's weight all-gathers, and how much of them
the schedule hides. Per-layer terms are bandwidth only, a layer's share of the call that holds
it (a bucket of the rank's layers, or a chunk's); one collective latency is counted in the edge
terms, and each further call's as far as compute does not hide it (`calls_latency_s`).

- Data parallel, 1F1B / interleaved / GPipe: one gradient reduction per step per pipeline rank
  (ZeRO-1: reduce-scatter of gradients + all-gather of 16-bit weights, the same volume), of which
  at most DP_OVERLAP of the last micro-batch's backward can hide it. Then the optimizer step
  (Adam, memory bound).
- Data parallel, breadth-first (chunk-major: each pass runs all m micro-batches of a chunk back
  to back): chunk k's reduction R (ZeRO-0 all-reduce, ZeRO-1 reduce-scatter) starts when its
  last backward ends, on a separate stream, and runs under the m backwards of the next chunk
  (W_b = m · backward of a chunk). Per rank with v equal chunks the stream exposes
      R/v (the last chunk's) + (v-1)/v · max(0, R - W_b)   (per-layer form, linear in y_r)
  ZeRO-1 adds the all-gather of updated weights after the optimizer, exposed.
- Sharded weights (ZeRO-3: at most two chunks gathered at once; zero=2, FSDP without
  resharding after forward: every chunk gathered once per step and kept until its last
  backward), every schedule with an unsplit backward: the weight-gather plan of the schedule's
  own lists (autopar.weight_gathers, what the runtime runs) gives the all-gathers G and
  reduce-scatters R of a rank per step — breadth-first about 2 per chunk, interleaved orders one
  per visit of a group of N micro-batches each way, 1F1B one — and how many computes each one
  is issued ahead of (a prefetched gather) or runs under (a reduce-scatter before the next):
      exposed = Σ_gathers max(0, G − lead·forward) + Σ_reduces max(0, R − lead·backward)
  per chunk, i.e. per layer / v (`_sharded_layer_s`).
- Expert parallelism: a rank's E/ep experts are reduced / gathered over the c·d/ep ranks
  holding the same experts (stride t·ep: `expert_data_groups`), the rest over c·d.
- Tied embeddings: the first and the last pipeline stage sum the shared embedding's gradient.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from autopar.cost.comm import (allgather_s, allreduce_s, group_spans_nodes, link,
                               reducescatter_s)
from autopar.cost.config import SCHEDULE_TRAITS, ZERO_TRAITS, Config
from autopar.cost.hardware import Cluster
from autopar.cost.precision import gathered_bytes_ratio
from autopar.cost.profile import ModelProfile
from autopar.cost.shares import RankParams, shared_block_elems, tied_table_elems
from autopar.schedules import SPLIT_BACKWARD, compute_ops, compute_order
from autopar.weight_gathers import (GatherCounts, GatherStats, compute_gather_stats,
                                    extrapolated, gather_stats)

# Gradients are reduced in 16-bit (Megatron-LM's fp16 runs of 2104.04473 reduce the fp16
# gradient buffer); they are kept and accumulated in fp32 (the 4 gradient bytes of the 18).
GRAD_REDUCE_BYTES = 2


def grad_reduce_bytes(profile: ModelProfile) -> int:
    """Bytes per gradient (and per gathered weight) the data-parallel collectives move: 16-bit
    (GRAD_REDUCE_BYTES) for a 16-bit profile, 4 for an fp32 run (the profile's
    `activation_bytes_per_elem`: compile's default precision reduces and gathers fp32)."""
    return GRAD_REDUCE_BYTES if profile.activation_bytes_per_elem <= 2 \
        else profile.activation_bytes_per_elem


@dataclass(frozen=True, kw_only=True)
class GradGroup:
    """The collectives of a gradient group: `size` ranks on one link; gradients reduced in
    16-bit (a reduce-scatter where the optimizer is sharded, else an all-reduce), weights
    all-gathered in 16-bit."""
    cluster: Cluster
    size: int
    inter: bool
    sharded_optimizer: bool
    elem_bytes: int = GRAD_REDUCE_BYTES   # per gradient and gathered weight (grad_reduce_bytes)

    @property
    def latency_s(self) -> float:
        return link(self.cluster, self.inter)[1]

    def gather_s(self, params: float) -> float:
        """All-gather of `params` weights (16-bit, or fp32 in an fp32 run)."""
        return allgather_s(self.cluster, self.elem_bytes * params, self.size, self.inter)

    def reduce_s(self, params: float) -> float:
        """Reduction of `params` gradients."""
        coll = reducescatter_s if self.sharded_optimizer else allreduce_s
        return coll(self.cluster, self.elem_bytes * params, self.size, self.inter)


class DpTerms(NamedTuple):
    """`dp_terms_s`: seconds per step of the rank's data-parallel collectives."""
    layer_s: float          # per layer of the rank: gradient reduction (and weight gathers)
    hidden_layer_s: float   # per layer: what hides behind compute
    first_s: float          # rank 0 extra (embedding, tied-embedding sync)
    last_s: float           # rank p - 1 extra (head, tied-embedding sync)
    rank_s: float           # every rank: its calls' latency beyond one (`calls_latency_s`)
    #                         and the step's scalar all-reduces (`step_scalars_s`)


def dp_terms_s(profile: ModelProfile, cluster: Cluster, cfg: Config, params: RankParams,
               block_s: tuple[float, float, float], layer_compute_s: float,
               gathers: GatherCounts | None = None) -> DpTerms:
    """Data-parallel seconds per step (`DpTerms`): per layer of the rank, hidden per layer,
    rank 0 extra, rank p-1 extra, every rank's extra call latency. Exposed per layer = the
    first less the second (see the module docstring).

    profile: the rank's (`rank_profile`); params: what the rank holds (`rank_params`; its
    experts reduced / gathered over the c·d/ep ranks holding the same ones); block_s: a
    layer's (compute, TP comm, forward) seconds per micro-batch (compute.block_times_s);
    layer_compute_s: the layer's compute per micro-batch as the load rounds it; gathers: the
    weight-gather plan (`weight_gather_stats`, computed here if not given) when the weights
    are sharded.
    """
    # the gradient group: the c·d ranks holding the same weights (context innermost of data,
    # autopar/runtime/groups.py gradient_groups: stride t, c·d ranks)
    t, p, d, v, m = cfg.t, cfg.p, cfg.replicas, cfg.v, cfg.num_microbatches
    sched, zt = SCHEDULE_TRAITS[cfg.schedule], ZERO_TRAITS[cfg.zero]
    tied_sync = tied_sync_s(profile, cluster, cfg)
    scalars = step_scalars_s(cluster, cfg)
    if d <= 1:
        return DpTerms(layer_s=0.0, hidden_layer_s=0.0, first_s=tied_sync, last_s=tied_sync,
                       rank_s=scalars)
    grp = GradGroup(cluster=cluster, size=d, sharded_optimizer=zt.sharded_optimizer,
                    inter=group_spans_nodes(cluster, stride=t, size=d, gpus=cfg.gpus),
                    elem_bytes=grad_reduce_bytes(profile))
    lat = grp.latency_s
    f8 = gathered_bytes_ratio(profile, t, params.block, zt.sharded_weights)  # FP8: 1 B
    experts = _expert_group(cluster, cfg, grp.elem_bytes) if params.experts else None
    # one call holds a chunk's layers (sharded weights, breadth-first's reductions) or the
    # rank's (one bucket), of a rank holding its share of the layers
    rank_layers = profile.num_layers / p
    whole_rank = not (zt.sharded_weights or sched.chunk_major)
    G, R = _layer_sync_s(grp, experts, params, f8,
                         rank_layers if whole_rank else rank_layers / v)
    comp, tp, fwd = block_s
    if zt.sharded_weights:
        st = gathers if gathers is not None else weight_gather_stats(cfg)
        dp_layer, hidden = _sharded_layer_s(st, G, R, fwd, comp + tp - fwd, v)
        edge = lambda n: (st.gathers * (grp.gather_s(n) - lat)  # noqa: E731
                          + st.reduce_scatters * (grp.reduce_s(n) - lat)) / v + lat
        calls = st.gathers + st.reduce_scatters
    else:
        after_step = G if zt.sharded_optimizer else 0.0  # ZeRO-1 weight gather, exposed
        dp_layer = R + after_step
        if not sched.chunk_major:
            hidden = sched.dp_overlap * layer_compute_s * (2.0 / 3.0)
        else:  # chunk-major: a chunk's m backwards (W_b) hide the next chunk's reduction
            w_b = m * (comp + tp - fwd)
            hidden = dp_layer - (R / v + (v - 1) / v * max(0.0, R - w_b) + after_step)
        # ZeRO-1: reduce-scatter grads + all-gather 16-bit weights
        edge = ((lambda n: grp.reduce_s(n) + grp.gather_s(n) - lat)  # noqa: E731
                if zt.sharded_optimizer else grp.reduce_s)
        calls = ((v if sched.chunk_major else 1) * 2 if zt.sharded_optimizer
                 else grad_bucket_calls(params, rank_layers, v, grp.elem_bytes))
    dp_first = edge(params.embedding) + tied_sync
    dp_last = edge(params.head) + tied_sync + (lat if p > 1 else 0.0)
    return DpTerms(layer_s=dp_layer, hidden_layer_s=hidden * cluster.comm_overlap,
                   first_s=dp_first, last_s=dp_last,        # what can hide does
                   rank_s=calls_latency_s(cluster, calls, lat) + scalars)


# autopar.runtime.data_parallel's buckets (DDP's, 2006.15704 §3.2): the first at most 1 MiB,
# the rest 25 MiB, never across a chunk (tests/unit/test_dp_calls.py checks these against it)
FIRST_BUCKET_BYTES, BUCKET_BYTES = 2**20, 25 * 2**20


def grad_bucket_calls(params: RankParams, rank_layers: float, v: int, elem_bytes: int) -> int:
    """The all-reduces a ZeRO-0 rank issues a step: its gradients in buckets as GradSync
    packs them (tests/unit/test_dp_calls.py builds the runtime's and compares), per chunk of
    rank_layers / v layers in reverse, never across a chunk: the first bucket (the last
    chunk's, which backward meets first) at most 1 MiB or the head's weight alone, the rest
    25 MiB; an embedding or head larger than a bucket is one of its own. The experts' in a
    GradSync of their own. Each call past the first pays a latency where compute does not
    hide it (`calls_latency_s`): on 2 CPU ranks a GPT of 4 layers at width 128 (3.5 MB of
    fp32 gradients) issued 2 where 1 was priced. Counted by region, not tensor: a layer's
    tensors fill a bucket's last room, which the runtime's may not (±1 call a chunk)."""
    head, emb = params.head * elem_bytes, params.embedding * elem_bytes
    layers = rank_layers / v * params.block * elem_bytes

    def filled(nbytes: float) -> int:
        return math.ceil(nbytes / BUCKET_BYTES) if nbytes > 0 else 0

    def edge(nbytes: float) -> tuple[int, float]:   # (calls of its own, bytes left to pack)
        return (1, 0.0) if nbytes >= BUCKET_BYTES else (0, nbytes)
    calls = 0
    for c in reversed(range(v)):
        own, rest = edge(emb) if c == 0 else (0, 0.0)
        rest += layers
        if c == v - 1:        # the first bucket: the head alone where it fills 1 MiB
            if head >= FIRST_BUCKET_BYTES:
                own += 1
            elif rest + head > 0:
                own += 1
                rest = max(0.0, rest + head - FIRST_BUCKET_BYTES)
        calls += own + filled(rest)
    experts = rank_layers * params.experts * elem_bytes
    return max(1, calls) + (filled(experts) if experts else 0)


# a scalar the runtime all-reduces each step (float64: the loss, the counted tokens)
SCALAR_BYTES = 8


def step_scalars_s(cluster: Cluster, cfg: Config) -> float:
    """Every rank's blocking scalar all-reduces of a step (autopar/runtime/runner.py): the
    global loss over the pipeline group (p > 1) and over the c·d replicas, and the counted
    tokens a token-mean loss is divided by over the replicas. Nothing hides them: ~0.5 ms
    each on 2 gloo CPU ranks (~1 ms of a 4-layer GPT's 52 ms step at d = 2, unpriced before,
    2026-11-27), tens of µs on a GPU's links."""
    t, p, d = cfg.t, cfg.p, cfg.replicas
    out = 0.0
    if p > 1:
        out += allreduce_s(cluster, SCALAR_BYTES, p, group_spans_nodes(
            cluster, stride=t * d, size=p, gpus=cfg.gpus))
    if d > 1:
        out += 2 * allreduce_s(cluster, SCALAR_BYTES, d, group_spans_nodes(
            cluster, stride=t, size=d, gpus=cfg.gpus))
    return out


def tied_sync_s(profile: ModelProfile, cluster: Cluster, cfg: Config) -> float:
    """The first and the last stage's all-reduce of the tied embedding's gradient and of a
    shared block's (called at several depths: one copy per stage), one flat buffer; for
    p > 2 the shared block's over all p stages (0 when neither or p = 1)."""
    t, p, d = cfg.t, cfg.p, cfg.replicas
    shared = shared_block_elems(profile, t)
    if not ((profile.tied_embeddings or shared) and p > 1):
        return 0.0
    pp_inter = group_spans_nodes(cluster, stride=t * d, size=p, gpus=cfg.gpus)
    table = tied_table_elems(profile, t, cfg.sequence_parallel and t > 1) \
        if profile.tied_embeddings else 0.0
    e = grad_reduce_bytes(profile)
    if p == 2 or not shared:   # one buffer over the first and the last stage
        return allreduce_s(cluster, e * (table + shared), 2, pp_inter)
    # p > 2: the shared block's copies over every stage (runtime: the pipeline group)
    return (allreduce_s(cluster, e * table, 2, pp_inter) if table else 0.0) \
        + allreduce_s(cluster, e * shared, p, pp_inter)


def _expert_group(cluster: Cluster, cfg: Config, elem_bytes: int) -> GradGroup | None:
    """The group the rank's experts are reduced over: the c·d/ep ranks holding the same ones
    (stride t·ep); None when that is the rank alone."""
    de = cfg.replicas // cfg.ep
    if de <= 1:
        return None
    return GradGroup(cluster=cluster, size=de, elem_bytes=elem_bytes,
                     sharded_optimizer=ZERO_TRAITS[cfg.zero].sharded_optimizer,
                     inter=group_spans_nodes(cluster, stride=cfg.t * cfg.ep, size=de,
                                             gpus=cfg.gpus))


def _layer_sync_s(grp: GradGroup, experts: GradGroup | None, params: RankParams,
                  gather_ratio: float = 1.0, per_call: float = 1.0) -> tuple[float, float]:
    """(G, R): the all-gather of a layer's 16-bit weights and the reduction of its gradients,
    bandwidth only (without each collective's latency), as a layer's share of one call of
    `per_call` layers (a bucket or a chunk: what the runtime reduces or gathers at once) —
    the same as one layer's alone on a link of latency + bytes / bandwidth, and the secant of
    a measured curve, whose small calls cost more than their bytes (a 196 KB all-reduce on 2
    CPU ranks took 1.6 ms, eight of them in one call ~3 ms); gather_ratio: the dense block's
    gathered bytes over bf16's (cost/precision.py: FP8 weights gathered in 1 byte)."""
    k = max(1.0, per_call)
    lat = grp.latency_s
    G = (grp.gather_s(gather_ratio * params.block * k) - lat) / k
    R = (grp.reduce_s(params.block * k) - lat) / k
    if experts is not None:
        lat_e = experts.latency_s
        G += (experts.gather_s(params.experts * k) - lat_e) / k
        R += (experts.reduce_s(params.experts * k) - lat_e) / k
    return G, R


def calls_latency_s(cluster: Cluster, calls: int, lat: float) -> float:
    """Per rank and step: the latency of its data-parallel calls beyond the one the edge terms
    count, as far as it does not hide behind compute (1 − comm_overlap: a GPU's collectives
    run beside its kernels; CPU ranks that fill every core wait for each one — on 2 local
    ranks breadth-first with v = 8 one-layer chunks, a reduction each, measured 5.3 ms a step
    over 1F1B's single one at ZeRO-0, 10.1 ms at ZeRO-2 with a gather and a reduce-scatter a
    chunk, each call ~0.6 ms)."""
    return max(0, calls - 1) * lat * (1.0 - cluster.comm_overlap)


# Schedules of more micro-batches than this many periods (p·N) past EXTRAPOLATE_START have
# their gather counts extrapolated from three short walks (weight_gathers.extrapolated,
# self-checking): planning a batch of millions of sequences would otherwise walk every one.
EXTRAPOLATE_START = 64


def weight_gather_stats(cfg: Config) -> GatherCounts:
    """The weight-gather plan of a sharded-weight configuration (zero 2 / 3) on its busiest
    rank, counted: autopar.weight_gathers on the schedule's compute order, elementwise the most
    of pipeline ranks 0 and p − 1 (the longest and shortest warm-up); long schedules
    extrapolated from short ones where exact (`extrapolated`)."""
    period = cfg.p * (cfg.microbatch_group or 1)
    start = EXTRAPOLATE_START + period
    long = extrapolated(lambda m: _walked_counts(cfg, m), cfg.num_microbatches, period, start)
    return long if long is not None else _walked_counts(cfg, cfg.num_microbatches)


def _walked_counts(cfg: Config, m: int) -> GatherCounts:
    """weight_gather_stats of cfg's schedule at m micro-batches, walked whole."""
    keep = ZERO_TRAITS[cfg.zero].keep(cfg.v)
    ranks = sorted({0, cfg.p - 1})
    if cfg.schedule in SPLIT_BACKWARD:
        orders = compute_order(cfg.schedule, cfg.p, cfg.v, m, group=cfg.microbatch_group,
                               ranks=ranks)
        stats = [gather_stats(o, keep=keep) for o in orders]
    else:       # the (kind, chunk, micro-batch) tuples: no Action per compute
        stats = [compute_gather_stats([op[1] for op in ops], [op[0] for op in ops], keep=keep)
                 for ops in compute_ops(cfg.schedule, cfg.p, cfg.v, m,
                                        group=cfg.microbatch_group, ranks=ranks)]
    worst = max(stats, key=lambda st: (st.gathers + st.reduce_scatters, st.peak_pending))
    return GatherCounts.of(GatherStats(
        gather_leads=worst.gather_leads, reduce_leads=worst.reduce_leads,
        peak_gathered=max(st.peak_gathered for st in stats),
        peak_pending=max(st.peak_pending for st in stats)))


def _sharded_layer_s(st: GatherCounts, G: float, R: float, fwd: float, bwd: float,
                     v: int) -> tuple[float, float]:
    """Data-parallel seconds per layer of sharded weights (zero 2 / 3), (traffic, hidden),
    from the schedule's own weight-gather plan (weight_gather_stats).

    A rank gathers its chunks n_g times and reduce-scatters them n_r times per step; a chunk
    holds 1/v of its layers, so per layer the traffic is (n_g·G + n_r·R)/v. Each gather is
    prefetched `lead` computes before its chunk is needed, and hides under them: exposed
    max(0, G − lead·forward) per layer (0 computes: exposed whole); each reduce-scatter runs
    under the computes before the next one starts: max(0, R − lead·backward), the step's last
    one exposed whole. The embedding and the head are gathered and reduced with the first /
    last chunk, not hidden (as ZeRO-1's edge traffic: `dp_terms_s`)."""
    dp_layer = (st.gathers * G + st.reduce_scatters * R) / v
    exposed = (sum(n * max(0.0, G - lead * fwd) for lead, n in st.gather_leads)
               + sum(n * max(0.0, R - lead * bwd) for lead, n in st.reduce_leads)) / v
    return dp_layer, dp_layer - exposed
