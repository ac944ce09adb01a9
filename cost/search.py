"""The planner's branch and bound: which knob combinations get priced, in which order.

cost/families.py enumerates the combinations the rules allow in families (bounds.Family: one
(t, c, p, d, ep, b, recompute, sp, attention method) with its schedules, v, N and ZeRO levels),
without building them. `search` then works best-first on one heap of families and
combinations, keyed by a lower bound of their step time:
  - a family's bound (`family_bound_s`) holds for every member: from the loads alone, with
    the largest v·bubble_div of its rows (the bubble shrinks with it), plus the least tail
    of its sharded ZeRO levels when only those fit (`_family_tail_s`);
  - a combination's is bounds.quick_lower_bound_scaled (its own v, N, ep and bubble
    divisor), shared through a memo by the ZeRO levels, plus for sharded weights (zero 2 /
    3) the least tail of their gathers (`_least_tail_s`: weight_gathers.least_counts, which
    no schedule's plan undercuts);
  - a combination popped with sharded weights is priced at those least gathers first
    (`_least_gathers_bound`: pruned or a memory failure without walking its schedule), then
    in full (cost.model.config_costs), bounded again over every partition
    (bounds.lower_bound_scaled), and split by the heuristic (an upper bound that lowers
    `best`).
A family is built only when popped, i.e. when its bound does not exceed the best plan found
so far; the search stops when the smallest bound left exceeds it (branch and bound:
nothing left can win). Every bound is at most the full price's, so the chosen plan is the
one pricing everything would give (tests/unit/test_search_work.py against cost/bruteforce.py);
what the bounds change is what is never built or priced (counted in SolveStats).
Members whose states, or states and least activations, overflow a GPU are never pushed
(`search`'s build, from their keys); memory failures are kept as (bytes, maker) and built only
for the few Plan.explain() shows (`_Failures`); a ZeRO level of a family whose states, or
states and the family's least activations, overflow is kept as one group and its members are
not even enumerated unless the explanation reaches them. For the explanation the search goes on past
the best, building families, until the `need` closest pruned combinations are known.
Families whose weights, gradients and optimizer states alone overflow a GPU at every ZeRO
level they offer are never built: each is reported as one memory failure (its least-memory
member).
"""
from __future__ import annotations

import bisect
import heapq
import math
from typing import Callable

from autopar.cost.hardware import Cluster
from autopar.cost.memo import CostMemo
from autopar.cost.memory import (least_activation_bytes, memory_coefficients,
                                 step_input_bytes)
from autopar.cost.model import (SCHEDULE_TRAITS, ZERO_TRAITS, Config, dp_terms_s,
                                layer_activation_bytes, layer_loads, p2p_load_ns,
                                optimizer_step_s, rank_params,
                                config_costs, state_bytes_lower_bound,
                                step_time_scaled)
from autopar.cost.profile import ModelProfile
from autopar.weight_gathers import least_counts
from autopar.cost.bounds import (GIB, Family, SolveStats, _Evaluated, heuristic_partition,
                                 lower_bound_scaled, memory_lower_bound,
                                 quick_bound_scaled_ns)
from autopar.cost.comm import p2p_hop_s

# float slack on the family bound: it must never exceed a member's quick bound, which is
# computed along another path of float operations
_SLACK = 1 - 1e-9


def family_bound_s(profile: ModelProfile, cluster: Cluster, fam: Family,
                   memo: CostMemo) -> float:
    """A lower bound of the step time (s) of every member of `fam`.

    A member's step is m·max τ + (Σ τ − max τ)/V + tail (cost.model.scaled_step_ns, V = v ·
    bubble_div), at least (m − 1/V)·max τ + Σ τ/V: increasing in max τ and Σ τ, and for
    Σ τ >= max τ decreasing in V. So with Σ τ >= S (the loads without p2p, the same at every v
    and N), max τ >= max(S/p, a layer + the embedding, a layer + the head) and V <= the
    family's largest, the bound holds for every member (all of one ep: its all-to-alls and
    its most loaded expert rank are in the loads)."""
    # the loads but the p2p: the same integers at every p, d, v and N (CostMemo.layer_parts),
    # so one layer_parts per (t, c, method, ep, b, recompute, sp) serves every family
    key = (fam.t, fam.c, fam.how, fam.ep, fam.b, fam.recompute, fam.sp)
    layer_ns = memo.family_loads.get(key)
    if layer_ns is None:
        cfg = Config(t=fam.t, p=fam.p, d=fam.d, c=fam.c, cp_attention=fam.how, ep=fam.ep, v=1,
                     micro_batch_size=fam.b, num_microbatches=fam.m, recompute=fam.recompute,
                     sequence_parallel=fam.sp)
        # load_costs' integers but the p2p: no pipeline p2p priced per family (and a layer's
        # load in s: the quick bound's p2p reads it)
        lc, layer_s = layer_loads(profile, cluster, cfg, memo)
        layer_ns = memo.family_loads[key] = (lc.layer_ns, lc.embed_ns, lc.head_ns, layer_s)
    layer, embed, head, _ = layer_ns
    total = layer * profile.num_layers + embed + head
    most = max(total / fam.p, layer + embed, layer + head)
    V = fam.bubble_v   # the largest v·bubble_div of its rows
    return ((fam.m - 1 / V) * most + total / V) / 1e9 * _SLACK


def _state_memo(profile: ModelProfile, cfg: Config, memo: CostMemo) -> float:
    # (sequence parallelism can change what the tensor-parallel pass replicates; the key is
    # a family's and a ZeRO level's: _memory_family builds it from those)
    key = (cfg.t, cfg.c, cfg.ep, cfg.p, cfg.d, cfg.zero, cfg.sequence_parallel)
    if key not in memo.state_bytes:
        memo.state_bytes[key] = state_bytes_lower_bound(profile, cfg)
    return memo.state_bytes[key]


def _memory_family(profile, cluster, fam: Family, memo: CostMemo,
                   least_states: dict) -> _Evaluated | None:
    """The family's least-memory member as a memory failure, if even its weights, gradients
    and optimizer states overflow (then so do every member's); else None. `least_states`:
    the search's memo of (which first member is least, its bytes) per the keys they read."""
    firsts = fam.first_of_each_zero()
    lkey = (fam.t, fam.c, fam.ep, fam.p, fam.d, fam.sp, tuple(z for *_, z in firsts))
    found = least_states.get(lkey)
    if found is None:
        def state(k: int) -> float:   # _state_memo's, its Config built on a miss only
            key = (fam.t, fam.c, fam.ep, fam.p, fam.d, firsts[k][3], fam.sp)
            if key not in memo.state_bytes:
                return _state_memo(profile, fam.config(*firsts[k]), memo)
            return memo.state_bytes[key]
        k = min(range(len(firsts)), key=state)
        found = least_states[lkey] = (k, state(k))
    k, least = found
    if least <= cluster.usable_memory_bytes:
        return None
    return _state_failure(cluster, fam.config(*firsts[k]), 0.0, least)


def _activation_bytes(profile, cluster, member: tuple, memo: CostMemo) -> float:
    """memory.activation_bytes_lower_bound of a member (fam, schedule, v, N, zero), without
    its Config: a layer's activation bytes memoised by the (t, c, method, b, recompute, sp)
    they depend on (the context rank's profile, one per c and method)."""
    fam, schedule, v, group, _ = member
    key = (fam.t, fam.c, fam.how, fam.b, fam.recompute, fam.sp)
    layer = memo.activation_bytes.get(key)
    if layer is None:
        ctx = memo.context_profile(profile, _config(member))
        layer = memo.activation_bytes[key] = layer_activation_bytes(
            ctx, fam.t, fam.b, fam.recompute, fam.sp and fam.t > 1)
    return (least_activation_bytes(layer, schedule, fam.p, v, fam.m, group, profile.num_layers)
            + step_input_bytes(profile, fam.b, fam.m))


def _quick_bound_s(profile: ModelProfile, cluster: Cluster, member: tuple, div: int,
                   memo: CostMemo, hops: dict) -> float:
    """bounds.quick_lower_bound_scaled / v in s of a member (fam, schedule, v, N, zero) whose
    schedule has bubble divisor `div`, without its Config: load_costs' integers from the
    family's loads (`family_bound_s`, the same at every v and N) and its p2p from one hop
    per (t, c, method, p, d, b, sp) (comm.p2p_hop_s, kept in `hops`) spread over its chunks
    as comm.pipeline_p2p_s does."""
    fam, _, v, group, _ = member
    layer, embed, head, layer_s = memo.family_loads[
        (fam.t, fam.c, fam.how, fam.ep, fam.b, fam.recompute, fam.sp)]
    p, l = fam.p, profile.num_layers
    p2p = 0
    if p > 1:
        hkey = (fam.t, fam.c, fam.how, p, fam.d, fam.b, fam.sp)
        one = hops.get(hkey)
        if one is None:
            cfg = _config(member)
            one = hops[hkey] = p2p_hop_s(memo.rank_profile(profile, cluster, cfg), cluster, cfg)
        p2p = p2p_load_ns(one, p, v, group, layer_s, l, cluster.comm_overlap)
    return float(quick_bound_scaled_ns(layer, embed, head, p2p, p, v, fam.m, div, l)) / v / 1e9


def _level_states(profile, fam: Family, memo: CostMemo) -> tuple[tuple[int, float], ...]:
    """(zero, weights + gradients + optimizer bytes) of each ZeRO level `fam` offers, in the
    order its rows first offer them (`_state_memo`, its Config built on a miss only)."""
    out = []
    for first in fam.first_of_each_zero():
        zero = first[3]
        state = memo.state_bytes.get((fam.t, fam.c, fam.ep, fam.p, fam.d, zero, fam.sp))
        if state is None:
            state = _state_memo(profile, fam.config(*first), memo)
        out.append((zero, state))
    return tuple(out)


def _first_order(fam: Family, seq: int, zero: int) -> tuple[int, int, int]:
    """The order found (_Failures) of the first member of ZeRO level `zero` in the `seq`-th
    family built: (seq, row, its place among the row's levels)."""
    for r, (*_, zeros) in enumerate(fam.rows):
        for zpos, (_, z) in enumerate(zeros):
            if z == zero:
                return seq, r, zpos
    raise ValueError(f"_first_order: zero={zero} is not a level of the family; pass one of "
                     f"{sorted(fam.zeros())}")


def _level_failures(fam: Family, seq: int, zero: int, state: float,
                    acts: list[float] | None) -> Callable[[], list[tuple]]:
    """The maker of the `_Failures` items of every member of ZeRO level `zero` of `fam`: its
    states alone overflow (`acts` None), or its states and each row's least activations."""
    def members() -> list[tuple]:
        out = []
        for r, (_, schedule, v, group, zeros) in enumerate(fam.rows):
            for zpos, (_, z) in enumerate(zeros):
                if z == zero:
                    member = (fam, schedule, v, group, zero)
                    out.append((state, (seq, r, zpos), _state_of, member, 0.0) if acts is None
                               else (state + acts[r], (seq, r, zpos), _activation_of, member,
                                     0.0))
        return out
    return members


def _sharded_fits(fam: Family, memo: CostMemo, usable: float,
                  sharded: set[int]) -> tuple[int, ...]:
    """The ZeRO levels of `fam` whose states fit a GPU when all are sharded-weight levels
    (the others' members fail memory when popped and can never be the plan), else ()."""
    fits = tuple(z for *_, z in fam.first_of_each_zero()
                 if memo.state_bytes[(fam.t, fam.c, fam.ep, fam.p, fam.d, z, fam.sp)] <= usable)
    return fits if fits and set(fits) <= sharded else ()


def _family_tail_s(profile, cluster, fam: Family, memo: CostMemo, tmemo: dict,
                   fits: tuple[int, ...]) -> float:
    """A lower bound (s) of the tail of every member of `fam` that fits its states, given
    `fits` (`_sharded_fits`: only sharded-weight ZeRO levels fit): the least `_least_tail_s`
    over them at the family's largest v (the least tail shrinks as v grows: each chunk's
    gathers and reduce-scatters are 1/v of the layer's). `tmemo` is the search's memo of
    least tails."""
    _, schedule, v, group, _ = fam.widest   # the first row of the largest v
    tails = []
    for zero in fits:
        tkey = (fam.t, fam.c, fam.how, fam.ep, fam.p, fam.d, fam.sp, zero, v)
        if tkey not in tmemo:
            tmemo[tkey] = _least_tail_s(profile, cluster, fam.config(schedule, v, group, zero),
                                        memo)
        tails.append(tmemo[tkey])
    return min(tails)


class _Failures:
    """The search's memory failures, each as (bytes, order, kind, member, bound): ~10^5 per
    large solve, of which the explanation shows the few needing the least memory
    (solver._alternatives) and the error the least, so only `least(k)` builds them (their
    Configs included) by `kind` (_state_of / _activation_of; None: built already). `order`
    is where it was found, a tuple: (n,) for one found alone, (n, row, level) for the members
    of the n-th family built (`stamp`), in that family's row and ZeRO-level order. A ZeRO
    level all of whose members fail is kept as one group (`group`: its least bytes, its first
    member's order and a maker of its members), expanded only if `least` reaches it."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.items: list[tuple] = []
        self.found = 0

    def stamp(self) -> int:
        """The next place in the order found."""
        self.found += 1
        return self.found

    def append(self, e: _Evaluated) -> None:
        self.items.append((e.mem_lb, (self.stamp(),), None, e, 0.0))

    def lazy(self, need_bytes: float, kind: Callable[..., _Evaluated], member: tuple,
             bound: float = 0.0, order: tuple | None = None) -> None:
        self.items.append((need_bytes, order or (self.stamp(),), kind, member, bound))

    def group(self, least_bytes: float, order: tuple, members: Callable[[], list]) -> None:
        """Members of at least `least_bytes`, the first at `order`, made by `members()` as
        items (the key, (least_bytes, order), is at most each member's)."""
        self.items.append((least_bytes, order, _GROUP, members, 0.0))

    def least(self, k: int) -> list[_Evaluated]:
        """The k failures of least memory (ties: the first found), in the order found: popped
        by (bytes, order) from one heap, a group's members pushed when the group is popped."""
        heap = list(self.items)   # (bytes, order) is unique: the rest is never compared
        heapq.heapify(heap)
        kept = []
        while heap and len(kept) < k:
            item = heapq.heappop(heap)
            if item[2] is _GROUP:
                for member in item[3]():
                    heapq.heappush(heap, member)
            else:
                kept.append(item)
        kept.sort(key=lambda x: x[1])
        return [e if kind is None else kind(self.cluster, e, bound, need)
                for need, _, kind, e, bound in kept]


def _GROUP() -> None:
    """The kind of a `_Failures.group` entry (a marker, never called)."""


def _state_of(cluster: Cluster, member: tuple, bound: float, state: float) -> _Evaluated:
    """The failure of a member whose states alone overflow (`_state_failure`)."""
    return _state_failure(cluster, _config(member), bound, state)


def _activation_of(cluster: Cluster, member: tuple, bound: float, need: float) -> _Evaluated:
    """... whose states and least activations overflow."""
    return _Evaluated(cc=None, cfg=_config(member), lb_s=bound, mem_lb=need, note=(
        f"memory: weights, optimizer states and the activations the schedule keeps "
        f"need at least {need / GIB:.1f} GiB > "
        f"{cluster.usable_memory_bytes / GIB:.1f} GiB usable per GPU"))


def _state_failure(cluster: Cluster, cfg: Config, bound: float, state: float) -> _Evaluated:
    return _Evaluated(cc=None, cfg=cfg, lb_s=bound, mem_lb=state, note=(
        f"memory: weights, gradients and optimizer states alone need {state / GIB:.1f} GiB > "
        f"{cluster.usable_memory_bytes / GIB:.1f} GiB usable per GPU"))


def search(profile: ModelProfile, cluster: Cluster, families: list[Family], need: int = 0,
           stats: SolveStats | None = None, memo: CostMemo | None = None
           ) -> tuple[list[_Evaluated], list[_Evaluated], list[_Evaluated]]:
    """(evaluated, memory failures, pruned): the combinations priced (with a heuristic split
    where one fits), those that overflow memory, and those pruned by a bound (with its note),
    the pruned ones including at least the `need` of least bound when that many exist (see the
    module docstring). `memo`: the solve's CostMemo (enumerate_families fills part of it), a
    new one if None. Why this size: the best-first loop keeps its heap, bound and memo in
    locals (the hot path of planning: attribute lookups cost measurable time here)."""
    stats = stats if stats is not None else SolveStats()
    l = profile.num_layers
    evaluated, pruned = [], []
    failures = _Failures(cluster)
    usable = cluster.usable_memory_bytes
    memo = CostMemo() if memo is None else memo
    qmemo: dict = {}
    hops: dict = {}    # one pipeline p2p hop per (t, c, method, p, d, b, sp): _quick_bound_s
    tmemo: dict = {}   # least tails and held bytes of sharded weights, by their keys
    hmemo: dict = {}
    least_states: dict = {}
    sharded = {z for z, traits in ZERO_TRAITS.items() if traits.sharded_weights}
    bdiv: dict = {}   # (schedule, recompute) -> the schedule's bubble divisor
    heap: list[tuple] = []
    stats.families += len(families)
    fits_at: dict = {}   # the ZeRO levels whose states fit, per (rows, t, c, ep, p, d, sp)
    for n, fam in enumerate(families):
        # the families of one (t, c, p, d, ep, b) share their rows (one tuple): the memory
        # check and the levels that fit read nothing else of them but sp
        fkey = (id(fam.rows), fam.t, fam.c, fam.ep, fam.p, fam.d, fam.sp)
        fits = fits_at.get(fkey)
        if fits is None:
            failed = _memory_family(profile, cluster, fam, memo, least_states)
            if failed is not None:
                stats.families_memory += 1
                failures.append(failed)
                continue
            fits = fits_at[fkey] = _sharded_fits(fam, memo, usable, sharded)
        bound = family_bound_s(profile, cluster, fam, memo)
        if fits:
            bound += _family_tail_s(profile, cluster, fam, memo, tmemo, fits) * _SLACK
        heap.append((bound, 0, fam.key + fam.sub, n))
    heapq.heapify(heap)

    def build(fam: Family) -> None:
        stats.families_built += 1
        ri, spi, hi = fam.sub
        seq = failures.stamp()
        states = _level_states(profile, fam, memo)
        acts = None   # each row's least activations (the same at every ZeRO level)
        live = {}     # the levels whose members are checked one by one: zero -> state bytes
        for zero, state in states:
            # a level whose states, or states and the family's least activations, overflow
            # a GPU fails at every member: one group, its members made only if explained
            if state > usable:
                failures.group(state, _first_order(fam, seq, zero),
                               _level_failures(fam, seq, zero, state, None))
                continue
            if acts is None:
                acts = [_activation_bytes(profile, cluster, (fam, schedule, v, group, zero),
                                          memo) for _, schedule, v, group, _ in fam.rows]
                least_act = min(acts)
            if state + least_act > usable:
                failures.group(state + least_act, _first_order(fam, seq, zero),
                               _level_failures(fam, seq, zero, state, acts))
                continue
            live[zero] = state
        if not live:
            return
        for r, (si, schedule, v, group, zeros) in enumerate(fam.rows):
            act, bound0 = acts[r], None   # a row's least activations and quick bound
            for zpos, (zi, zero) in enumerate(zeros):
                state = live.get(zero)
                if state is None:   # (its level failed as a group)
                    continue
                stats.configs += 1
                member = (fam, schedule, v, group, zero)
                # members whose states and least activations overflow a GPU are never pushed
                # (their bound cannot matter), kept as (bytes, maker): Configs built only
                # for those explained
                if state + act > usable:
                    failures.lazy(state + act, _activation_of, member, order=(seq, r, zpos))
                    continue
                # the quick bound depends on the loads only: shared by the ZeRO levels (each
                # expert degree has its own: its all-to-alls and its most loaded expert rank
                # are in the loads, and bounding ep > 1 by its ep = 1 twin priced ~10^5 MoE
                # configurations the all-to-alls alone rule out)
                if bound0 is None:
                    div = bdiv.get((schedule, fam.recompute))
                    if div is None:
                        div = bdiv[schedule, fam.recompute] = SCHEDULE_TRAITS[
                            schedule].bubble_div(fam.recompute)
                    qkey = (fam.t, fam.c, fam.how, fam.p, fam.d, fam.ep, v, fam.b,
                            fam.recompute, fam.sp, div, group)
                    if qkey not in qmemo:
                        stats.quick_bounds += 1
                        qmemo[qkey] = _quick_bound_s(profile, cluster, member, div, memo, hops)
                    bound0 = qmemo[qkey]
                bound = bound0
                if zero in sharded:   # the least tail of its ZeRO level (_least_tail_s)
                    tkey = (fam.t, fam.c, fam.how, fam.ep, fam.p, fam.d, fam.sp, zero, v)
                    if tkey not in tmemo:
                        tmemo[tkey] = _least_tail_s(profile, cluster,
                                                    fam.config(schedule, v, group, zero), memo)
                    bound = (bound + tmemo[tkey]) * _SLACK
                # (keys are unique: the member itself is never compared; its Config is built
                # only if popped)
                heapq.heappush(heap, (bound, 1, fam.key + (si, ri, spi, zi, hi), member))

    best_ub = math.inf
    while heap and heap[0][0] <= best_ub:
        bound, kind, _, item = heapq.heappop(heap)
        if kind == 0:
            build(families[item])
            continue
        fam, schedule, v, group, zero = item
        if zero in sharded:   # the least gathered working set too (_least_held_bytes)
            hkey = (fam.t, fam.c, fam.how, fam.ep, fam.p, fam.d, fam.sp, zero, v)
            if hkey not in hmemo:
                hmemo[hkey] = _least_held_bytes(profile, cluster, _config(item), memo)
            need_bytes = hmemo[hkey] + _activation_bytes(profile, cluster, item, memo)
            if need_bytes > usable:
                failures.lazy(need_bytes, _activation_of, item, bound)
                continue
        cfg = _config(item)
        if zero in sharded:
            failed = _least_gathers_bound(profile, cluster, cfg, memo, best_ub, stats)
            if failed is not None:
                (pruned if failed.note.startswith("slower") else failures).append(failed)
                continue
        stats.priced += 1
        cc = config_costs(profile, cluster, cfg, memo)
        e = _Evaluated(cc=cc, cfg=cfg, lb_s=float(lower_bound_scaled(cc, l)) / cfg.v / 1e9)
        if e.lb_s > best_ub:
            e.note = f"slower: lower bound {e.lb_s:.4g} s > best {best_ub:.4g} s"
            pruned.append(e)
            continue
        e.y = heuristic_partition(cc, l)
        if e.y is not None:
            e.ub_s = float(step_time_scaled(cc, e.y)) / cfg.v / 1e9
            best_ub = min(best_ub, e.ub_s)
        else:
            e.mem_lb = memory_lower_bound(cc, l)
            if e.mem_lb > cc.capacity_bytes:
                e.note = (f"memory: needs at least {e.mem_lb / GIB:.1f} GiB > "
                          f"{cc.capacity_bytes / GIB:.1f} GiB usable per GPU")
                failures.append(e)
                continue
        evaluated.append(e)
    _closest_pruned(heap, families, build, evaluated, pruned, best_ub, need)
    return evaluated, failures.least(max(need, 1)), pruned


def _least_tail_s(profile: ModelProfile, cluster: Cluster, cfg: Config,
                  memo: CostMemo) -> float:
    """A lower bound (s) of the tail (exposed gradient reduction and weight gathers, the
    optimizer step: step.rank_tail_terms_ns) of every sharded-weight configuration (zero 2 /
    3) sharing cfg's (t, c, attention method, ep, p, d, sp, zero, v): cfg's data-parallel
    terms at the least gathers (weight_gathers.least_counts: each exposed whole at lead 0,
    so neither the schedule, N, b, m nor recompute enters), summed over the layers as
    step.total_tail_ns does and spread evenly over the p ranks (the max is at least the
    mean). Each of the full price's rounded terms is within 1 ns of a term at least this
    one's, hence the 2l + p + 4 ns given back."""
    rank = memo.rank_profile(profile, cluster, cfg)
    params = rank_params(rank, cfg)
    least = least_counts(ZERO_TRAITS[cfg.zero].keep(cfg.v), cfg.v)
    dp, hidden, first, last, each = dp_terms_s(rank, cluster, cfg, params,
                                               memo.block_times_s(rank, cluster, cfg), 0.0,
                                               least)
    # without the gradient accumulation (`grad_accumulate_s`, m − 1 a step): b and m vary
    # among the configurations sharing the key, and one micro-batch accumulates nothing
    opt, opt_first, opt_last = optimizer_step_s(cluster, cfg, params, rank, accumulate=False)
    l = profile.num_layers
    total = (dp - hidden + opt) * l + first + last + opt_first + opt_last + cfg.p * each
    return max(0.0, total - (2 * l + 4 + cfg.p) / 1e9) / cfg.p


def _least_held_bytes(profile: ModelProfile, cluster: Cluster, cfg: Config,
                      memo: CostMemo) -> float:
    """A lower bound of the weights, gradients, optimizer states and gathered working set a
    sharded-weight configuration's busiest rank holds, for every one sharing cfg's keys of
    `_least_tail_s`: cfg's memory coefficients (those config_costs would give) at the least
    gathers, spread evenly over the p ranks; its loads and tail are not needed here."""
    rank = memo.rank_profile(profile, cluster, cfg)
    _, _, parts, fixed_parts, _ = memory_coefficients(
        rank, cluster, cfg, rank_params(rank, cfg),
        least_counts(ZERO_TRAITS[cfg.zero].keep(cfg.v), cfg.v))
    return (min(sum(layer[:3]) for layer in parts) * profile.num_layers
            + sum(sum(fixed[:3]) for fixed in fixed_parts)) / cfg.p


def _least_gathers_bound(profile: ModelProfile, cluster: Cluster, cfg: Config, memo: CostMemo,
                         best_ub: float, stats: SolveStats) -> _Evaluated | None:
    """A sharded-weight configuration (zero 2 / 3) priced at the least gathers any schedule
    could do (weight_gathers.least_counts: every tail and memory coefficient at most its own,
    the loads the same), before its schedule is walked: pruned (note 'slower') when even
    that step's bound exceeds `best_ub`, a memory failure when even that needs more than a
    GPU over every split, else None (price it in full). Either outcome is the one its full
    price would give (a larger bound, more memory), the plan unchanged; cc is left None so
    the explanation prices what it shows in full."""
    stats.least_priced += 1
    keep = ZERO_TRAITS[cfg.zero].keep(cfg.v)
    low = config_costs(profile, cluster, cfg, memo, gathers=least_counts(keep, cfg.v))
    l = profile.num_layers
    bound = float(lower_bound_scaled(low, l)) / cfg.v / 1e9
    if bound > best_ub:
        return _Evaluated(cc=None, cfg=cfg, lb_s=bound, note=(
            f"slower: lower bound {bound:.4g} s > best {best_ub:.4g} s"))
    need = memory_lower_bound(low, l)
    if need > low.capacity_bytes:
        return _Evaluated(cc=None, cfg=cfg, lb_s=bound, mem_lb=need, note=(
            f"memory: needs at least {need / GIB:.1f} GiB > "
            f"{low.capacity_bytes / GIB:.1f} GiB usable per GPU"))
    return None


def _config(member: tuple) -> Config:
    fam, schedule, v, group, zero = member
    return fam.config(schedule, v, group, zero)


def _closest_pruned(heap, families, build, evaluated, pruned, best_ub, need) -> None:
    """Pop on past `best_ub` until the `need` pruned combinations of least bound are known
    (every one left on the heap, or in a family not built, has a bound >= the heap's top).
    Why this size: it continues `search`'s loop on `search`'s own state (heap, lists, memo)."""
    known = sorted([e.lb_s for e in pruned] + [e.lb_s for e in evaluated if e.lb_s > best_ub])
    popped = 0
    while heap and bisect.bisect_right(known, heap[0][0]) + popped < need:
        bound, kind, _, item = heapq.heappop(heap)
        if kind == 0:
            build(families[item])
            continue
        popped += 1   # (members that overflow memory were never pushed)
        pruned.append(_Evaluated(cc=None, cfg=_config(item), lb_s=bound, note=(
            f"slower: lower bound {bound:.4g} s > best {best_ub:.4g} s")))
