"""CP-SAT planner: the fastest (t, c, ep, p, d, v, b, schedule, recompute, sp, zero, stages) that
fits.

Variables
    sel[k]        Boolean, one per surviving knob combination k (t, c, ep, p, d, v, micro-batch b,
                  schedule, recompute, sequence_parallel, zero); exactly one is true.
    x[p,v][c]     integer layers of chunk c (1 <= x <= l), one vector per distinct (p, v) shared by
                  all combinations with that chunk layout; y_r = sum of x over chunks c = r mod p.
    M[k], D[k]    integer ns: max per-micro-batch rank load, and max rank tail (exposed
                  data-parallel reduction + optimizer), 0 unless k is selected.
Objective (integer, ns · W, W = lcm of the V_k = cost.model.step_scale of the candidates:
v_k · bubble_div_k, bubble_div = 1 except for zero-bubble schedules)
    minimise sum_k (W / V_k) · scaled_step_ns(cfg_k, M[k], sel[k]·S_k, D[k])
    = W · step time of the selected combination (cost.model.scaled_step_ns is V · step time;
    S_k = total_load_ns, the sum of the rank loads, does not depend on the partition).
Constraint families (one method each; every cost is a cost.model function of y_r, affine, so
the same function prices ints in predict and builds the linear expressions here)
    _add_selection       exactly one combination
    _add_partition       sum_c x[c] = l for every chunk layout
    _add_load_max        M[k] >= rank_load_ns(y_r) for every rank r, if sel[k]
    _add_tail_max        D[k] >= each of rank_tail_terms_ns(y_r), if sel[k]
    _add_memory          rank_memory_bytes(y_r) <= capacity, if sel[k]
Schedules: gpipe, 1f1b, interleaved-1f1b (v = 2..8, m % p == 0), interleaved-zb (zero-bubble
interleaved 1F1B: v = 1, ZB-H1, or v = 2..8 with m % p == 0; ZeRO 0/1) and breadth-first (v in
_breadth_first_vs, any m >= p; with p = 1 and d > 1 it is layered gradient accumulation); ZeRO
levels per schedule from SCHEDULE_TRAITS (ZeRO-3 only where weights are gathered once per chunk
per pass, i.e. breadth-first). Their costs differ only through cost.model (bubble, DP exposure,
memory), so the constraint families are the same for every schedule.
Stage layout within a rank (after the solve): the objective depends on the rank totals y only,
so the layers of each rank are spread over its chunks by simulating the plan's schedule
(cost/layout.py: the fill and drain run through the first and last chunks, which may end with
the embedding / head + loss alone).
Combinations are enumerated in Python (divisibility, pins and rules decide which exist, each
rejected one with its reason), costed with cost.model, and pruned when a lower bound of their
step time exceeds the step time of a feasible plan already found, or a lower bound of their
memory exceeds the GPU's (optimality is kept: a pruned combination cannot win); they are
enumerated in families bounded before they are built (cost/search.py). The brute
force in cost/bruteforce.py enumerates the same combinations and every partition with the same
integer costs.
"""
from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Iterator

from ortools.sat.python import cp_model

from autopar.cost.hardware import Cluster, get_cluster
# the search's types and bounds (cost/bounds.py, shared with cost/search.py); chunk_minimums and
# chunks_from_ranks are re-exported for cost/bruteforce.py and the tests
from autopar.cost.bounds import (GIB, Family, SolveStats, chunk_minimums, chunks_from_ranks,
                                 heuristic_partition)
from autopar.cost.layout import spread_layers
from autopar.cost.memo import CostMemo
from autopar.cost.model import (SCHEDULE_TRAITS, ZERO_TRAITS, Config, ConfigCosts,
                                alltoall_heads_rule, config_costs,
                                context_comm_s, load_costs, predict, rank_layers, rank_load_ns,
                                rank_memory_bytes, rank_tail_ns, rank_tail_terms_ns,
                                scaled_step_ns, step_scale, step_time_scaled, total_load_ns,
                                total_tail_ns, v_step_ns)
from autopar.cost.profile import ModelProfile
from autopar.plan import (CP_ATTENTION, RECOMPUTE, ZERO_LEVELS, Alternative, Plan, Prediction,
                          Stage)
from autopar.request import Pins as RequestPins
from autopar.rules import degrees_refusal
from autopar.schedules import FEWER_MICROBATCHES_THAN_RANKS

# Schedules the solver picks on its own. interleaved-zb is opt-in (pin it, or list it in
# `schedules=`): its bubble is priced (a third of interleaved 1F1B's) but not the cost of
# splitting each backward into B and W, which on the CPU runtime measured 10-25 % of a
# backward at benchmark sizes (benchmarks/pipeline.py) — more than the bubble it saved there.
AUTO_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "breadth-first")
MAX_MICRO_BATCH = 64      # larger micro-batches never pay off: GEMMs saturate at b·s >> 1000
MAX_CHUNKS_PER_RANK = 8   # interleaving deeper than 8 multiplies p2p for < 1% bubble
SOLVER_TIME_LIMIT_S = 20.0


# ----- enumeration of knob combinations --------------------------------------------------------
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
    return [k for k in range(1, n + 1) if n % k == 0]


def _tensor_rule(profile: ModelProfile, t: int) -> str | None:
    """Why t cannot split this model (heads, hidden, ffn, kv heads), or None."""
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


def tensor_degrees(profile: ModelProfile, cluster: "Cluster | str", gpus: int,
                   t: int | None = None) -> list[int]:
    """The tensor-parallel degrees t > 1 `solve` may choose for `gpus` GPUs (the rules of
    `enumerate_configs`: t divides gpus, passes _tensor_rule, and stays in a node unless
    pinned); the graph path analyses the tensor-parallel pass at these (passes/tp_cost.py)."""
    cluster = get_cluster(cluster)
    if t is not None:
        return [t] if isinstance(t, int) and t > 1 and gpus % t == 0 else []
    return [k for k in _divisors(gpus) if k > 1 and _tensor_rule(profile, k) is None
            and k <= cluster.gpus_per_node]


def _context_rule(profile: ModelProfile, c: int) -> str | None:
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
                       pins: Pins) -> tuple[list[Family], list[Rejection]]:
    """The knob combinations the rules allow, in families that share a load-only bound
    (cost/search.py: one (t, c, p, d, ep, b, recompute, sp, attention), its schedules, v, N and
    ZeRO levels built only when the search needs them), and the rejected ones with reasons
    (every rule checked, whether or not its family is ever built)."""
    families: list[Family] = []
    rejected: list[Rejection] = []
    exchanges = _Exchanges(profile, cluster, pins, gpus, rejected)
    l = profile.num_layers
    for ti, t in enumerate(_divisors(gpus)):
        if not pins.allows("t", t):
            continue
        why = _tensor_rule(profile, t)
        if why is None and t > cluster.gpus_per_node and pins.t is None:
            why = (f"tensor group would span nodes (t={t} > {cluster.gpus_per_node} GPUs per "
                   f"node); pin t={t} to force it")
        if why:
            rejected.append(Rejection({"t": t}, why))
            continue
        for ci, c in enumerate(_divisors(gpus // t)):
            if not pins.allows("c", c):
                continue
            why = _context_rule(profile, c)
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
                for ei, ep in enumerate(_expert_degrees(profile, c * d, pins, rejected, where)):
                    families.extend(_inner_families(profile, t, p, d, global_batch, pins,
                                                    rejected, c, ep, (ti, ci, pi, ei),
                                                    exchanges))
    return families, rejected


class _Exchanges:
    """The context attention methods to enumerate at (t, c, b, sp, recompute): those
    `_cp_attentions` allows, less any another one beats there (`_beats`). The methods differ
    only in the exchange (cost.model.context_comm_s) and in whether the gathered K/V is saved,
    so one whose exchange costs no less in forward and in total and saves no less can never
    give a faster or smaller plan; weighed once per key, one Rejection per method dropped."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, pins: Pins, gpus: int,
                 rejected: list) -> None:
        self.profile, self.cluster, self.pins, self.gpus = profile, cluster, pins, gpus
        self.rejected = rejected
        self.kept: dict[tuple, tuple[str, ...]] = {}   # (t, c, b, sp, recompute) -> methods
        self.costs = CostMemo()

    def __call__(self, t: int, c: int, b: int, sp: bool, recompute: str) -> tuple[str, ...]:
        key = (t, c, b, sp and t > 1, recompute)
        if key not in self.kept:
            self.kept[key] = self._undominated(*key)
        return self.kept[key]

    def _undominated(self, t, c, b, sp, recompute) -> tuple[str, ...]:
        hows = _cp_attentions(self.profile, c, self.pins, t)
        if len(hows) < 2:
            return hows
        cost = {}
        for how in hows:
            cfg = Config(t=t, p=1, d=self.gpus // (t * c), c=c, cp_attention=how,
                         micro_batch_size=b, recompute=recompute, sequence_parallel=sp)
            rank = self.costs.rank_profile(self.profile, self.cluster, cfg)
            cost[how] = context_comm_s(rank, self.cluster, cfg)
        kept = []
        for x in hows:
            by = next((y for y in hows if y != x and _beats(y, x, cost, hows)), None)
            if by is None:
                kept.append(x)
                continue
            self.rejected.append(Rejection(
                {"t": t, "c": c, "cp_attention": x, "micro_batch_size": b,
                 "recompute": recompute, "sequence_parallel": sp},
                f"slower exchange: {x} context attention costs no less than {by} at the same "
                f"knobs (cost.model.context_comm_s), with no more memory"))
        return tuple(kept)


def _beats(y: str, x: str, cost: dict, hows: tuple[str, ...]) -> bool:
    """Context method y dominates x at the same knobs: it saves no more activations (the
    all-gather keeps the gathered K/V, ring and all-to-all do not) and its exchange costs no
    more in forward and in total; ties go to the smaller memory, then to the earlier method."""
    mem = {how: how == "all-gather" for how in hows}
    (yf, yt), (xf, xt) = cost[y], cost[x]
    if mem[y] > mem[x] or yf > xf or yt > xt:
        return False
    return (yf, yt) != (xf, xt) or mem[y] < mem[x] or hows.index(y) < hows.index(x)


def _inner_families(profile, t, p, d, global_batch, pins, rejected, c, ep,
                    prefix, exchanges: _Exchanges | None = None) -> Iterator[Family]:
    """The families of one (t, c, p, d, ep): per micro-batch size b, the (schedule, v, N,
    ZeRO levels) rows the rules allow, crossed with recompute, sp and the attention method.
    Each rule's rejection is recorded once per (t, c, p, d, ep, b, schedule) where it applies."""
    l = profile.num_layers
    per_replica = global_batch // d
    recs = [(ri, r) for ri, r in enumerate(RECOMPUTE) if pins.allows("recompute", r)]
    hows = list(enumerate(_cp_attentions(profile, c, pins, t)))
    for bi, b in enumerate(_divisors(per_replica)):
        if not pins.allows("micro_batch_size", b) or (
                b > MAX_MICRO_BATCH and pins.micro_batch_size is None):
            continue
        m = per_replica // b
        rows, sps = [], []
        for si, (schedule, v, group) in enumerate(_schedules(p, m, l, pins, rejected,
                                                             (t, p, d, b))):
            if d > 1 and pins.zero is None and 3 not in SCHEDULE_TRAITS[schedule].zero_levels:
                rejected.append(Rejection(
                    {"t": t, "p": p, "d": d, "schedule": schedule, "zero": 3},
                    f"zero=2/3 not offered with {schedule}: its split backward's weight-gradient "
                    f"halves would need the sharded weights gathered again"))
            if not recs:
                continue
            sps = [(i, sp) for i, sp in enumerate(
                       _sequence_parallel_modes(profile, t, p, d, pins, rejected, c))
                   if t == 1 or pins.allows("sequence_parallel", sp)]
            if not sps:
                continue
            zeros = _zero_levels(schedule, t, p, d, pins, rejected)
            if zeros:
                rows.append((si, schedule, v, group, zeros))
        if not rows:
            continue
        for ri, recompute in recs:
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
                                 rows=tuple(rows))


def _zero_levels(schedule, t, p, d, pins, rejected) -> tuple[tuple[int, int], ...]:
    """(index, level) of the ZeRO levels a (schedule, d) may run, the others rejected (every
    level runs with expert parallelism: its experts sharded over the expert-data group)."""
    zeros = SCHEDULE_TRAITS[schedule].zero_levels if d > 1 else (pins.zero or 0,)
    if pins.zero is not None and pins.zero not in zeros:
        rejected.append(Rejection(
            {"t": t, "p": p, "d": d, "schedule": schedule, "zero": pins.zero},
            f"zero={pins.zero} is not supported with schedule {schedule!r} "
            f"(supported: {SCHEDULE_TRAITS[schedule].zero_levels})"))
    out = []
    for zi, zero in enumerate(zeros):
        if d > 1 and not pins.allows("zero", zero):
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


# ----- the CP-SAT model ---------------------------------------------------------------------
class _PlanModel:
    """One CP-SAT model over the surviving combinations; see the module docstring."""

    def __init__(self, candidates: list[ConfigCosts], num_layers: int,
                 hint: tuple[int, list[int]] | None) -> None:
        self.cands, self.l = candidates, num_layers
        self.model = cp_model.CpModel()
        self.W = math.lcm(*[step_scale(cc.cfg) for cc in candidates])
        self.sel = [self.model.NewBoolVar(f"sel{k}") for k in range(len(candidates))]
        self.x: dict[tuple[int, int], list[cp_model.IntVar]] = {}
        self.y: dict[tuple[int, int], list[Any]] = {}
        self.M: list[cp_model.IntVar] = []
        self.D: list[cp_model.IntVar] = []
        self._add_selection()
        self._add_partition()
        self._add_load_max()
        self._add_tail_max()
        self._add_memory()
        self._set_objective()
        if hint is not None:
            self._add_hint(*hint)

    def _add_selection(self) -> None:
        self.model.AddExactlyOne(self.sel)

    def _add_partition(self) -> None:
        for cc in self.cands:
            key = (cc.cfg.p, cc.cfg.v)
            if key in self.x:
                continue
            p, v = key
            mins = chunk_minimums(p, v, self.l)
            xs = [self.model.NewIntVar(lo, self.l - sum(mins) + lo, f"x{p}_{v}_{c}")
                  for c, lo in enumerate(mins)]
            self.model.Add(sum(xs) == self.l)
            self.x[key] = xs
            self.y[key] = [sum(xs[j * p + r] for j in range(v)) for r in range(p)]

    def _ub(self, cc: ConfigCosts) -> tuple[int, int]:
        p = cc.cfg.p
        load = max(rank_load_ns(cc, r, self.l) for r in range(p))
        tail = max(max(abs(q) for q in rank_tail_terms_ns(cc, r, self.l)) for r in range(p))
        return load, tail

    def _add_load_max(self) -> None:
        for k, cc in enumerate(self.cands):
            y = self.y[(cc.cfg.p, cc.cfg.v)]
            ub_load, _ = self._ub(cc)
            mk = self.model.NewIntVar(0, ub_load, f"M{k}")
            for r in range(cc.cfg.p):
                self.model.Add(mk >= rank_load_ns(cc, r, y[r])).OnlyEnforceIf(self.sel[k])
            self.M.append(mk)

    def _add_tail_max(self) -> None:
        for k, cc in enumerate(self.cands):
            y = self.y[(cc.cfg.p, cc.cfg.v)]
            _, ub_tail = self._ub(cc)
            dk = self.model.NewIntVar(0, ub_tail, f"D{k}")
            for r in range(cc.cfg.p):
                for term in rank_tail_terms_ns(cc, r, y[r]):
                    self.model.Add(dk >= term).OnlyEnforceIf(self.sel[k])
            self.D.append(dk)

    def _add_memory(self) -> None:
        for k, cc in enumerate(self.cands):
            y = self.y[(cc.cfg.p, cc.cfg.v)]
            for r in range(cc.cfg.p):
                self.model.Add(rank_memory_bytes(cc, r, y[r])
                               <= cc.capacity_bytes).OnlyEnforceIf(self.sel[k])

    def _set_objective(self) -> None:
        terms = []
        for k, cc in enumerate(self.cands):
            # Σ load does not depend on the split; it counts only if k is selected
            total = total_load_ns(cc, self.l) * self.sel[k]
            scaled = scaled_step_ns(cc.cfg, self.M[k], total, self.D[k])  # V_k · step
            terms.append(self.W // step_scale(cc.cfg) * scaled)
        self.model.Minimize(sum(terms))

    def _add_hint(self, k: int, y_hint: list[int]) -> None:
        cc = self.cands[k]
        x = chunks_from_ranks(y_hint, cc.cfg.p, cc.cfg.v)
        for var, val in zip(self.x[(cc.cfg.p, cc.cfg.v)], x):
            self.model.AddHint(var, val)
        for j, s in enumerate(self.sel):
            self.model.AddHint(s, j == k)

    def solve(self) -> tuple[int, list[int], int, bool]:
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = SOLVER_TIME_LIMIT_S
        solver.parameters.num_workers = max(1, min(8, os.cpu_count() or 1))
        status = solver.Solve(self.model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return -1, [], 0, False
        k = next(j for j, s in enumerate(self.sel) if solver.Value(s))
        cc = self.cands[k]
        x = [solver.Value(var) for var in self.x[(cc.cfg.p, cc.cfg.v)]]
        return k, x, int(solver.ObjectiveValue()), status == cp_model.OPTIMAL


# ----- public entry point -------------------------------------------------------------------
def _config_dict(cfg: Config) -> dict[str, Any]:
    return {"t": cfg.t, "c": cfg.c, "cp_attention": cfg.cp_attention, "ep": cfg.ep, "p": cfg.p, "d": cfg.d, "v": cfg.v,
            "micro_batch_size": cfg.micro_batch_size, "num_microbatches": cfg.num_microbatches,
            "schedule": cfg.schedule, "recompute": cfg.recompute,
            "sequence_parallel": cfg.sequence_parallel, "zero": cfg.zero,
            "microbatch_group": cfg.microbatch_group}


def _validate(profile: ModelProfile, cluster: Cluster, gpus: int, global_batch: int,
              pins: Pins) -> None:
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"solve: gpus={gpus!r} must be a positive integer")
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"solve: global_batch_size={global_batch!r} must be a positive integer "
                         f"(sequences per optimizer step)")
    if pins.ep is not None and pins.ep > 1:
        experts = profile.block.experts
        if not experts:
            raise ValueError(f"solve: ep={pins.ep}: the model has no mixture of experts (no "
                             f"grouped matmul over 3-D expert weights) to spread over ranks; "
                             f"pass ep=1 or leave it None")
        if experts % pins.ep:
            raise ValueError(f"solve: ep={pins.ep} with {experts} experts per layer: each "
                             f"expert-parallel rank holds experts/ep whole experts, so ep must "
                             f"divide {experts}; pick an ep that divides {experts}")
    if pins.cp_attention in ("ring", "all-to-all") and (why := cp_attention_rule(
            profile, pins.cp_attention, pins.c or 1, pins.t or 1)):
        raise ValueError(f"solve: cp_attention={pins.cp_attention!r}: {why}; pin "
                         f"cp_attention='all-gather' or leave it None")
    if pins.c is not None:
        why = _context_rule(profile, pins.c)
        if why:
            raise ValueError(f"solve: c={pins.c}: {why}; pad the sequence to a multiple of "
                             f"{2 * pins.c} or pick a c with 2c dividing {profile.seq_len}")
    if pins.t is not None:
        why = _tensor_rule(profile, pins.t)
        if why:
            raise ValueError(f"solve: t={pins.t}: {why}; pick a t that divides them (the "
                             f"vocabulary {profile.vocab} needs no rule: it is padded to a "
                             f"multiple of 128·t)")
        if pins.sequence_parallel and profile.seq_len % pins.t:
            raise ValueError(f"solve: sequence_parallel=True with t={pins.t}: sequence "
                             f"parallelism needs the sequence length ({profile.seq_len}) "
                             f"divisible by t={pins.t}; pick a t that divides it or pad the "
                             f"sequence")
    if why := degrees_refusal(gpus, t=pins.t, c=pins.c, p=pins.p, d=pins.d):
        raise ValueError(f"solve: {why}")
    if pins.d is not None and global_batch % pins.d:
        raise ValueError(f"solve: global_batch_size={global_batch} is not divisible by d="
                         f"{pins.d}; every data-parallel replica needs the same number of "
                         f"sequences: use a multiple of {pins.d}")
    if pins.micro_batch_size is not None:
        b = pins.micro_batch_size
        dd = pins.d or 1
        if global_batch % (b * dd):
            raise ValueError(f"solve: global_batch_size={global_batch} does not split into "
                             f"micro-batches of {b} × d={dd} replicas (needs a multiple of "
                             f"{b * dd}); change global_batch_size or micro_batch_size")
    if pins.schedules is not None and set(pins.schedules) - set(SCHEDULE_TRAITS):
        raise ValueError(f"solve: schedules={pins.schedules!r}: unknown "
                         f"{sorted(set(pins.schedules) - set(SCHEDULE_TRAITS))}; the cost model "
                         f"supports {sorted(SCHEDULE_TRAITS)}")


def solve(profile: ModelProfile, cluster: "Cluster | str", *, gpus: int, global_batch_size: int,
          t: int | None = None, p: int | None = None, d: int | None = None,
          v: int | None = None, micro_batch_size: int | None = None,
          schedule: str | None = None, recompute: str | None = None, zero: int | None = None,
          sequence_parallel: bool | None = None, microbatch_group: int | None = None,
          max_alternatives: int = 50, zero_levels: tuple[int, ...] = ZERO_LEVELS,
          schedules: tuple[str, ...] | None = None, c: int | None = None,
          ep: int | None = None, cp_attention: str | None = None,
          cp_attentions: tuple[str, ...] = CP_ATTENTION,
          stats: SolveStats | None = None) -> Plan:
    """The predicted-fastest plan that fits in memory, with ranked alternatives.
    `schedules`: the schedules the solver may choose (None: AUTO_SCHEDULES, every one the
    cost model knows except the opt-in interleaved-zb); a pinned `schedule` is always
    planned. `microbatch_group`: pin N of the interleaved schedules (p <= N <= m, N | m).
    `cp_attention`: pin how context parallelism's attention meets the other ranks' K/V
    (autopar.plan.CP_ATTENTION); None: the cheapest per configuration, as the cost model
    prices them, among `cp_attentions` (those the caller can build). `stats`: a SolveStats
    to fill with the search's work (families, configurations built, bounds, configurations
    priced, CP-SAT candidates)."""
    cluster = get_cluster(cluster)
    profile = profile.for_cluster(cluster)  # the cluster's kernels
    if c is None and None not in (t, p, d):
        c = 1   # t, p and d pinned: the layout the caller wrote (before c existed) is t·p·d
    try:
        pins = Pins(t=t, c=c, cp_attention=cp_attention, ep=ep, p=p, d=d, v=v,
                    micro_batch_size=micro_batch_size, schedule=schedule, recompute=recompute,
                    zero=zero, sequence_parallel=sequence_parallel,
                    microbatch_group=microbatch_group, zero_levels=tuple(zero_levels),
                    cp_attentions=tuple(cp_attentions),
                    schedules=None if schedules is None else tuple(schedules))
    except ValueError as exc:
        raise ValueError(f"solve: {exc}") from None
    _validate(profile, cluster, gpus, global_batch_size, pins)
    from autopar.cost.search import search   # (search imports this module's bounds)
    t0 = time.perf_counter()
    families, rejected = enumerate_families(profile, cluster, gpus, global_batch_size, pins)
    if not families:
        raise ValueError(_no_config_message(profile, gpus, global_batch_size, pins, rejected))
    stats = stats if stats is not None else SolveStats()
    evaluated, memory_fail, pruned = search(
        profile, cluster, families, max(0, max_alternatives // 2) + max(0, max_alternatives // 4),
        stats)
    feasible = evaluated
    if not feasible:
        raise ValueError(_no_fit_message(profile, cluster, gpus, pins, memory_fail))
    best_ub = min(e.ub_s for e in feasible)
    survivors = [e for e in feasible if e.lb_s <= best_ub]
    for e in feasible:
        if e.lb_s > best_ub:
            pruned.append(e)
            e.note = f"slower: lower bound {e.lb_s:.4g} s > best {best_ub:.4g} s"
    hint = None
    if math.isfinite(best_ub):
        kbest = min(range(len(survivors)), key=lambda j: survivors[j].ub_s)
        hint = (kbest, survivors[kbest].y)
    stats.candidates = len(survivors)
    pm = _PlanModel([e.cc for e in survivors], profile.num_layers, hint)
    k, x, _, optimal = pm.solve()
    if k < 0:
        raise ValueError(_no_fit_message(profile, cluster, gpus, pins, memory_fail + survivors))
    chosen = survivors[k]
    p_, v_ = chosen.cc.cfg.p, chosen.cc.cfg.v
    # CP-SAT fixed the rank totals; which of a rank's chunks holds its layers the step-time
    # formula cannot see, the schedule's simulation can (cost/layout.py)
    x = spread_layers(chosen.cc, chunks_from_ranks(rank_layers(x, p_), p_, v_))
    chosen, x = _ties_to_less_memory(profile, cluster, chosen, x, survivors)
    solve_s = time.perf_counter() - t0
    return _build_plan(profile, cluster, global_batch_size, chosen.cc, x, survivors + pruned,
                       memory_fail, rejected, max_alternatives, optimal, solve_s)


TIE_RTOL = 1e-9   # step times this close are one time (float noise of the ns-integer model)


def _ties_to_less_memory(profile, cluster, chosen, x, survivors):
    """(configuration, layer split): CP-SAT's choice, or a survivor whose heuristic split is as
    fast and needs less memory per GPU — CP-SAT's objective is the step time alone, so among
    equal times its pick is arbitrary (ZeRO-3 at p = 1 gathers the whole chunk: no faster than
    ZeRO-1 and heavier). Only survivors whose upper bound reaches the chosen time are priced."""
    def priced(e, xe):
        pr = predict(profile, cluster, e.cc.cfg, xe, costs=e.cc)
        return pr.step_time_s, pr.memory_bytes_per_gpu
    best_t, best_m = priced(chosen, x)
    for e in survivors:
        if e is chosen or e.y is None or e.ub_s > best_t * (1 + TIE_RTOL):
            continue
        xe = spread_layers(e.cc, chunks_from_ranks(e.y, e.cc.cfg.p, e.cc.cfg.v))
        t, m = priced(e, xe)
        if t < best_t * (1 - TIE_RTOL) or (t <= best_t * (1 + TIE_RTOL) and m < best_m):
            chosen, x, best_t, best_m = e, xe, t, m
    return chosen, x


def _build_plan(profile, cluster, global_batch, cc, x, others, memory_fail, rejected,
                max_alternatives, optimal, solve_s) -> Plan:
    cfg = cc.cfg
    pred = predict(profile, cluster, cfg, x, costs=cc)
    stages, first = [], 0
    for c, n in enumerate(x):
        stages.append(Stage(chunk=c, rank=c % cfg.p, first_layer=first, last_layer=first + n,
                            embedding=c == 0, head=c == len(x) - 1))
        first += n
    alts = _alternatives(profile, cluster, cc, pred, others, memory_fail, rejected,
                         max_alternatives, optimal, solve_s)
    return Plan(t=cfg.t, p=cfg.p, d=cfg.d, c=cfg.c, cp_attention=cfg.cp_attention, ep=cfg.ep,
                v=cfg.v,
                micro_batch_size=cfg.micro_batch_size,
                num_microbatches=cfg.num_microbatches, schedule=cfg.schedule,
                recompute=cfg.recompute, sequence_parallel=cfg.sequence_parallel, zero=cfg.zero,
                microbatch_group=cfg.microbatch_group,
                stages=tuple(stages), predicted=pred, global_batch_size=global_batch,
                seq_len=profile.seq_len, cluster=cluster.name, model=profile.name,
                num_layers=profile.num_layers, alternatives=tuple(alts))


_TERMS = (("bubble", "bubble_s"), ("data-parallel comm exposed", "dp_comm_s"),
          ("pipeline p2p", "pp_comm_s"), ("tensor-parallel comm", "tp_comm_s"),
          ("context-parallel comm", "cp_comm_s"), ("expert-parallel comm", "ep_comm_s"),
          ("compute", "compute_s"), ("optimizer", "optimizer_s"))


def _why_slower(alt: Prediction, chosen: Prediction, top: int = 2) -> str:
    """': bubble 0.12 s larger, data-parallel comm exposed 0.05 s larger' — the cost terms
    (critical rank, cost.model.predict) by which an alternative exceeds the chosen plan."""
    diffs = sorted(((getattr(alt, f) - getattr(chosen, f), name) for name, f in _TERMS),
                   reverse=True)
    parts = [f"{name} {d:.3g} s larger" for d, name in diffs[:top] if d > 0.0005 * max(
        chosen.step_time_s, 1e-9)]
    return (": " + ", ".join(parts)) if parts else ""


def _alternatives(profile, cluster, cc, pred, others, memory_fail, rejected, limit, optimal,
                  solve_s) -> list[Alternative]:
    chosen_key = _config_dict(cc.cfg)
    status = "optimal" if optimal else "best found within the time limit"
    alts = [Alternative(config=chosen_key, predicted=pred, feasible=True,
                        reason=f"chosen ({status}; CP-SAT solve {solve_s:.2f} s)")]
    ranked = []
    for e in others:
        if e.cfg == cc.cfg:
            continue
        if e.y is not None and not e.note:
            x = chunks_from_ranks(e.y, e.cc.cfg.p, e.cc.cfg.v)
            pr = predict(profile, cluster, e.cc.cfg, x, costs=e.cc)
            ranked.append(Alternative(
                config=_config_dict(e.cc.cfg), predicted=pr, feasible=True,
                reason=_not_chosen_reason(pr, pred)))
        elif not e.note:
            ranked.append(Alternative(config=_config_dict(e.cfg), predicted=None,
                                      feasible=False, reason="memory: no stage split found "
                                      "that fits (heuristic); not chosen by CP-SAT"))
    # the closest combinations pruned by their bound: price them too (heuristic split), so the
    # explanation shows their cost terms; the rest keep the bound as their reason
    bounded = sorted((e for e in others if e.note and e.cfg != cc.cfg), key=lambda e: e.lb_s)
    keep = max(0, limit // 2)
    for e in bounded[:keep]:
        ecc = e.cc or config_costs(profile, cluster, e.cfg)
        y = heuristic_partition(ecc, profile.num_layers)
        if y is None:
            continue
        x = chunks_from_ranks(y, e.cfg.p, e.cfg.v)
        pr = predict(profile, cluster, e.cfg, x, costs=ecc)
        ranked.append(Alternative(
            config=_config_dict(e.cfg), predicted=pr, feasible=True,
            reason=f"slower: {pr.step_time_s:.4g} s vs {pred.step_time_s:.4g} s"
                   + _why_slower(pr, pred) + f" ({e.note.removeprefix('slower: ')})"))
    ranked.sort(key=lambda a: (not a.feasible, a.predicted.step_time_s if a.predicted else 0))
    alts += ranked[:keep]
    alts += [Alternative(config=_config_dict(e.cfg), predicted=None, feasible=False,
                         reason=e.note) for e in bounded[keep: keep + max(0, limit // 4)]]
    mem = sorted(memory_fail, key=lambda e: e.mem_lb)
    alts += [Alternative(config=_config_dict(e.cfg), predicted=None, feasible=False,
                         reason=e.note) for e in mem[: max(0, limit // 8)]]
    rules, seen = [], set()
    for r in rejected:  # one entry per distinct rule (e.g. "tensor group would span nodes")
        key = re.sub(r"\d+", "#", r.reason)
        if key not in seen:
            seen.add(key)
            rules.append(Alternative(config=r.config, predicted=None, feasible=False,
                                     reason=r.reason))
    rules = rules[: max(1, limit // 8)]
    return alts[: max(1, limit + 1 - len(rules))] + rules


def _not_chosen_reason(pr: Prediction, pred: Prediction) -> str:
    """Why a priced alternative lost to the chosen plan: slower, or as fast with more memory."""
    if pr.step_time_s <= pred.step_time_s * (1 + TIE_RTOL):
        return (f"as fast ({pr.step_time_s:.4g} s), more memory: "
                f"{pr.memory_bytes_per_gpu / GIB:.2f} GiB vs {pred.memory_bytes_per_gpu / GIB:.2f}"
                f" GiB per GPU (ties go to the smaller memory)")
    return f"slower: {pr.step_time_s:.4g} s vs {pred.step_time_s:.4g} s" + _why_slower(pr, pred)


def _no_config_message(profile, gpus, global_batch, pins, rejected) -> str:
    reasons = sorted({r.reason for r in rejected})[:5]
    return (f"solve: no configuration of {gpus} GPUs satisfies the rules and pins "
            f"({', '.join(f'{k}={v}' for k, v in vars(pins).items() if v is not None) or 'none'})"
            f" for global_batch_size={global_batch}: " + "; ".join(reasons)
            + ". Fix: relax a pin, or use a GPU count / batch size with more divisors")


def _no_fit_message(profile, cluster, gpus, pins, failed) -> str:
    least = min((e.mem_lb for e in failed), default=math.inf)
    helps = []
    if pins.recompute not in (None, "full"):
        helps.append("unpin recompute (full recompute keeps only layer inputs)")
    if pins.zero is not None and pins.zero != 3:
        helps.append("unpin zero (ZeRO-1/3 shard the optimizer states / weights)")
    for knob in ("t", "p", "micro_batch_size"):
        if getattr(pins, knob) is not None:
            helps.append(f"unpin {knob}")
    helps.append(f"more GPUs than {gpus} (more pipeline/tensor/data sharding)")
    helps.append("a GPU with more memory")
    cap = cluster.usable_memory_bytes
    return (f"solve: model {profile.name!r} ({profile.params_elems / 1e9:.2f} B parameters) fits "
            f"under no plan on {gpus} GPUs of {cluster.name}: the least memory any plan needs is "
            f"{least / GIB:.1f} GiB per GPU > {cap / GIB:.1f} GiB usable. Fix: "
            + "; or ".join(helps))
