"""Uneven expert routing in the cost model (issue 32 item 4, cost/imbalance.py): the most loaded
expert rank's factor from a given imbalance or measured counts, its price on the expert GEMMs
and all-to-alls, and the solver's choice of t and ep as the imbalance grows."""
from __future__ import annotations

import dataclasses

import pytest

from autopar.cost.hardware import get_cluster
from autopar.cost.imbalance import ExpertLoad, with_expert_load
from autopar.cost.model import Config, expert_comm_s, load_parts_s
from autopar.cost.profile import transformer_profile
from autopar.cost.solver import solve


def _moe(experts: int = 64, top_k: int = 2, layers: int = 4, hidden: int = 2048,
         seq: int = 1024):
    """A textbook profile whose MLP GEMMs are `experts` experts' grouped GEMMs (FFN 4h,
    SwiGLU), top-k routed: tokens · k rows each, the dispatch tokens · k · hidden."""
    prof = transformer_profile(num_layers=layers, hidden=hidden, heads=16, seq_len=seq,
                               vocab=32000, gated_mlp=True)
    gemms = tuple(dataclasses.replace(g, expert=True, m=g.m * top_k)
                  if g.name in ("fc_in", "fc_out") else g for g in prof.block.gemms)
    elems = experts * 3 * hidden * 4 * hidden
    blk = dataclasses.replace(prof.block, gemms=gemms, expert_params_elems=elems,
                              params_split_elems=prof.block.params_split_elems + elems,
                              experts=experts, expert_dispatch_elems=seq * top_k * hidden)
    return dataclasses.replace(prof, block=blk)


def test_rank_factor_from_a_given_imbalance_and_from_counts():
    """Given: 1 + (f − 1)·ep/E (the hot expert with mean-loaded neighbours), 1 at ep = 1, f at
    ep = E. Counts (E = 4, contiguous blocks of E/ep): layer (4, 2, 1, 1) gives ranks (6, 2) at
    ep = 2, 6/4 = 1.5; layer (2, 2, 2, 2) 1; the mean over layers 1.25; at ep = 4 (2 + 1)/2."""
    given = ExpertLoad(factor=1.8)
    assert [given.rank_factor(ep, 8) for ep in (1, 2, 8, 16)] == pytest.approx(
        [1.0, 1.2, 1.8, 1.8])
    measured = ExpertLoad(counts=((4, 2, 1, 1), (2, 2, 2, 2)))
    assert measured.rank_factor(1, 4) == 1.0
    assert measured.rank_factor(2, 4) == pytest.approx(1.25)
    assert measured.rank_factor(4, 4) == pytest.approx(1.5)
    assert measured.expert_factor == pytest.approx(1.5)
    for bad, words in ((0.9, "moe_imbalance=0.9"), (float("nan"), ">= 1")):
        with pytest.raises(ValueError, match=words) as e:
            ExpertLoad(factor=bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="all of one length"):
        ExpertLoad(counts=((1, 2), (1, 2, 3)))


def test_imbalance_prices_the_expert_gemms_and_all_to_alls_of_the_hot_rank():
    """At ep = 8 of 64 experts and imbalance 3: factor 1 + 2·8/64 = 1.25 on the experts'
    all-to-alls and their GEMMs (forward + backward: 3 forwards); nothing at ep = 1; nothing on
    a dense model (a profile without experts refuses an imbalance)."""
    a100, prof = get_cluster("dgx-a100-80gb"), _moe()
    hot = with_expert_load(prof, 3.0)
    cfg = Config(t=1, p=1, d=8, ep=8, micro_batch_size=1, num_microbatches=1)
    even, uneven = load_parts_s(prof, a100, cfg), load_parts_s(hot, a100, cfg)
    assert uneven[6] == pytest.approx(1.25 * even[6])          # the all-to-alls
    assert expert_comm_s(hot, a100, cfg)[0] == pytest.approx(
        1.25 * expert_comm_s(prof, a100, cfg)[0])
    extra = uneven[0] - even[0]
    assert extra > 0 and uneven[1:6] == even[1:6]
    from autopar.cost.model import local_gemm_time_s as _local_gemm_time_s
    fwd = sum(_local_gemm_time_s(a100, g, 1, 1, prof.activation_bytes_per_elem)
              for g in prof.block.gemms if g.expert)
    assert extra == pytest.approx(0.25 * 3 * fwd)
    flat = dataclasses.replace(cfg, ep=1)
    assert load_parts_s(hot, a100, flat) == load_parts_s(prof, a100, flat)
    dense = transformer_profile(num_layers=2, hidden=256, heads=4, seq_len=128, vocab=1000)
    with pytest.raises(ValueError, match=r"moe_imbalance=1.3: the model has no mixture"):
        with_expert_load(dense, 1.3)


def test_solver_moves_from_expert_to_tensor_parallel_experts_as_imbalance_grows():
    """64 experts on 16 A100s: balanced, the experts spread over all 16 ranks (ep = 16, t = 1);
    at imbalance 2.5 the hot rank's GEMMs and exchanges cost more than splitting every expert
    over 2 tensor ranks, so the plan halves ep and takes t = 2; the plan explains the factor.
    (At 1.5 and 2.0, t = 1 ep = 16 stays faster by 3%: the flip at 1.5 this test once showed
    came from a tied table counted twice at p = 1, which favoured t = 2.)"""
    prof = _moe()
    pins = dict(gpus=16, global_batch_size=64, p=1, zero=1, micro_batch_size=1,
                recompute="none")
    balanced = solve(prof, "dgx-a100-80gb", **pins)
    uneven = solve(with_expert_load(prof, 2.5), "dgx-a100-80gb", **pins)
    mild = solve(with_expert_load(prof, 2.0), "dgx-a100-80gb", **pins)
    assert (mild.t, mild.ep) == (1, 16)         # the plan changes between 2.0 and 2.5
    assert (balanced.t, balanced.ep) == (1, 16)
    assert uneven.t > balanced.t and uneven.ep < balanced.ep, (uneven.t, uneven.ep)
    assert uneven.predicted.step_time_s > balanced.predicted.step_time_s
    line = ExpertLoad(factor=2.5).describe(uneven.ep, 64)
    rank = 1 + (2.5 - 1) * uneven.ep / 64      # the hot expert's rank, its neighbours at the mean
    assert f"ep={uneven.ep}, {rank:.2f}×" in line and "2.50× the mean expert's" in line, line
