"""The solver's search vocabulary and bounds, below cost/families.py (which enumerates),
cost/solver.py (which solves) and cost/search.py (which bounds families before building them): the family and
work-count types, the lower bounds of a combination's step time and memory, and the greedy
partition that is the pruning's upper bound. Pure functions of cost.model's ConfigCosts.
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Iterator

from autopar.cost.hardware import Cluster
from autopar.cost.memo import CostMemo
from autopar.cost.config import bubble_div
from autopar.cost.model import (SCHEDULE_TRAITS, Config, ConfigCosts, load_costs, rank_layers,
                                rank_load_ns, rank_tail_ns, total_load_ns, total_tail_ns,
                                v_step_ns)
from autopar.cost.step import (chunks_from_ranks, load_of_ns, scaled_step_of,  # noqa: F401
                               total_load_of_ns)   # chunks_from_ranks re-exported
from autopar.cost.profile import ModelProfile

GIB = 1024 ** 3   # every printed memory size is in GiB (issue 16: one unit)


@dataclass(frozen=True, kw_only=True)
class Family:
    """Knob combinations that share one load-only lower bound (cost/search.py family_bound_s):
    one (t, c, p, d, ep, micro-batch b, recompute, sp, attention method) and its `rows`, each
    (index, schedule, v, N, ((index, zero), ...)). `key` + `sub` place its members in
    enumeration order: a member's order is key + (schedule index, *sub[:2], zero index,
    sub[2]), the loops' order (t, c, p, ep, b, schedule, recompute, sp, zero, attention)."""
    key: tuple[int, ...]
    sub: tuple[int, int, int]
    t: int
    c: int
    p: int
    d: int
    ep: int
    b: int
    m: int
    recompute: str
    sp: bool
    how: str
    rows: tuple
    # facts of `rows` (shared by the families of one (t, c, p, d, ep, b), computed once there
    # by `row_facts`): the first member of each ZeRO level, the largest v·bubble_div at this
    # recompute, the first row of the largest v (the search reads them for ~10^4 families)
    firsts: tuple = ()
    bubble_v: int = 1
    widest: tuple = ()

    def configs(self) -> Iterator[tuple[tuple[int, ...], Config]]:
        """(enumeration order, configuration) of every member."""
        for si, schedule, v, group, zeros in self.rows:
            for zi, zero in zeros:
                yield self._member(si, schedule, v, group, zi, zero)

    def members(self) -> Iterator[tuple[tuple[int, ...], str, int, int | None, int]]:
        """(enumeration order, schedule, v, N, zero) of every member, in `configs` order,
        without building its Config (`config` does, for the few the search pops)."""
        ri, spi, hi = self.sub
        for si, schedule, v, group, zeros in self.rows:
            for zi, zero in zeros:
                yield self.key + (si, ri, spi, zi, hi), schedule, v, group, zero

    def config(self, schedule: str, v: int, group: int | None, zero: int,
               ep: int | None = None) -> Config:
        """The member (schedule, v, N, zero) as a Config (`ep`: another expert degree)."""
        return Config(t=self.t, p=self.p, d=self.d, c=self.c, cp_attention=self.how,
                      ep=self.ep if ep is None else ep, v=v, micro_batch_size=self.b,
                      num_microbatches=self.m, schedule=schedule, recompute=self.recompute,
                      sequence_parallel=self.sp, zero=zero, microbatch_group=group)

    def first_of_each_zero(self) -> tuple[tuple[str, int, int | None, int], ...]:
        """(schedule, v, N, zero) of the first member (in `configs` order) of each ZeRO level
        the family offers, in that order (`config` builds one)."""
        return self.firsts or first_of_each_zero(self.rows)

    def _member(self, si: int, schedule: str, v: int, group: int | None, zi: int,
                zero: int) -> tuple[tuple[int, ...], Config]:
        ri, spi, hi = self.sub
        return self.key + (si, ri, spi, zi, hi), self.config(schedule, v, group, zero)

    def with_ep(self, key: tuple[int, ...], ep: int) -> "Family":
        """This family at expert degree `ep`, placed at `key`: its rows, facts and the rest
        shared (a (t, c, p, d)'s rows do not depend on ep; dataclasses.replace's validation
        round trip cost more than the enumeration it saved, at ~4·10^4 families)."""
        out = object.__new__(Family)
        out.__dict__.update(self.__dict__, key=key, ep=ep)
        return out

    def zeros(self) -> set[int]:
        return {z for *_, z in self.first_of_each_zero()}


def first_of_each_zero(rows: tuple) -> tuple[tuple[str, int, int | None, int], ...]:
    """(schedule, v, N, zero) of the first member of `rows` (Family.rows) of each ZeRO level,
    in that order."""
    out, seen, last = [], set(), None
    for _, schedule, v, group, zeros in rows:
        if zeros is last:   # consecutive rows of a schedule share their levels' tuple
            continue
        last = zeros
        for _, zero in zeros:
            if zero not in seen:
                seen.add(zero)
                out.append((schedule, v, group, zero))
    return tuple(out)


def row_facts(rows: tuple) -> Callable[[str], dict]:
    """recompute -> Family's facts of `rows` at it (firsts, bubble_v, widest), as keywords;
    one pass over the rows serves every recompute."""
    firsts = first_of_each_zero(rows)
    widest = max(rows, key=lambda row: row[2])
    vmax: dict[str, int] = {}
    for _, schedule, v, _, _ in rows:
        if v > vmax.get(schedule, 0):
            vmax[schedule] = v
    return lambda recompute: dict(firsts=firsts, widest=widest, bubble_v=max(
        v * SCHEDULE_TRAITS[schedule].bubble_div(recompute) for schedule, v in vmax.items()))


@dataclass
class SolveStats:
    """The work of one solve, in counts (deterministic, unlike seconds): tests bound it so a
    new degree cannot silently multiply the search; benchmarks/planner.py prints it. Pass
    one to `solve(..., stats=)` to have it filled."""
    families: int = 0            # families enumerated (each bounded before it is built)
    families_built: int = 0      # of them, built: their bound did not exceed the best plan
    families_memory: int = 0     # of them, skipped: weights and optimizer states alone overflow
    configs: int = 0             # configurations enumerated (pushed on the search's heap)
    quick_bounds: int = 0        # load-only lower bounds computed (the rest shared, memoised)
    least_priced: int = 0        # sharded-weight ones priced at their least gathers first
    priced: int = 0              # configurations fully priced (cost.model.config_costs)
    candidates: int = 0          # configurations handed to CP-SAT


@dataclass
class _Evaluated:
    cc: ConfigCosts | None   # None when pruned before costing
    cfg: Config
    lb_s: float
    y: list[int] | None = None
    ub_s: float = math.inf
    mem_lb: float = 0.0
    note: str = ""
    extra: dict = field(default_factory=dict)


# ----- bounds and a heuristic partition -----------------------------------------------------
def chunk_minimums(p: int, v: int, num_layers: int) -> list[int]:
    """Least layers of each chunk: one, except that with more chunk slots than layers
    (p·v = l + 1 or l + 2) the first and the last chunk may hold none: they still hold the
    embedding and the head + loss (Llama 3's layout, 2407.21783 §3.3.2: 126 layers in 16 × 8
    chunks, the first only the embedding, the last only the output projection and loss)."""
    mins = [1] * (p * v)
    if p * v > num_layers:
        mins[0] = mins[-1] = 0
    return mins


def rank_minimums(p: int, v: int, num_layers: int) -> list[int]:
    """Least layers of each pipeline rank (the sum of its chunks' `chunk_minimums`)."""
    return list(_rank_minimums(p, v, num_layers))


@functools.lru_cache(maxsize=4096)
def _rank_minimums(p: int, v: int, num_layers: int) -> tuple[int, ...]:
    # every bound of every configuration asks; a handful of (p, v) per solve
    return tuple(rank_layers(chunk_minimums(p, v, num_layers), p))


def balance(fixed: list[int], slope: int, num_layers: int, v: "int | list[int]",
            caps: list[int],
            tie: "Callable[[int, int], int] | None" = None) -> list[int] | None:
    """Integer y_r in [lo_r, caps_r] with sum l minimising max_r (fixed_r + slope·y_r), or None
    (lo_r = v, or v[r] when v is a list of per-rank minimums).

    Start every rank at or below the continuous water level (which no integer solution beats),
    then hand out the remaining layers one by one to the rank whose level grows least (ties:
    smallest `tie(r, y_r + 1)`); this greedy is exact for a max of increasing linear loads.
    """
    p = len(fixed)
    lo = list(v) if isinstance(v, list) else [v] * p
    if any(caps[r] < lo[r] for r in range(p)) or sum(caps) < num_layers:
        return None
    s = max(slope, 1)
    level = (s * num_layers + sum(fixed)) / p
    y = [max(lo[r], min(caps[r], int((level - fixed[r]) // s))) for r in range(p)]
    if sum(y) > num_layers:
        y = list(lo)
    tie = tie or (lambda r, n: 0)
    heap = [(fixed[r] + s * (y[r] + 1), tie(r, y[r] + 1), r) for r in range(p) if y[r] < caps[r]]
    heapq.heapify(heap)
    for _ in range(num_layers - sum(y)):
        _, _, r = heapq.heappop(heap)
        y[r] += 1
        if y[r] < caps[r]:
            heapq.heappush(heap, (fixed[r] + s * (y[r] + 1), tie(r, y[r] + 1), r))
    return y


def lower_bound_scaled(cc: ConfigCosts, num_layers: int) -> int | Fraction:
    """A lower bound of v·step time over all partitions (memory ignored): the least max load
    and the least max tail, each minimised on its own over integer rank layer counts (every
    rank holds at least v layers, one per chunk)."""
    p, v = cc.cfg.p, cc.cfg.v
    lo = rank_minimums(p, v, num_layers)
    fixed = [rank_load_ns(cc, r, 0) for r in range(p)]
    y = balance(fixed, cc.layer_ns, num_layers, lo, [num_layers] * p)
    max_load = max(rank_load_ns(cc, r, y[r]) for r in range(p))
    # the exposed tails sum to the same for every split: their max is at least their mean
    tail = max(-(-total_tail_ns(cc, num_layers) // p),
               max(rank_tail_ns(cc, r, lo[r]) for r in range(p)))
    return v_step_ns(cc.cfg, max_load, total_load_ns(cc, num_layers), tail)


def memory_lower_bound(cc: ConfigCosts, num_layers: int) -> float:
    """min over fractional rank layer counts y_r >= v (sum l) of max_r memory_r(y_r).

    Every rank holds >= v layers, so the level is at least L0 = max_r (c_r + a_r·v); above L0
    rank r holds (L - c_r)/a_r layers, linear in L, so L* = max(L0, (l + Σ c/a) / Σ 1/a).
    """
    p, v = cc.cfg.p, cc.cfg.v
    a, c = cc.mem_layer_bytes, cc.mem_fixed_bytes
    lo = rank_minimums(p, v, num_layers)
    floor = max(c[r] + a[r] * lo[r] for r in range(p))
    if not all(a):
        return float(floor)
    level = (num_layers + sum(c[r] / a[r] for r in range(p))) / sum(1 / a[r] for r in range(p))
    return max(float(floor), level)


def heuristic_partition(cc: ConfigCosts, num_layers: int) -> list[int] | None:
    """Rank layer counts that fit in memory with the least max load (ties: least tail), or
    None when the greedy finds no split that fits. An upper bound for pruning, and the split
    shown for alternatives; CP-SAT decides the chosen plan's split."""
    p, v = cc.cfg.p, cc.cfg.v
    if sum(chunk_minimums(p, v, num_layers)) > num_layers:
        return None
    caps = []
    for r in range(p):
        room = cc.capacity_bytes - cc.mem_fixed_bytes[r]
        caps.append(num_layers if cc.mem_layer_bytes[r] == 0 else
                    max(0, min(num_layers, room // cc.mem_layer_bytes[r])))
    fixed = [rank_load_ns(cc, r, 0) for r in range(p)]
    return balance(fixed, cc.layer_ns, num_layers, rank_minimums(p, v, num_layers), caps,
                   tie=lambda r, n: rank_tail_ns(cc, r, n))


def quick_lower_bound_scaled(profile: ModelProfile, cluster: Cluster, cfg: Config,
                             memo: "CostMemo") -> int | Fraction:
    """v·step time lower bound from the loads alone (tail >= 0): `quick_bound_scaled_ns` of
    cfg's load_costs."""
    lc = load_costs(profile, cluster, cfg, memo)
    return quick_bound_scaled_ns(lc.layer_ns, lc.embed_ns, lc.head_ns, lc.p2p_ns, cfg.p, cfg.v,
                                 cfg.num_microbatches, bubble_div(cfg), profile.num_layers)


def quick_bound_scaled_ns(layer_ns: int, embed_ns: int, head_ns: int, p2p_ns: int, p: int,
                          v: int, m: int, div: int, num_layers: int) -> int | Fraction:
    """v·step time lower bound (`v_step_ns` at tail 0) from a configuration's integer loads:
    they sum to S for every split (total_load_ns), so their max is at least ceil(S/p), and at
    least the first and the last rank's with their fewest layers (rank_load_ns: they add the
    embedding and the head). `div`: the schedule's bubble divisor."""
    total = total_load_of_ns(layer_ns, p2p_ns, embed_ns, head_ns, p, num_layers)
    lo = rank_minimums(p, v, num_layers)
    first = load_of_ns(layer_ns, p2p_ns, embed_ns, head_ns, p, 0, lo[0])
    last = load_of_ns(layer_ns, p2p_ns, embed_ns, head_ns, p, p - 1, lo[-1])
    scaled = scaled_step_of(m, v * div, max(-(-total // p), first, last), total, 0)
    return scaled if div == 1 else Fraction(scaled, div)
