"""Brute-force planner for small instances: the check on cost/solver.py's CP-SAT optimum.

Enumerates the same knob combinations as the solver (`enumerate_configs`) and EVERY split of the
layers into p·v non-empty chunks, prices each with the same integer costs
(`cost.model.step_time_scaled`), and keeps the fastest that fits in memory. Exponential in the
layer count: tests only.
"""
from __future__ import annotations

from fractions import Fraction
from itertools import combinations
from typing import Iterator

from autopar.cost.hardware import Cluster, get_cluster
from autopar.cost.memo import CostMemo
from autopar.cost.model import Config, config_costs, fits, rank_layers, step_time_scaled
from autopar.cost.profile import ModelProfile
from autopar.cost.solver import Pins, chunk_minimums, enumerate_configs
from autopar.plan import Plan


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write `total` as an ordered sum of `parts` positive integers; with more
    parts than `total` (the solver's chunk_minimums), the first and the last may be 0."""
    lo = chunk_minimums(1, parts, total) if parts > 1 else [1]
    extra = [i for i in range(parts) if lo[i] == 0]
    for cuts in combinations(range(1, total + len(extra)), parts - 1):
        bounds = (0,) + cuts + (total + len(extra),)
        x = [bounds[i + 1] - bounds[i] for i in range(parts)]
        for i in extra:  # shift: a part of 1 here stands for 0 layers
            x[i] -= 1
        yield tuple(x)


def brute_force(profile: ModelProfile, cluster: "Cluster | str", *, gpus: int,
                global_batch_size: int, **pins) -> tuple[Fraction, Config, tuple[int, ...]] | None:
    """(step time in ns as an exact fraction, config, layers per chunk) of the optimum, or None
    when nothing fits."""
    cluster = get_cluster(cluster)
    configs, _ = enumerate_configs(profile, cluster, gpus, global_batch_size, Pins(**pins))
    best = None
    memo = CostMemo()  # pure functions' caches: the same integers as pricing each config alone
    for cfg in configs:
        cc = config_costs(profile, cluster, cfg, memo)
        for x in compositions(profile.num_layers, cfg.p * cfg.v):
            y = rank_layers(x, cfg.p)
            if not fits(cc, y):
                continue
            obj = Fraction(step_time_scaled(cc, y), cfg.v)
            if best is None or obj < best[0]:
                best = (obj, cfg, x)
    return best


def plan_objective(profile: ModelProfile, cluster: "Cluster | str", plan: Plan) -> Fraction:
    """The exact integer-cost step time (ns) of a plan, as the solver and brute force see it."""
    cluster = get_cluster(cluster)
    cc = config_costs(profile, cluster, Config.of_plan(plan))
    y = rank_layers([s.num_layers for s in plan.stages], plan.p)
    return Fraction(step_time_scaled(cc, y), plan.v)
