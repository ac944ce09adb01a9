"""The activation peak walked along the schedule's action lists (autopar.schedules.peak_held,
cost.model.schedule_activation_bytes) against the solver's linear form (cost.model.inflight,
pending_weight_grads)."""
from __future__ import annotations

import pytest

from autopar.cost.config import Config, _pending_zero_bubble, inflight
from autopar.schedules import (SCHEDULE_NAMES, compute_order, make_schedule, peak_held,
                               peak_inflight)

DIMS = [(2, 2, 4), (4, 2, 8), (4, 2, 16), (4, 4, 16), (3, 2, 6), (2, 1, 8), (4, 1, 16)]


# every schedule at every size it runs (gpipe and 1F1B: one chunk per rank)
CASES = [(n, p, v, m) for n in SCHEDULE_NAMES for p, v, m in DIMS
         if v == 1 or n not in ("gpipe", "1f1b")]


@pytest.mark.parametrize("name,p,v,m", CASES)
def test_unit_weights_are_peak_inflight(name, p, v, m):
    acts = make_schedule(name, p, v, m)
    assert peak_held(acts, [1] * (p * v)) == peak_inflight(acts)


@pytest.mark.parametrize("name,p,v,m", CASES)
def test_linear_inflight_is_the_walk_with_equal_chunks(name, p, v, m):
    walk = peak_held(compute_order(name, p, v, m), [1] * (p * v))
    cfg = Config(t=1, p=p, d=1, v=v, num_microbatches=m, schedule=name)
    assert walk == [inflight(cfg, r) for r in range(p)]


def test_uneven_chunks_weigh_what_they_hold():
    # interleaved 1F1B, p = 2, v = 2, m = 4: rank 0 holds chunks 0 and 2. Chunk 0 heavy:
    # its four micro-batches are all in flight before chunk 2's first backward
    acts = compute_order("interleaved-1f1b", 2, 2, 4)
    heavy0 = peak_held(acts, [10, 1, 1, 1])[0]
    heavy2 = peak_held(acts, [1, 1, 10, 1])[0]
    assert heavy0 == 4 * 10 + 1           # F0.0-3 then F2.0 before B2.0 ... by the list
    assert heavy2 < heavy0                # chunk 2 is held for fewer micro-batches at once
    assert peak_held(acts, [0, 0, 0, 0]) == [0, 0]


@pytest.mark.parametrize("p,v,m", DIMS)
def test_pending_bound_covers_deferred_weight_grads(p, v, m):
    acts = make_schedule("interleaved-zb", p, v, m)
    # pairs whose B ran and W not: weight 0 until B, 1 from B to W
    walked = peak_held(acts, [0] * (p * v), [1] * (p * v))
    g0 = min(p, m)
    assert walked == [_pending_zero_bubble(p, v, m, r, g0) for r in range(p)]


def test_deferred_weights_add_between_b_and_w():
    acts = make_schedule("interleaved-zb", 2, 2, 4)
    base = peak_held(acts, [1, 1, 1, 1])
    more = peak_held(acts, [1, 1, 1, 1], [1, 1, 1, 1])
    assert all(m > b for m, b in zip(more, base))
    assert peak_held(acts, [1, 1, 1, 1], None) == base
