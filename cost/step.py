"""The step-time formula: a step's time from the rank layer counts y_r, each piece affine in
y_r with integer coefficients (`rank_load_ns`, `rank_tail_terms_ns`, `rank_memory_bytes`),
and `scaled_step_ns`, the one statement of the formula (the pipeline bubble included).

- Pipeline: each pipeline rank r has a per-micro-batch load tau_r (forward + backward of all its
  chunks, their TP collectives and p2p). With m micro-batches and v chunks per rank
      T_pipe = m * max_r tau_r + (sum_r tau_r - max_r tau_r) / v.
  For equal loads this is m*tau*(1 + (p-1)/(v*m)): the published bubble (p-1)/m for GPipe/1F1B
  and (p-1)/(v*m) for interleaved 1F1B; for unequal loads the slowest rank sets the steady
  state and the others' loads fill the ramp-up/down. bubble_fraction = bubble / (m * max tau).
  Breadth-first (2211.05953) has the same bubble: with equal chunks and asynchronous sends its
  event simulation (cost/simulate.py, blocking=False) idles exactly (p-1)·tau/v per rank, like
  interleaved 1F1B (tests/unit/test_breadth_first_planner.py checks all four schedules).
  Zero-bubble interleaved 1F1B ("interleaved-zb", 2401.10241's B/W split on the interleaved or,
  for v = 1, the 1F1B order) fills the ramp-down with the deferred weight-gradient halves W of
  the backwards: with F : B : W = 1 : 1 : 1 each rank idles (p-1)·(F + B - W) per chunk instead
  of (p-1)·(F + B + W), a third (ScheduleTraits.bubble_div = 3; with full recompute B also
  recomputes the forward, F : B : W = 1 : 2 : 1, half: bubble_div = 2), so
      T_pipe = m * max_r tau_r + (sum_r tau_r - max_r tau_r) / (v * bubble_div),
  what cost/simulate.py gives on autopar.schedules.interleaved_zb's lists for equal chunks.
  The tail after a rank's last backward: its exposed data-parallel reduction (cost/dp_terms.py)
  and its optimizer step, the larger of the two (`rank_tail_terms_ns`).

The pieces only add and multiply by int constants, so y_r (and the loads and tails passed to
scaled_step_ns) may be plain ints (predict, the brute force, the bounds) or CP-SAT linear
expressions (cost/cpsat.py's constraints and objective): the solver restates none of them.
"""
from __future__ import annotations

from fractions import Fraction
from typing import TypeVar

from autopar.cost.config import Config, ConfigCosts, LoadCosts, bubble_div

Lin = TypeVar("Lin")  # an int, or a CP-SAT linear expression


def even_chunks(num_layers: int, chunks: int) -> list[int]:
    """Layers per chunk of the even split: num_layers // chunks each, the earlier chunks one
    more while the remainder lasts."""
    q, rem = divmod(num_layers, chunks)
    return [q + (1 if c < rem else 0) for c in range(chunks)]


def chunks_from_ranks(y: list[int], p: int, v: int) -> list[int]:
    """Layers per chunk (chunk c on rank c mod p) from rank totals: near-even split per rank,
    the earlier chunks taking the remainder; a rank with fewer layers than chunks leaves the
    first / last chunk of the pipeline (embedding / head) empty first."""
    C = p * v
    x = [0] * C
    for r in range(p):
        q, rem = divmod(y[r], v)
        order = list(range(v))
        if q == 0:  # middle chunks first: only an edge chunk may be empty
            order.sort(key=lambda j: j * p + r in (0, C - 1))
        for k, j in enumerate(order):
            x[j * p + r] = q + (1 if k < rem else 0)
    return x


def rank_layers(layers_per_chunk: tuple[int, ...] | list[int], p: int) -> list[int]:
    """y_r: layers on pipeline rank r when chunk c runs on rank c mod p."""
    y = [0] * p
    for c, n in enumerate(layers_per_chunk):
        y[c % p] += n
    return y


def rank_load_ns(lc: LoadCosts, r: int, y_r: Lin) -> Lin:
    """tau_r, the per-micro-batch load of pipeline rank r holding y_r layers: its layers, its
    p2p, the embedding on rank 0 and the head on rank p-1 (`load_of_ns`), and when the stack
    has kinds what its real layers take beyond its mean layers (`LoadCosts.cut_ns`)."""
    return load_of_ns(lc.layer_ns, lc.p2p_ns, lc.embed_ns, lc.head_ns, lc.cfg.p, r,
                      y_r) + lc.cut_ns(r)


def total_load_ns(lc: LoadCosts, num_layers: int) -> int:
    """Σ_r tau_r, the same for every split of num_layers layers (`total_load_of_ns`; a stack of
    kinds too: the cut only moves time between ranks, `LoadCosts.rank_cut_ns` sums to 0)."""
    return total_load_of_ns(lc.layer_ns, lc.p2p_ns, lc.embed_ns, lc.head_ns, lc.cfg.p,
                            num_layers)


def load_of_ns(layer_ns: int, p2p_ns: int, embed_ns: int, head_ns: int, p: int, r: int,
               y_r: Lin) -> Lin:
    """`rank_load_ns` from a LoadCosts' integers and p (no Config: the search's quick bound)."""
    fixed = p2p_ns + (embed_ns if r == 0 else 0) + (head_ns if r == p - 1 else 0)
    return layer_ns * y_r + fixed


def total_load_of_ns(layer_ns: int, p2p_ns: int, embed_ns: int, head_ns: int, p: int,
                     num_layers: int) -> int:
    """`load_of_ns` summed over the p ranks: one slope on every rank, p2p on each, the
    embedding and the head once."""
    return layer_ns * num_layers + p * p2p_ns + embed_ns + head_ns


def tail_layer_ns(cc: ConfigCosts) -> int:
    """Per layer of a rank: its exposed data-parallel reduction + its optimizer step."""
    return cc.dp_layer_ns - cc.window_layer_ns + cc.opt_layer_ns


def rank_tail_terms_ns(cc: ConfigCosts, r: int, y_r: Lin) -> tuple[Lin, Lin]:
    """(exposed DP reduction + optimizer, optimizer) after rank r's last backward; its tail is
    the larger of the two: the overlap credit (window_layer_ns) cannot make the tail shorter
    than the optimizer step."""
    p = cc.cfg.p
    opt_fixed = (cc.opt_first_ns if r == 0 else 0) + (cc.opt_last_ns if r == p - 1 else 0)
    dp_fixed = (cc.dp_first_ns if r == 0 else 0) + (cc.dp_last_ns if r == p - 1 else 0) \
        + cc.dp_rank_ns
    return (tail_layer_ns(cc) * y_r + (dp_fixed + opt_fixed),
            cc.opt_layer_ns * y_r + opt_fixed)


def rank_tail_ns(cc: ConfigCosts, r: int, y_r: int) -> int:
    """The tail of rank r: the larger of `rank_tail_terms_ns`."""
    return max(rank_tail_terms_ns(cc, r, y_r))


def total_tail_ns(cc: ConfigCosts, num_layers: int) -> int:
    """Σ_r of the first tail term, the same for every split of num_layers layers:
    `rank_tail_terms_ns` summed (one slope on every rank, the edge terms once)."""
    return (tail_layer_ns(cc) * num_layers + cc.dp_first_ns + cc.dp_last_ns + cc.opt_first_ns
            + cc.opt_last_ns + cc.cfg.p * cc.dp_rank_ns)


def rank_memory_bytes(cc: ConfigCosts, r: int, y_r: Lin) -> Lin:
    return cc.mem_layer_bytes[r] * y_r + cc.mem_fixed_bytes[r]


def step_scale(cfg: Config) -> int:
    """V = v · bubble_div: the bubble is (Σ tau - max tau) / V, so V · step time is an integer
    for integer loads."""
    return cfg.v * bubble_div(cfg)


def scaled_step_ns(cfg: Config, load_max_ns: Lin, load_sum_ns: Lin, tail_max_ns: Lin) -> Lin:
    """V · step time in ns (V = step_scale(cfg)) from the max and the sum of the rank loads and
    the max tail: the module docstring's T_pipe plus the tail,
        step = m · max tau + (Σ tau - max tau) / V + max tail
        V · step = (m·V - 1) · max tau + Σ tau + V · max tail.
    The one statement of the step-time formula: step_time_scaled, both lower bounds and the
    solver's objective (which scales each combination's by W / V to a common denominator W)
    call it."""
    return scaled_step_of(cfg.num_microbatches, step_scale(cfg), load_max_ns, load_sum_ns,
                          tail_max_ns)


def scaled_step_of(m: int, V: int, load_max_ns: Lin, load_sum_ns: Lin, tail_max_ns: Lin) -> Lin:
    """`scaled_step_ns` from m micro-batches and V = v · bubble_div (no Config: the search's
    quick bound)."""
    return (m * V - 1) * load_max_ns + load_sum_ns + V * tail_max_ns


def v_step_ns(cfg: Config, load_max_ns: int, load_sum_ns: int,
              tail_max_ns: int) -> int | Fraction:
    """v · step time in ns, exactly: `scaled_step_ns` / bubble_div (an int when bubble_div is 1,
    else an exact Fraction)."""
    scaled, k = scaled_step_ns(cfg, load_max_ns, load_sum_ns, tail_max_ns), bubble_div(cfg)
    return scaled if k == 1 else Fraction(scaled, k)


def step_time_scaled(cc: ConfigCosts, y: list[int]) -> int | Fraction:
    """v · step time in ns of the rank layer counts y, exactly (`v_step_ns`)."""
    loads = [rank_load_ns(cc, r, yr) for r, yr in enumerate(y)]
    tail = max(rank_tail_ns(cc, r, yr) for r, yr in enumerate(y))
    return v_step_ns(cc.cfg, max(loads), sum(loads), tail)


def step_time_ns(cc: ConfigCosts, y: list[int]) -> float:
    return float(step_time_scaled(cc, y) / cc.cfg.v)


def fits(cc: ConfigCosts, y: list[int]) -> bool:
    return all(rank_memory_bytes(cc, r, yr) <= cc.capacity_bytes for r, yr in enumerate(y))

