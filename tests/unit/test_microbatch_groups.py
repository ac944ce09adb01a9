"""Micro-batch groups N of the interleaved schedules (Llama 3's tunable N; Megatron-Core's
microbatch_group_size_per_vp_stage) and pipelines with fewer micro-batches than ranks: the
plan field, the cost model's memory and p2p terms, the simulator, and the solver's choice."""
from __future__ import annotations

import dataclasses

import pytest

from autopar.cost.hardware import get_cluster, with_overrides
from autopar.cost.model import Config, inflight, predict
from autopar.cost.profile import transformer_profile
from autopar.cost.simulate import simulate
from autopar.cost.solver import solve
from autopar.schedules import interleaved_1f1b, peak_inflight

A100 = get_cluster("dgx-a100-80gb")


def _profile(layers: int = 16):
    return transformer_profile(num_layers=layers, hidden=4096, heads=32, seq_len=2048,
                               vocab=51200)


def _cfg(**kw):
    base = dict(t=8, p=4, d=1, v=2, micro_batch_size=1, num_microbatches=32,
                schedule="interleaved-1f1b", recompute="full")
    return Config(**{**base, **kw})


def test_group_is_validated_with_value_rule_and_fix():
    with pytest.raises(ValueError, match=r"microbatch_group=3 .* N dividing m"):
        _cfg(microbatch_group=3)
    with pytest.raises(ValueError, match=r"microbatch_group=2 .* p <= N"):
        _cfg(microbatch_group=2)
    with pytest.raises(ValueError, match="only .*interleaved"):
        _cfg(schedule="1f1b", v=1, microbatch_group=8)
    plan = solve(_profile(), A100, gpus=32, global_batch_size=32, t=8, p=4, v=2,
                 micro_batch_size=1, schedule="interleaved-1f1b", microbatch_group=8)
    assert plan.microbatch_group == 8 and "N=8" in str(plan)
    assert type(plan).from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="Plan.microbatch_group=8 with schedule='1f1b'"):
        dataclasses.replace(plan, schedule="1f1b", v=1, stages=plan.stages)
    with pytest.raises(ValueError, match="only the interleaved schedules"):
        solve(_profile(), A100, gpus=32, global_batch_size=32, schedule="1f1b",
              microbatch_group=8)


def test_memory_grows_and_exposed_p2p_falls_with_the_group():
    """N = p is Megatron's order: the same prediction as no group. A wider group holds more
    micro-batches (rank 0: 2(p−1) + (v−1)·N + 1, what the action lists hold) and hides more
    of the ring's p2p latency."""
    cl = with_overrides(A100, inter_node_bandwidth_Bps=2e9)     # slow pipeline links
    prof = _profile()
    base = predict(prof, cl, _cfg(d=2))
    assert predict(prof, cl, _cfg(d=2, microbatch_group=4)) == base
    wide = [predict(prof, cl, _cfg(d=2, microbatch_group=n)) for n in (8, 16, 32)]
    for n, pr in zip((8, 16, 32), wide):
        cfg = _cfg(d=2, microbatch_group=n)
        assert inflight(cfg, 0) == max(peak_inflight(interleaved_1f1b(4, 2, 32, group=n)))
        assert pr.memory_bytes_per_gpu > base.memory_bytes_per_gpu
    assert base.pp_comm_s > wide[0].pp_comm_s >= wide[1].pp_comm_s >= wide[2].pp_comm_s
    assert wide[0].step_time_s < base.step_time_s


def test_simulated_step_agrees_that_a_wider_group_hides_p2p():
    """The event simulation of the action lists with asynchronous sends, equal chunks and a
    p2p latency of a quarter forward: a group of 2p is faster than Megatron's p."""
    p, v, m = 4, 2, 32
    C = p * v

    def step(group):
        s = interleaved_1f1b(p, v, m, group=group)
        return simulate(s, [1.0] * C, [2.0] * C, p2p_s=0.25, comm="async").makespan_s
    assert step(2 * p) < step(p)
    assert step(None) == step(p)


def test_solver_widens_the_group_when_the_pipeline_link_is_slow():
    cl = with_overrides(A100, inter_node_bandwidth_Bps=1e9)
    plan = solve(_profile(), cl, gpus=64, global_batch_size=64, t=8, p=4, v=2,
                 micro_batch_size=1, schedule="interleaved-1f1b")
    assert plan.microbatch_group is not None and plan.microbatch_group > plan.p
    fast = solve(_profile(), A100, gpus=64, global_batch_size=64, t=8, p=4, v=2,
                 micro_batch_size=1, schedule="interleaved-1f1b", microbatch_group=4)
    assert plan.predicted.pp_comm_s < solve(
        _profile(), cl, gpus=64, global_batch_size=64, t=8, p=4, v=2, micro_batch_size=1,
        schedule="interleaved-1f1b", microbatch_group=4).predicted.pp_comm_s
    assert fast.microbatch_group == 4


def test_pinned_p_with_fewer_microbatches_than_ranks_is_planned():
    """2 sequences per step on a 4-stage pipeline: planned with one chunk per rank (the
    pipeline never fills: bubble (p − 1)/m of the compute), never by the free solver."""
    prof = _profile(layers=8)
    plan = solve(prof, A100, gpus=4, global_batch_size=2, t=1, p=4, micro_batch_size=1)
    assert plan.num_microbatches == 2 < plan.p and plan.schedule in ("gpipe", "1f1b")
    assert plan.v == 1
    # idle (Σ load − max load)/m per micro-batch of the critical rank: (p − 1)/m = 1.5 of the
    # compute for equal ranks, a little less with the head making the last rank the heaviest
    assert 0.75 < plan.predicted.bubble_fraction <= 1.5
    free = solve(prof, A100, gpus=4, global_batch_size=2)
    assert free.num_microbatches >= free.p


def test_a_groups_hops_hide_only_as_far_as_communication_overlaps_compute():
    """Interleaved groups of N > p run the ring's hops behind the extra micro-batches'
    compute: on a GPU (overlap 1) only what outlasts that compute shows; on CPU ranks that
    fill every core (overlap 0) every hop costs its time, as with N = p; between, 1 − overlap
    of every hop still costs its time."""
    from autopar.cost.comm import chunk_p2p_s
    one, p, v, layer_s, layers = 1e-3, 2, 2, 4e-3, 8        # a chunk: 2 layers, 8 ms
    whole = chunk_p2p_s(one, p, v, None, layer_s, layers, 1.0)
    assert whole == pytest.approx(2 * v * one)
    assert chunk_p2p_s(one, p, v, 8, layer_s, layers, 1.0) == 0.0          # 6 chunks hide 2 ms
    assert chunk_p2p_s(one, p, v, 8, layer_s, layers, 0.0) == pytest.approx(whole)
    assert chunk_p2p_s(one, p, v, 8, layer_s, layers, 0.25) == pytest.approx(0.75 * whole)
    # the ring's 20 ms outlasts one extra micro-batch's chunk (8 ms): 12 ms a visit shows
    assert chunk_p2p_s(10 * one, p, v, 3, layer_s, layers, 1.0) == pytest.approx(
        2 * v * (20e-3 - 8e-3) / 3)
