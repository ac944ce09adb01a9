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


def test_the_chosen_split_fits_the_gpu_by_the_schedule_walk_not_only_the_linear_form():
    """CP-SAT's memory rows are the linear form (in-flight chunk-micro-batches × a rank's mean
    layers per chunk); under interleaving a rank's early chunks hold more micro-batches in
    flight, so 6 layers on 4 chunks placed [2, 2, 1, 1] walk to more than the linear form says.
    On a GPU between the two the solver must hand back a split whose walked peak fits: the
    same rank totals placed late-heavy ([1, 1, 2, 2], layout.late_heavy), the same step time."""
    import dataclasses
    from autopar.cost import model as M
    from autopar.cost.bounds import chunks_from_ranks
    from autopar.cost.hardware import get_cluster
    from autopar.cost.layout import late_heavy
    from autopar.cost.profile import transformer_profile
    from autopar.cost.solver import solve
    GIB = 2 ** 30
    h100 = get_cluster("dgx-h100-80gb")
    prof = transformer_profile(num_layers=24, hidden=4096, heads=32, seq_len=4096, vocab=32000)
    pins = dict(t=4, p=4, d=1, v=4, micro_batch_size=1, schedule="interleaved-1f1b", zero=1,
                recompute="none", sequence_parallel=False, c=1)
    cfg = M.Config(t=4, p=4, d=1, v=4, micro_batch_size=1, num_microbatches=16,
                   schedule="interleaved-1f1b", zero=1, recompute="none")
    cc = M.config_costs(prof, h100, cfg)
    walked = lambda x: M.predict(prof, h100, cfg, x, costs=cc).memory_bytes_per_gpu  # noqa
    first, late = chunks_from_ranks([6] * 4, 4, 4), late_heavy([6] * 4, 4, 4)
    assert late == [1] * 8 + [2] * 8 and first == [2] * 8 + [1] * 8
    linear = max(cc.mem_layer_bytes[r] * 6 + cc.mem_fixed_bytes[r] for r in range(4))
    assert linear + h100.reserved_bytes < walked(late) + 0.3 * GIB < walked(first)
    gpu = dataclasses.replace(h100, memory_bytes=(walked(late) + walked(first)) / 2)
    plan = solve(prof, gpu, gpus=16, global_batch_size=16, **pins)
    assert plan.predicted.memory_bytes_per_gpu <= gpu.memory_bytes
    assert plan.predicted.step_time_s == pytest.approx(
        M.predict(prof, h100, cfg, late, costs=cc).step_time_s, rel=1e-6)


def test_the_last_stage_holds_the_losss_backward_working_set():
    """The loss's backward holds the gradient into and out of the vocabulary-wide log-softmax
    beside the saved one: two more of its fp32 size, on the last stage only, and not at the
    same time as a recomputed layer's working set (the larger counts). Without it an H100's
    allocator held 29% more activations than priced (benchmarks/gpu.py, 2026-11-26)."""
    from autopar.cost.hardware import get_cluster
    from autopar.cost.memory import memory_coefficients, microbatch_activations
    from autopar.cost.profile import transformer_profile
    from autopar.cost.shares import rank_params
    cl = get_cluster("dgx-h100-80gb")
    prof = transformer_profile(num_layers=4, hidden=256, heads=4, seq_len=512,
                               vocab=50304).for_cluster(cl)
    logsoftmax = 512 * 50304 * 4                      # one sequence's fp32 log-probabilities
    for recompute in ("none", "full"):
        cfg = Config(t=1, p=2, d=1, v=1, micro_batch_size=2, num_microbatches=4,
                     schedule="1f1b", recompute=recompute)
        acts = microbatch_activations(prof, cfg, cl)
        assert acts.head_work == pytest.approx(2 * 2 * logsoftmax, rel=0.01)
        *_, fparts, _ = memory_coefficients(prof, cl, cfg, rank_params(prof, cfg))
        assert fparts[0][4] == acts.work                               # first stage: no loss
        assert fparts[1][4] == max(acts.work, acts.head_work) > acts.work   # last stage
