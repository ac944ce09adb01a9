"""Time to train against GPU count, per schedule family: `autopar scale` and `scale_sweep`.

For each GPU count and each schedule family (the solver restricted to that family's schedules
and ZeRO levels), the batch and plan that train `tokens` soonest (cost/time_to_train.py); the
table and the plot show days and GPU-hours against GPUs, the shortest time, and where GPUs stop
paying. One capture and profile serve the whole sweep (autopar/api.py `plan_profile`); each GPU
count's batch walk starts from the previous count's batch, so a sweep costs a few solves per
point.

"Where GPUs stop paying": going from g to the next count g' multiplies the GPUs by g'/g; the
step returns a fraction e = (T(g)/T(g') − 1)/(g'/g − 1) of the ideal speed-up (1: time falls in
proportion; 0: no faster). GPUs stop paying at the last count reached with e ≥ 1/2, i.e. where
a doubling no longer cuts the time by a quarter: beyond it each GPU returns less than half its
share and the cost (GPU-hours) climbs faster than the time falls.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from autopar.cost.solver import solve
from autopar.cost.time_to_train import plan_for_tokens
from autopar.plan import Plan
from autopar.request import Pins
from autopar.progress import Progress

PAYING_EFFICIENCY = 0.5   # see the module docstring


@dataclass(frozen=True, kw_only=True)
class Family:
    """A schedule family: the schedules and ZeRO levels the solver may use for it."""
    name: str
    schedules: tuple[str, ...]
    zero_levels: tuple[int, ...]
    description: str


# Megatron-LM's schedules (2104.04473) with its distributed optimizer (ZeRO-1) at most, against
# 2106.02679's layered gradient accumulation + modular pipeline: breadth-first with the weights
# sharded too (ZeRO-3, gathered once per chunk per pass).
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family(name="1f1b", schedules=("1f1b",), zero_levels=(0, 1),
           description="1F1B, replicated or ZeRO-1 optimizer (2104.04473 without interleaving)"),
    Family(name="interleaved", schedules=("interleaved-1f1b",), zero_levels=(0, 1),
           description="interleaved 1F1B, ZeRO-1 at most (Megatron-LM, 2104.04473)"),
    Family(name="breadth-first", schedules=("breadth-first",), zero_levels=(0, 1, 2, 3),
           description="breadth-first with sharded weights: layered gradient accumulation + "
                       "modular pipeline (2106.02679)"),
)}
DEFAULT_FAMILIES = ("interleaved", "breadth-first")


@dataclass(frozen=True, kw_only=True)
class ScalePoint:
    gpus: int
    family: str
    plan: Plan | None
    note: str = ""

    @property
    def days(self) -> float | None:
        return None if self.plan is None else self.plan.training.days

    @property
    def gpu_hours(self) -> float | None:
        return None if self.plan is None else self.plan.training.gpu_hours


@dataclass(frozen=True, kw_only=True)
class ScaleResult:
    model: str
    cluster: str
    tokens: float
    critical_batch_tokens: float
    critical_batch_source: str
    seq_len: int
    gpu_counts: tuple[int, ...]
    families: tuple[str, ...]
    points: tuple[ScalePoint, ...]
    seconds: float = 0.0
    descriptions: dict[str, str] = field(default_factory=dict, compare=False)

    def point(self, gpus: int, family: str) -> ScalePoint:
        return next(pt for pt in self.points if pt.gpus == gpus and pt.family == family)

    def best(self, family: str | None = None) -> ScalePoint | None:
        """The shortest time to train (of one family, or of all)."""
        pts = [pt for pt in self.points if pt.plan is not None
               and (family is None or pt.family == family)]
        return min(pts, key=lambda pt: (pt.days, pt.gpus)) if pts else None

    def envelope(self, family: str | None = None) -> list[ScalePoint]:
        """Per GPU count, the fastest point (of one family, or of all)."""
        out = []
        for g in self.gpu_counts:
            pts = [pt for pt in self.points if pt.gpus == g and pt.plan is not None
                   and (family is None or pt.family == family)]
            if pts:
                out.append(min(pts, key=lambda pt: pt.days))
        return out

    def stop_paying(self, family: str | None = None) -> ScalePoint | None:
        """The last GPU count reached while each step of GPUs still returns at least
        PAYING_EFFICIENCY of its ideal speed-up (module docstring); None when every step of
        the sweep still pays (the end of the sweep is not where GPUs stop paying)."""
        env = self.envelope(family)
        for a, b in zip(env, env[1:]):
            if parallel_return(a.gpus, a.days, b.gpus, b.days) < PAYING_EFFICIENCY:
                return a
        return None

    def table(self) -> str:
        return format_scale(self)

    def plot(self, path: str) -> str:
        return plot_scale(self, path)


def parallel_return(gpus_a: int, days_a: float, gpus_b: int, days_b: float) -> float:
    """e = (T_a/T_b − 1)/(g_b/g_a − 1): the fraction of the ideal speed-up that going from
    g_a to g_b GPUs returns (1: time falls in proportion to the GPUs, 0: not at all)."""
    return (days_a / days_b - 1.0) / (gpus_b / gpus_a - 1.0)


def sweep(profile: Any, cluster: Any, *, tokens: float, critical_batch_tokens: float,
          critical_batch_source: str, gpu_counts: tuple[int, ...],
          families: tuple[str | Family, ...] = DEFAULT_FAMILIES,
          solve_fn: Callable[..., Plan] = solve, **pins: Any) -> ScaleResult:
    """Plan every (GPU count, family) for the shortest time to train `tokens`. `families`:
    names of FAMILIES, or Family objects.
    Why this size: the sweep's request (profile, GPU counts, families, tokens, cluster, batch,
    precision, seq) passed to each solve."""
    pins = Pins.of(pins, "scale").as_dict()   # one line per bad knob (autopar.rules)
    unknown = [f for f in families if isinstance(f, str) and f not in FAMILIES]
    if unknown:
        raise ValueError(f"scale: unknown schedule families {unknown}; pick from "
                         f"{sorted(FAMILIES)}")
    fams = [FAMILIES[f] if isinstance(f, str) else f for f in families]
    t0 = time.perf_counter()
    points = []
    bar = Progress(total=len(fams) * len(gpu_counts), desc="autopar scale")
    for fam in fams:
        fam_name = fam.name
        start = None
        for g in gpu_counts:
            bar.start(f"{fam_name} on {g} GPUs")
            def solve_at(batch: int, g: int = g) -> Plan:
                return solve_fn(profile, cluster, gpus=g, global_batch_size=batch,
                                schedules=fam.schedules, zero_levels=fam.zero_levels,
                                max_alternatives=0, **pins)
            try:
                pl = plan_for_tokens(solve_at, tokens=tokens,
                                     critical_batch_tokens=critical_batch_tokens,
                                     critical_batch_source=critical_batch_source,
                                     seq_len=profile.seq_len, gpus=g, start=start,
                                     refine=bool(g & (g - 1)))
            except ValueError as err:
                points.append(ScalePoint(gpus=g, family=fam_name, plan=None,
                                         note=str(err).split("\n")[0][:200]))
                continue
            start = pl.global_batch_size
            points.append(ScalePoint(gpus=g, family=fam_name, plan=pl))
    bar.close()
    return ScaleResult(model=profile.name, cluster=getattr(cluster, "name", str(cluster)),
                       tokens=tokens, critical_batch_tokens=critical_batch_tokens,
                       critical_batch_source=critical_batch_source, seq_len=profile.seq_len,
                       gpu_counts=tuple(gpu_counts), families=tuple(f.name for f in fams),
                       descriptions={f.name: f.description for f in fams},
                       points=tuple(points), seconds=time.perf_counter() - t0)


def gpu_range(gpus_max: int, gpus_min: int | None = None) -> tuple[int, ...]:
    """Powers of two from gpus_min (default gpus_max/64) up to gpus_max (itself included)."""
    if not isinstance(gpus_max, int) or gpus_max < 1:
        raise ValueError(f"scale: gpus_max={gpus_max!r} must be a positive integer")
    lo = gpus_min if gpus_min is not None else max(1, gpus_max // 64)
    if not isinstance(lo, int) or not 1 <= lo <= gpus_max:
        raise ValueError(f"scale: gpus_min={gpus_min!r} must be an integer in [1, gpus_max="
                         f"{gpus_max}]")
    counts, g = [], 1
    while g <= gpus_max:
        if g >= lo:
            counts.append(g)
        g *= 2
    if not counts or counts[-1] != gpus_max:
        counts.append(gpus_max)
    if counts[0] != lo:
        counts.insert(0, lo)
    return tuple(sorted(set(counts)))


def scale_sweep(model: Any, *, example_inputs: tuple, tokens: float, gpus_max: int,
                gpus_min: int | None = None, gpu_counts: tuple[int, ...] | None = None,
                cluster: Any = "dgx-a100-80gb", loss_fn: Callable | None = None,
                example_targets: Any = None, critical_batch_tokens: float | None = None,
                families: tuple[str, ...] = DEFAULT_FAMILIES, name: str | None = None,
                **pins: Any) -> ScaleResult:
    """`autopar scale` from Python: capture `model` once, then sweep GPU counts (powers of two
    from gpus_min to gpus_max, or `gpu_counts`) for each schedule family.
    Why this size: the planning keywords of parallelize plus the sweep's range and token
    budget."""
    import torch

    from autopar.api import _default_targets, critical_batch, plan_profile
    from autopar.cost.critical_batch import check_training_inputs
    from autopar.cost.hardware import get_cluster

    pins = Pins.of(pins, "scale").as_dict()
    example_inputs = tuple(example_inputs)
    first = example_inputs[0]
    seq_len = int(first.shape[1]) if isinstance(first, torch.Tensor) and first.dim() > 1 else 1
    check_training_inputs(tokens, critical_batch_tokens, seq_len, "scale")
    counts = tuple(gpu_counts) if gpu_counts else gpu_range(gpus_max, gpus_min)
    if loss_fn is not None and example_targets is None:
        example_targets = _default_targets(example_inputs)
    cl = get_cluster(cluster)
    _, profile = plan_profile(model, example_inputs, loss_fn, example_targets, cl,
                              gpu_counts=counts, t=pins.get("t"),
                              sequence_parallel=pins.get("sequence_parallel"), name=name)
    crit, source = critical_batch(profile, critical_batch_tokens)
    return sweep(profile, cl, tokens=tokens, critical_batch_tokens=crit,
                 critical_batch_source=source, gpu_counts=counts, families=families, **pins)


# ----- presentation ----------------------------------------------------------------------------
def _plan_label(pl: Plan) -> str:
    return (f"t{pl.t} p{pl.p} d{pl.d} v{pl.v} b{pl.micro_batch_size} z{pl.zero} "
            f"{pl.recompute[:3]}")


def format_scale(res: ScaleResult) -> str:
    lines = [f"Time to train {res.tokens:.3g} tokens of {res.model} on {res.cluster} "
             f"(critical batch {res.critical_batch_tokens:,.0f} tokens = "
             f"{res.critical_batch_tokens / res.seq_len:,.0f} sequences of {res.seq_len}: "
             f"{res.critical_batch_source})", ""]
    head = f"{'GPUs':>7}"
    for f in res.families:
        head += f" | {f + ': days':>20} {'GPU-hours':>11} {'batch':>6} {'plan':<28}"
    lines.append(head)
    lines.append("-" * len(head))
    for g in res.gpu_counts:
        row = f"{g:>7}"
        for f in res.families:
            pt = res.point(g, f)
            if pt.plan is None:
                row += f" | {'no plan':>20} {'':>11} {'':>6} {'':<28}"
            else:
                row += (f" | {pt.days:>20.3g} {pt.gpu_hours:>11,.0f} "
                        f"{pt.plan.global_batch_size:>6} {_plan_label(pt.plan):<28}")
        lines.append(row)
    lines.append("")
    for f in (*res.families, None):
        best, stop = res.best(f), res.stop_paying(f)
        label = f if f else "all families"
        if best is None:
            lines.append(f"{label}: no GPU count has a plan")
            continue
        lines.append(f"{label}: shortest {best.days:.3g} days on {best.gpus} GPUs "
                     f"({best.gpu_hours:,.0f} GPU-hours, batch {best.plan.global_batch_size} "
                     f"sequences, {best.plan.schedule} {_plan_label(best.plan)}); "
                     + (f"GPUs stop paying after {stop.gpus} ({stop.days:.3g} days, "
                        f"{stop.gpu_hours:,.0f} GPU-hours)" if stop is not None else
                        f"GPUs still pay at the largest count swept ({res.gpu_counts[-1]}); "
                        f"sweep further with --gpus-max"))
    fails = sorted({pt.note for pt in res.points if pt.plan is None})
    if fails:
        lines.append("no plan: " + " | ".join(fails[:3]))
    lines.append(f"(swept {len(res.points)} points in {res.seconds:.1f} s)")
    return "\n".join(lines)


def plot_scale(res: ScaleResult, path: str) -> str:
    """Days and GPU-hours against GPUs per family (PNG): the shortest time starred, the point
    where GPUs stop paying marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_c) = plt.subplots(1, 2, figsize=(12, 6.0))
    for f in res.families:
        pts = res.envelope(f)
        if not pts:
            continue
        xs = [pt.gpus for pt in pts]
        line, = ax_t.plot(xs, [pt.days for pt in pts], "o-", label=res.descriptions.get(f, f))
        ax_c.plot(xs, [pt.gpu_hours for pt in pts], "o-", color=line.get_color(), label=f)
        stop = res.stop_paying(f)
        if stop is not None:       # only where GPUs do stop paying within the sweep
            ax_t.axvline(stop.gpus, color=line.get_color(), ls=":", lw=1)
            ax_c.axvline(stop.gpus, color=line.get_color(), ls=":", lw=1)
    best = res.best()
    if best is not None:
        ax_t.plot([best.gpus], [best.days], "*", ms=16, color="gold", mec="k",
                  label=f"shortest: {best.days:.3g} days on {best.gpus} GPUs ({best.family})")
        ax_c.plot([best.gpus], [best.gpu_hours], "*", ms=16, color="gold", mec="k")
    for ax, ylabel in ((ax_t, "days to train"), (ax_c, "GPU-hours")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    # legends below the axes, out of the data
    ax_t.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=1)
    ax_c.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2,
                title="dotted: GPUs stop paying" if any(res.stop_paying(f) for f in
                                                        res.families) else None,
                title_fontsize=7)
    fig.suptitle(f"{res.model} on {res.cluster}: {res.tokens:.3g} tokens, critical batch "
                 f"{res.critical_batch_tokens / 1e6:.3g}M tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
