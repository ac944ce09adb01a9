"""The planner's enumeration: which knob combinations the rules and pins allow, in families.

cost/solver.py asks `enumerate_families` for every (t, c, p, d, ep, b, recompute, sp, attention
method) family with its (schedule, v, N, ZeRO levels) rows, each rule's rejection recorded with
its reason; cost/search.py bounds the families before building them; cost/bruteforce.py walks
the same combinations (`enumerate_configs`). Divisibility, the pins (`Pins`) and the rules of
autopar.rules decide which exist: nothing here prices a plan beyond what dominance between the
context attention methods needs (`_Exchanges`).
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any, Iterator

from autopar.cost.bounds import Family, row_facts
from autopar.cost.exchanges import (HYBRID_RING_SLOWER, context_saved_kv_bytes,
                                    hybrid_degree, hybrid_ring_weighed)
from autopar.cost.hardware import Cluster, get_cluster
from autopar.cost.memo import CostMemo
from autopar.cost.model import SCHEDULE_TRAITS, Config, alltoall_heads_rule
from autopar.cost.profile import ModelProfile
from autopar.plan import CP_ATTENTION, RECOMPUTE, ZERO_LEVELS
from autopar.request import Pins as RequestPins
from autopar.rules import recompute_refusal
from autopar.schedules import FEWER_MICROBATCHES_THAN_RANKS

# Schedules the solver picks on its own, every one: interleaved-zb's bubble is priced (a third
# of interleaved 1F1B's) and so is splitting each backward into B and W (cost/compute.py
# `split_backward_s`: the measured host work per op, ~9 us on a CPU core, and the measured
# share of the compute its retained-graph backward adds there, ~0.1; 0 where a fused GPU
# stack's kernels hide it, like dispatch).
AUTO_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "breadth-first", "interleaved-zb")
MAX_MICRO_BATCH = 64      # larger micro-batches never pay off: GEMMs saturate at b·s >> 1000
MAX_CHUNKS_PER_RANK = 8   # interleaving deeper than 8 multiplies p2p for < 1% bubble
SOLVER_TIME_LIMIT_S = 20.0


@dataclass(frozen=True, kw_only=True)
class Pins(RequestPins):
    """The request's pins (autopar.request.Pins: the knobs, validated by autopar.rules) and
    what the caller can build, which bounds the free knobs."""
    # ZeRO levels the caller can run (parallelize: those the runtime executes); a pinned
    # zero is always allowed.
    zero_levels: tuple[int, ...] = ZERO_LEVELS
    # context attention methods the caller can build (parallelize: those the context-parallel
    # pass builds for this model); a pinned one is always allowed
    cp_attentions: tuple[str, ...] = CP_ATTENTION
    # schedules the solver may choose (None: AUTO_SCHEDULES); a pinned schedule is always
    # allowed
    schedules: tuple[str, ...] | None = None

    def allows(self, name: str, value: Any) -> bool:
        pin = getattr(self, name)
        if name == "schedule" and pin is None:
            return value in (AUTO_SCHEDULES if self.schedules is None else self.schedules)
        return pin is None or pin == value


@dataclass
class Rejection:
    config: dict[str, Any]
    reason: str


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt n) (a global batch of 10^9 sequences is a
    typo worth planning, not a minute of counting)."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def tensor_rule(profile: ModelProfile, t: int) -> str | None:
    """Why t cannot split this model (its sizes: `tensor_size_rule`; its graph:
    `pass_refusal`), or None."""
    return tensor_size_rule(profile, t) or pass_refusal(profile, t)


def tensor_size_rule(profile: ModelProfile, t: int) -> str | None:
    """Why t cannot split this model's sizes (heads, hidden, ffn, kv heads), or None."""
    for what, value in (("heads", profile.heads), ("hidden", profile.hidden),
                        ("ffn", profile.ffn)):
        if value % t:
            return (f"divisibility: {what} {value} not divisible by t={t} "
                    f"(t must divide heads, hidden and ffn)")
    kv = profile.kv_heads
    if kv % t and t % kv:
        return (f"divisibility: kv_heads {kv} neither divisible by t={t} nor dividing it "
                f"(kv heads are split, or replicated when t is a multiple of kv_heads)")
    return None


def pass_refusal(profile: ModelProfile, t: int) -> str | None:
    """Why the tensor-parallel pass itself refuses t on this model's graph (`tp_refused`:
    what building the program would raise), or None."""
    for refused, why in profile.tp_refused:
        if refused == t:
            return f"the tensor-parallel pass refuses t={t}: {why}"
    return None


def tensor_degrees(profile: ModelProfile, cluster: "Cluster | str", gpus: int,
                   t: int | None = None) -> list[int]:
    """The tensor-parallel degrees t > 1 `solve` may choose for `gpus` GPUs (the rules of
    `enumerate_configs`: t divides gpus, passes tensor_rule, and stays in a node unless
    pinned); the graph path analyses the tensor-parallel pass at these (passes/tp_cost.py)."""
    cluster = get_cluster(cluster)
    if t is not None:
        return [t] if isinstance(t, int) and t > 1 and gpus % t == 0 else []
    return [k for k in _divisors(gpus) if k > 1 and tensor_rule(profile, k) is None
            and k <= cluster.gpus_per_node]


def context_rule(profile: ModelProfile, c: int) -> str | None:
    """Why c cannot split this model's sequences, or None: the sequence must cut into 2c equal
    chunks (rank i holds chunks i and 2c−1−i, cost/context.py), and the attention must be one
    the context-parallel pass splits (scaled-dot-product attention calls in the block)."""
    if c == 1:
        return None
    if profile.seq_len % (2 * c):
        return (f"divisibility: sequence length {profile.seq_len} not divisible by 2c={2 * c} "
                f"(context parallelism cuts each sequence into 2c equal chunks)")
    return None


def _expert_degrees(profile: ModelProfile, replicas: int, pins: Pins,
                    rejected: list[Rejection], where: dict[str, Any]) -> list[int]:
    """The expert-parallel degrees of a (t, c, p, d): 1, and for a mixture of experts each ep
    dividing both the c·d ranks holding the same weights and the experts per layer (each rank
    holds E/ep whole experts), or the pinned ep."""
    experts = profile.block.experts
    if not experts:   # nothing to spread (a pinned ep > 1 is refused by _validate)
        return [1] if pins.allows("ep", 1) else []
    out = []
    for ep in _divisors(replicas):
        if not pins.allows("ep", ep):
            continue
        if experts % ep:
            rejected.append(Rejection(dict(where, ep=ep), (
                f"divisibility: ep={ep} does not divide the {experts} experts per layer")))
            continue
        out.append(ep)
    return out


def enumerate_configs(profile: ModelProfile, cluster: Cluster, gpus: int, global_batch: int,
                      pins: Pins) -> tuple[list[Config], list[Rejection]]:
    """All knob combinations the rules allow, in enumeration order (t, c, p, ep, b, schedule,
    recompute, sp, zero, attention), and the rejected ones with reasons."""
    families, rejected = enumerate_families(profile, cluster, gpus, global_batch, pins)
    members = sorted((key, cfg) for fam in families for key, cfg in fam.configs())
    return [cfg for _, cfg in members], rejected


def enumerate_families(profile: ModelProfile, cluster: Cluster, gpus: int, global_batch: int,
                       pins: Pins, memo: CostMemo | None = None
                       ) -> tuple[list[Family], list[Rejection]]:
    """The knob combinations the rules allow, in families that share a load-only bound
    (cost/search.py: one (t, c, p, d, ep, b, recompute, sp, attention), its schedules, v, N and
    ZeRO levels built only when the search needs them), and the rejected ones with reasons
    (every rule checked, whether or not its family is ever built). `memo`: the solve's
    CostMemo, whose context profiles and exchange prices the search reads again."""
    families: list[Family] = []
    rejected: list[Rejection] = []
    exchanges = _Exchanges(profile, cluster, pins, gpus, [], memo)
    l = profile.num_layers
    for ti, t in enumerate(_divisors(gpus)):
        if not pins.allows("t", t):
            continue
        why = tensor_rule(profile, t)
        if why is None and t > cluster.gpus_per_node and pins.t is None:
            why = (f"tensor group would span nodes (t={t} > {cluster.gpus_per_node} GPUs per "
                   f"node); pin t={t} to force it")
        if why:
            rejected.append(Rejection({"t": t}, why))
            continue
        for ci, c in enumerate(_divisors(gpus // t)):
            if not pins.allows("c", c):
                continue
            why = context_rule(profile, c)
            if why:
                rejected.append(Rejection({"t": t, "c": c}, why))
                continue
            for pi, p in enumerate(_divisors(gpus // (t * c))):
                d = gpus // (t * c * p)
                if not (pins.allows("p", p) and pins.allows("d", d)):
                    continue
                if p > l:
                    rejected.append(Rejection({"t": t, "c": c, "p": p, "d": d},
                                              f"more pipeline stages (p={p}) than layers ({l})"))
                    continue
                if global_batch % d:
                    rejected.append(Rejection(
                        {"t": t, "c": c, "p": p, "d": d},
                        f"global batch {global_batch} not divisible by d={d}"))
                    continue
                where = {"t": t, "c": c, "p": p, "d": d}
                eps = _expert_degrees(profile, c * d, pins, rejected, where)
                if not eps:
                    continue
                if pins.sequence_parallel:   # (its rejection is recorded once: per ep)
                    for ei, ep in enumerate(eps):
                        families.extend(_inner_families(profile, t, p, d, global_batch, pins,
                                                        rejected, c, ep, (ti, ci, pi, ei),
                                                        exchanges))
                    continue
                # nothing of a (t, c, p, d)'s rows depends on ep: built once, its families
                # and its rejections repeated per expert degree in the order of one call each
                n = len(rejected)
                shared = list(_inner_families(profile, t, p, d, global_batch, pins, rejected,
                                              c, eps[0], (ti, ci, pi, 0), exchanges))
                families.extend(shared)
                again = rejected[n:]
                for ei, ep in enumerate(eps[1:], 1):
                    rejected.extend(again)
                    families.extend(f.with_ep((ti, ci, pi, ei) + f.key[4:], ep) for f in shared)
    # the methods a cheaper one displaced last, one per distinct reason: explain() lists the
    # first distinct rules, and the degrees' own come first
    seen = set()
    rejected += [r for r in exchanges.rejected if not (r.reason in seen or seen.add(r.reason))]
    return families, rejected


class _Exchanges:
    """The context attention methods to enumerate at (t, c, b, sp, recompute): those
    `_cp_attentions` allows, less any another one beats there (`_beats`). The methods differ
    only in the exchange (cost.model.context_comm_s) and in how much of the other ranks' K/V
    is saved (exchanges.context_saved_kv_bytes), so one whose exchange costs no less in
    forward and in total and saves no less can never give a faster or smaller plan; the hybrid
    is skipped where it has no inner degree (the all-gather itself) and stands in for the
    all-to-all across nodes (`_STANDS_IN`); weighed once per key, one Rejection per method
    dropped (enumerate_families lists each reason once, after the degrees' rules)."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, pins: Pins, gpus: int,
                 rejected: list, memo: CostMemo | None = None) -> None:
        self.profile, self.cluster, self.pins, self.gpus = profile, cluster, pins, gpus
        self.rejected = rejected
        self.kept: dict[tuple, tuple[str, ...]] = {}   # (t, c, b, sp, recompute) -> methods
        self.costs = CostMemo() if memo is None else memo

    def __call__(self, t: int, c: int, b: int, sp: bool, recompute: str) -> tuple[str, ...]:
        key = (t, c, b, sp and t > 1, recompute)
        if key not in self.kept:
            self.kept[key] = self._undominated(*key)
        return self.kept[key]

    def _undominated(self, t, c, b, sp, recompute) -> tuple[str, ...]:
        hows = _cp_attentions(self.profile, c, self.pins, t)
        if len(hows) < 2:
            return hows
        cost, mem = {}, {}
        for how in hows:
            cfg = Config(t=t, p=1, d=self.gpus // (t * c), c=c, cp_attention=how,
                         micro_batch_size=b, recompute=recompute, sequence_parallel=sp)
            rank = self.costs.rank_profile(self.profile, self.cluster, cfg)
            if how in ("hybrid", "hybrid-ring") and hybrid_degree(rank, self.cluster, cfg) == 1:
                continue     # no inner degree (c inside a node): the all-gather / ring itself
            cost[how] = self.costs.context_comm_s(rank, self.cluster, cfg)
            mem[how] = context_saved_kv_bytes(rank, self.cluster, cfg)
        hows = tuple(cost)
        if "hybrid" in cost and "all-to-all" in cost and _stands_in(cost):
            hows = tuple(h for h in hows if h != "all-to-all")
            self._reject(t, c, b, sp, recompute, "all-to-all", _STANDS_IN)
        if not hybrid_ring_weighed(cost):
            hows = tuple(h for h in hows if h != "hybrid-ring")
            self._reject(t, c, b, sp, recompute, "hybrid-ring", HYBRID_RING_SLOWER)
        kept = []
        for x in hows:
            by = next((y for y in hows if y != x and _beats(y, x, cost, mem, hows)), None)
            if by is None:
                kept.append(x)
                continue
            self._reject(t, c, b, sp, recompute, x,
                         f"slower exchange: {x} context attention costs no less than {by} at "
                         f"the same knobs (cost.model.context_comm_s), with no more memory")
        return tuple(kept)

    def _reject(self, t, c, b, sp, recompute, how: str, reason: str) -> None:
        self.rejected.append(Rejection(
            {"t": t, "c": c, "cp_attention": how, "micro_batch_size": b,
             "recompute": recompute, "sequence_parallel": sp}, reason))


# Across nodes the hybrid stands in for the all-to-all over the whole context group where its
# exchange is no slower (Megatron-Core's a2a+p2p is that all-to-all made hierarchical): the
# all-to-all's only edge there is the outer ranks' share of K/V the hybrid saves, and the ring
# (which saves none) stays weighed as the memory-lean method. Not strict dominance: it keeps
# the search from growing by a family per such knob (tests/unit/test_search_work.py).
_STANDS_IN = ("slower exchange: all-to-all context attention across nodes costs no less than "
              "hybrid at the same knobs (cost.model.context_comm_s); the hybrid stands in for "
              "it there, the ring is the memory-lean method")


def _stands_in(cost: dict) -> bool:
    (hf, ht), (af, at) = cost["hybrid"], cost["all-to-all"]
    return hf <= af and ht <= at


def _beats(y: str, x: str, cost: dict, mem: dict, hows: tuple[str, ...]) -> bool:
    """Context method y dominates x at the same knobs: it saves no more of the other ranks'
    K/V (mem: exchanges.context_saved_kv_bytes) and its exchange costs no more in forward and
    in total; ties go to the smaller memory, then to the earlier method."""
    (yf, yt), (xf, xt) = cost[y], cost[x]
    if mem[y] > mem[x] or yf > xf or yt > xt:
        return False
    return (yf, yt) != (xf, xt) or mem[y] < mem[x] or hows.index(y) < hows.index(x)


def _inner_families(profile, t, p, d, global_batch, pins, rejected, c, ep,
                    prefix, exchanges: _Exchanges | None = None) -> Iterator[Family]:
    """The families of one (t, c, p, d, ep): per micro-batch size b, the (schedule, v, N,
    ZeRO levels) rows the rules allow, crossed with recompute, sp and the attention method.
    Each rule's rejection is recorded once per (t, c, p, d, ep, b, schedule) where it applies.
    Why this size: the degrees of one outer family (t, c, p, d, ep), the pins, the rejection
    record and the prefix are what every row reads; bundling them would only rename them."""
    l = profile.num_layers
    per_replica = global_batch // d
    recs = [(ri, r) for ri, r in enumerate(RECOMPUTE) if pins.allows("recompute", r)]
    hows = list(enumerate(_cp_attentions(profile, c, pins, t)))
    sps = None         # the same for every row (computed where the first row needs it)
    zero_rows: dict[str, tuple] = {}   # schedule -> (_zero_levels, the rejections it added)
    for bi, b in enumerate(_divisors(per_replica)):
        if not pins.allows("micro_batch_size", b) or (
                b > MAX_MICRO_BATCH and pins.micro_batch_size is None):
            continue
        m = per_replica // b
        rows = []
        for si, (schedule, v, group) in enumerate(_schedules(p, m, l, pins, rejected,
                                                             (t, p, d, b))):
            if c * d > 1 and pins.zero is None and 3 not in SCHEDULE_TRAITS[schedule].zero_levels:
                rejected.append(Rejection(
                    {"t": t, "c": c, "p": p, "d": d, "schedule": schedule, "zero": 3},
                    f"zero=2/3 not offered with {schedule}: its split backward's weight-gradient "
                    f"halves would need the sharded weights gathered again"))
            if not recs:
                continue
            if sps is None:
                sps = [(i, sp) for i, sp in enumerate(
                           _sequence_parallel_modes(profile, t, p, d, pins, rejected, c))
                       if t == 1 or pins.allows("sequence_parallel", sp)]
            if not sps:
                continue
            if schedule not in zero_rows:
                n = len(rejected)
                zeros = _zero_levels(schedule, t, c, p, d, pins, rejected)
                zero_rows[schedule] = zeros, tuple(rejected[n:])
            else:   # the same levels and rejections as the first call's (one per row)
                zeros, again = zero_rows[schedule]
                rejected.extend(again)
            if zeros:
                rows.append((si, schedule, v, group, zeros))
        if not rows:
            continue
        rows = tuple(rows)
        facts_at = row_facts(rows)
        for ri, recompute in recs:
            kept_rows = tuple(r for r in rows if recompute_refusal(recompute, r[1]) is None)
            if not kept_rows:
                continue
            facts = (facts_at if kept_rows == rows else row_facts(kept_rows))(recompute)
            for spi, sp in sps:
                # the methods no other one dominates at these knobs (_Exchanges), each keyed
                # by its place among all of them so the search order is the flat one's
                kept = (exchanges(t, c, b, sp, recompute) if exchanges is not None
                        else tuple(how for _, how in hows))
                for hi, how in hows:
                    if how not in kept:
                        continue
                    yield Family(key=prefix + (bi,), sub=(ri, spi, hi), t=t, c=c, p=p, d=d,
                                 ep=ep, b=b, m=m, recompute=recompute, sp=sp, how=how,
                                 rows=kept_rows, **facts)


def _zero_levels(schedule, t, c, p, d, pins, rejected) -> tuple[tuple[int, int], ...]:
    """(index, level) of the ZeRO levels a (schedule, c·d) may run, the others rejected (every
    level runs with expert parallelism: its experts sharded over the expert-data group). ZeRO
    shards over the c·d ranks that hold the same weights; with one such rank the levels are
    alike and only the pinned one (or 0) is planned, still under the schedule's rule."""
    levels = SCHEDULE_TRAITS[schedule].zero_levels
    if pins.zero is not None and pins.zero not in levels:
        rejected.append(Rejection(
            {"t": t, "c": c, "p": p, "d": d, "schedule": schedule, "zero": pins.zero},
            f"zero={pins.zero} is not supported with schedule {schedule!r} "
            f"(supported: {levels})"))
        return ()
    zeros = levels if c * d > 1 else (pins.zero or 0,)
    out = []
    for zi, zero in enumerate(zeros):
        if c * d > 1 and not pins.allows("zero", zero):
            continue
        if pins.zero is None and zero not in pins.zero_levels:
            rejected.append(Rejection(
                {"t": t, "p": p, "d": d, "schedule": schedule, "zero": zero},
                f"zero={zero} is priced but not executed by this runtime yet "
                f"(runnable: {pins.zero_levels}); pin zero={zero} to plan it"))
            continue
        out.append((zi, zero))
    return tuple(out)


def _cp_attentions(profile: ModelProfile, c: int, pins: Pins, t: int = 1) -> tuple[str, ...]:
    """How attention may meet the other context ranks' tokens: every method the model allows
    when c > 1 (the cost model prices each: cost.model.context_comm_s) and the caller can build
    (`Pins.cp_attentions`), the pinned one if any; with c = 1 there is nothing to meet, one
    value. Ring and all-to-all attention replace scaled-dot-product attention calls only
    (attention written out as matmuls keeps the all-gather); all-to-all needs t·c to divide the
    heads (`alltoall_heads_rule`)."""
    if c == 1:
        return ("all-gather",)
    if pins.cp_attention is not None:   # at a (c, t) it cannot run: no configuration
        return (() if cp_attention_rule(profile, pins.cp_attention, c, t)
                else (pins.cp_attention,))
    ok = [how for how in CP_ATTENTION if how in pins.cp_attentions
          and cp_attention_rule(profile, how, c, t) is None]
    return tuple(ok) or ("all-gather",)


def cp_attention_rule(profile: ModelProfile, how: str, c: int, t: int = 1) -> str | None:
    """Why context attention `how` cannot run this model's attention at (c, t), or None."""
    if how == "all-gather" or c == 1:
        return None
    why = ring_attention_rule(profile)
    if why is not None:
        return why.replace("ring attention", f"{how} attention")
    if how == "all-to-all":
        return alltoall_heads_rule(profile.heads, profile.kv_heads, t, c)
    if how in ("hybrid", "hybrid-ring"):   # inner degree k: runtime/groups.py hybrid_inner_degree
        from autopar.runtime.groups import hybrid_heads_rule   # (this rule's lines only)
        return hybrid_heads_rule(profile.heads // t if profile.heads % t == 0 else 1, c)
    return None


def ring_attention_rule(profile: ModelProfile) -> str | None:
    """Why ring attention cannot run this model's attention, or None."""
    if profile.block.fused is None or not profile.block.fused.calls:
        return ("ring attention replaces scaled_dot_product_attention calls; this model's "
                "attention is written out (q·kᵀ, softmax, p·v), which keeps the all-gather")
    return None


def _sequence_parallel_modes(profile, t, p, d, pins, rejected, c=1) -> tuple[bool, ...]:
    """Sequence parallelism splits the sequence over the t ranks, so it needs seq_len % t == 0
    (the pass refuses otherwise; under context parallelism the rank's s/c tokens); with t = 1 it
    is a no-op: one value, the pinned one if any."""
    if t == 1:
        return (bool(pins.sequence_parallel),)
    seq = profile.seq_len // c
    if seq % t == 0:
        return (False, True)
    if pins.sequence_parallel:
        why = Rejection({"t": t, "c": c, "p": p, "d": d, "sequence_parallel": True},
                        f"sequence parallelism needs the sequence length ({seq}) "
                        f"divisible by t={t}; pick a t that divides it or pad the sequence")
        if why not in rejected:      # one per (t, p, d), not per knob combination
            rejected.append(why)
    return (False,)


def _breadth_first_vs(p: int, l: int, pins: Pins) -> list[int]:
    """Chunks per rank tried for breadth-first: powers of two up to MAX_CHUNKS_PER_RANK and one
    layer per chunk (v = l/p, modular pipeline), or the pinned v. (Bubble and exposed
    data-parallel time fall as 1/v, p2p grows as v: a coarse grid of v keeps the search small;
    pin v for any other value.) v = 1 is GPipe's order with per-chunk
    reduction (and ZeRO-3 gathering once per pass); with p = 1 only v >= 2 differs from plain
    gradient accumulation (layered gradient accumulation, 2106.02679)."""
    vs = sorted({1 << k for k in range(MAX_CHUNKS_PER_RANK.bit_length())
                 if 1 << k <= min(l // p, MAX_CHUNKS_PER_RANK)} | {l // p})
    if pins.v is not None:
        vs = [pins.v] if pins.v <= l // p else []
    return [v for v in vs if p > 1 or v > 1]


def _schedules(p, m, l, pins, rejected, key) -> Iterator[tuple[str, int, int | None]]:
    """(schedule, v, micro-batch group N) of every schedule the rules allow for (p, m)."""
    d = key[2]
    if p == 1:  # one stage: plain gradient accumulation (a pinned schedule keeps its name and
        # its rules, e.g. interleaved-zb's split backward and the ZeRO levels that go with it)
        sched = pins.schedule if pins.schedule not in (None, "breadth-first") else "1f1b"
        if pins.v in (None, 1) and pins.schedule != "breadth-first":
            yield sched, 1, None
        if d > 1 and pins.allows("schedule", "breadth-first"):  # layered accumulation
            for v in _breadth_first_vs(p, l, pins):
                yield "breadth-first", v, None
        return
    where = dict(zip(("t", "p", "d", "micro_batch_size"), key))
    for schedule in SCHEDULE_TRAITS:
        if not pins.allows("schedule", schedule):
            continue
        if m < p and (pins.p is None or schedule not in FEWER_MICROBATCHES_THAN_RANKS
                      or SCHEDULE_TRAITS[schedule].multi_chunk):
            # a pipeline that never fills is planned only when p is pinned, and only with one
            # chunk per rank (the bubble formula then holds: m + p − 1 chunk times)
            rejected.append(Rejection(dict(where, schedule=schedule), (
                f"only m={m} micro-batches for p={p} stages (need m >= p; with p pinned, "
                f"gpipe or 1f1b run fewer)")))
            continue
        if schedule == "breadth-first":  # no m % p rule: every m >= p fills the pipeline
            for v in _breadth_first_vs(p, l, pins):
                yield schedule, v, None
            continue
        if not SCHEDULE_TRAITS[schedule].multi_chunk:
            if pins.allows("v", 1):
                yield schedule, 1, None
            continue
        if schedule == "interleaved-zb" and pins.allows("v", 1):
            yield schedule, 1, None  # ZB-H1: 1F1B's order, any m >= p
        # up to l + 2 chunk slots: the first and the last may hold only the embedding / head
        vmax = (l + 2) // p if pins.v else min((l + 2) // p, MAX_CHUNKS_PER_RANK)
        for v in range(2, vmax + 1):
            if not pins.allows("v", v):
                continue
            if m % p:
                rejected.append(Rejection(dict(where, schedule=schedule, v=v), (
                    f"interleaving needs m % p == 0 (Megatron-LM); m={m}, p={p}")))
                break
            for group in _groups(p, m, pins):
                yield schedule, v, group


def _groups(p: int, m: int, pins: Pins) -> list[int | None]:
    """Micro-batch groups N tried for the interleaved schedules (m % p == 0): None (N = p,
    Megatron's order), the multiples 2^k·p that divide m, and m (the breadth-first end), or
    the pinned N. (A larger N hides more of the ring's p2p latency and gathers ZeRO-3 weights
    less often, and holds more micro-batches: a coarse grid keeps the search small.)"""
    if pins.microbatch_group is not None:
        return [pins.microbatch_group] if (p <= pins.microbatch_group <= m
                                            and m % pins.microbatch_group == 0) else []
    wider = {p << k for k in range(1, 8)} | {m}
    return [None] + sorted(n for n in wider if p < n <= m and m % n == 0)

