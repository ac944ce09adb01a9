"""A parallel configuration, the schedule and ZeRO tables it is checked against, and the
integer constants the cost model prices it to (cost/model.py `config_costs`).

- `Config`: everything of a plan but its stage boundaries (degrees, schedule, ZeRO level,
  recompute, micro-batches), validated once, one line per bad value.
- `SCHEDULE_TRAITS`: per pipeline schedule, the chunk-micro-batches a rank holds at its peak
  (`inflight`, equal to autopar.schedules.peak_inflight on the action lists), the deferred
  weight gradients of a split backward (`pending_weight_grads`), the bubble divisor
  (`bubble_div`, cost/step.py) and the ZeRO levels it supports.
- `ZERO_TRAITS`: per ZeRO level, the bytes per parameter at rest and whether the weights are
  sharded (cost/memory.py, cost/dp_terms.py).
- `LoadCosts` / `ConfigCosts`: integer ns and bytes, affine in a rank's layer count y_r, that
  the solver's constraints and objective and `predict` share (cost/step.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from autopar.plan import CP_ATTENTION_PINNED, RECOMPUTE, SCHEDULES, ZERO_LEVELS, Plan
from autopar.schedules import GROUPED, SPLIT_BACKWARD, check_group, first_group_size

# Fraction of the last micro-batch's backward that can hide the data-parallel reduction.
# Megatron-LM (2021) starts the reduction after the backward pass: no overlap.
DP_OVERLAP = 0.0
# nanoseconds per second: the cost model's integers are ns
NS = 1e9


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
        if self.cp_attention not in CP_ATTENTION_PINNED:
            raise ValueError(f"Config.cp_attention={self.cp_attention!r}: must be one of "
                             f"{CP_ATTENTION_PINNED}")
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

    def bytes_per_param(self, d: int, weight_bytes: int = 2) -> tuple[float, float, float]:
        """(weights, gradients, optimizer) bytes per parameter at rest over d replicas, for
        weights of `weight_bytes`: 2 (16-bit, the traits' own numbers: an fp32 master among
        the optimizer's 12) or 4 (an fp32 run: the weight is 4 B where held whole; where the
        optimizer is not sharded the weight is its own master, leaving Adam's m and v, 8 B;
        ZeRO-1's shard keeps an fp32 master as under 16-bit; ZeRO-2/3's shard is the weight)."""
        w, g, o = self.weight_bytes(d), self.grad_bytes(d), self.optimizer_bytes(d)
        if weight_bytes == 4:
            w, o = 2 * w, o if self.sharded_optimizer else o - 4.0
        return w, g, o


# The recompute modes that checkpoint each block whole (passes/recompute.py: full, op): the
# backward reruns the block's forward collectives (tensor-parallel, context and expert
# exchanges) and keeps none of the tensors inside the block but what the mode saves (the
# context ranks' gathered K/V included).
BLOCK_CHECKPOINTED = ("full", "op")

ZERO_TRAITS: dict[int, ZeroTraits] = {
    0: ZeroTraits(lambda d: 2.0, lambda d: 4.0, lambda d: 12.0, sharded_optimizer=False),
    1: ZeroTraits(lambda d: 2.0, lambda d: 4.0, lambda d: 12.0 / d, sharded_optimizer=True),
    # ZeRO-2 in FSDP's terms (reshard_after_forward=False, torchtitan): fp32 grads and
    # optimizer states sharded at rest, and no 16-bit weights: the runtime
    # (autopar/runtime/zero3_chunks.py) keeps only the fp32 master shard (4 of the optimizer's 12 B:
    # master, m, v) and casts it to 16-bit for each all-gather, as FSDP2's
    # MixedPrecisionPolicy(param_dtype=bf16); each chunk gathered once per step and kept until
    # its last backward. The gathered working set is added in memory.memory_coefficients.
    2: ZeroTraits(lambda d: 0.0, lambda d: 4.0 / d, lambda d: 12.0 / d,
                  sharded_optimizer=True, keep=lambda v: v),
    # ZeRO-3: the same shards, at most two chunks gathered at once (computing + prefetched)
    3: ZeroTraits(lambda d: 0.0, lambda d: 4.0 / d, lambda d: 12.0 / d,
                  sharded_optimizer=True, keep=lambda v: min(2, v)),
}
assert set(SCHEDULE_TRAITS) <= set(SCHEDULES) and set(ZERO_TRAITS) <= set(ZERO_LEVELS)


# ----- per-configuration constants ---------------------------------------------------------------
def layer_parts_key(cfg: Config) -> tuple:
    """What one layer's parts per micro-batch read of cfg (cost/layer_parts.py, cached by
    `CostMemo.layer_parts` and per kind by cost/kinds.py): (t, c, method, ep, b, recompute,
    sp, GPUs, whether the schedule splits the backward); neither p, d, v nor N."""
    return (cfg.t, cfg.c, cfg.cp_attention, cfg.ep, cfg.micro_batch_size, cfg.recompute,
            cfg.sequence_parallel, cfg.gpus, cfg.schedule in SPLIT_BACKWARD)


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
    # a stack of several kinds (cost/kinds.py `kinds_cut_ns`): per pipeline rank, the time of
    # the real layers the cost cut gives it minus its mean layers' (summing to 0); empty: none
    rank_cut_ns: tuple[int, ...] = ()

    @property
    def layer_ns(self) -> int:
        return self.layer_compute_ns + self.layer_tp_ns + self.layer_cp_ns + self.layer_ep_ns

    def cut_ns(self, r: int) -> int:
        """Pipeline rank r's load beyond its mean layers' (`rank_cut_ns`; 0 for one kind)."""
        return self.rank_cut_ns[r] if self.rank_cut_ns else 0


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
    # every rank: the latency of its data-parallel calls beyond one, exposed
    # (cost/dp_terms.py calls_latency_s)
    dp_rank_ns: int = 0

