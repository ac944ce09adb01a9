"""The cost model: step time, memory and throughput of one parallel configuration.

Pure functions of (ModelProfile, Cluster, Config, layers per chunk); units are in the names.
The solver (cost/solver.py), `predict` and `Plan.explain()` all go through `config_costs` and
the step-time pieces below it (`rank_load_ns`, `rank_tail_terms_ns`, `rank_memory_bytes`,
affine in a rank's layer count, and `scaled_step_ns`, the one statement of the step-time
formula), so the solver's constraints and objective and the reported prediction are the same
functions.

Mechanisms (one each, no per-configuration constants):
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
- Tensor-parallel fallbacks (`ModelProfile.tp_fallbacks`, from the graph path's analysis of the
  tensor-parallel pass at each t, autopar/passes/tp_cost.py): the GEMMs the pass keeps replicated
  are priced whole (t = 1), their parameters, saved activations and elementwise bytes are not
  divided by t (not even under sequence parallelism), the all-reduces of row-parallel GEMMs it
  does not split are dropped, and the collectives it inserts (gathers of split values, gradient
  all-gathers / all-reduces of sliced replicated values) are added to the tensor-parallel
  communication, forward ones again under full recompute. Without an entry for t (textbook
  profiles) the structural split of Gemm.tp_split is priced as is.
- Collectives (`allreduce_s`, `allgather_s`, `p2p_s`): latency + bytes / bandwidth of the link
  the group lives on (Megatron rank order, `group_link`): ring all-reduce 2(n-1)/n, all-gather
  and reduce-scatter (n-1)/n. Nothing is overlapped with compute except the data-parallel
  reduction (see DP_OVERLAP) — Megatron-LM ran TP collectives and p2p on the compute stream.
  autopar's runtime does hide the backward reduction of each column-parallel input gradient
  under the weight-gradient GEMMs (passes/overlap.py), and under SP the re-gather of the saved
  shard under the dx GEMMs; the model does not credit either. The published runs it is
  calibrated against predate Megatron's asynchronous TP all-reduce, and with full credit
  (Σ min(c, dW) per block) the model, already a few % optimistic, put 2104.04473's 76B–1T rows
  at +10–12.5%; on a GPU the overlapped NCCL kernels also slow the GEMMs they share SMs and
  memory bandwidth with, by an amount no source here gives. Predicted step times are thus
  an upper bound by at most that backward communication.
- Pipeline p2p: each chunk boundary sends the activation forward and its gradient back, on
  the pipeline link (each tensor rank 1/t, all-gathered in-node: the scatter/gather of
  2104.04473 §4.1), charged per micro-batch in the load; an interleaved order with groups of
  N > p micro-batches per chunk visit hides part of it (`_grouped_p2p_s`).
- Pipeline: each pipeline rank r has a per-micro-batch load tau_r (forward + backward of all its
  chunks, their TP collectives and p2p). With m micro-batches and v chunks per rank
      T_pipe = m * max_r tau_r + (sum_r tau_r - max_r tau_r) / v.
  For equal loads this is m*tau*(1 + (p-1)/(v*m)): the published bubble (p-1)/m for GPipe/1F1B
  and (p-1)/(v*m) for interleaved 1F1B; for unequal loads the slowest rank sets the steady
  state and the others' loads fill the ramp-up/down. bubble_fraction = bubble / (m * max tau).
  Breadth-first (2211.05953) has the same bubble: with equal chunks and asynchronous sends its
  event simulation (cost/simulate.py, blocking=False) idles exactly (p-1)·tau/v per rank, like
  interleaved 1F1B (tests/unit/test_breadth_first_planner.py checks all four schedules).
  Zero-bubble interleaved 1F1B ("interleaved-zb", 2401.10241's B/W split on the interleaved or,
  for v = 1, the 1F1B order) fills the ramp-down with the deferred weight-gradient halves W of
  the backwards: with F : B : W = 1 : 1 : 1 each rank idles (p-1)·(F + B - W) per chunk instead
  of (p-1)·(F + B + W), a third (ScheduleTraits.bubble_div = 3; with full recompute B also
  recomputes the forward, F : B : W = 1 : 2 : 1, half: bubble_div = 2), so
      T_pipe = m * max_r tau_r + (sum_r tau_r - max_r tau_r) / (v * bubble_div),
  what cost/simulate.py gives on autopar.schedules.interleaved_zb's lists for equal chunks.
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
  per chunk, i.e. per layer / v (`_sharded_dp_terms_s`).
- Expert parallelism (ep > 1, a mixture of experts): each of ep ranks of a gradient group
  holds E/ep of every layer's experts (their weights, gradients and Adam states / ep; ZeRO
  shards them over the c·d/ep ranks holding the same experts), and the expert gradients are
  reduced over those c·d/ep ranks (`expert_data_groups`, stride t·ep), the rest over c·d.
  Tokens reach their experts' rank by an all-to-all and come back by another, per MoE layer:
  2 in forward, 2 in backward (the reverse exchanges of the gradients), 2 more forward under
  full recompute, each of micro-batch · tokens · top-k · hidden elements per rank, (ep−1)/ep
  of them leaving the rank (`alltoall_s`), exposed (Megatron-Core's dispatcher runs them on
  the compute stream), on the link the expert group spans (stride t, ep ranks). Routing is
  priced balanced: every rank computes tokens · k expert rows, as without ep.
- Memory per pipeline rank: weights/grads/optimizer per ZERO_TRAITS, activations per layer per
  recompute mode (2205.05198) times the micro-batches the schedule keeps in flight
  (SCHEDULE_TRAITS, equal to autopar.schedules.peak_inflight on the action lists:
  breadth-first all m micro-batches of all v chunks, v·m; interleaved 2(p−r−1) + (v−1)·N + 1;
  interleaved-zb torch's ZeroBubble bound (v−1)·N + p, a micro-batch in flight until its W),
  embedding on the first and head (+ tied embedding copy) on the last rank, and the cluster's
  reserve. Sharded weights keep no 16-bit weights at rest (the fp32 master shard is cast for
  each gather) and add the plan's gathered working set: its most chunks gathered at once
  (16-bit) and the fp32 gradient accumulators of its most chunks with unreduced gradients plus
  one fp32 reduce-scatter buffer.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence, TypeVar

from autopar.cost.context import context_rank_profile
from autopar.cost.hardware import Cluster
from autopar.cost.imbalance import alltoall_factor, expert_gemm_extra_s
from autopar.cost.overlap import ROW_PIECES, block_tp_exposed_s
from autopar.cost.precision import gathered_bytes_ratio
from autopar.cost.profile import (NO_FALLBACK, AttentionCall, Gemm, ModelProfile, RegionProfile,
                                  TPRegionFallback)
from autopar.plan import CP_ATTENTION, RECOMPUTE, SCHEDULES, ZERO_LEVELS, Memory, Plan, Prediction
from autopar.schedules import (GROUPED, check_group, compute_order, first_group_size,
                               peak_held)
from autopar.weight_gathers import GatherStats, gather_stats

# Gradients are reduced in 16-bit (Megatron-LM's fp16 runs of 2104.04473 reduce the fp16
# gradient buffer); they are kept and accumulated in fp32 (the 4 gradient bytes of the 18).
GRAD_REDUCE_BYTES = 2
# Fraction of the last micro-batch's backward that can hide the data-parallel reduction.
# Megatron-LM (2021) starts the reduction after the backward pass: no overlap.
DP_OVERLAP = 0.0
# Adam step traffic per parameter it owns: read fp32 grad, master, m, v (16 B), write master,
# m, v (12 B) and the 16-bit weight (2 B).
ADAM_BYTES_PER_PARAM = 30
NS = 1e9
# Backward of the non-GEMM ops (norms, softmax, dropout, GeLU) per forward byte: it reads the
# incoming gradient and the saved input and writes one gradient, ~2x the forward traffic.
BWD_ELEMENTWISE_FACTOR = 2.0


# ----- configuration ---------------------------------------------------------------------------
_INT_ONLY = {int}


@dataclass(frozen=True, kw_only=True)
class Config:
    """One parallel configuration (everything but the stage boundaries)."""
    t: int
    p: int
    d: int
    c: int = 1                            # context parallelism (cost/context.py)
    cp_attention: str = "all-gather"      # how its attention meets the other ranks' K/V
    ep: int = 1                           # expert parallelism over the c·d ranks
    v: int = 1
    micro_batch_size: int = 1
    num_microbatches: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"
    sequence_parallel: bool = False
    zero: int = 0
    microbatch_group: int | None = None   # N of the interleaved schedules (None: p)

    def __post_init__(self) -> None:
        counts = (self.t, self.p, self.d, self.c, self.ep, self.v, self.micro_batch_size,
                  self.num_microbatches)
        # checked in C when all are plain ints (the solver builds ~10^5 configurations per
        # solve); otherwise one by one, for the message
        if set(map(type, counts)) != _INT_ONLY or min(counts) < 1:
            for name in ("t", "p", "d", "c", "ep", "v", "micro_batch_size", "num_microbatches"):
                value = getattr(self, name)
                if not isinstance(value, int) or value < 1:
                    raise ValueError(f"Config.{name}={value!r}: must be a positive integer")
        if self.replicas % self.ep:
            raise ValueError(f"Config.ep={self.ep}: must divide c·d = {self.replicas} (the "
                             f"expert-parallel ranks are drawn from them)")
        if self.cp_attention not in CP_ATTENTION:
            raise ValueError(f"Config.cp_attention={self.cp_attention!r}: must be one of "
                             f"{CP_ATTENTION}")
        if self.schedule not in SCHEDULE_TRAITS:
            raise ValueError(f"Config.schedule={self.schedule!r}: the cost model supports "
                             f"{sorted(SCHEDULE_TRAITS)}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Config.recompute={self.recompute!r}: must be one of {RECOMPUTE}")
        if self.zero not in ZERO_TRAITS:
            raise ValueError(f"Config.zero={self.zero!r}: must be one of {sorted(ZERO_TRAITS)}")
        if self.v > 1 and not SCHEDULE_TRAITS[self.schedule].multi_chunk:
            raise ValueError(f"Config.v={self.v} with schedule={self.schedule!r}: several chunks "
                             f"per rank need an interleaved schedule; set v=1")
        if self.microbatch_group is not None:
            if self.schedule not in GROUPED:
                raise ValueError(f"Config.microbatch_group={self.microbatch_group} with "
                                 f"schedule={self.schedule!r}: only {GROUPED} take one")
            check_group(self.p, self.num_microbatches, self.microbatch_group, "Config")

    @classmethod
    def of_plan(cls, plan: "Plan") -> "Config":
        """The configuration of a Plan (everything but its stages)."""
        return cls(t=plan.t, p=plan.p, d=plan.d, c=plan.c, cp_attention=plan.cp_attention,
                   ep=plan.ep, v=plan.v,
                   micro_batch_size=plan.micro_batch_size,
                   num_microbatches=plan.num_microbatches, schedule=plan.schedule,
                   recompute=plan.recompute, sequence_parallel=plan.sequence_parallel,
                   zero=plan.zero, microbatch_group=plan.microbatch_group)

    @property
    def gpus(self) -> int:
        return self.t * self.c * self.p * self.d

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights, over which gradients are reduced and ZeRO shards:
        c·d (context ranks hold the same weights, as data-parallel ones do)."""
        return self.c * self.d

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.d

    @property
    def first_group(self) -> int:
        """g₀: micro-batches of the first group of the interleaved orders (N, or p)."""
        return first_group_size(self.p, self.num_microbatches, self.microbatch_group)


# ----- schedule and ZeRO tables (breadth-first / ZeRO-3 variants slot in here) ----------------
@dataclass(frozen=True)
class ScheduleTraits:
    """What the cost model needs from a pipeline schedule.

    inflight(p, v, m, r, g0): chunk-micro-batches whose activations rank r holds at its peak
    (g0: the first micro-batch group of the interleaved orders, Config.first_group).
    dp_overlap: fraction of the last micro-batch's backward that can hide the DP reduction
    (schedules that are not chunk-major).
    zero_levels: the ZeRO levels the schedule supports (sharded weights, 2 and 3, need a
    backward that is not split: the deferred weight gradients would need the weights again).
    bubble_div(recompute): the pipeline bubble is (Σ load − max load) / (v · bubble_div);
    1 except for zero-bubble schedules, whose deferred weight gradients fill part of it.
    pending(p, v, m, r, g0): chunk-micro-batches whose W rank r defers at most (split
    backward only): each holds the gradients recorded for its W besides its forward's
    activations.
    """
    multi_chunk: bool
    inflight: Callable[[int, int, int, int, int], int]
    dp_overlap: float = DP_OVERLAP
    zero_levels: tuple[int, ...] = (0, 1, 2, 3)
    # all micro-batches of a chunk run back to back in each pass: a chunk's gradients are final
    # once per step (its reduction overlaps later chunks' backward) and ZeRO-3 gathers its
    # weights once per pass instead of once per micro-batch
    chunk_major: bool = False
    bubble_div: Callable[[str], int] = lambda recompute: 1
    # split-backward schedules: chunk-micro-batches with a deferred W (same signature as
    # inflight); None: a backward is never split
    pending: Callable[[int, int, int, int, int], int] | None = None


def _inflight_gpipe(p: int, v: int, m: int, r: int, g0: int) -> int:
    return m * v  # every micro-batch's forward finishes before any backward


def _inflight_1f1b(p: int, v: int, m: int, r: int, g0: int) -> int:
    return min(p - r, m) * v  # rank r warms up with p - r - 1 forwards, then 1F1B


def _inflight_interleaved(p: int, v: int, m: int, r: int, g0: int) -> int:
    # Megatron-LM's warm-up: 2(p - r - 1) + (v - 1)·g0 forwards (g0 = N, p by default), +1 in
    # steady state; on rank 0 with g0 = p this is the 2205.05198 factor p·(1 + (p-1)/(p·v))
    # micro-batches of l/p layers
    return min(2 * (p - r - 1) + (v - 1) * g0 + 1, m * v)


def _inflight_breadth_first(p: int, v: int, m: int, r: int, g0: int) -> int:
    return m * v  # every chunk's forward of every micro-batch runs before the first backward


def _inflight_zero_bubble(p: int, v: int, m: int, r: int, g0: int) -> int:
    # torch's ScheduleInterleavedZeroBubble bound, which autopar.schedules.interleaved_zb keeps:
    # its F/B order warms up with (p - r - 1) + (v - 1)·g0 forwards, and no rank holds more
    # chunk-micro-batches (F run, W not yet) than rank 0's (v - 1)·g0 + p (v·p for g0 = p;
    # v = 1, ZB-H1: p, 1F1B's rank 0)
    return min((v - 1) * g0 + p, m * v)


def _pending_zero_bubble(p: int, v: int, m: int, r: int, g0: int) -> int:
    # chunk-micro-batches whose B has run and W not, at most, on rank r of
    # autopar.schedules.interleaved_zb: (v - 1)·g0 + r + 1 (rank r defers one W more than
    # rank r - 1 in the cool-down); tests/unit/test_memory_walk.py checks it against the lists
    return min((v - 1) * g0 + r + 1, m * v)


def inflight(cfg: Config, r: int) -> int:
    """Chunk-micro-batches whose activations pipeline rank r holds at its peak under cfg."""
    return SCHEDULE_TRAITS[cfg.schedule].inflight(cfg.p, cfg.v, cfg.num_microbatches, r,
                                                  cfg.first_group)


def _bubble_div_zero_bubble(recompute: str) -> int:
    # idle (p-1)(F + B - W) of (p-1)(F + B + W): 1:1:1 -> 1/3; full recompute 1:2:1 -> 1/2
    return 2 if recompute == "full" else 3


SCHEDULE_TRAITS: dict[str, ScheduleTraits] = {
    "gpipe": ScheduleTraits(multi_chunk=False, inflight=_inflight_gpipe),
    "1f1b": ScheduleTraits(multi_chunk=False, inflight=_inflight_1f1b),
    "interleaved-1f1b": ScheduleTraits(multi_chunk=True, inflight=_inflight_interleaved),
    "breadth-first": ScheduleTraits(multi_chunk=True, inflight=_inflight_breadth_first,
                                    chunk_major=True),
    # no sharded weights: the runtime does not gather them for the deferred W's
    "interleaved-zb": ScheduleTraits(multi_chunk=True, inflight=_inflight_zero_bubble,
                                     zero_levels=(0, 1), bubble_div=_bubble_div_zero_bubble,
                                     pending=_pending_zero_bubble),
}


def pending_weight_grads(cfg: Config, r: int) -> int:
    """Chunk-micro-batches whose weight gradient pipeline rank r defers at most (0 unless the
    schedule splits the backward); a bound: the pairs' B→W windows need not all overlap the
    activation peak."""
    fn = SCHEDULE_TRAITS[cfg.schedule].pending
    return 0 if fn is None else fn(cfg.p, cfg.v, cfg.num_microbatches, r, cfg.first_group)


def bubble_div(cfg: Config) -> int:
    """The schedule's bubble divisor (ScheduleTraits.bubble_div) for this configuration."""
    return SCHEDULE_TRAITS[cfg.schedule].bubble_div(cfg.recompute)


@dataclass(frozen=True)
class ZeroTraits:
    """Bytes per parameter at rest (weights, grads, optimizer) as functions of d, and whether
    the weights are sharded: `keep(v)`, the chunks of a rank gathered at once (the weight-gather
    plan of autopar.weight_gathers), None when every rank holds its weights whole."""
    weight_bytes: Callable[[int], float]
    grad_bytes: Callable[[int], float]
    optimizer_bytes: Callable[[int], float]
    sharded_optimizer: bool
    keep: Callable[[int], int] | None = None

    @property
    def sharded_weights(self) -> bool:
        return self.keep is not None


ZERO_TRAITS: dict[int, ZeroTraits] = {
    0: ZeroTraits(lambda d: 2.0, lambda d: 4.0, lambda d: 12.0, sharded_optimizer=False),
    1: ZeroTraits(lambda d: 2.0, lambda d: 4.0, lambda d: 12.0 / d, sharded_optimizer=True),
    # ZeRO-2 in FSDP's terms (reshard_after_forward=False, torchtitan): fp32 grads and
    # optimizer states sharded at rest, and no 16-bit weights: the runtime
    # (autopar/runtime/zero3.py) keeps only the fp32 master shard (4 of the optimizer's 12 B:
    # master, m, v) and casts it to 16-bit for each all-gather, as FSDP2's
    # MixedPrecisionPolicy(param_dtype=bf16); each chunk gathered once per step and kept until
    # its last backward. The gathered working set is added in _memory_coefficients.
    2: ZeroTraits(lambda d: 0.0, lambda d: 4.0 / d, lambda d: 12.0 / d,
                  sharded_optimizer=True, keep=lambda v: v),
    # ZeRO-3: the same shards, at most two chunks gathered at once (computing + prefetched)
    3: ZeroTraits(lambda d: 0.0, lambda d: 4.0 / d, lambda d: 12.0 / d,
                  sharded_optimizer=True, keep=lambda v: min(2, v)),
}
assert set(SCHEDULE_TRAITS) <= set(SCHEDULES) and set(ZERO_TRAITS) <= set(ZERO_LEVELS)


# ----- compute -----------------------------------------------------------------------------------
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
    comm_s = FP8_AMAX_ALLREDUCES * allreduce_s(cluster, 4.0, t, tp_inter) if t > 1 else 0.0
    return cast_s + FP8_AMAX_ALLREDUCES * cluster.kernel_launch_s + comm_s


# Backward of a fused attention kernel per forward FLOP: five GEMMs (the scores recomputed, dV,
# dP, dQ, dK) against the forward's two (FlashAttention-2 §3.2; its benchmark convention).
FLASH_BWD_FLOPS_FACTOR = 2.5


def fused_attention_time_s(cluster: Cluster, call: AttentionCall, b: float,
                           t: int) -> tuple[float, float]:
    """(forward, backward) seconds of one attention call run as a fused kernel on b sequences,
    its heads split over t ranks: the FLOPs of the tiles its mask leaves at the cluster's
    fused-attention efficiency (lower for short keys), or its q/k/v/output traffic at HBM
    bandwidth if that is longer, + a launch each."""
    flops = call.fwd_flops * b / t
    length = call.kv_len / (call.kv_len + cluster.flash_half_len)
    io_s = call.io_bytes * b / t / (cluster.hbm_bandwidth_Bps * cluster.elementwise_efficiency)
    fwd = flops / (cluster.peak_flops * cluster.flash_fwd_efficiency * length)
    bwd = FLASH_BWD_FLOPS_FACTOR * flops / (
        cluster.peak_flops * cluster.flash_bwd_efficiency * length)
    # backward reads q, k, v, output, its gradient and the logsumexp, writes dq, dk, dv: ~2x
    return (max(fwd, io_s) + cluster.kernel_launch_s,
            max(bwd, 2 * io_s) + cluster.kernel_launch_s)


def fused_calls(profile: ModelProfile, region: RegionProfile) -> tuple[AttentionCall, ...]:
    """The region's attention calls priced as fused kernels: those of a profile priced with
    flash attention (`ModelProfile.with_attention`); none otherwise."""
    if profile.attention != "flash" or region.fused is None:
        return ()
    return region.fused.calls


def _fused_times_s(cluster: Cluster, calls: tuple[AttentionCall, ...], fix: TPRegionFallback,
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


def _fallback(profile: ModelProfile, kind: str, t: int, sp: bool) -> TPRegionFallback:
    """What the tensor-parallel pass keeps whole in region `kind` at (t, sp) (see cost/profile.py
    TPRegionFallback); nothing when the profile has no analysis for t."""
    if not profile.tp_fallbacks or t <= 1:
        return NO_FALLBACK
    c = profile.tp_correction(t, sp)
    return c.region(kind) if c is not None else NO_FALLBACK


def _extra_collectives_s(cluster: Cluster, fix: TPRegionFallback, t: int, b: int, e: int,
                         tp_inter: bool) -> tuple[float, float]:
    """(forward, backward) seconds of the collectives the pass inserts in a region, per
    micro-batch."""
    fwd = bwd = 0.0
    for c in fix.collectives:
        coll = allgather_s if c.kind == "all-gather" else allreduce_s
        sec = coll(cluster, b * c.elems * e, t, tp_inter)
        if c.backward:
            bwd += sec
        else:
            fwd += sec
    return fwd, bwd


def _local_gemm_time_s(cluster: Cluster, g: Gemm, t: int, b: int, e: int,
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
    return nbytes / (cluster.hbm_bandwidth_Bps * cluster.elementwise_efficiency)


def _other_bytes(region: RegionProfile, t: int, b: int, sp: bool,
                 fix: TPRegionFallback = NO_FALLBACK) -> float:
    """Non-GEMM bytes per micro-batch on one tensor rank (replicated part split only by SP; the
    part the tensor-parallel pass keeps whole not at all)."""
    repl = region.other_bytes - region.other_split_bytes
    split = region.other_split_bytes - fix.other_split_bytes
    return b * (split / t + repl / (t if sp else 1) + fix.other_split_bytes)


# ----- communication ----------------------------------------------------------------------------
def group_spans_nodes(cluster: Cluster, *, stride: int, size: int, gpus: int) -> bool:
    """Whether a rank group {base + j*stride, j < size} leaves a node (Megatron rank order).

    Example: 8-GPU nodes, t=8, d=4: a data group has stride 8, size 4 -> spans 32 ranks -> True;
    t=2, d=4: stride 2, size 4 -> 8 ranks inside one node -> False.
    """
    if size <= 1 or gpus <= cluster.gpus_per_node:
        return False
    span = stride * size
    return not (span <= cluster.gpus_per_node and cluster.gpus_per_node % span == 0)


def _link(cluster: Cluster, inter: bool) -> tuple[float, float]:
    if inter:
        return cluster.inter_node_bandwidth_Bps, cluster.inter_node_latency_s
    return cluster.intra_node_bandwidth_Bps, cluster.intra_node_latency_s


def allreduce_s(cluster: Cluster, nbytes: float, n: int, inter: bool) -> float:
    """Ring all-reduce of nbytes over n ranks: 2(n-1)/n · bytes / bandwidth + latency."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = _link(cluster, inter)
    return lat + 2.0 * (n - 1) / n * nbytes / bw


def allgather_s(cluster: Cluster, nbytes: float, n: int, inter: bool) -> float:
    """Ring all-gather (or reduce-scatter) whose full result is nbytes: (n-1)/n · bytes / bw."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = _link(cluster, inter)
    return lat + (n - 1) / n * nbytes / bw


def alltoall_s(cluster: Cluster, nbytes: float, n: int, inter: bool) -> float:
    """All-to-all in which each of n ranks holds nbytes and keeps 1/n of them: (n-1)/n · bytes /
    bandwidth + latency (every rank sends and receives at once, pairwise exchanges)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, lat = _link(cluster, inter)
    return lat + (n - 1) / n * nbytes / bw


def p2p_s(cluster: Cluster, nbytes: float, inter: bool) -> float:
    if nbytes <= 0:
        return 0.0
    bw, lat = _link(cluster, inter)
    return lat + nbytes / bw


def padded_vocab(vocab: int, t: int) -> int:
    """Megatron pads the vocabulary to a multiple of 128·t so each shard is GEMM-friendly."""
    q = 128 * t
    return -(-vocab // q) * q


def vocab_pad_ratio(vocab: int, t: int) -> float:
    """padded_vocab / vocab: the factor vocab-parallel work grows by; 1 for a model without a
    vocabulary (vocab 0: ViT, a classification or regression head), which pads nothing."""
    return padded_vocab(vocab, t) / vocab if vocab > 0 else 1.0


# ----- per-configuration constants ---------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LoadCosts:
    """Integer ns of the per-micro-batch pipeline load (`rank_load_ns`): all a lower bound of
    the step time needs, cheaper than the whole `ConfigCosts`."""
    cfg: Config
    layer_compute_ns: int    # per layer per micro-batch: fwd + bwd + recompute (+ ZeRO-3 wait)
    layer_tp_ns: int         # per layer per micro-batch: tensor-parallel collectives
    embed_ns: int            # chunk 0 extra per micro-batch (compute + collectives)
    head_ns: int             # last chunk extra per micro-batch
    p2p_ns: int              # per rank per micro-batch (all its chunks' sends/receives)
    layer_cp_ns: int = 0     # per layer per micro-batch: context-parallel K/V exchange
    layer_ep_ns: int = 0     # per layer per micro-batch: the experts' token all-to-alls

    @property
    def layer_ns(self) -> int:
        return self.layer_compute_ns + self.layer_tp_ns + self.layer_cp_ns + self.layer_ep_ns


@dataclass(frozen=True, kw_only=True)
class ConfigCosts(LoadCosts):
    """Integer-ns / byte constants of one configuration; everything is linear in y_r, the layer
    count of pipeline rank r. The solver and `step_time_ns` use exactly these integers."""
    dp_layer_ns: int         # per layer on the rank: gradient reduction
    dp_first_ns: int         # rank 0 extra (embedding grads, tied-embedding sync)
    dp_last_ns: int          # rank p-1 extra (head grads, tied-embedding sync)
    window_layer_ns: int     # per layer: overlappable part of the last micro-batch's backward
    opt_layer_ns: int        # per layer: optimizer step
    opt_first_ns: int
    opt_last_ns: int
    mem_layer_bytes: tuple[int, ...]   # per rank r: bytes per layer held on r
    mem_fixed_bytes: tuple[int, ...]   # per rank r: bytes independent of its layer count
    capacity_bytes: int
    flops_per_step: float              # hardware FLOPs incl. recompute (papers' definition)
    model_flops_per_step: float        # without recompute (for MFU)
    mem_parts: tuple[tuple[float, ...], ...]  # per rank: (weights, grads, opt, act) per layer,
    mem_fixed_parts: tuple[tuple[float, ...], ...]  # and fixed (+ recompute, reserve), by part
    # per layer per micro-batch: the forward pass with its TP collectives (part of layer_ns;
    # the rest is backward + recompute); only cost/layout.py's schedule simulation splits them
    layer_fwd_ns: int
    # activation bytes one micro-batch saves: per layer, and in the embedding / head regions
    # (predict walks the schedule with them; mem_parts holds the solver's linear form)
    act_layer_bytes: float = 0.0
    act_embed_bytes: float = 0.0
    act_head_bytes: float = 0.0
    # split backward: what a deferred W keeps per layer / in the head, per micro-batch
    pending_layer_bytes: float = 0.0
    pending_head_bytes: float = 0.0


def _block_times_s(profile: ModelProfile, cluster: Cluster, t: int, b: int, recompute: str,
                   sp: bool, tp_inter: bool) -> tuple[float, float, float]:
    """(compute_s, tp_comm_s, forward_pass_s) of one block for one micro-batch: compute_s is
    forward + backward + recompute; forward_pass_s the forward with its TP collectives."""
    blk, e = profile.block, profile.activation_bytes_per_elem
    fix = _fallback(profile, "block", t, sp)
    k_fwd, k_bwd, fused = _fused_times_s(cluster, fused_calls(profile, blk), fix, t, b)
    fp8 = profile.gemm_precision == "fp8"
    gemm = [0.0 if i in fused else
            _local_gemm_time_s(cluster, g, 1 if i in fix.replicated_gemms else t, b, e,
                               dict(fix.whole_columns).get(i, 0), fp8)
            for i, g in enumerate(blk.gemms)]
    fwd_gemm = sum(gemm)
    attn_gemm = sum(tm for tm, g in zip(gemm, blk.gemms) if g.batch_scales)
    fwd_other = elementwise_time_s(cluster, _other_bytes(blk, t, b, sp, fix))
    fwd = fwd_gemm + k_fwd + fwd_other
    bwd = 2 * fwd_gemm + k_bwd + BWD_ELEMENTWISE_FACTOR * fwd_other
    if recompute == "full":
        rec = fwd
    elif recompute == "selective":  # the attention core again: GEMMs or the fused kernel
        rec = attn_gemm + k_fwd + elementwise_time_s(
            cluster, _attention_bytes(blk, t, fix, 2 * b))
    else:
        rec = 0.0
    # tensor-parallel collectives: the forward all-reduces (SP: all-gather + reduce-scatter,
    # the same bytes), the same in backward, once more for a full recompute; minus those of
    # row-parallel GEMMs the pass keeps replicated, plus the collectives it inserts
    ar_elems = blk.tp_allreduce_elems - fix.allreduce_elems_removed
    ar_bytes = b * ar_elems * e
    n_coll = max(1, round(ar_elems / (profile.seq_len * profile.hidden)))
    if sp:
        one = 2 * n_coll * allgather_s(cluster, ar_bytes / n_coll, t, tp_inter)
        # SP keeps only the sequence shard of each column-parallel input, so backward
        # all-gathers it again for the weight gradient (Megatron-LM 2205.05198 §4.2.2)
        extra = n_coll * allgather_s(cluster, ar_bytes / n_coll, t, tp_inter)
    else:
        one = n_coll * allreduce_s(cluster, ar_bytes / n_coll, t, tp_inter)
        extra = 0.0
    passes = 3 if recompute == "full" else 2
    tp = passes * one + extra if ar_elems else 0.0
    if cluster.tp_overlap and ar_elems:   # collective matmuls; dx reduction under dW
        tp = _overlapped_tp_s(blk.gemms, gemm, one, one + extra, passes - 1)
    x_fwd, x_bwd = _extra_collectives_s(cluster, fix, t, b, e, tp_inter)
    tp += (2 if recompute == "full" else 1) * x_fwd + x_bwd
    return fwd + bwd + rec, tp, fwd + (one if ar_elems else 0.0) + x_fwd


def _overlapped_tp_s(gemms: Sequence[Gemm], times_s: Sequence[float], fwd_comm_s: float,
                     bwd_comm_s: float, forward_passes: int) -> float:
    """The block's TP communication left exposed by the runtime's overlap (cost/overlap.py):
    forward collectives pipelined with the row-parallel ("k"-split) GEMMs, backward ones
    under the column-parallel ("n"-split) projections' weight gradients."""
    row = sum(s for g, s in zip(gemms, times_s) if g.tp_split == "k" and g.has_weight_grad)
    col = sum(s for g, s in zip(gemms, times_s) if g.tp_split == "n" and g.has_weight_grad)
    return block_tp_exposed_s(fwd_comm_s, bwd_comm_s, row, col, ROW_PIECES, forward_passes)


def _edge_times_s(profile: ModelProfile, cluster: Cluster, t: int, b: int, sp: bool,
                  tp_inter: bool) -> tuple[float, float]:
    """(embedding_s, head_s) per micro-batch incl. their collectives; never recomputed."""
    e = profile.activation_bytes_per_elem
    vpad_ratio = vocab_pad_ratio(profile.vocab, t)
    emb, head = profile.embedding, profile.head
    efix, hfix = _fallback(profile, "embedding", t, sp), _fallback(profile, "head", t, sp)
    emb_s = 3 * elementwise_time_s(cluster, _other_bytes(emb, t, b, sp, efix))
    emb_ar = b * (emb.tp_allreduce_elems - efix.allreduce_elems_removed) * e
    emb_s += (allgather_s if sp else allreduce_s)(cluster, emb_ar, t, tp_inter)
    emb_s += sum(_extra_collectives_s(cluster, efix, t, b, e, tp_inter))
    k_fwd, k_bwd, fused = _fused_times_s(cluster, fused_calls(profile, head), hfix, t, b)
    head_s = k_fwd + k_bwd
    for i, g in enumerate(head.gemms):
        if i in fused:
            continue
        if i in hfix.replicated_gemms:  # kept whole by the tensor-parallel pass: no padding
            head_s += 3 * _local_gemm_time_s(cluster, g, 1, b, e)
            continue
        n = g.n * vpad_ratio if g.tp_split == "n" else g.n
        g2 = Gemm(name=g.name, batch=g.batch, m=g.m, n=round(n), k=g.k, tp_split=g.tp_split,
                  batch_scales=g.batch_scales)
        head_s += 3 * _local_gemm_time_s(cluster, g2, t, b, e)
    whole = b * hfix.other_split_bytes
    head_s += 3 * elementwise_time_s(
        cluster, (_other_bytes(head, t, b, sp, hfix) - whole) * vpad_ratio + whole)
    # column-parallel head: identity forward, all-reduce of the input gradient in backward
    # (SP: all-gather forward + reduce-scatter backward, the same bytes)
    in_bytes = b * (head.input_bytes - hfix.allreduce_elems_removed * e)
    head_s += (2 * allgather_s(cluster, in_bytes, t, tp_inter) if sp
               else allreduce_s(cluster, in_bytes, t, tp_inter))
    head_s += sum(_extra_collectives_s(cluster, hfix, t, b, e, tp_inter))
    return emb_s, head_s


def shard_params_elems(profile: ModelProfile, t: int,
                       sp: bool = False) -> tuple[float, float, float]:
    """Parameters on one tensor rank: (per block, embedding on rank 0, head on rank p-1); the
    split ones the tensor-parallel pass keeps whole at (t, sp) count whole."""
    vpad = vocab_pad_ratio(profile.vocab, t)
    blk, emb, head = profile.block, profile.embedding, profile.head
    bf, ef, hf = (_fallback(profile, k, t, sp).params_elems for k in ("block", "embedding", "head"))
    block = (blk.params_split_elems - bf) / t + blk.params_replicated_elems + bf
    table = (emb.params_split_elems - ef) * vpad / t + ef
    embp = table + emb.params_replicated_elems
    headp = ((head.params_split_elems - hf) * vpad / t
             + head.params_replicated_elems + hf)
    if profile.tied_embeddings:  # the last stage keeps a copy of the word embedding
        headp += table
    return block, embp, headp


def expert_params_elems(profile: ModelProfile, t: int, ep: int = 1) -> float:
    """Expert parameters of one block on one rank: the experts' weights split by t (expert
    tensor parallelism) and spread over ep ranks, E/ep experts each (part of
    `shard_params_elems`' block term, which counts them at ep = 1)."""
    return profile.block.expert_params_elems / (t * ep)


def _tied_table_elems(profile: ModelProfile, t: int, sp: bool) -> float:
    """Elements of the (tied) word embedding on one tensor rank, as the gradient sync sees it."""
    ef = _fallback(profile, "embedding", t, sp).params_elems
    return (profile.embedding.params_split_elems - ef) / t + ef


def _attention_bytes(blk: RegionProfile, t: int, fix: TPRegionFallback, b: float = 1) -> float:
    """Attention activations (the s² tensors) of b sequences on one tensor rank."""
    return b * (blk.act_attention_bytes - fix.act_attention_bytes) / t + b * fix.act_attention_bytes


def _gemm_output_bytes(profile: ModelProfile, region: RegionProfile, t: int, b: int) -> float:
    """Bytes of the outputs of the region's weight GEMMs for b sequences: the gradients at
    those outputs are what a deferred W keeps (split_backward's recorded gradients)."""
    total = 0.0
    for g in region.gemms:
        if g.has_weight_grad:
            total += g.batch * g.m * g.n / (t if g.tp_split == "n" else 1)
    return b * total * profile.activation_bytes_per_elem


def pending_w_layer_bytes(profile: ModelProfile, t: int, b: int) -> float:
    """Per layer per micro-batch, what a deferred W keeps besides the layer's saved
    activations (held until the W, counted by `inflight`): the recorded output gradients of
    its weight GEMMs. Recomputed activations are not kept from B to W: a checkpointed region
    recomputes again in the W (torch.utils.checkpoint unpacks each recomputed tensor once)."""
    return _gemm_output_bytes(profile, profile.block, t, b)


def layer_activation_bytes(profile: ModelProfile, t: int, b: int, recompute: str,
                           sp: bool) -> float:
    """Activations kept per layer per micro-batch (2205.05198 §4 per recompute mode)."""
    blk = profile.block
    if recompute == "full":
        return b * blk.input_bytes / (t if sp else 1)
    fix = _fallback(profile, "block", t, sp)
    repl = blk.act_replicated_bytes / (t if sp else 1)
    kept = (blk.act_split_bytes - fix.act_split_bytes) / t + repl + fix.act_split_bytes
    if recompute == "none":
        kept += _attention_bytes(blk, t, fix)
    return b * kept


def rank_profile(profile: ModelProfile, cluster: Cluster, cfg: Config) -> ModelProfile:
    """The profile as one rank of cfg sees it: priced with the cluster's attention kernel and
    restated for one of cfg.c context ranks (cost/context.py; the profile itself for c = 1)."""
    return context_rank_profile(profile.for_cluster(cluster), cfg.c, cfg.cp_attention)


def _rank_profile_memo(profile: ModelProfile, cluster: Cluster, cfg: Config,
                       memo: dict) -> ModelProfile:
    """`rank_profile`, cached in `memo` (one solve prices one profile on one cluster)."""
    key = ("rank_profile", cluster.attention, cfg.c, cfg.cp_attention)
    if key not in memo:
        memo[key] = rank_profile(profile, cluster, cfg)
    return memo[key]


def context_comm_s(profile: ModelProfile, cluster: Cluster, cfg: Config) -> tuple[float, float]:
    """(forward, forward + backward + recompute) seconds per layer per micro-batch of the
    context-parallel K/V exchange, on a profile restated for cfg.c (`rank_profile`).

    cfg.cp_attention "all-gather": Llama 3's all-gather of K and V along the sequence before
    attention, exposed on the critical path (2407.21783 §3.3.2), and in backward the
    reduce-scatter of their gradients (the same bytes), again in forward under full recompute;
    ring all-gather over the c context ranks on their link (context groups: stride t, inside a
    node when t·c <= GPUs per node). "ring": `ring_attention_s`, the blocks' transfers exposed
    only where they outlast the attention step they overlap, plus the ring's own overheads.
    Each tensor rank moves its kv heads: 1/t of them, or one when t exceeds kv_heads (the
    tensor-parallel pass replicates kv heads then)."""
    c, t = cfg.c, cfg.t
    elems = profile.block.cp_gather_elems
    if c <= 1 or not elems:
        return 0.0, 0.0
    local = elems / min(t, max(1, profile.kv_heads))
    cp_inter = group_spans_nodes(cluster, stride=t, size=c, gpus=cfg.gpus)
    kv_bytes = cfg.micro_batch_size * local * profile.activation_bytes_per_elem
    if cfg.cp_attention == "ring":
        fwd, bwd = ring_attention_s(profile, cluster, cfg, kv_bytes, cp_inter)
        return fwd, fwd + bwd + (fwd if cfg.recompute == "full" else 0.0)
    if cfg.cp_attention == "all-to-all":
        fwd, bwd = alltoall_attention_s(profile, cluster, cfg, cp_inter)
        return fwd, fwd + bwd + (fwd if cfg.recompute == "full" else 0.0)
    one = allgather_s(cluster, kv_bytes, c, cp_inter)
    return one, (3 if cfg.recompute == "full" else 2) * one


def ring_exposed_s(hop_s: float, step_s: float, steps: int) -> float:
    """Exposed seconds of `steps` ring transfers of hop_s each, every one started before and
    overlapped with an attention step of step_s: only what outlasts the step shows."""
    return steps * max(0.0, hop_s - step_s)


def ring_attention_s(profile: ModelProfile, cluster: Cluster, cfg: Config, kv_bytes: float,
                     inter: bool) -> tuple[float, float]:
    """(forward, backward) seconds per layer per micro-batch that ring attention adds to the
    rank's attention (autopar/runtime/ring_attention.py), on the rank's profile; kv_bytes: the
    whole sequence's K and V on one tensor rank, so one context rank's block is kv_bytes / c.

    Transfers: forward, c − 1 hops of a block (the first step computes on the rank's own block
    while the next one travels); backward, c − 1 steps each sending a block and a dK/dV
    accumulator of the same size (2 blocks a hop), then the last accumulator's hop home, which
    nothing overlaps. A ring hop crosses nodes when the context group does (its slowest link).
    Each hop overlaps one step's attention: the rank's attention (forward / backward,
    `attention_core_s`) / c, the balanced causal split's equal steps.
    Overheads (not communication, charged here because only the ring has them): each step is a
    kernel over kv_len / c keys (the fused kernel's efficiency falls for short keys:
    Cluster.flash_half_len), c launches where the all-gather's attention has one, and c − 1
    online-softmax merges (read the running output and the step's, write the merged one, fp32,
    and their log-sum-exps) in forward, c − 1 dK/dV accumulations (fp32) in backward."""
    c = cfg.c
    fwd_s, bwd_s = attention_core_s(profile, cluster, cfg)
    block = kv_bytes / c
    fwd = ring_exposed_s(p2p_s(cluster, block, inter), fwd_s / c, c - 1)
    bwd = (ring_exposed_s(p2p_s(cluster, 2 * block, inter), bwd_s / c, c - 1)
           + p2p_s(cluster, block, inter))
    step_f, step_b = attention_core_s(profile, cluster, cfg, keys_over=c)
    # fp32 (4 B), read twice and written once: the merged outputs with their lse, the dK/dV
    merges = 3 * 4 * cfg.micro_batch_size * _ring_output_elems(profile, cfg.t)
    accum = 3 * 4 * kv_bytes / profile.activation_bytes_per_elem / c
    fwd += c * step_f - fwd_s + (c - 1) * elementwise_time_s(cluster, merges)
    bwd += c * step_b - bwd_s + (c - 1) * elementwise_time_s(cluster, accum)
    return fwd, bwd


def alltoall_heads_rule(heads: int, kv_heads: int, t: int, c: int) -> str | None:
    """Why all-to-all context attention cannot split `heads` query heads over c context ranks
    under t tensor ranks, or None: each tensor rank's heads (heads / t) go heads/(t·c) to each
    context rank, so t·c must divide heads. kv heads need not: with fewer per tensor rank than
    c (or not a multiple) they are repeated up to the query heads before the exchange."""
    if heads % (t * c):
        return (f"all-to-all attention gives each of the c={c} context ranks heads/c of each "
                f"tensor rank's {heads}/{t} heads; t·c = {t * c} does not divide the {heads} "
                f"query heads")
    return None


def alltoall_exchange_elems(profile: ModelProfile, t: int) -> tuple[float, float, float]:
    """(q, k + v, output) elements one context rank holds of its tokens per sequence on one
    tensor rank: what the all-to-alls around its attention exchange (heads over t; kv heads
    over t, or one when t exceeds them, as the tensor-parallel pass replicates them; repeated
    up to the query heads when they do not divide by c: autopar/runtime/ulysses.py)."""
    c = profile.context
    q = kv = out = 0.0
    for x in (profile.block.fused.calls if profile.block.fused is not None else ()):
        heads = x.heads / min(t, max(1, x.heads))
        kv_heads = max(1, x.kv_heads // t)
        if kv_heads % c:
            kv_heads = heads
        q += heads * x.q_len * x.head_dim
        kv += kv_heads * x.q_len * (x.head_dim + x.v_head_dim)
        out += heads * x.q_len * x.v_head_dim
    return q, kv, out


def alltoall_attention_s(profile: ModelProfile, cluster: Cluster, cfg: Config,
                         inter: bool) -> tuple[float, float]:
    """(forward, backward) seconds per layer per micro-batch of all-to-all context attention
    (DeepSpeed-Ulysses, 2309.14509 §3; autopar/runtime/ulysses.py) on the rank's profile.

    Forward: q, k and v traded tokens-for-heads (three all-to-alls over the c context ranks)
    and the output traded back (one); backward the four conjugates (dq, dk, dv, d-output), the
    same bytes. Each all-to-all is exposed (nothing overlaps it: attention needs its result)
    and each rank keeps 1/c of what it holds (`alltoall_s`), so its volume does not grow with c.
    Plus the reorder to global token order and back (the runtime's index_select: one read and
    one write of q, k, v after the exchange and of the output before it, forward; of their
    gradients, backward), charged at elementwise bandwidth. The attention kernel itself is the
    rank profile's: heads/c heads over the whole sequence run the same causal tiles as the
    local queries against every key."""
    q, kv, out = alltoall_exchange_elems(profile, cfg.t)
    e, b, c = profile.activation_bytes_per_elem, cfg.micro_batch_size, cfg.c
    moved = sum(alltoall_s(cluster, b * x * e, c, inter) for x in (q, kv, out))
    if kv:       # k and v are two all-to-alls: the second one's latency
        moved += _link(cluster, inter)[1]
    reorder = elementwise_time_s(cluster, 2 * b * (q + kv + out) * e)
    one = moved + reorder
    return one, one


def _ring_output_elems(profile: ModelProfile, t: int) -> float:
    """Elements of a block's attention outputs and their log-sum-exps per sequence on one
    tensor rank (heads split over t): what each online-softmax merge reads and writes."""
    heads_t = min(t, max(1, profile.heads))
    blk = profile.block
    if blk.fused is not None and blk.fused.calls:
        return sum(x.heads * x.q_len * (x.v_head_dim + 1) for x in blk.fused.calls) / heads_t
    whole = profile.seq_len * profile.context
    return sum(g.batch * g.m * (g.n + 1) for g in blk.gemms
               if g.batch_scales and g.k == whole) / heads_t


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
    fix = _fallback(profile, "block", t, sp)
    calls = tuple(dataclasses.replace(call, kv_len=max(1, call.kv_len // keys_over))
                  for call in fused_calls(profile, blk))
    k_fwd, k_bwd, fused = _fused_times_s(cluster, calls, fix, t, b)
    whole = profile.seq_len * profile.context
    written = sum(_local_gemm_time_s(cluster, _keys_cut(g, whole, keys_over),
                                     1 if i in fix.replicated_gemms else t, b, e,
                                     dict(fix.whole_columns).get(i, 0))
                  for i, g in enumerate(blk.gemms) if g.batch_scales and i not in fused)
    return k_fwd + written, k_bwd + 2 * written


def expert_comm_s(profile: ModelProfile, cluster: Cluster, cfg: Config) -> tuple[float, float]:
    """(forward, forward + backward + recompute) seconds per layer per micro-batch of the
    experts' token exchange under expert parallelism, on a profile restated for cfg.c.

    Per MoE layer the dispatch all-to-all sends each token's hidden vector to the ranks of its
    k experts and the combine brings the results back: 2 in forward, their reverses in
    backward, 2 more under full recompute (Megatron-Core's alltoall token dispatcher, exposed).
    Each rank exchanges micro-batch · its tokens · k · hidden elements
    (`RegionProfile.expert_dispatch_elems`; every tensor rank of a replicated token stream
    sends them for its expert shards), (ep−1)/ep of them leaving it, over the expert group:
    ep ranks at stride t (groups.expert_groups), inside a node when t·ep <= GPUs per node."""
    elems = profile.block.expert_dispatch_elems
    if cfg.ep <= 1 or not elems:
        return 0.0, 0.0
    inter = group_spans_nodes(cluster, stride=cfg.t, size=cfg.ep, gpus=cfg.gpus)
    one = alltoall_s(cluster, cfg.micro_batch_size * elems * profile.activation_bytes_per_elem,
                     cfg.ep, inter) * alltoall_factor(profile, cfg.ep)   # the busiest rank
    return 2 * one, (6 if cfg.recompute == "full" else 4) * one


def _block_times_memo(profile: ModelProfile, cluster: Cluster, cfg: Config,
                      memo: dict) -> tuple[float, float, float]:
    """`_block_times_s` of cfg's (t, b, recompute, sp, TP link, c), cached in `memo`;
    `profile` is the rank's (`rank_profile`)."""
    sp = cfg.sequence_parallel and cfg.t > 1
    tp_inter = group_spans_nodes(cluster, stride=1, size=cfg.t, gpus=cfg.gpus)
    key = ("layer", cfg.t, cfg.micro_batch_size, cfg.recompute, sp, tp_inter, cfg.c,
           cfg.cp_attention)
    if key not in memo:
        memo[key] = _block_times_s(profile, cluster, cfg.t, cfg.micro_batch_size,
                                   cfg.recompute, sp, tp_inter)
    return memo[key]


def _context_comm_memo(profile: ModelProfile, cluster: Cluster, cfg: Config,
                       memo: dict) -> tuple[float, float]:
    """`context_comm_s` of cfg's (t, b, sp, c, method, recompute, GPUs), cached in `memo` (the
    ring's price runs the attention pricing twice; load and memory both ask for it);
    `profile` is the rank's (`rank_profile`)."""
    key = ("cp", cluster.attention, cfg.t, cfg.micro_batch_size,
           cfg.sequence_parallel and cfg.t > 1, cfg.c, cfg.cp_attention, cfg.recompute, cfg.gpus)
    if key not in memo:
        memo[key] = context_comm_s(profile, cluster, cfg)
    return memo[key]


def load_parts_s(profile: ModelProfile, cluster: Cluster, cfg: Config,
                 memo: dict | None = None
                 ) -> tuple[float, float, float, float, float, float, float]:
    """(layer compute, layer TP comm, embedding, head, rank p2p, layer context-parallel comm,
    layer expert all-to-alls) seconds per micro-batch, on one context rank's share of the
    sequences.

    `memo` (optional, any dict) caches the parts shared by many configurations within one
    solve; the result does not depend on it.
    """
    memo = {} if memo is None else memo
    profile = _rank_profile_memo(profile, cluster, cfg, memo)
    t, p, d, v, b = cfg.t, cfg.p, cfg.d, cfg.v, cfg.micro_batch_size
    sp = cfg.sequence_parallel and t > 1
    tp_inter = group_spans_nodes(cluster, stride=1, size=t, gpus=cfg.gpus)
    pp_inter = group_spans_nodes(cluster, stride=t * cfg.c * d, size=p, gpus=cfg.gpus)
    comp_s, tp_s, _ = _block_times_memo(profile, cluster, cfg, memo)
    cp_s = _context_comm_memo(profile, cluster, cfg, memo)[1]
    ep_s = expert_comm_s(profile, cluster, cfg)[1]
    comp_s += expert_gemm_extra_s(profile, cfg.ep, cfg.recompute, lambda g: _local_gemm_time_s(
        cluster, g, t, b, profile.activation_bytes_per_elem))   # the most loaded expert rank
    key = ("edge", t, b, sp, tp_inter, cfg.c, cfg.cp_attention)
    if key not in memo:
        memo[key] = _edge_times_s(profile, cluster, t, b, sp, tp_inter)
    emb_s, head_s = memo[key]
    # pipeline p2p: the activation (b·s·h) leaves each chunk forward and its gradient comes
    # back; scatter/gather: each tensor rank sends 1/t and the receiver all-gathers in-node
    p2p_total = 0.0
    if p > 1:
        act = b * profile.block.input_bytes
        one = p2p_s(cluster, act / t, pp_inter)
        if not sp:
            one += allgather_s(cluster, act, t, tp_inter)
        p2p_total = 2 * v * one
        if cfg.microbatch_group is not None and cfg.microbatch_group > p:
            p2p_total = _grouped_p2p_s(one, p, v, cfg.microbatch_group,
                                       (comp_s + tp_s + cp_s + ep_s) * profile.num_layers
                                       / (p * v))
    return comp_s, tp_s, emb_s, head_s, p2p_total, cp_s, ep_s


def _grouped_p2p_s(one_s: float, p: int, v: int, group: int, chunk_s: float) -> float:
    """Exposed p2p per micro-batch of the interleaved order with groups of N > p.

    With N = p (Megatron's order) a chunk's first micro-batch of a group comes back round the
    ring just when the rank needs it: each of the 2·v·m/N chunk visits per step waits for the
    ring's p hops, 2·v·one per micro-batch — what the p2p term charges for every schedule.
    A group of N > p leaves the rank N − p more micro-batches of the chunk (chunk_s each, its
    forward + backward) to compute before it needs the first one back, which hide as much of
    the ring's latency: max(0, p·one − (N − p)·chunk_s) per visit.
    """
    return 2 * v * max(0.0, p * one_s - (group - p) * chunk_s) / group


def _ns(seconds: float) -> int:
    return int(round(seconds * NS))


def load_costs(profile: ModelProfile, cluster: Cluster, cfg: Config,
               memo: dict | None = None) -> LoadCosts:
    """`load_parts_s` rounded to integer ns: the exact integers the solver and predict use."""
    comp, tp, emb, head, p2p, cp, ep = (_ns(x) for x in load_parts_s(profile, cluster, cfg,
                                                                       memo))
    return LoadCosts(cfg=cfg, layer_compute_ns=comp, layer_tp_ns=tp, embed_ns=emb, head_ns=head,
                     p2p_ns=p2p, layer_cp_ns=cp, layer_ep_ns=ep)


def config_costs(profile: ModelProfile, cluster: Cluster, cfg: Config,
                 memo: dict | None = None) -> ConfigCosts:
    memo = {} if memo is None else memo
    lc = load_costs(profile, cluster, cfg, memo)
    profile = _rank_profile_memo(profile, cluster, cfg, memo)
    t, d = cfg.t, cfg.replicas   # the weights' replicas: gradients and ZeRO shards over c·d
    sp = cfg.sequence_parallel and t > 1
    zt = ZERO_TRAITS[cfg.zero]
    fwd_ns = min(_ns(_block_times_memo(profile, cluster, cfg, memo)[2]
                     + _context_comm_memo(profile, cluster, cfg, memo)[0]
                     + expert_comm_s(profile, cluster, cfg)[0]), lc.layer_ns)
    comp_s = lc.layer_compute_ns / NS
    block_p, emb_p, head_p = shard_params_elems(profile, t, sp)
    # expert parallelism: the rank holds E/ep of the experts (block_e), the dense rest whole
    block_e = expert_params_elems(profile, t, cfg.ep) if cfg.ep > 1 else 0.0
    if cfg.ep > 1:
        block_p -= expert_params_elems(profile, t)

    dp_layer, window_layer, dp_first, dp_last = _dp_terms_s(
        profile, cluster, cfg, memo, block_p, emb_p, head_p, comp_s, block_e)

    own = 1.0 / d if zt.sharded_optimizer else 1.0
    own_e = cfg.ep / d if zt.sharded_optimizer else 1.0   # experts sharded over c·d/ep
    adam = lambda params: params * own * ADAM_BYTES_PER_PARAM / (  # noqa: E731
        cluster.hbm_bandwidth_Bps * cluster.elementwise_efficiency)

    mem_layer, mem_fixed, parts, fparts, (act_layer, act_emb, act_head, pend_layer,
                                          pend_head) = \
        _memory_coefficients(profile, cluster, cfg, sp, block_p, emb_p, head_p, memo, block_e)

    flops_fwd_seq, rec_seq = _flops_per_seq(profile, t, cfg.recompute, memo, cfg.c)
    # a rank's share of a sequence is 1/c of its FLOPs (the balanced split): the sequence's are c×
    B = cfg.global_batch_size * cfg.c

    ns = _ns
    return ConfigCosts(
        cfg=cfg, layer_compute_ns=lc.layer_compute_ns, layer_tp_ns=lc.layer_tp_ns,
        embed_ns=lc.embed_ns, head_ns=lc.head_ns, p2p_ns=lc.p2p_ns, layer_cp_ns=lc.layer_cp_ns,
        layer_ep_ns=lc.layer_ep_ns,
        dp_layer_ns=ns(dp_layer), dp_first_ns=ns(dp_first), dp_last_ns=ns(dp_last),
        window_layer_ns=ns(window_layer),
        opt_layer_ns=ns(adam(block_p) + adam(block_e * own_e / own)),
        opt_first_ns=ns(adam(emb_p)), opt_last_ns=ns(adam(head_p)),
        mem_layer_bytes=mem_layer, mem_fixed_bytes=mem_fixed,
        capacity_bytes=int(cluster.usable_memory_bytes),
        flops_per_step=B * (3 * flops_fwd_seq + rec_seq),
        model_flops_per_step=B * 3 * flops_fwd_seq,
        mem_parts=parts, mem_fixed_parts=fparts, layer_fwd_ns=fwd_ns,
        act_layer_bytes=act_layer, act_embed_bytes=act_emb, act_head_bytes=act_head,
        pending_layer_bytes=pend_layer, pending_head_bytes=pend_head)


def _dp_terms_s(profile: ModelProfile, cluster: Cluster, cfg: Config, memo: dict | None,
                block_p: float, emb_p: float, head_p: float, comp_s: float,
                block_e: float = 0.0) -> tuple[float, float, float, float]:
    """Data-parallel seconds per step: (per layer of the rank, hidden per layer, rank 0 extra,
    rank p-1 extra). Exposed per layer = first - second (see the module docstring).

    Per-layer terms are bandwidth only; each rank's collective latency is counted once in the
    edge terms (bucketed, pipelined collectives). block_e: expert parameters of a block on the
    rank under expert parallelism (not in block_p), reduced / gathered over the c·d/ep ranks
    holding the same experts (stride t·ep).
    """
    # the gradient group: the c·d ranks holding the same weights (context innermost of data,
    # autopar/runtime/groups.py gradient_groups: stride t, c·d ranks)
    t, p, d, v, m = cfg.t, cfg.p, cfg.replicas, cfg.v, cfg.num_microbatches
    sched, zt = SCHEDULE_TRAITS[cfg.schedule], ZERO_TRAITS[cfg.zero]
    dp_inter = group_spans_nodes(cluster, stride=t, size=d, gpus=cfg.gpus)
    pp_inter = group_spans_nodes(cluster, stride=t * d, size=p, gpus=cfg.gpus)
    tied_sync = 0.0
    if profile.tied_embeddings and p > 1:  # first and last stage sum the shared embedding grad
        tied_sync = allreduce_s(cluster, GRAD_REDUCE_BYTES * _tied_table_elems(
            profile, t, cfg.sequence_parallel and t > 1), 2, pp_inter)
    if d <= 1:
        return 0.0, 0.0, tied_sync, tied_sync
    lat = _link(cluster, dp_inter)[1]
    gather = lambda n: allgather_s(cluster, 2 * n, d, dp_inter)  # noqa: E731 16-bit weights
    if zt.sharded_optimizer:  # reduce-scatter of the gradients
        reduce = lambda n: allgather_s(cluster, GRAD_REDUCE_BYTES * n, d, dp_inter)  # noqa
    else:
        reduce = lambda n: allreduce_s(cluster, GRAD_REDUCE_BYTES * n, d, dp_inter)  # noqa
    f8 = gathered_bytes_ratio(profile, t, block_p, zt.sharded_weights)  # FP8 gathers: 1 B
    G, R = gather(f8 * block_p) - lat, reduce(block_p) - lat
    if block_e and d // cfg.ep > 1:
        de, inter_e = d // cfg.ep, group_spans_nodes(cluster, stride=t * cfg.ep, size=d // cfg.ep,
                                                     gpus=cfg.gpus)
        lat_e = _link(cluster, inter_e)[1]
        G += allgather_s(cluster, 2 * block_e, de, inter_e) - lat_e
        R += (allgather_s if zt.sharded_optimizer else allreduce_s)(
            cluster, GRAD_REDUCE_BYTES * block_e, de, inter_e) - lat_e
    comp, tp, fwd = _block_times_memo(profile, cluster, cfg, memo if memo is not None else {})
    if zt.sharded_weights:
        return _sharded_dp_terms_s(cfg, memo, G, R, fwd, comp + tp - fwd, lat,
                                   gather, reduce, emb_p, head_p, tied_sync)
    if zt.sharded_optimizer:  # reduce-scatter grads + all-gather 16-bit weights
        edge = lambda n: reduce(n) + gather(n) - lat  # noqa: E731
    else:
        edge = reduce
    dp_first = edge(emb_p) + tied_sync
    dp_last = edge(head_p) + tied_sync + (lat if p > 1 else 0.0)
    if not sched.chunk_major:
        dp_layer = R + (G if zt.sharded_optimizer else 0.0)
        return dp_layer, sched.dp_overlap * comp_s * (2.0 / 3.0), dp_first, dp_last
    # chunk-major: a chunk's m backwards (W_b) hide the next chunk's reduction
    w_b = m * (comp + tp - fwd)
    after_step = G if zt.sharded_optimizer else 0.0  # ZeRO-1 weight gather, exposed
    dp_layer = R + after_step
    exposed = R / v + (v - 1) / v * max(0.0, R - w_b) + after_step
    return dp_layer, dp_layer - exposed, dp_first, dp_last


def weight_gather_stats(cfg: Config, memo: dict | None = None) -> GatherStats:
    """The weight-gather plan of a sharded-weight configuration (zero 2 / 3) on its busiest
    rank: autopar.weight_gathers on the schedule's compute order, elementwise the most of
    pipeline ranks 0 and p − 1 (the longest and shortest warm-up)."""
    key = ("gathers", cfg.schedule, cfg.p, cfg.v, cfg.num_microbatches, cfg.microbatch_group,
           ZERO_TRAITS[cfg.zero].keep(cfg.v))
    if memo is not None and key in memo:
        return memo[key]
    orders = compute_order(cfg.schedule, cfg.p, cfg.v, cfg.num_microbatches,
                           group=cfg.microbatch_group, ranks=sorted({0, cfg.p - 1}))
    stats = [gather_stats(o, keep=key[-1]) for o in orders]
    worst = max(stats, key=lambda st: (st.gathers + st.reduce_scatters, st.peak_pending))
    out = GatherStats(gather_leads=worst.gather_leads, reduce_leads=worst.reduce_leads,
                      peak_gathered=max(st.peak_gathered for st in stats),
                      peak_pending=max(st.peak_pending for st in stats))
    if memo is not None:
        memo[key] = out
    return out


def _sharded_dp_terms_s(cfg: Config, memo: dict | None, G: float, R: float, fwd: float,
                        bwd: float, lat: float, gather: Callable, reduce: Callable,
                        emb_p: float, head_p: float, tied_sync: float
                        ) -> tuple[float, float, float, float]:
    """Data-parallel seconds of sharded weights (zero 2 / 3), per layer of the rank and for
    the edge ranks, from the schedule's own weight-gather plan (weight_gather_stats).

    A rank gathers its chunks n_g times and reduce-scatters them n_r times per step; a chunk
    holds 1/v of its layers, so per layer the traffic is (n_g·G + n_r·R)/v. Each gather is
    prefetched `lead` computes before its chunk is needed, and hides under them: exposed
    max(0, G − lead·forward) per layer (0 computes: exposed whole); each reduce-scatter runs
    under the computes before the next one starts: max(0, R − lead·backward), the step's last
    one exposed whole. The embedding and the head are gathered and reduced with the first /
    last chunk, not hidden (as ZeRO-1's edge traffic)."""
    st = weight_gather_stats(cfg, memo)
    v, p = cfg.v, cfg.p
    dp_layer = (st.gathers * G + st.reduce_scatters * R) / v
    exposed = (sum(max(0.0, G - lead * fwd) for lead in st.gather_leads)
               + sum(max(0.0, R - lead * bwd) for lead in st.reduce_leads)) / v
    edge = lambda n: (st.gathers * (gather(n) - lat) + st.reduce_scatters * (reduce(n) - lat)  # noqa
                      ) / v + lat
    dp_first = edge(emb_p) + tied_sync
    dp_last = edge(head_p) + tied_sync + (lat if p > 1 else 0.0)
    return dp_layer, dp_layer - exposed, dp_first, dp_last


def _flops_per_seq(profile: ModelProfile, t: int, recompute: str,
                   memo: dict | None, c: int = 1) -> tuple[float, float]:
    """(model forward FLOPs incl. the padded vocabulary, recompute FLOPs) per sequence (per
    context rank's share of one, on a profile restated for c)."""
    key = ("flops", t, recompute, c)
    if memo is not None and key in memo:
        return memo[key]
    fwd = profile.fwd_flops_per_seq()
    fwd += profile.head.fwd_flops * (vocab_pad_ratio(profile.vocab, t) - 1)
    rec = {"none": 0.0, "full": profile.num_layers * profile.block.fwd_flops,
           "selective": profile.num_layers * sum(
               g.fwd_flops for g in profile.block.gemms if g.batch_scales)}[recompute]
    if memo is not None:
        memo[key] = (fwd, rec)
    return fwd, rec


def state_bytes_lower_bound(profile: ModelProfile, cfg: Config) -> float:
    """Weights + grads + optimizer bytes per GPU if the layers were spread perfectly evenly
    (embedding and head included): no partition of this configuration needs less."""
    zt = ZERO_TRAITS[cfg.zero]
    per_param = lambda n: zt.weight_bytes(n) + zt.grad_bytes(n) + zt.optimizer_bytes(n)  # noqa
    n = cfg.replicas
    block_p, emb_p, head_p = shard_params_elems(profile, cfg.t, cfg.sequence_parallel and cfg.t > 1)
    experts = 0.0
    if cfg.ep > 1:   # the experts over ep ranks, their ZeRO shards over c·d/ep
        block_p -= expert_params_elems(profile, cfg.t)
        experts = per_param(n // cfg.ep) * expert_params_elems(profile, cfg.t, cfg.ep)
    return (per_param(n) * (block_p * profile.num_layers + emb_p + head_p)
            + experts * profile.num_layers) / cfg.p


def activation_bytes_lower_bound(profile: ModelProfile, cfg: Config,
                                 memo: dict | None = None) -> float:
    """Block activations per GPU that no partition avoids: the busiest rank holds at least the
    average of y_r · a_r, and that is >= (l/p) · min_r a_r (a_r = activation bytes per layer on
    rank r: kept bytes per micro-batch × its in-flight micro-batches per chunk). `memo`
    (optional, any dict) caches the context rank's profile (one per c and method)."""
    sp = cfg.sequence_parallel and cfg.t > 1
    if memo is None:
        profile = context_rank_profile(profile, cfg.c, cfg.cp_attention)
    else:
        key = ("cp_profile", cfg.c, cfg.cp_attention)
        if key not in memo:
            memo[key] = context_rank_profile(profile, cfg.c, cfg.cp_attention)
        profile = memo[key]
    act = layer_activation_bytes(profile, cfg.t, cfg.micro_batch_size, cfg.recompute, sp)
    # every schedule's in-flight count is non-increasing in r (rank 0 warms up longest)
    least = min(inflight(cfg, r) for r in (0, cfg.p - 1))
    return act * least / cfg.v * profile.num_layers / cfg.p


def _memory_coefficients(profile, cluster, cfg, sp, block_p, emb_p, head_p, memo=None,
                         block_e=0.0):
    """Per rank: bytes per layer held and fixed bytes (rounded up), with their breakdown;
    block_e: the rank's expert parameters under expert parallelism (not in block_p), their
    ZeRO shards over the c·d/ep ranks holding the same experts."""
    t, p, d, v, b = cfg.t, cfg.p, cfg.replicas, cfg.v, cfg.micro_batch_size
    zt = ZERO_TRAITS[cfg.zero]
    wb, gb, ob = zt.weight_bytes(d), zt.grad_bytes(d), zt.optimizer_bytes(d)
    de = d // cfg.ep
    wbe, gbe, obe = zt.weight_bytes(de), zt.grad_bytes(de), zt.optimizer_bytes(de)
    act_layer = layer_activation_bytes(profile, t, b, cfg.recompute, sp)
    full_layer = layer_activation_bytes(profile, t, b, "none", sp)
    # working memory while one layer runs its backward: its full activations when recomputed
    # (full) or its attention tensors (selective)
    work = {"full": full_layer, "selective": _attention_bytes(
        profile.block, t, _fallback(profile, "block", t, sp), b), "none": 0.0}[cfg.recompute]
    # Sharded weights (zero 2 / 3): the gathered working set of the weight-gather plan, per
    # layer of the rank: its most chunks gathered at once in 16-bit (2·gathered/v B per
    # parameter), and the fp32 gradient accumulators of the chunks holding unreduced gradients
    # plus one fp32 reduce-scatter buffer ((4·pending + 4)/v: the runtime reduces in fp32, as
    # FSDP2's reduce_dtype=fp32); the embedding / head are gathered whole (2 B weights + 4 B
    # grads). At d = 1 the runtime still gathers (copies) and releases each chunk.
    chunk_w = chunk_g = edge_w = edge_g = 0.0
    if zt.sharded_weights:
        st = weight_gather_stats(cfg, memo)
        f8 = gathered_bytes_ratio(profile, t, block_p, True)   # FP8 gathers: 1 B/elem
        chunk_w, chunk_g = 2.0 * f8 * st.peak_gathered / v, 4.0 * (st.peak_pending + 1) / v
        edge_w, edge_g = 2.0, 4.0
    efix, hfix = _fallback(profile, "embedding", t, sp), _fallback(profile, "head", t, sp)
    emb_act = b * ((profile.embedding.act_split_bytes - efix.act_split_bytes) / t
                   + profile.embedding.act_replicated_bytes / (t if sp else 1)
                   + efix.act_split_bytes)
    vpad_ratio = vocab_pad_ratio(profile.vocab, t)
    head_act = b * ((profile.head.act_split_bytes - hfix.act_split_bytes) * vpad_ratio / t
                    + profile.head.act_replicated_bytes / (t if sp else 1)
                    + hfix.act_split_bytes)
    # deferred weight gradients (split backward): held on top, per pending chunk-micro-batch
    pend_layer = pend_head = 0.0
    if SCHEDULE_TRAITS[cfg.schedule].pending is not None:
        pend_layer = pending_w_layer_bytes(profile, t, b)
        pend_head = _gemm_output_bytes(profile, profile.head, t, b) * vpad_ratio
    mem_layer, mem_fixed, parts, fparts = [], [], [], []
    for r in range(p):
        held, pending = inflight(cfg, r), pending_weight_grads(cfg, r)
        mb = -(-held // v)  # micro-batches of the edge regions in flight
        a = (act_layer * held + pend_layer * pending) / v
        parts.append(((wb + chunk_w) * block_p + (wbe + chunk_w) * block_e,
                      (gb + chunk_g) * block_p + (gbe + chunk_g) * block_e,
                      ob * block_p + obe * block_e, a))
        params = (emb_p if r == 0 else 0.0) + (head_p if r == p - 1 else 0.0)
        acts = ((emb_act * mb if r == 0 else 0.0)
                + ((head_act * mb + pend_head * -(-pending // v)) if r == p - 1 else 0.0))
        fparts.append(((wb + edge_w) * params, (gb + edge_g) * params, ob * params, acts, work,
                       cluster.reserved_bytes))
        mem_layer.append(int(math.ceil(sum(parts[-1]))))
        mem_fixed.append(int(math.ceil(sum(fparts[-1][:5]))))
    return (tuple(mem_layer), tuple(mem_fixed), tuple(parts), tuple(fparts),
            (act_layer, emb_act, head_act, pend_layer, pend_head))


# ----- step time from rank layer counts (shared by solver, brute force and predict) ------------
# The step time's pieces, each affine in the rank layer counts y_r with integer coefficients.
# They only add and multiply by int constants, so y_r (and the loads and tails passed to
# scaled_step_ns) may be plain ints (predict, the brute force, the bounds) or CP-SAT linear
# expressions (cost/solver.py's constraints and objective): the solver restates none of them.
Lin = TypeVar("Lin")  # an int, or a CP-SAT linear expression


def rank_layers(layers_per_chunk: tuple[int, ...] | list[int], p: int) -> list[int]:
    """y_r: layers on pipeline rank r when chunk c runs on rank c mod p."""
    y = [0] * p
    for c, n in enumerate(layers_per_chunk):
        y[c % p] += n
    return y


def rank_load_ns(lc: LoadCosts, r: int, y_r: Lin) -> Lin:
    """tau_r, the per-micro-batch load of pipeline rank r holding y_r layers: its layers, its
    p2p, the embedding on rank 0 and the head on rank p-1."""
    p = lc.cfg.p
    fixed = lc.p2p_ns + (lc.embed_ns if r == 0 else 0) + (lc.head_ns if r == p - 1 else 0)
    return lc.layer_ns * y_r + fixed


def total_load_ns(lc: LoadCosts, num_layers: int) -> int:
    """Σ_r tau_r, the same for every split of num_layers layers: `rank_load_ns` summed (one
    slope on every rank, p2p on each, the embedding and the head once)."""
    return lc.layer_ns * num_layers + lc.cfg.p * lc.p2p_ns + lc.embed_ns + lc.head_ns


def tail_layer_ns(cc: ConfigCosts) -> int:
    """Per layer of a rank: its exposed data-parallel reduction + its optimizer step."""
    return cc.dp_layer_ns - cc.window_layer_ns + cc.opt_layer_ns


def rank_tail_terms_ns(cc: ConfigCosts, r: int, y_r: Lin) -> tuple[Lin, Lin]:
    """(exposed DP reduction + optimizer, optimizer) after rank r's last backward; its tail is
    the larger of the two: the overlap credit (window_layer_ns) cannot make the tail shorter
    than the optimizer step."""
    p = cc.cfg.p
    opt_fixed = (cc.opt_first_ns if r == 0 else 0) + (cc.opt_last_ns if r == p - 1 else 0)
    dp_fixed = (cc.dp_first_ns if r == 0 else 0) + (cc.dp_last_ns if r == p - 1 else 0)
    return (tail_layer_ns(cc) * y_r + (dp_fixed + opt_fixed),
            cc.opt_layer_ns * y_r + opt_fixed)


def rank_tail_ns(cc: ConfigCosts, r: int, y_r: int) -> int:
    """The tail of rank r: the larger of `rank_tail_terms_ns`."""
    return max(rank_tail_terms_ns(cc, r, y_r))


def total_tail_ns(cc: ConfigCosts, num_layers: int) -> int:
    """Σ_r of the first tail term, the same for every split of num_layers layers:
    `rank_tail_terms_ns` summed (one slope on every rank, the edge terms once)."""
    return (tail_layer_ns(cc) * num_layers + cc.dp_first_ns + cc.dp_last_ns + cc.opt_first_ns
            + cc.opt_last_ns)


def rank_memory_bytes(cc: ConfigCosts, r: int, y_r: Lin) -> Lin:
    return cc.mem_layer_bytes[r] * y_r + cc.mem_fixed_bytes[r]


def step_scale(cfg: Config) -> int:
    """V = v · bubble_div: the bubble is (Σ tau - max tau) / V, so V · step time is an integer
    for integer loads."""
    return cfg.v * bubble_div(cfg)


def scaled_step_ns(cfg: Config, load_max_ns: Lin, load_sum_ns: Lin, tail_max_ns: Lin) -> Lin:
    """V · step time in ns (V = step_scale(cfg)) from the max and the sum of the rank loads and
    the max tail: the module docstring's T_pipe plus the tail,
        step = m · max tau + (Σ tau - max tau) / V + max tail
        V · step = (m·V - 1) · max tau + Σ tau + V · max tail.
    The one statement of the step-time formula: step_time_scaled, both lower bounds and the
    solver's objective (which scales each combination's by W / V to a common denominator W)
    call it."""
    V = step_scale(cfg)
    return (cfg.num_microbatches * V - 1) * load_max_ns + load_sum_ns + V * tail_max_ns


def v_step_ns(cfg: Config, load_max_ns: int, load_sum_ns: int,
              tail_max_ns: int) -> int | Fraction:
    """v · step time in ns, exactly: `scaled_step_ns` / bubble_div (an int when bubble_div is 1,
    else an exact Fraction)."""
    scaled, k = scaled_step_ns(cfg, load_max_ns, load_sum_ns, tail_max_ns), bubble_div(cfg)
    return scaled if k == 1 else Fraction(scaled, k)


def step_time_scaled(cc: ConfigCosts, y: list[int]) -> int | Fraction:
    """v · step time in ns of the rank layer counts y, exactly (`v_step_ns`)."""
    loads = [rank_load_ns(cc, r, yr) for r, yr in enumerate(y)]
    tail = max(rank_tail_ns(cc, r, yr) for r, yr in enumerate(y))
    return v_step_ns(cc.cfg, max(loads), sum(loads), tail)


def step_time_ns(cc: ConfigCosts, y: list[int]) -> float:
    return float(step_time_scaled(cc, y) / cc.cfg.v)


def fits(cc: ConfigCosts, y: list[int]) -> bool:
    return all(rank_memory_bytes(cc, r, yr) <= cc.capacity_bytes for r, yr in enumerate(y))


# ----- prediction ----------------------------------------------------------------------------
def predict(profile: ModelProfile, cluster: Cluster, cfg: Config,
            layers_per_chunk: tuple[int, ...] | list[int] | None = None,
            costs: ConfigCosts | None = None) -> Prediction:
    """Predicted step of `cfg` with the given layers per chunk (default: as even as possible)."""
    cc = costs or config_costs(profile, cluster, cfg)
    profile = rank_profile(profile, cluster, cfg)
    nchunks = cfg.p * cfg.v
    if layers_per_chunk is None:
        q, rem = divmod(profile.num_layers, nchunks)
        layers_per_chunk = [q + (1 if c < rem else 0) for c in range(nchunks)]
    if len(layers_per_chunk) != nchunks or sum(layers_per_chunk) != profile.num_layers:
        raise ValueError(f"layers_per_chunk={list(layers_per_chunk)}: needs p·v = {nchunks} "
                         f"entries summing to num_layers={profile.num_layers}")
    y = rank_layers(layers_per_chunk, cfg.p)
    m = cfg.num_microbatches
    loads = [rank_load_ns(cc, r, yr) for r, yr in enumerate(y)]
    crit = max(range(cfg.p), key=lambda r: loads[r])
    tails = [rank_tail_terms_ns(cc, r, yr) for r, yr in enumerate(y)]
    tr = max(range(cfg.p), key=lambda r: max(tails[r]))
    tail_ns, opt_ns = max(tails[tr]), tails[tr][1]
    step_ns = step_time_ns(cc, y)
    bubble_ns = (sum(loads) - loads[crit]) / step_scale(cfg)
    yc = y[crit]
    compute_ns = m * (cc.layer_compute_ns * yc + (cc.embed_ns if crit == 0 else 0)
                      + (cc.head_ns if crit == cfg.p - 1 else 0))
    acts = schedule_activation_bytes(cc, layers_per_chunk)
    ranks = tuple(dataclasses.replace(rank_memory_parts(cc, r, y[r]), activations_bytes=acts[r])
                  for r in range(cfg.p))
    mem = max(ranks, key=lambda m: m.total_bytes)
    step_s = step_ns / NS
    return Prediction(
        step_time_s=step_s,
        tflops_per_gpu=cc.flops_per_step / (cfg.gpus * step_s) / 1e12,
        mfu=cc.model_flops_per_step / (cfg.gpus * step_s * cluster.peak_flops),
        bubble_fraction=bubble_ns / (m * loads[crit]) if loads[crit] else 0.0,
        memory_bytes_per_gpu=mem.total_bytes,
        compute_s=compute_ns / NS, tp_comm_s=m * cc.layer_tp_ns * yc / NS,
        cp_comm_s=m * cc.layer_cp_ns * yc / NS, ep_comm_s=m * cc.layer_ep_ns * yc / NS,
        pp_comm_s=m * cc.p2p_ns / NS, dp_comm_s=(tail_ns - opt_ns) / NS,
        bubble_s=bubble_ns / NS, optimizer_s=opt_ns / NS, memory=mem, rank_memory=ranks,
        attention=cluster.attention, elementwise=cluster.elementwise)


def schedule_activation_bytes(cc: ConfigCosts, layers_per_chunk: tuple[int, ...] | list[int],
                              *, deferred: bool = True) -> list[float]:
    """Per pipeline rank, the activation bytes at its peak, found by walking the schedule's
    compute order (the lists the runtime executes) with each chunk's own size: its layers ×
    the per-layer bytes, plus the embedding's (chunk 0) and the head's (last chunk). Exact
    where the solver's linear form `mem_parts` (in-flight chunk-micro-batches × the rank's
    mean layers per chunk, `inflight`) approximates: with uneven chunks, or an edge chunk
    held for fewer micro-batches than the rank's other chunks under interleaving, and a
    split backward's deferred W's (the linear form bounds their count by
    `pending_weight_grads`). With one chunk per rank (v = 1) and no split backward the linear
    form is exact and no schedule is built. `deferred=False`: without the deferred W's
    recorded gradients (the saved tensors alone, what a saved-tensor hook sees)."""
    cfg = cc.cfg
    if cfg.v == 1 and SCHEDULE_TRAITS[cfg.schedule].pending is None:
        return [cc.mem_parts[r][3] * n + cc.mem_fixed_parts[r][3]
                for r, n in enumerate(layers_per_chunk)]
    order = compute_order(cfg.schedule, cfg.p, cfg.v, cfg.num_microbatches,
                          group=cfg.microbatch_group if cfg.schedule in GROUPED else None)
    last = len(layers_per_chunk) - 1
    weight = [cc.act_layer_bytes * n + (cc.act_embed_bytes if c == 0 else 0.0)
              + (cc.act_head_bytes if c == last else 0.0) for c, n in enumerate(layers_per_chunk)]
    # chunk 0 receives no input gradient: its B is empty and its W the whole backward
    pending = [0.0 if c == 0 else cc.pending_layer_bytes * n
               + (cc.pending_head_bytes if c == last else 0.0)
               for c, n in enumerate(layers_per_chunk)]
    return peak_held(order, weight, pending if deferred else None)


def rank_memory_parts(cc: ConfigCosts, r: int, y_r: int) -> Memory:
    """Pipeline rank r's predicted memory, by part, holding y_r layers."""
    lp, fp = cc.mem_parts[r], cc.mem_fixed_parts[r]
    return Memory(weights_bytes=lp[0] * y_r + fp[0], gradients_bytes=lp[1] * y_r + fp[1],
                  optimizer_bytes=lp[2] * y_r + fp[2], activations_bytes=lp[3] * y_r + fp[3],
                  recompute_bytes=fp[4], other_bytes=fp[5])
