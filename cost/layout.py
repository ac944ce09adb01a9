"""Spread each pipeline rank's layers over its chunks by simulating the schedule.

The solver (cost/solver.py) fixes y_r, the layers of pipeline rank r. cost.model's step time
depends on y only (T_pipe = m·max τ + (Σ τ − max τ)/v, exact for equal chunks) and so is blind
to how a rank's y_r layers are spread over its v chunks. The schedule is not. Every
micro-batch's forward runs chunks 0, 1, …, C−1 in order and its backward C−1, …, 0, so the
pipeline fills through the forward of chunk 0 (which also holds the embedding) and drains
through the backward of chunk 0, after every other rank has finished. A layer more in chunk 0
than in rank 0's later chunks lengthens both ends; the same layer in a later chunk of rank 0
runs in the steady state, while the other ranks are busy too. The same holds, mirrored, for
the last chunk and the head.

`spread_layers` picks the split: it times the plan's own action lists (autopar.schedules)
with the simulator (cost/simulate.py, comm="irecv": the runtime's pre-posted receives, so a
compute waits for its data only), fed with the cost model's per-chunk forward and backward
times. It hill-climbs over moves of one layer between two chunks of the same rank. y, and so
the predicted step time, the memory and the solver's optimality, are unchanged.

The first and the last chunk may end with no layers: they still hold the embedding and the
head + loss. Megatron-Core's pipeline layouts allow the same (a stage of only "L", the loss;
account_for_loss_in_pipeline_split). A heavy head alone in the last chunk is the turning point
of every micro-batch (its forward ends and its backward starts there) at the least cost.

Worked example: benchmarks/pipeline.py's GPT on 2 CPU ranks (8 layers; the LM head + loss
weighs ~2.5 layers; p=2, v=2, m=4; the solver's y = (5, 3)). Fed per-layer times measured
there (layer F 5.8 / B 12.0 ms, embedding 3.9 ms, head + loss 45.1 ms), the near-even split
[3, 2, 2, 1] simulates to 473 ms, [2, 2, 3, 1] to 461 ms and [2, 3, 3, 0], which the search
picks, to 434 ms (the even [2, 2, 2, 2]: 509 ms).
"""
from __future__ import annotations

from typing import Sequence

from autopar.cost.config import NS, ConfigCosts
from autopar.cost.profile import LayerKind
from autopar.cost.simulate import simulate
from autopar.cost.step import chunks_from_ranks
from autopar.schedules import Action, make_schedule, zb_weight_times

# cost.compute.edge_times_s prices the embedding and the head as one forward plus a backward
# of twice its work (GEMMs: dX and dW, each of the forward's size; elementwise: 2x the
# traffic), so a third of each is forward.
EDGE_FORWARD_SHARE = 1 / 3
# Simulated compute actions one call may spend (p·v·m·2 per simulation; each costs ~25-50 us
# here with its messages): ~5 simulations of p=8, v=4, m=32; smaller plans get more moves
# tried, and a plan whose lists cost more than a fifth of it keeps the near-even split (the
# planning-time goals of benchmarks/planner.py: solve < 1 s for GPT-3 175B and 1T).
MAX_SIMULATED_ACTIONS = 16_000


def chunk_times_s(cc: ConfigCosts, x: Sequence[int]) -> tuple[list[float], list[float], float]:
    """Per-chunk forward and backward seconds per micro-batch for layers per chunk `x`, and the
    seconds of one pipeline message. A layer takes cc.layer_ns (its TP collectives included),
    cc.layer_fwd_ns of it forward; chunk 0 adds the embedding and the last chunk the head;
    cc.p2p_ns is a rank's per-micro-batch p2p: 2·v messages."""
    C = len(x)
    fwd, bwd = [], []
    for c, n in enumerate(x):
        edge = (cc.embed_ns if c == 0 else 0) + (cc.head_ns if c == C - 1 else 0)
        f = cc.layer_fwd_ns * n + EDGE_FORWARD_SHARE * edge
        fwd.append(f / NS)
        bwd.append((cc.layer_ns * n + edge - f) / NS)
    return fwd, bwd, cc.p2p_ns / (2 * cc.cfg.v) / NS


def chunk_times_ms(cc: ConfigCosts, x: Sequence[int]) -> list[tuple[float, float]]:
    """(forward, backward) ms per micro-batch of every chunk at layers per chunk `x`
    (`chunk_times_s`): what a Plan's stages record and interleaved-zb's lists are placed by
    (autopar.schedules.make_schedule chunk_times), the same numbers here and in the runtime."""
    fwd, bwd, _ = chunk_times_s(cc, x)
    return [(f * 1e3, b * 1e3) for f, b in zip(fwd, bwd)]


def simulated_step_s(cc: ConfigCosts, x: Sequence[int],
                     per_rank: Sequence[Sequence[Action]], check: bool = True) -> float:
    """Makespan of the action lists `per_rank` with `x`'s per-chunk times (cost/simulate.py,
    comm="irecv"); the data-parallel tail and optimizer (the same for every x of one y) are
    not included. check=False: `per_rank` was validated already."""
    fwd, bwd, p2p = chunk_times_s(cc, x)
    # zero-bubble's W as the step formula prices it (bubble_div: F : B : W = 1 : 1 : 1, or
    # 1 : 2 : 1 under full recompute): a chunk's weight gradients take its forward's time;
    # chunk 0's its whole backward (its B has no input to return a gradient to)
    return simulate(per_rank, fwd, bwd, p2p, comm="irecv", wgt_s=zb_weight_times(fwd, bwd),
                    check=check).makespan_s


def schedule_pipe_s(cc: ConfigCosts, x: Sequence[int],
                    max_actions: int = MAX_SIMULATED_ACTIONS // 4) -> float | None:
    """Seconds from the step's first forward to the last backward (its data-parallel tail and
    optimizer not included) of the plan's own action lists at layers per chunk `x`, simulated
    (`simulated_step_s`); None for one pipeline rank, or when the lists hold more than
    `max_actions` compute actions (large m: the equal-chunk formula of cost/step.py is then
    what remains, and the one most plans of that size need)."""
    cfg = cc.cfg
    if cfg.p == 1 or 2 * cfg.p * cfg.v * cfg.num_microbatches > max_actions:
        return None
    fwd, bwd, _ = chunk_times_s(cc, x)
    c0 = max(range(len(x)), key=lambda c: fwd[c])
    per_rank = make_schedule(cfg.schedule, cfg.p, cfg.v, cfg.num_microbatches,
                             group=cfg.microbatch_group, times_fb=(fwd[c0], bwd[c0]),
                             chunk_times=chunk_times_ms(cc, x))   # the runtime's lists
    return simulated_step_s(cc, x, per_rank, check=False)


def layer_moves(x: list[int], p: int) -> list[list[int]]:
    """Every split that moves one layer from one chunk to another chunk of the same rank, in a
    fixed order: rank, source, destination. A chunk keeps at least one layer, except the first
    (the embedding) and the last (the head + loss): they have work without layers, and a
    head-only last chunk shortens the fill and drain that run through it."""
    out = []
    C = len(x)
    for r in range(p):
        mine = range(r, C, p)
        for a in mine:
            if x[a] <= (0 if a in (0, C - 1) else 1):
                continue
            for b in mine:
                if b != a:
                    y = list(x)
                    y[a] -= 1
                    y[b] += 1
                    out.append(y)
    return out


def spread_layers(cc: ConfigCosts, x: Sequence[int],
                  max_actions: int = MAX_SIMULATED_ACTIONS) -> list[int]:
    """Layers per chunk with the same per-rank totals as `x` (chunk c on rank c mod p) and the
    least simulated step time of the plan's schedule (first-improvement hill climbing from `x`
    over single-layer moves within a rank; a move must shorten the simulated step to be taken,
    so with equal-cost chunks `x` comes back unchanged). At most `max_actions` simulated
    compute actions are spent, building the action lists counted as two simulations. One chunk
    per rank (v = 1) leaves nothing to choose."""
    cfg = cc.cfg
    x = list(x)
    cost = 2 * cfg.p * cfg.v * cfg.num_microbatches
    # building and checking the action lists and the first simulation cost about two
    # simulations: a plan too large for one candidate besides them keeps the near-even split
    budget = max_actions // cost - 3
    if cfg.v == 1 or cfg.p == 1 or budget < 1:
        return x
    fwd, bwd, _ = chunk_times_s(cc, x)
    c0 = max(range(len(x)), key=lambda c: fwd[c])
    per_rank = make_schedule(cfg.schedule, cfg.p, cfg.v, cfg.num_microbatches,
                             group=cfg.microbatch_group, times_fb=(fwd[c0], bwd[c0]))
    best = simulated_step_s(cc, x, per_rank)
    improved = True
    while improved and budget > 0:
        improved = False
        for cand in layer_moves(x, cfg.p):
            if budget <= 0:
                break
            budget -= 1
            t = simulated_step_s(cc, cand, per_rank, check=False)
            if t < best * (1 - 1e-9):
                x, best, improved = cand, t, True
                break
    return x


def late_heavy(y: Sequence[int], p: int, v: int) -> list[int]:
    """Layers per chunk from rank totals `y` with each rank's remainder in its LAST chunks
    (step.chunks_from_ranks puts it in the first). Under the interleaved schedules a rank's
    earlier chunks hold more micro-batches in flight, so this placement holds the fewest
    activations of the near-even ones. A rank with fewer layers than chunks keeps
    chunks_from_ranks' placement (only an edge chunk may be empty)."""
    x = chunks_from_ranks(list(y), p, v)
    for r in range(p):
        q, rem = divmod(y[r], v)
        if q:
            for j in range(v):
                x[j * p + r] = q + (1 if j >= v - rem else 0)
    return x


def layers_over_kinds(units: Sequence[int], kinds: Sequence[LayerKind]) -> list[int]:
    """The model's layers in each chunk when the solver's split `units` counts repeat units of
    one layer of each kind (an encoder-decoder: one encoder and one decoder layer) and the
    chunks run the kinds' layers in order (all encoder layers, then all decoder layers).

    A chunk's units are work: U = (Σ layers' forward FLOPs) / units each. Cut c falls at the
    layer boundary whose cumulative forward FLOPs are nearest the chunks' cumulative units · U,
    so a stage of the lighter kind holds more layers than one of the heavier. A chunk with
    units keeps at least one layer; one without (an embedding- or head-only chunk) none.
    Worked example: T5's 2 + 2 layers (encoder 2 FLOPs, decoder 3), units [1, 1] → the cut
    nearest 5 of 10: after 2 encoder layers (4) or after one decoder layer (7)? 4 → [2, 2].
    """
    flops = [k.fwd_flops for k in kinds for _ in range(k.num_layers)]
    prefix = [0]
    for f in flops:
        prefix.append(prefix[-1] + f)
    total_units = sum(units)
    if any(k.num_layers != total_units for k in kinds):
        raise ValueError(f"layers_over_kinds: units {list(units)} sum to {total_units}, but "
                         f"the kinds hold {[k.num_layers for k in kinds]} layers (one unit "
                         f"per layer of each kind); split the profile's num_layers units")
    mins = [1 if u else 0 for u in units]
    out, prev, done = [], 0, 0
    for c, u in enumerate(units[:-1]):
        done += u
        lo = prev + mins[c]
        hi = len(flops) - sum(mins[c + 1:])
        target = prefix[-1] * done / total_units
        cut = prev if not u else min(range(lo, hi + 1), key=lambda i: abs(prefix[i] - target))
        out.append(cut - prev)
        prev = cut
    out.append(len(flops) - prev)
    return out
