"""Spreading a rank's layers over its chunks by simulating the schedule (cost/layout.py)."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from autopar.cost import layout
from autopar.cost import model as M
from autopar.cost.hardware import get_cluster
from autopar.cost.profile import transformer_profile
from autopar.cost.simulate import simulate
from autopar.cost.solver import chunks_from_ranks, solve
from autopar.schedules import interleaved_1f1b, make_schedule

MS = 1_000_000  # ns


def _costs(p: int, v: int, m: int, layer_f_ms: float, layer_b_ms: float, embed_ms: float,
           head_ms: float, schedule: str = "interleaved-1f1b") -> M.ConfigCosts:
    cfg = M.Config(t=1, p=p, d=1, v=v, num_microbatches=m, schedule=schedule)
    z = dict(p2p_ns=0, dp_layer_ns=0, dp_first_ns=0, dp_last_ns=0, window_layer_ns=0,
             opt_layer_ns=0, opt_first_ns=0, opt_last_ns=0)
    return M.ConfigCosts(cfg=cfg, layer_compute_ns=round((layer_f_ms + layer_b_ms) * MS),
                         layer_tp_ns=0, embed_ns=round(embed_ms * MS),
                         head_ns=round(head_ms * MS), **z, mem_layer_bytes=(0,) * p,
                         mem_fixed_bytes=(0,) * p, capacity_bytes=1, flops_per_step=1.0,
                         model_flops_per_step=1.0, mem_parts=(), mem_fixed_parts=(),
                         layer_fwd_ns=round(layer_f_ms * MS))


def _ranks(x, p):
    return M.rank_layers(x, p)


def _sim(cc, x):
    acts = make_schedule(cc.cfg.schedule, cc.cfg.p, cc.cfg.v, cc.cfg.num_microbatches,
                         group=cc.cfg.microbatch_group)
    return layout.simulated_step_s(cc, x, acts)


def test_chunk_times_put_embedding_first_and_head_last():
    cc = _costs(2, 2, 4, 5.0, 10.0, 3.0, 30.0)
    fwd, bwd, p2p = layout.chunk_times_s(cc, [1, 2, 2, 1])
    assert fwd == pytest.approx([0.006, 0.010, 0.010, 0.015])
    assert bwd == pytest.approx([0.012, 0.020, 0.020, 0.030])
    assert p2p == 0


def test_worked_example_moves_a_layer_out_of_the_first_chunk():
    """The module docstring's example: benchmarks/pipeline.py's GPT with measured per-layer
    times; y = (5, 3) from the solver. The near-even [3, 2, 2, 1] fills and drains through a
    3-layer chunk 0 and turns every micro-batch around in a head + 1-layer chunk 3;
    [2, 3, 3, 0] runs those layers in the ranks' middle chunks and leaves the head alone."""
    cc = _costs(2, 2, 4, 5.8, 12.0, 3.9, 45.1)
    start = [3, 2, 2, 1]
    got = layout.spread_layers(cc, start)
    assert got == [2, 3, 3, 0]
    assert _ranks(got, 2) == _ranks(start, 2)
    assert _sim(cc, got) < _sim(cc, [2, 2, 3, 1]) < _sim(cc, start)
    assert _sim(cc, got) < _sim(cc, start) * 0.95


def test_only_the_edge_chunks_may_lose_every_layer():
    """The first chunk keeps the embedding and the last the head + loss without layers; a
    middle chunk with none would only relay, so moves keep one layer there."""
    moves = layout.layer_moves([1, 1, 1, 1, 1, 1], 2)
    for x in moves:
        assert min(x[1:-1]) >= 1 and sum(x) == 6
    assert [0, 1, 2, 1, 1, 1] in moves and [1, 1, 1, 2, 1, 0] in moves


def test_equal_chunks_without_edges_stay_as_given():
    """Nothing to gain: every move lengthens some chunk, so the near-even split comes back."""
    cc = _costs(4, 2, 8, 1.0, 2.0, 0.0, 0.0)
    start = chunks_from_ranks([4, 4, 4, 4], 4, 2)
    assert layout.spread_layers(cc, start) == start


def test_heavy_head_is_mirrored_on_the_last_rank():
    """A head worth 4 layers, ranks balanced (8 layers vs 4 + head): the last chunk is the
    pipeline's turning point (each micro-batch's forward ends and its backward starts there),
    so rank p−1's earlier chunk takes its layers."""
    cc = _costs(2, 2, 4, 5.0, 10.0, 0.0, 60.0)
    start = [4, 2, 4, 2]
    got = layout.spread_layers(cc, start)
    assert _ranks(got, 2) == _ranks(start, 2)
    assert got[3] < start[3]
    assert _sim(cc, got) < _sim(cc, start)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "interleaved-zb", "breadth-first"])
def test_every_multi_chunk_schedule_only_improves(schedule):
    cc = _costs(2, 3, 4, 5.0, 10.0, 8.0, 40.0, schedule=schedule)
    start = chunks_from_ranks([7, 5], 2, 3)
    got = layout.spread_layers(cc, start)
    assert _ranks(got, 2) == [7, 5] and min(got[1:-1]) >= 1
    assert _sim(cc, got) <= _sim(cc, start)


def test_no_budget_or_one_chunk_per_rank_returns_the_input():
    cc = _costs(2, 2, 4, 5.8, 12.0, 3.9, 45.1)
    assert layout.spread_layers(cc, [3, 2, 2, 1], max_actions=1) == [3, 2, 2, 1]
    one = _costs(2, 1, 4, 5.8, 12.0, 3.9, 45.1, schedule="1f1b")
    assert layout.spread_layers(one, [5, 3]) == [5, 3]


def test_simulate_without_check_times_the_same():
    acts = interleaved_1f1b(2, 2, 4)
    fwd, bwd = [0.01, 0.02, 0.02, 0.03], [0.02, 0.04, 0.04, 0.06]
    a = simulate(acts, fwd, bwd, 0.001, comm="irecv")
    b = simulate(acts, fwd, bwd, 0.001, comm="irecv", check=False)
    assert a.makespan_s == b.makespan_s and a.events == b.events


def test_solver_spreads_the_chosen_plans_layers_by_simulation():
    """The solver's rank totals stay; within them the plan's chunks simulate no slower than the
    near-even split, and a heavy-head model gets a lighter first chunk than near-even gives."""
    prof = transformer_profile(num_layers=8, hidden=256, heads=4, seq_len=64, vocab=32768)
    plan = solve(prof, "dgx-a100-80gb", gpus=2, global_batch_size=16, t=1, p=2, d=1, v=2,
                 micro_batch_size=4, schedule="interleaved-1f1b")
    x = [st.num_layers for st in plan.stages]
    even = chunks_from_ranks(_ranks(x, 2), 2, 2)
    cc = M.config_costs(prof, get_cluster("dgx-a100-80gb"), M.Config.of_plan(plan))
    assert _sim(cc, x) <= _sim(cc, even)
    assert x != even and x[0] < even[0]


def _kinds(encoder_flops: int, decoder_flops: int, depth: int):
    from autopar.cost.profile import LayerKind
    return (LayerKind(name="encoder", num_layers=depth, fwd_flops=encoder_flops),
            LayerKind(name="decoder", num_layers=depth, fwd_flops=decoder_flops))


def test_layers_over_kinds_cuts_at_equal_forward_flops():
    """Units of one encoder and one decoder layer: the docstring's worked example, then a
    4-way split of 12 + 12 layers where a decoder layer weighs 2 encoder layers (36 in all, 9
    a stage): 9 encoder layers; 3 encoder + 3 decoder (18); the cut at 27 ties between 26 and
    28 and takes the earlier (4 decoder layers); the other 5."""
    assert layout.layers_over_kinds([1, 1], _kinds(2, 3, 2)) == [2, 2]
    assert layout.layers_over_kinds([3, 3, 3, 3], _kinds(1, 2, 12)) == [9, 6, 4, 5]
    # equal kinds: a unit is two layers
    assert layout.layers_over_kinds([2, 1, 1], _kinds(5, 5, 4)) == [4, 2, 2]


def test_layers_over_kinds_keeps_empty_edge_chunks_and_one_layer_per_chunk():
    """An embedding-only first chunk and a head-only last chunk stay empty; light encoder
    layers and a heavy decoder layer share a stage (1 + 1 + 100 against 100)."""
    assert layout.layers_over_kinds([0, 2, 2, 0], _kinds(1, 1, 4)) == [0, 4, 4, 0]
    assert layout.layers_over_kinds([1, 1], _kinds(1, 100, 2)) == [3, 1]


def test_layers_over_kinds_refuses_units_that_do_not_match_the_depths():
    with pytest.raises(ValueError, match="units"):
        layout.layers_over_kinds([1, 1], _kinds(1, 1, 3))


def _same_rank_totals(x: list[int], p: int) -> list[list[int]]:
    """Every split with x's per-rank totals whose middle chunks keep a layer (layer_moves'
    rule: only the embedding's and the head's chunks may be empty)."""
    C, out = len(x), []
    for cand in itertools.product(range(sum(x) + 1), repeat=C):
        if (_ranks(list(cand), p) == _ranks(x, p) and min(cand[1:-1]) >= 1):
            out.append(list(cand))
    return out


def test_benchmark_plans_cut_is_the_best_simulated_in_its_own_group():
    """benchmarks/pipeline.py's model (GPT, 8 layers, hidden 256, vocab 8192, p = 2, v = 2,
    m = 4) on local-cpu: the planner runs it in micro-batch groups N and cuts its chunks by
    simulating THAT order, so of every split with the solver's rank totals the plan's is the
    fastest under the plan's own action lists. The cut belongs to its N: measured 2026-11-26,
    [1, 2, 4, 1] ran 0.83 × torch's step at N = 4 and 0.95 × at N = p, the order the benchmark
    had run it in (docs/benchmarks.md)."""
    prof = transformer_profile(num_layers=8, hidden=256, heads=4, seq_len=64, vocab=8192)
    plan = solve(prof, "local-cpu", gpus=2, global_batch_size=16, t=1, p=2, d=1, v=2,
                 micro_batch_size=4, schedule="interleaved-1f1b")
    cfg = M.Config.of_plan(plan)
    assert cfg.microbatch_group == plan.microbatch_group
    cc = M.config_costs(prof, get_cluster("local-cpu"), cfg)
    x = [st.num_layers for st in plan.stages]
    best = _sim(cc, x)
    others = _same_rank_totals(x, 2)
    assert len(others) > 5 and x in others
    assert all(best <= _sim(cc, o) * (1 + 1e-9) for o in others)
    # and the ranking is the order's: in torch's order (N = p) another split is faster (the
    # planner picks N = 4 here today; should a cost change pick N = p, the check above is it)
    if (plan.microbatch_group or 2) > 2:
        at_p = M.config_costs(prof, get_cluster("local-cpu"),
                              dataclasses.replace(cfg, microbatch_group=2))
        assert min(_sim(at_p, o) for o in others) < _sim(at_p, x)


def _formula_pipe_ns(cc, x):
    from autopar.cost.step import rank_load_ns, step_scale
    loads = [rank_load_ns(cc, r, y) for r, y in enumerate(_ranks(x, cc.cfg.p))]
    return cc.cfg.num_microbatches * max(loads) + (sum(loads) - max(loads)) / step_scale(cc.cfg)


@pytest.mark.parametrize("group", [None, 4])
def test_zero_bubble_lists_of_uneven_chunks_are_priced_by_their_stalls(group):
    """A 2-layer GPT at p = v = 2 (embedding-only first chunk, a layer each in the middle,
    head-only last chunk; per-layer F 10 / B 21 ms as measured on CPU): interleaved-zb's
    lists stall where the step formula sees a third of a bubble, and predict adds the
    simulated excess (schedule_stall_ns); with groups of N = 4 that prices it above
    interleaved 1F1B (the formula alone: 7% below; measured 23–27% slower). Equal chunks at
    F : B : W = 1 : 1 : 1 do not stall."""
    x = [0, 1, 1, 0]
    zb = _costs(2, 2, 4, 10, 21, 0.3, 4.8, schedule="interleaved-zb")
    zb = dataclasses.replace(zb, cfg=dataclasses.replace(zb.cfg, microbatch_group=group))
    pipe = _formula_pipe_ns(zb, x)
    stall = M.schedule_stall_ns(zb, x, pipe)
    assert stall == pytest.approx(layout.schedule_pipe_s(zb, x) * 1e9 - pipe, rel=1e-9)
    assert stall > 0.1 * pipe
    one = dataclasses.replace(zb, cfg=dataclasses.replace(zb.cfg, schedule="interleaved-1f1b"))
    one_pipe = _formula_pipe_ns(one, x)
    assert pipe < one_pipe
    if group == 4:
        assert one_pipe + M.schedule_stall_ns(one, x, one_pipe) < pipe + stall
    assert M.schedule_stall_ns(zb, x, pipe, mixed=True) == 0.0   # kinds: not simulated
    even = _costs(2, 2, 4, 10, 20, 0, 0, schedule="interleaved-zb")
    assert M.schedule_stall_ns(even, [1] * 4, _formula_pipe_ns(even, [1] * 4)) == 0.0
