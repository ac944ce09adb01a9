"""CP-SAT planner: the fastest (t, c, ep, p, d, v, b, schedule, recompute, sp, zero, stages) that
fits.

The CP-SAT model (variables, objective, constraint families) is cost/cpsat.py's PlanModel;
the enumeration of the combinations (rules, pins, families) is cost/families.py's; this module
validates the request, runs the search and the model, and assembles the Plan with its ranked
alternatives (ties to less memory).
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
import re
import time
from typing import Any

from autopar.collector import collector_paused
from autopar.cost.hardware import Cluster, get_cluster
# the search's types and bounds (cost/bounds.py, shared with cost/search.py); chunk_minimums and
# chunks_from_ranks are re-exported for cost/bruteforce.py and the tests
from autopar.cost.bounds import (GIB, SolveStats, chunk_minimums, chunks_from_ranks,  # noqa: F401
                                 heuristic_partition)
from autopar.cost.cpsat import SOLVER_TIME_LIMIT_S, PlanModel  # noqa: F401
# the enumeration (cost/families.py); its public names re-exported for the callers of solve
from autopar.cost.families import (AUTO_SCHEDULES, MAX_CHUNKS_PER_RANK,  # noqa: F401
                                   MAX_MICRO_BATCH, Pins, Rejection, context_rule,
                                   cp_attention_rule, enumerate_configs, enumerate_families,
                                   pass_refusal, ring_attention_rule, tensor_degrees,
                                   tensor_rule, tensor_size_rule)
from autopar.cost.layout import chunk_times_ms, late_heavy, spread_layers
from autopar.cost.memo import CostMemo
from autopar.cost.model import (SCHEDULE_TRAITS, Config, config_costs, predict, rank_layers)
from autopar.cost.profile import ModelProfile
from autopar.plan import CP_ATTENTION, ZERO_LEVELS, Alternative, Plan, Prediction, Stage
from autopar.rules import degrees_refusal


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
    # the hybrids' rule needs c (a divisor k of c): asked here when c is pinned too
    asked = pins.cp_attention in ("ring", "all-to-all") or (
        pins.cp_attention in ("hybrid", "hybrid-ring") and pins.c is not None)
    if asked and (why := cp_attention_rule(profile, pins.cp_attention, pins.c or 1,
                                           pins.t or 1)):
        raise ValueError(f"solve: cp_attention={pins.cp_attention!r}: {why}; pin "
                         f"cp_attention='all-gather' or leave it None")
    if pins.c is not None:
        why = context_rule(profile, pins.c)
        if why:
            raise ValueError(f"solve: c={pins.c}: {why}; pad the sequence to a multiple of "
                             f"{2 * pins.c} or pick a c with 2c dividing {profile.seq_len}")
    if pins.t is not None:
        why = tensor_size_rule(profile, pins.t)
        if why:
            raise ValueError(f"solve: t={pins.t}: {why}; pick a t that divides them (the "
                             f"vocabulary {profile.vocab} needs no rule: it is padded to a "
                             f"multiple of 128·t)")
        if why := pass_refusal(profile, pins.t):       # the sizes divide; the graph not
            raise ValueError(f"solve: t={pins.t}: {why}; pick another t, or leave t unpinned "
                             f"so the planner chooses one")
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
    Why this size: one keyword per plan knob a user may pin (the Pins of autopar.request,
    validated there), plus the solver's own limits; the body validates, searches, solves and
    assembles, each a call.
    `schedules`: the schedules the solver may choose (None: AUTO_SCHEDULES, every one the
    cost model knows); a pinned `schedule` is always
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
    with collector_paused():
        return _solve(profile, cluster, gpus, global_batch_size, pins, max_alternatives, stats)


def _solve(profile: ModelProfile, cluster: Cluster, gpus: int, global_batch_size: int,
           pins: Pins, max_alternatives: int, stats: SolveStats | None) -> Plan:
    """`solve` after validation: enumerate, search, CP-SAT, ties, the walked memory fit and
    the plan."""
    from autopar.cost.search import search   # (search imports this module's bounds)
    t0 = time.perf_counter()
    memo = CostMemo()   # shared: the enumeration's exchange prices are the search's too
    families, rejected = enumerate_families(profile, cluster, gpus, global_batch_size, pins,
                                            memo)
    if not families:
        raise ValueError(_no_config_message(profile, gpus, global_batch_size, pins, rejected))
    stats = stats if stats is not None else SolveStats()
    evaluated, memory_fail, pruned = search(
        profile, cluster, families, max(0, max_alternatives // 2) + max(0, max_alternatives // 4),
        stats, memo)
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
    pm = PlanModel([e.cc for e in survivors], profile.num_layers, hint)
    k, x, _, optimal = pm.solve()
    if k < 0 and hint is not None:   # CP-SAT gave up (e.g. step times of ~1e8 s at a batch of
        (k, x), optimal = hint, False  # 10^9 overflow its integer model): the heuristic's split
    if k < 0:
        raise ValueError(_no_fit_message(profile, cluster, gpus, pins, memory_fail + survivors))
    chosen = survivors[k]
    p_, v_ = chosen.cc.cfg.p, chosen.cc.cfg.v
    # CP-SAT fixed the rank totals; which of a rank's chunks holds its layers the step-time
    # formula cannot see, the schedule's simulation can (cost/layout.py)
    x = spread_layers(chosen.cc, chunks_from_ranks(rank_layers(x, p_), p_, v_))
    chosen, x = _ties_to_less_memory(profile, cluster, chosen, x, survivors)
    chosen, x = _fit_walked_memory(profile, cluster, chosen, x, survivors)
    solve_s = time.perf_counter() - t0
    return _build_plan(profile, cluster, global_batch_size, chosen.cc, x, survivors + pruned,
                       memory_fail, rejected, max_alternatives, optimal, solve_s, memo)


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


WALKED_FIT_TRIES = 16   # survivors priced by the walk when the chosen split overflows it


def _fit_walked_memory(profile, cluster, chosen, x, survivors):
    """(configuration, layer split) whose walked memory fits the GPU. CP-SAT's memory rows are
    the linear form (in-flight chunk-micro-batches × the rank's mean layers per chunk); the
    schedule's walk (`memory.schedule_activation_bytes`, what the plan reports) is higher where
    a rank's chunks are uneven, since its early chunks hold the most micro-batches in flight
    (a 235 B MoE on 512 H100: 87.5 GiB walked on an 80 GB card). Kept if it fits; else the
    same rank totals placed late-heavy (`layout.late_heavy`, the same step-time formula);
    else the fastest of the first WALKED_FIT_TRIES survivors whose heuristic split fits, in
    either placement; else unchanged (the plan's memory then shows the overflow)."""
    def fits(e, xe) -> bool:
        pr = predict(profile, cluster, e.cc.cfg, xe, costs=e.cc)
        return pr.memory_bytes_per_gpu - cluster.reserved_bytes <= e.cc.capacity_bytes
    if fits(chosen, x):
        return chosen, x
    p_, v_ = chosen.cc.cfg.p, chosen.cc.cfg.v
    late = late_heavy(rank_layers(x, p_), p_, v_)
    if fits(chosen, late):
        return chosen, late
    others = sorted((e for e in survivors if e is not chosen and e.y is not None),
                    key=lambda e: e.ub_s)[:WALKED_FIT_TRIES]
    for e in others:
        p_, v_ = e.cc.cfg.p, e.cc.cfg.v
        for xe in (spread_layers(e.cc, chunks_from_ranks(e.y, p_, v_)), late_heavy(e.y, p_, v_)):
            if fits(e, xe):
                return e, xe
    return chosen, x


def _build_plan(profile, cluster, global_batch, cc, x, others, memory_fail, rejected,
                max_alternatives, optimal, solve_s, memo=None) -> Plan:
    """The Plan of the chosen configuration `cc` at layer split `x`, with its alternatives.
    Why this size: it hands `solve`'s results (the others priced, the memory failures, the
    rejections, the solve status) through to `_alternatives` unchanged."""
    cfg = cc.cfg
    pred = predict(profile, cluster, cfg, x, costs=cc)
    stages, first = [], 0
    for c, (n, (f_ms, b_ms)) in enumerate(zip(x, chunk_times_ms(cc, x))):
        stages.append(Stage(chunk=c, rank=c % cfg.p, first_layer=first, last_layer=first + n,
                            embedding=c == 0, head=c == len(x) - 1, fwd_ms=f_ms, bwd_ms=b_ms))
        first += n
    alts = _alternatives(profile, cluster, cc, pred, others, memory_fail, rejected,
                         max_alternatives, optimal, solve_s, memo)
    return Plan(t=cfg.t, p=cfg.p, d=cfg.d, c=cfg.c, cp_attention=cfg.cp_attention, ep=cfg.ep,
                v=cfg.v,
                micro_batch_size=cfg.micro_batch_size,
                num_microbatches=cfg.num_microbatches, schedule=cfg.schedule,
                recompute=cfg.recompute, sequence_parallel=cfg.sequence_parallel, zero=cfg.zero,
                microbatch_group=cfg.microbatch_group,
                stages=tuple(stages), predicted=pred, global_batch_size=global_batch,
                seq_len=profile.seq_len, cluster=cluster.name, model=profile.name,
                num_layers=profile.num_layers, elementwise=cluster.elementwise,
                alternatives=tuple(alts))


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
                  solve_s, memo=None) -> list[Alternative]:
    """The chosen configuration first, then the other priced ones ranked by step time, then
    memory failures and rejections, at most `limit`. Why this size: one list per kind of
    alternative, each built in its own short loop."""
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
        ecc = e.cc or config_costs(profile, cluster, e.cfg, memo)   # (the search's caches)
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
    if profile.input_bytes_per_sequence:
        helps.append(f"shorter rows: packed documents hand every rank its sequences' (T, T) "
                     f"boolean masks, {profile.input_bytes_per_sequence / GIB:.3g} GiB per "
                     f"sequence (or train each row as one document)")
    helps.append(f"more GPUs than {gpus} (more pipeline/tensor/data sharding)")
    helps.append("a GPU with more memory")
    cap = cluster.usable_memory_bytes
    return (f"solve: model {profile.name!r} ({profile.params_elems / 1e9:.2f} B parameters) fits "
            f"under no plan on {gpus} GPUs of {cluster.name}: the least memory any plan needs is "
            f"{least / GIB:.1f} GiB per GPU > {cap / GIB:.1f} GiB usable. Fix: "
            + "; or ".join(helps))

