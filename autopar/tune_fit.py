"""The refit of `autopar tune` (autopar/tuning.py): each measured plan (`Trial`), the parts of
its predicted step that get scales of their own, the scales fitted to what was measured
(`fit_scales`), the plans to measure again before trusting them (`suspects`), and the
cluster refitted by them (`refit_cluster`).

Refit (`refit_cluster`): measured ≈ a · (kernels: compute + bubble + optimizer, less the
host's per-op dispatch) + h · (that dispatch) + b · (the collectives' terms) + c · (the
pipeline's send/recv), least absolute relative error (numpy, reweighted least squares)
over the measured plans, so one plan the scales cannot fit does not move the rest (h apart
from a, c apart from b only where the plans can tell them apart: `fit_scales`; so too the
tensor-parallel collectives and the context-parallel exchange, each apart from b only
where it earns its keep); the
cluster's compute rates (gemm_max_efficiency, the flash efficiencies,
elementwise_efficiency; peak_flops and hbm_bandwidth_Bps where an efficiency would pass 1)
divided by a (its host work measured in real blocks multiplied: op recompute's per op,
the optimizer's per parameter and tensor), its per-op dispatch measured on ops in
isolation (launch, autograd, the zb split's per-op work) multiplied by h, its link
bandwidths divided and latencies (and measured collective curves' times) multiplied by b,
its pipeline messages' (`Cluster.pipeline_p2p_scale`) by c, its TP and CP collectives'
(`Cluster.tp_comm_scale`, `cp_comm_scale`) by theirs over b. The refined cluster is
re-solved for every measured plan to report the error before and after. Overlap is not a
constant of this cost model (it is modelled per term), so it is not refitted.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable

import numpy as np

from autopar.cost.hardware import Cluster
from autopar.plan import Plan
from autopar.request import Pins

PIN_KEYS = tuple(f.name for f in dataclasses.fields(Pins))   # the request's knobs
_COMPUTE_TERMS = ("compute_s", "bubble_s", "optimizer_s")
_COMM_TERMS = ("tp_comm_s", "dp_comm_s", "cp_comm_s", "ep_comm_s")
_P2P_TERMS = ("pp_comm_s",)
# a third scale for the pipeline's send/recv is fitted only with enough plans to hold it: at
# least this many plans that send pipeline messages, and this many more plans than scales
MIN_P2P_PLANS, SPARE_PLANS = 2, 2
# the least pipeline-message scale a fit returns (`fit_scales`): 1% of the priced message, not
# 0, so that the messages stay a term the next tune can fit (a cluster pricing them at 0
# would give every plan a p2p term of 0, and no later fit could raise it)
P2P_FLOOR = 0.01
# the host's work per op (and per checkpointed region), measured on ops in isolation by
# calibrate (`Trial.dispatch_s`
# prices a step without it): its own scale where the plans' dispatch shares differ enough to
# tell it from the kernels' (`fit_scales`), else the compute scale
DISPATCH_WORK_S = ("kernel_launch_s", "autograd_op_s", "split_backward_op_s",
                   "checkpoint_region_s")
# ... and the host work calibrate measures inside real blocks or steps — op recompute's per-op
# policy work (two checkpointed blocks), the optimizer's per parameter and tensor, the split
# backward's per saved byte (two GPT blocks): always the compute scale. Fitted with the
# dispatch, op recompute came out 7-11% slow in three runs whose untuned price was within 5%,
# and ZeRO-0 plans 4% slow against ZeRO-1's (2026-11-27).
HOST_WORK_S = ("checkpoint_op_s", "optimizer_param_s", "optimizer_tensor_s",
               "split_backward_s_per_byte")
# the least spread of the plans' dispatch shares (dispatch / kernel seconds, most over least)
# that holds a dispatch scale apart: plans dispatching alike leave it and the compute scale
# one direction, which any split fits
DISPATCH_SPREAD = 1.5
# ... and the least it must lower the fit's summed |relative error| by (a fraction of the
# error with the dispatch on the compute scale): an extra scale always lowers it a little.
# Chosen on five runs of three models on 2 local CPU ranks (2026-11-27): the three where the
# dispatch fitted 2.3–3.2× lowered the sum by 16–34%; the two at hidden 256, where dispatch
# is ~2% of a step, by 0–8%, one of them at a dispatch scale of 0.14
DISPATCH_GAIN = 0.1
# the collectives of one kind that get a scale of their own where the plans tell them apart
# (`fit_scales`): tensor-parallel (Cluster.tp_comm_scale) and the context-parallel K/V exchange
# (Cluster.cp_comm_scale), each the Trial's seconds of it (`part_seconds`). Calibrate times a
# collective on idle ranks after a short GEMM; inside a step each kind costs its own multiple
# of that: on 2 local CPU ranks t = 2 was priced from 16% fast to 34% slow and c = 2 11–27%
# fast, run to run, while one scale for every collective left both off (2026-11-27/28)
KIND_COLUMNS = ("tp", "cp")
# ... fitted apart only where at least this many plans carry it, and only if it lowers the
# summed held-out |relative error| (each plan priced by the scales the others fit) by
# DISPATCH_GAIN against the kind on the collectives' scale
MIN_KIND_PLANS = 2



@dataclasses.dataclass(frozen=True, kw_only=True)
class Scales:
    """How much slower than priced each part of the measured steps ran (`fit_scales`), folded
    into a cluster by `refit_cluster`: the kernels (compute, bubble, optimizer), the host's
    per-op dispatch, the collectives, the pipeline's send/recv; the tensor- and
    context-parallel collectives' (`KIND_COLUMNS`; None: the collectives' scale)."""
    compute: float
    dispatch: float
    collectives: float
    p2p: float
    tp: float | None = None
    cp: float | None = None

    def __post_init__(self) -> None:
        for kind in KIND_COLUMNS:
            if getattr(self, kind) is None:
                object.__setattr__(self, kind, self.collectives)

    def __str__(self) -> str:
        kinds = "".join(f", {name} ×{getattr(self, k):.2f}" for k, name in
                        (("tp", "tensor-parallel"), ("cp", "context-parallel"))
                        if getattr(self, k) != self.collectives)
        return (f"compute ×{self.compute:.2f}, dispatch ×{self.dispatch:.2f}, collectives "
                f"×{self.collectives:.2f}{kinds}, pipeline messages ×{self.p2p:.2f}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trial:
    """One candidate plan: predicted and measured step time (s) and memory (bytes per rank)."""
    plan: Plan
    measured_s: float
    measured_memory_bytes: float
    refit_s: float | None = None     # predicted by the refitted cluster
    # the predicted step's seconds of host dispatch (`DISPATCH_WORK_S`): the plan's step less
    # the same plan priced without it (`dispatch_seconds`); 0: none priced
    dispatch_s: float = 0.0
    # ... and its seconds of tensor-parallel collectives and of the context-parallel exchange
    # (`part_seconds`: the step less the same plan priced with them free); 0: none
    tp_s: float = 0.0
    cp_s: float = 0.0

    @property
    def label(self) -> str:
        return pins_label(plan_pins(self.plan))


def rel_error(trial: Trial) -> float:
    return trial.plan.predicted.step_time_s / trial.measured_s - 1


def plan_pins(plan: Plan) -> dict[str, Any]:
    """Every knob of `plan` as parallelize/solve pins."""
    return {k: getattr(plan, k) for k in PIN_KEYS if getattr(plan, k, None) is not None}


def pins_label(pins: dict[str, Any]) -> str:
    short = {"micro_batch_size": "b", "sequence_parallel": "sp", "cp_attention": "cp",
             "microbatch_group": "N"}
    return " ".join(f"{short.get(k, k)}={v}" for k, v in pins.items()
                    if not (k in ("c", "ep") and v == 1)
                    and not (k == "cp_attention" and pins.get("c", 1) == 1))


# ---- refitting ----

def dispatch_seconds(plan: Plan, cluster: Cluster,
                     solve_pins: Callable[[Cluster, dict], Plan]) -> float:
    """The seconds of `plan`'s predicted step that are the host's per-op dispatch
    (`DISPATCH_WORK_S`): its step less the same pins priced on `cluster` without them (≥ 0)."""
    return part_seconds(plan, cluster, solve_pins, "dispatch")


# what each part of `part_seconds` zeroes on the cluster, and which plans can have it
_PARTS = {"dispatch": (DISPATCH_WORK_S, lambda plan: True),
          "tp": (("tp_comm_scale",), lambda plan: plan.t > 1),
          "cp": (("cp_comm_scale",), lambda plan: plan.c > 1)}


def measured_trial(plan: Plan, measured_s: float, memory_bytes: float, cluster: Cluster,
                   solve_pins: Callable[[Cluster, dict], Plan]) -> Trial:
    """The Trial of `plan` measured at `measured_s` and `memory_bytes`, with the seconds of
    each part the fit may scale apart (`part_seconds` on `cluster`, the one it was priced on)."""
    return Trial(plan=plan, measured_s=measured_s, measured_memory_bytes=memory_bytes,
                 **{f"{part}_s": part_seconds(plan, cluster, solve_pins, part)
                    for part in _PARTS})


def part_seconds(plan: Plan, cluster: Cluster, solve_pins: Callable[[Cluster, dict], Plan],
                 part: str) -> float:
    """The seconds of `plan`'s predicted step that are `part`: "dispatch" (the host's per-op
    work, `DISPATCH_WORK_S`), "tp" (its tensor-parallel collectives) or "cp" (its
    context-parallel exchange) — its step less the same pins priced on `cluster` with that
    part free (≥ 0), wherever the step holds it (a block's terms, the edges, the bubble)."""
    fields, holds = _PARTS[part]
    if not holds(plan) or not any(getattr(cluster, k) for k in fields):
        return 0.0
    bare = dataclasses.replace(cluster, **{k: 0.0 for k in fields})
    return max(0.0, plan.predicted.step_time_s
               - solve_pins(bare, plan_pins(plan)).predicted.step_time_s)


def _columns(trials: list[Trial]) -> dict[str, np.ndarray]:
    """Each trial's predicted seconds split as `fit_scales` scales them: a kind's seconds
    (`KIND_COLUMNS`) taken from its own term (tp_comm_s, cp_comm_s) as far as that holds
    them, the rest (the edges' TP collectives, the bubble they lengthen) from the compute."""
    def col(keys):
        return np.array([sum(getattr(t.plan.predicted, k) for k in keys) for t in trials])
    dispatch = np.array([t.dispatch_s for t in trials])
    out = {"compute": col(_COMPUTE_TERMS) - dispatch, "dispatch": dispatch,
           "collectives": col(_COMM_TERMS), "p2p": col(_P2P_TERMS)}
    for kind, term in (("tp", "tp_comm_s"), ("cp", "cp_comm_s")):
        part, own = np.array([getattr(t, f"{kind}_s") for t in trials]), col((term,))
        out[kind] = part
        out["collectives"] = out["collectives"] - np.minimum(part, own)
        out["compute"] = out["compute"] - np.maximum(0.0, part - own)
    return out


def _dispatch_apart(cols: dict[str, np.ndarray]) -> bool:
    """Whether the plans' dispatch shares differ enough (DISPATCH_SPREAD) to fit its scale."""
    has = (cols["dispatch"] > 0) & (cols["compute"] > 0)
    if has.sum() < 2:
        return False
    share = cols["dispatch"][has] / cols["compute"][has]
    return float(share.max() / share.min()) >= DISPATCH_SPREAD


def fit_scales(trials: list[Trial], rounds: int = 50, separate_p2p: bool = True,
               separate_dispatch: bool = True, separate_kinds: bool = True) -> Scales:
    """The `Scales` minimising Σ |(a·kernels + h·dispatch + b·collectives + c·pipeline p2p)
    / measured − 1|: the least absolute relative error, by iteratively reweighted least
    squares (numpy; each round weighs a plan by the inverse of its last error). Plain least
    squares let one plan the scales cannot fit (a term the cost model misses: t = 2 SP 21% slow
    while the rest were within 5%) pull every other plan off: on 2 local ranks it doubled the
    median error it was meant to halve (2.3% → 4.4%, 2026-11-27).

    h, the host's per-op dispatch (`Trial.dispatch_s`), is its own scale
    (`separate_dispatch`) where the plans' dispatch shares differ (DISPATCH_SPREAD: smaller
    micro-batches and the zb split dispatch more ops per kernel second) and enough
    plans hold it (SPARE_PLANS more plans than scales), and only if it lowers the summed
    error by DISPATCH_GAIN against h = a; otherwise h = a. calibrate times its
    ops in isolation; inside a step they cost more (on 2 local CPU ranks a 4-layer GPT's
    dispatch fitted 2.8–3.7× and a Llama's 1.8× what calibrate priced, the kernels within 6%:
    one scale for both left b = 1 plans 12% fast and pulled c to 2.3 to cover a pipeline of 8
    micro-batches; apart, the median error 3.3% → 2.2% over 17 plans, 2026-11-27).

    c, the pipeline's messages, is its own scale (`separate_p2p`) where enough plans hold
    it (MIN_P2P_PLANS with pipeline messages, SPARE_PLANS more plans than scales): the
    pipeline's pre-posted sends and receives cost apart from the collectives (on 2 local CPU
    ranks, priced from calibrate's blocking exchange, 0.1 – 0.4 of it in four runs while the
    collectives' scale stayed 0.8 – 1.2; priced from its relay, `comm.hop_s`, 0.7 – 3.3 of a
    hop ~0.1 ms, a few % of a step). Otherwise c = b. c may go down to P2P_FLOOR, not below:
    the runtime's pre-posted sends and receives can hide nearly every message behind compute,
    so a c fitted below it (the plans with messages over-priced by more than their messages)
    is fitted again at that bound, the least error where c ≥ P2P_FLOOR; taking c = b there
    instead left the pipeline plans over-priced (Llama GQA on 2 local ranks: c = −0.06
    unconstrained; at c = b the worst error 14.6%, at the bound 7.7%, the median 1.3% /
    1.2%). A scale fitted non-positive is dropped (h = a, c = b; then the collectives kept at
    1): no part of a step can cost nothing. The richest grouping that fits is taken.

    Then the tensor-parallel collectives and the context-parallel exchange (`KIND_COLUMNS`,
    `separate_kinds`) each get a scale of their own, one at a time, the one that lowers the
    held-out error most first (`_kinds_apart`: each plan priced by the scales the others fit),
    where MIN_KIND_PLANS plans carry it, enough plans hold the extra scale (SPARE_PLANS) and
    it lowers that error by DISPATCH_GAIN; otherwise they are on the collectives' scale."""
    cols, meas = _columns(trials), np.array([t.measured_s for t in trials])
    comm = sum(cols[n] for n in ("collectives",) + KIND_COLUMNS)
    p2p_apart = separate_p2p and int((cols["p2p"] > 0).sum()) >= MIN_P2P_PLANS \
        and comm.sum() > 0
    dispatch_apart = separate_dispatch and _dispatch_apart(cols)
    fits = [(h_apart, f) for h_apart in ((True, False) if dispatch_apart else (False,))
            if (f := _richest_fit(cols, meas, h_apart, p2p_apart, (), rounds)) is not None]
    if len(fits) == 2 and _fit_error(cols, meas, fits[0][1]) > (
            1 - DISPATCH_GAIN) * _fit_error(cols, meas, fits[1][1]):
        fits = fits[1:]                # the dispatch's own scale does not earn its keep
    if fits:
        h_apart, fitted = fits[0]
        kinds = [k for k in KIND_COLUMNS if separate_kinds
                 and int((cols[k] > 0).sum()) >= MIN_KIND_PLANS]
        return Scales(**_kinds_apart(cols, meas, fitted, h_apart, p2p_apart, kinds, rounds))
    # compute alone (communication kept as calibrated)
    comm = (comm + cols["p2p"]) / meas
    (a,) = _least_absolute(((cols["compute"] + cols["dispatch"]) / meas)[:, None], rounds,
                           1 - comm)
    a = max(float(a), 1e-3)
    return Scales(compute=a, dispatch=a, collectives=1.0, p2p=1.0)


def _kinds_apart(cols: dict[str, np.ndarray], meas: np.ndarray, fitted: dict[str, float],
                 h_apart: bool, p2p_apart: bool, kinds: list[str],
                 rounds: int) -> dict[str, float]:
    """`fitted` with the `kinds` (KIND_COLUMNS) given scales of their own one at a time, the
    one lowering the held-out error most first, while it lowers it by DISPATCH_GAIN. Judged
    on each plan priced by the scales the other plans fit (`_held_out_error`), not on the
    plans fitted: with a kind apart, the collectives' scale is left to the data-parallel
    terms, a few % of a d = 2 step, and fitted on all plans it chased their noise (2.4–6.1 in
    four runs on 2 CPU ranks, 2026-11-28), which would price the next plan's data
    parallelism that much slower."""
    def fit(cs: dict[str, np.ndarray], ms: np.ndarray, apart: tuple[str, ...]):
        return _richest_fit(cs, ms, h_apart, p2p_apart, apart, rounds)
    apart: tuple[str, ...] = ()
    score = _held_out_error(cols, meas, lambda cs, ms: fit(cs, ms, ()))
    while kinds:
        tries = [(_held_out_error(cols, meas, lambda cs, ms, k=k: fit(cs, ms, apart + (k,))),
                  k) for k in kinds]
        error, kind = min(tries, key=lambda x: x[0])
        better = fit(cols, meas, apart + (kind,))
        if better is None or not error <= (1 - DISPATCH_GAIN) * score:
            break
        apart, fitted, score = apart + (kind,), better, error
        kinds = [k for k in kinds if k != kind]
    return fitted


def _held_out_error(cols: dict[str, np.ndarray], meas: np.ndarray,
                    fit: Callable[[dict[str, np.ndarray], np.ndarray],
                                  dict[str, float] | None]) -> float:
    """Σ over the plans of |(the plan priced by the scales `fit` gives on the other plans)
    / measured − 1| (leave-one-out); inf where a fold has no fit."""
    total = 0.0
    for j in range(len(meas)):
        keep = np.arange(len(meas)) != j
        scales = fit({n: c[keep] for n, c in cols.items()}, meas[keep])
        if scales is None:
            return float("inf")
        total += abs(sum(scales[n] * cols[n][j] for n in cols) / meas[j] - 1)
    return total


def _richest_fit(cols: dict[str, np.ndarray], meas: np.ndarray, h_apart: bool,
                 p2p_apart: bool, kinds: tuple[str, ...], rounds: int) -> dict[str, float] | None:
    """The fit with the dispatch apart or not (`h_apart`), the `kinds` of collectives
    (KIND_COLUMNS) apart, the pipeline's messages apart where they may be and the fit holds,
    else with them on the collectives' scale; None if neither (a group with nothing to fit,
    too few plans, a scale fitted non-positive)."""
    plans = len(meas)
    for c_apart in ((True, False) if p2p_apart else (False,)):
        shared = ("collectives",) + tuple(k for k in KIND_COLUMNS if k not in kinds)
        groups = [("compute",) if h_apart else ("compute", "dispatch")] \
            + ([("dispatch",)] if h_apart else []) \
            + [shared if c_apart else shared + ("p2p",)] + [(k,) for k in kinds] \
            + ([("p2p",)] if c_apart else [])
        if len(groups) > 2 and plans < len(groups) + SPARE_PLANS:
            continue
        if any(sum(cols[n].sum() for n in g) <= 0 for g in groups[1:]):
            continue                                        # a scale with nothing to fit
        fitted = _fit_groups(cols, meas, groups, rounds)
        if fitted is not None:
            return fitted
    return None


def _fit_error(cols: dict[str, np.ndarray], meas: np.ndarray, scales: dict[str, float]) -> float:
    """Σ |Σ scale · column / measured − 1| over the plans: what `fit_scales` minimises."""
    return float(np.abs(sum(scales[n] * cols[n] for n in cols) / meas - 1).sum())


def _fit_groups(cols: dict[str, np.ndarray], meas: np.ndarray, groups: list[tuple[str, ...]],
                rounds: int) -> dict[str, float] | None:
    """One scale per group of columns (every column of a group gets its scale), least absolute
    relative error; a lone p2p group fitted under P2P_FLOOR fitted again at it; None where a
    scale comes out non-positive."""
    mat = np.stack([sum(cols[n] for n in g) for g in groups], axis=1) / meas[:, None]
    x = _least_absolute(mat, rounds)
    if groups[-1] == ("p2p",) and x[-1] < P2P_FLOOR:   # at its bound: messages nearly hidden
        x = np.append(_least_absolute(mat[:, :-1], rounds, 1 - P2P_FLOOR * mat[:, -1]),
                      P2P_FLOOR)
    if (x <= 0).any():
        return None
    return {n: float(v) for g, v in zip(groups, x) for n in g}


def _least_absolute(mat: np.ndarray, rounds: int, rhs: np.ndarray | None = None) -> np.ndarray:
    """x minimising Σ |mat·x − rhs| (rhs: ones), IRLS from the least-squares start; an
    error under 1e-4 weighs as 1e-4 (a plan fitted exactly must not take every weight)."""
    rhs = np.ones(len(mat)) if rhs is None else rhs
    x, *_ = np.linalg.lstsq(mat, rhs, rcond=None)
    for _ in range(rounds):
        w = 1.0 / np.sqrt(np.maximum(np.abs(mat @ x - rhs), 1e-4))
        x, *_ = np.linalg.lstsq(mat * w[:, None], rhs * w, rcond=None)
    return x


def refit_cluster(cluster: Cluster, scales: Scales, note: str) -> Cluster:
    """`cluster` with its compute rates divided by the compute scale (`HOST_WORK_S`
    multiplied), its per-op dispatch (`DISPATCH_WORK_S`) multiplied by the dispatch scale,
    its links slowed by the collectives' and its pipeline messages by the p2p scale, its
    tensor- and context-parallel collectives by theirs (module doc)."""
    a, h, b, c = scales.compute, scales.dispatch, scales.collectives, scales.p2p
    kinds = {f"{k}_comm_scale": getattr(cluster, f"{k}_comm_scale") * getattr(scales, k) / b
             for k in KIND_COLUMNS}
    gemm_rate = cluster.peak_flops * cluster.gemm_max_efficiency / a
    emax = min(1.0, cluster.gemm_max_efficiency / a)
    peak = gemm_rate / emax
    stream = cluster.hbm_bandwidth_Bps * cluster.elementwise_efficiency / a
    elem = min(1.0, cluster.elementwise_efficiency / a)
    flash = {k: min(1.0, getattr(cluster, k) * cluster.peak_flops / (a * peak))
             for k in ("flash_fwd_efficiency", "flash_bwd_efficiency")}
    curves = tuple(dataclasses.replace(cv, seconds=tuple(x * b for x in cv.seconds))
                   for cv in cluster.collective_curves)
    host = {k: getattr(cluster, k) * a for k in HOST_WORK_S} \
        | {k: getattr(cluster, k) * h for k in DISPATCH_WORK_S}
    return dataclasses.replace(
        cluster, peak_flops=peak, gemm_max_efficiency=emax, hbm_bandwidth_Bps=stream / elem,
        elementwise_efficiency=elem, **host, **flash, collective_curves=curves,
        pipeline_p2p_scale=cluster.pipeline_p2p_scale * c / b, **kinds,
        intra_node_bandwidth_Bps=cluster.intra_node_bandwidth_Bps / b,
        intra_node_latency_s=cluster.intra_node_latency_s * b,
        inter_node_bandwidth_Bps=cluster.inter_node_bandwidth_Bps / b,
        inter_node_latency_s=cluster.inter_node_latency_s * b,
        sources=cluster.sources + (
            f"refitted by autopar tune ({note}): compute rates ÷ {a:.3f} (gemm_max_efficiency, "
            f"flash efficiencies, elementwise_efficiency; peak_flops / hbm_bandwidth_Bps where "
            f"an efficiency would pass 1; the host work measured in real blocks, "
            f"{', '.join(HOST_WORK_S)}, × {a:.3f}), the host's per-op dispatch "
            f"({', '.join(DISPATCH_WORK_S)}) × {h:.3f}, link "
            f"bandwidths ÷ {b:.3f} and latencies × {b:.3f} (collective_curves' times × "
            f"{b:.3f}), pipeline "
            f"messages × {c:.3f} (pipeline_p2p_scale), tensor-parallel collectives × "
            f"{scales.tp:.3f} and the context-parallel exchange × {scales.cp:.3f} "
            f"(tp_comm_scale, cp_comm_scale: ÷ {b:.3f}, as their links are slowed); least "
            f"absolute relative error over the measured plans",))




# ---- measuring again ----

# a plan the refit prices this much faster than it measured, in multiples of the median
# |refit error| over the plans and at least SUSPECT_FLOOR, is measured once more before the
# fit is trusted (`suspects`)
SUSPECT_SPREAD, SUSPECT_FLOOR = 2.0, 0.03


def suspects(trials: list[Trial]) -> list[int]:
    """The trials (indices) to measure again: measured slower than the refit prices them by
    more than SUSPECT_SPREAD × the median |refit error| over all of them (and SUSPECT_FLOOR).
    A shared host only ever adds time, a plan's time from compile to compile spread ±10% on 2
    CPU ranks, and a slow spell can outlast a plan's passes: such a plan measures slower than
    the scales fitted to the others price it, the fit leans towards it, and the plans priced
    alike disagree (a Llama-style model's run, 2026-11-28: ZeRO-0 129.5 ms against
    ZeRO-1 and 2's 115.5 for the same work). A plan measured faster than priced is left: more
    samples cannot make a least time larger. Plans without a refit price are left too."""
    errors = {i: tr.measured_s / tr.refit_s - 1 for i, tr in enumerate(trials) if tr.refit_s}
    if not errors:
        return []
    bar = max(SUSPECT_FLOOR, SUSPECT_SPREAD * statistics.median(map(abs, errors.values())))
    return [i for i, e in errors.items() if e > bar]
