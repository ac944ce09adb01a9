"""Gantt charts of pipeline schedules, simulated or measured.

Events are `(rank, action, start_s, end_s)` tuples — `cost.simulate.Event` or plain tuples —
where `action` is an `autopar.schedules.Action` or its string ('F0.3', 'B1.0', 'W1.0',
'sF0.3>1', 'R2'). The runtime records measured events in this form and calls `draw_timeline` too.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

from autopar.cost.simulate import simulate
from autopar.plan import recorded_chunk_times
from autopar.words import bubble_text
from autopar.schedules import Action, make_schedule, parse_action, zb_weight_times

_CMAPS = {"F": "Blues", "B": "Oranges", "W": "Greens"}


def _colour(kind: str, local_chunk: int, v: int):
    from matplotlib import colormaps
    cmap = colormaps[_CMAPS[kind]]
    # lighter for the first local chunk, darker for later ones
    return cmap(0.35 + 0.5 * (local_chunk / max(1, v - 1)) if v > 1 else 0.55)


def draw_timeline(events: Iterable[Sequence], p: int, path: str, title: str = "pipeline schedule") -> str:
    """Draw one row per pipeline rank (rank 0 on top): forwards blue, backwards orange (the
    input-gradient part in zero-bubble schedules) and weight-gradient W's green (darker for
    later local chunks), micro-batch numbers in the boxes, transfers and reductions as thin
    grey / purple bars under the row; white is idle. Writes a PNG at `path`, returns it."""
    out_dir = Path(path).resolve().parent
    if not out_dir.is_dir():
        raise ValueError(f"timeline: cannot write {path}: the directory {out_dir} does not "
                         f"exist; create it first or pass --out in an existing directory")
    try:
        import matplotlib
    except ImportError as exc:
        raise ValueError("timeline: matplotlib is not installed; `pip install matplotlib` "
                         "(it is a dependency of `pip install -e .` from this version on)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    evs = [(int(r), a if isinstance(a, Action) else parse_action(str(a)), float(s), float(e))
           for r, a, s, e in events]
    chunks = [a.chunk for _, a, _, _ in evs] or [0]
    v = max(1, -(-(max(chunks) + 1) // p))
    end = max((e for *_, e in evs), default=1.0) or 1.0
    # bounded at any scale: 8-24 in wide, 2.5-12 in tall (rows thin out past ~40 ranks)
    width_in = min(24.0, max(8.0, 4 + 0.25 * len(evs) / max(p, 1)))
    fig, ax = plt.subplots(figsize=(width_in, min(12.0, max(2.5, 0.35 * p + 2.0))))
    px_per_s = width_in * 110 * 0.85 / end
    drawn: set[str] = set()
    bars: dict[tuple, list] = {}      # one broken_barh per (row, band, colour): fast at scale
    for r, a, s, e in evs:
        y = p - 1 - r
        if a.kind in _CMAPS:
            bars.setdefault((y + 0.1, 0.8, _colour(a.kind, a.chunk // p, v)), []).append(
                (s, e - s))
            drawn.add(a.kind)
            if (e - s) * px_per_s > 12 and p <= 32:   # a number only where it fits
                ax.text((s + e) / 2, y + 0.5, str(a.mb), ha="center", va="center", fontsize=7)
        elif e > s:  # transfers and reductions only show when they take time
            colour = "tab:purple" if a.kind == "REDUCE" else "grey"
            bars.setdefault((y - 0.02, 0.1, colour), []).append((s, e - s))
            drawn.add("REDUCE" if a.kind == "REDUCE" else "P2P")
    for (y0, height, colour), spans in bars.items():
        edge = dict(edgecolor="black", linewidth=0.4) if height > 0.5 and p <= 32 else {}
        ax.broken_barh(spans, (y0, height), facecolors=colour, **edge)
    every = max(1, -(-p // 16))                   # at most ~16 row labels
    rows = range(0, p, every)
    ax.set_yticks([p - 1 - r + 0.5 for r in rows], [f"pipeline rank {r}" for r in rows])
    ax.set_ylim(-0.1, p)
    ax.set_xlim(0, end)
    ax.set_xlabel("time (s)")
    ax.set_title(title)
    ax.legend(handles=_legend(drawn, v, Patch), loc="upper center", bbox_to_anchor=(0.5, -0.18),
              fontsize=7, ncol=6, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _legend(drawn: set[str], v: int, Patch) -> list:
    """Legend entries for what is drawn only: each kind once, and with v > 1 local chunks
    the shades of the forward (lighter = earlier local chunk)."""
    has_w = "W" in drawn
    names = {"F": "forward", "B": "input grad" if has_w else "backward", "W": "weight grad"}
    handles = [Patch(color=_colour(k, 0, 1), label=names[k]) for k in ("F", "B", "W")
               if k in drawn]
    if v > 1 and "F" in drawn:
        shown = range(v) if v <= 4 else (0, v - 1)
        handles += [Patch(color=_colour("F", c, v), label=f"local chunk {c}") for c in shown]
    if "P2P" in drawn:
        handles.append(Patch(color="grey", label="p2p"))
    if "REDUCE" in drawn:
        handles.append(Patch(color="tab:purple", label="reduce"))
    return handles


def chunk_times(plan) -> tuple[list[float], list[float]]:
    """Per-chunk forward/backward seconds per micro-batch for `plan`: what its stages record
    (`plan.recorded_chunk_times`), else (a plan from before 2026-11-27) each chunk's share
    proportional to its layer count (an embedding- or head-only chunk counts as zero layers),
    scaled so the most loaded rank's compute over the step equals `plan.predicted.compute_s`
    (unit layers when that is 0), backward = 2 × forward (2104.04473 §5.1), 3 × with full
    recompute (one extra forward).
    """
    recorded = recorded_chunk_times(plan)
    if recorded is not None:
        return [f / 1e3 for f, _ in recorded], [b / 1e3 for _, b in recorded]
    layers = [max(0, st.num_layers) for st in plan.stages]
    if not any(layers):
        layers = [1] * len(plan.stages)
    # backward + recompute per forward: full reruns the forward, op about half its GEMMs
    bwd_ratio = {"full": 3.0, "op": 2.5}.get(plan.recompute, 2.0)
    per_rank = [sum(layers[c] for c in range(r, len(layers), plan.p)) for r in range(plan.p)]
    step_units = max(per_rank) * plan.num_microbatches * (1.0 + bwd_ratio)
    compute_s = getattr(plan.predicted, "compute_s", 0.0) or 0.0
    unit = compute_s / step_units if compute_s > 0 else 1.0
    fwd = [unit * n for n in layers]
    return fwd, [bwd_ratio * f for f in fwd]


def plan_timeline(plan, path: str) -> str:
    """Simulate `plan`'s schedule (per-chunk times from `chunk_times`, p2p and reduction time
    not drawn: 0) with blocking send/recv, and draw it at `path`. interleaved-zb: the
    runtime's own lists (placed by the stages' recorded times, equal chunks when none), the
    weight gradient W the forward's time (same GEMM FLOPs; chunk 0's its whole backward:
    `zb_weight_times`; B the rest of the backward), and the runtime's pre-posted receives
    (comm="irecv")."""
    fwd, bwd = chunk_times(plan)
    c0 = next(c for c, f in enumerate(fwd) if f > 0)  # order messages with real time ratios
    if plan.schedule == "interleaved-zb":    # the runtime's lists, as autopar/compile.py
        per_rank = make_schedule(plan.schedule, plan.p, plan.v, plan.num_microbatches,
                                 group=plan.microbatch_group,
                                 chunk_times=recorded_chunk_times(plan))
        res = simulate(per_rank, fwd, bwd, comm="irecv", wgt_s=zb_weight_times(fwd, bwd))
    else:
        per_rank = make_schedule(plan.schedule, plan.p, plan.v, plan.num_microbatches,
                                 group=plan.microbatch_group, times_fb=(fwd[c0], bwd[c0]))
        res = simulate(per_rank, fwd, bwd)
    # the bubble is the plan's number under the plan's definition (autopar.words.BUBBLE_MEANING)
    # — this drawing's simulation has no p2p time, so its own idle share would be another number
    fraction = plan.predicted.bubble_fraction if plan.predicted is not None \
        else res.bubble_over_compute
    title = (f"{plan.schedule}  p={plan.p} v={plan.v} m={plan.num_microbatches}  "
             f"{bubble_text(fraction)}")
    return draw_timeline(res.events, plan.p, path, title=title)
