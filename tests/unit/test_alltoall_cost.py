"""All-to-all (DeepSpeed-Ulysses) context attention in the cost model and the solver: its
exchange does not grow with c where the all-gather's does; it wins for multi-head attention in
a node; it saves no gathered K/V; it is offered only where t·c divides the heads (a pin
elsewhere is refused in one line); the solver weighs it with the all-gather and the ring and
explain() says which and why. The hybrid (all-to-all inside a node, the K/V all-gather
across: Megatron-Core's a2a+p2p): its inner degree is the runtime's rule on the cluster's
node; it beats the all-gather and the all-to-all when the context group spans nodes and the
heads allow it; it is the all-gather where no inner degree fits (priced the same, so never
chosen over it); it saves 1/k of the all-gather's K/V; it is refused where no divisor of c
divides the heads; the free solver picks it across nodes and explain() says why. The hybrid
with the ring across ("hybrid-ring", pin-only): the ring's formula with c/k steps on the outer
link, no other ranks' K/V saved, the ring where no inner degree fits; the rule that would weigh
it freely (exchanges.hybrid_ring_weighed: only where its total is no more than the hybrid's)."""
from __future__ import annotations

import pytest

from autopar.cost.comm import allgather_s
from autopar.cost.compute import elementwise_time_s
from autopar.cost.exchanges import (context_saved_kv_bytes, hybrid_attention_s, hybrid_degree,
                                    ring_attention_s)
from autopar.cost.families import cp_attention_rule
from autopar.cost.hardware import get_cluster
from autopar.cost.model import (Config, alltoall_exchange_elems, alltoall_heads_rule,
                                context_comm_s, predict, rank_profile)
from autopar.cost.profile import transformer_profile
from autopar.cost.solver import solve

H100 = get_cluster("dgx-h100-80gb")


def _model(seq: int, kv_heads: int, heads: int = 32, layers: int = 4):
    return transformer_profile(name="m", num_layers=layers, hidden=4096, heads=heads,
                               kv_heads=kv_heads, seq_len=seq, vocab=32000, ffn=16384,
                               gated_mlp=True, tied_embeddings=False)


def _comm_s(prof, **cfg) -> dict[str, float]:
    """Per layer per micro-batch forward + backward seconds of each method."""
    out = {}
    for how in ("all-gather", "ring", "all-to-all", "hybrid", "hybrid-ring"):
        c = Config(p=1, d=1, cp_attention=how, **cfg)
        out[how] = context_comm_s(rank_profile(prof, H100, c), H100, c)[1]
    return out


def test_alltoall_volume_does_not_grow_with_c():
    """Per rank: q, k, v and the output of its T/c tokens, (c−1)/c of them sent; the
    all-gather's K/V grows to (c−1)/c of the whole sequence's."""
    prof = _model(65536, kv_heads=32)
    a2a = [_comm_s(prof, t=1, c=c)["all-to-all"] for c in (2, 4, 8)]
    ag = [_comm_s(prof, t=1, c=c)["all-gather"] for c in (2, 4, 8)]
    assert a2a[2] < a2a[0] and ag[2] > ag[0], (a2a, ag)
    q, kv, out = alltoall_exchange_elems(rank_profile(prof, H100, Config(t=1, p=1, d=1, c=4)), 1)
    assert q == out == 32 * 128 * 65536 // 4 and kv == 2 * q


def test_alltoall_wins_for_multi_head_attention_in_a_node():
    cost = _comm_s(_model(65536, kv_heads=32), t=1, c=8)
    assert cost["all-to-all"] < 0.5 * min(cost["all-gather"], cost["ring"]), cost


def test_fewer_kv_heads_than_ranks_are_repeated_and_priced_so():
    prof = rank_profile(_model(8192, kv_heads=2), H100, Config(t=1, p=1, d=1, c=4))
    q, kv, _ = alltoall_exchange_elems(prof, 1)
    assert kv == 2 * q          # 2 kv heads over 4 ranks: repeated up to the 32 query heads


def test_alltoall_keeps_no_gathered_kv():
    prof = _model(32768, kv_heads=8)
    ag = predict(prof, H100, Config(t=8, c=4, p=1, d=1))
    a2a = predict(prof, H100, Config(t=8, c=4, p=1, d=1, cp_attention="all-to-all"))
    assert a2a.memory.activations_bytes < ag.memory.activations_bytes


def test_heads_rule_and_pins_one_line():
    assert alltoall_heads_rule(32, 8, 8, 4) is None
    assert "t·c = 64 does not divide the 32 query heads" in alltoall_heads_rule(32, 8, 8, 8)
    prof = _model(8192, kv_heads=8, heads=24, layers=2)     # 24 heads: c = 16 cannot split them
    with pytest.raises(ValueError, match=r"^solve: cp_attention='all-to-all': all-to-all "
                                         r"attention gives each of the c=16"):
        solve(prof, H100, gpus=16, global_batch_size=16, c=16, cp_attention="all-to-all")
    plan = solve(prof, H100, gpus=32, global_batch_size=2, t=8, c=4)   # 24 % 32: not offered
    assert plan.cp_attention != "all-to-all"
    assert all(a.config.get("cp_attention") != "all-to-all" for a in plan.alternatives)


def test_solver_picks_alltoall_for_mha_in_a_node_and_explains():
    plan = solve(_model(65536, kv_heads=32), H100, gpus=8, global_batch_size=1, t=1, c=8)
    assert plan.cp_attention == "all-to-all"
    line = next(x for x in plan.explain().splitlines()
                if x.lstrip().startswith("Context attention"))
    assert "Context attention all-to-all:" in line
    for other in ("all-gather", "ring"):   # dominated at the same knobs: both costs named
        assert f"with {other} not weighed: slower exchange: {other} context attention" in line


# ----- the hybrid ----------------------------------------------------------------------------
def test_inner_degree_is_the_node_and_the_heads():
    prof = _model(131072, kv_heads=32)
    deg = lambda **k: hybrid_degree(rank_profile(prof, H100, Config(p=1, d=1, **k)), H100,
                                    Config(p=1, d=1, cp_attention="hybrid", **k))
    assert deg(t=1, c=16) == 8            # 8 context ranks a node
    assert deg(t=2, c=16) == 4            # t = 2: 4 of them a node
    assert deg(t=8, c=16) == 1            # one a node: the hybrid is the all-gather


def test_hybrid_wins_when_c_spans_nodes_and_heads_allow():
    """c = 16 over two 8-GPU nodes, multi-head: the all-to-all crosses the slow link with
    all of q, k, v and the output, the all-gather with the whole sequence's K/V; the hybrid
    only with the K/V of heads/8 heads once."""
    cost = _comm_s(_model(131072, kv_heads=32), t=1, c=16)
    assert cost["hybrid"] < 0.8 * min(cost["all-gather"], cost["ring"], cost["all-to-all"]), cost
    inside = _comm_s(_model(65536, kv_heads=32), t=1, c=8)   # one node: the all-to-all's
    assert inside["all-to-all"] < inside["hybrid"], inside


def test_no_inner_degree_prices_the_all_gather():
    cost = _comm_s(_model(131072, kv_heads=8), t=8, c=16)
    assert cost["hybrid"] == cost["all-gather"]


def test_refused_where_heads_do_not_divide():
    prof = _model(8192, kv_heads=8, heads=24, layers=2)    # 3 heads per tensor rank at t = 8
    why = cp_attention_rule(prof, "hybrid", 4, 8)
    assert why is not None and "none does" in why and "3 heads per tensor rank" in why
    assert cp_attention_rule(prof, "hybrid", 2, 1) is not None    # c = 2: no inner degree
    assert cp_attention_rule(prof, "hybrid", 4, 1) is None
    with pytest.raises(ValueError, match=r"^solve: cp_attention='hybrid': hybrid attention "):
        solve(prof, H100, gpus=32, global_batch_size=2, t=8, c=4, cp_attention="hybrid")


def test_free_solver_picks_the_hybrid_across_nodes_and_explains():
    """Weighed freely (rules.CP_ATTENTION): across two nodes the hybrid beats the all-to-all
    and the all-gather pinned at the same degrees, and explain() says why, naming the others
    (at 8,192 tokens, where hybrid-ring's total exchange exceeds the hybrid's: not weighed)."""
    prof = _model(8192, kv_heads=32)
    plan = solve(prof, H100, gpus=16, global_batch_size=1, t=1, c=16)
    assert plan.cp_attention == "hybrid"
    for other in ("all-to-all", "all-gather", "hybrid-ring"):
        pinned = solve(prof, H100, gpus=16, global_batch_size=1, t=1, c=16, cp_attention=other)
        assert plan.predicted.step_time_s < pinned.predicted.step_time_s, other
        assert plan.predicted.cp_comm_s < 0.8 * pinned.predicted.cp_comm_s or \
            other == "hybrid-ring", other
    line = next(x for x in plan.explain().splitlines()
                if x.lstrip().startswith("Context attention"))
    assert "Context attention hybrid: the all-to-alls run over the context ranks inside a " \
           "node" in line
    assert all(m in line.split("vs", 1)[1] for m in ("all-to-all", "all-gather", "hybrid-ring"))
    assert "hybrid-ring context attention costs more in total than hybrid" in line


def test_hybrid_saves_one_kth_of_the_all_gathers_kv():
    """The hybrid keeps for the backward the K/V of its heads/k heads over the whole sequence:
    of the other ranks' K/V, (m − 1)/c of the whole where the all-gather keeps (c − 1)/c (k = 8
    inner × m = 2 outer at c = 16: 1/15 of it), ring and all-to-all none; the memory model
    charges exactly that (what the runtime's saved tensors hold), none under full recompute."""
    prof = _model(131072, kv_heads=32)
    act = {how: predict(prof, H100, Config(t=1, c=16, p=1, d=1, cp_attention=how))
           .memory.activations_bytes for how in ("all-gather", "all-to-all", "hybrid")}
    assert act["all-to-all"] < act["hybrid"] < act["all-gather"]
    assert act["hybrid"] - act["all-to-all"] == pytest.approx(
        (act["all-gather"] - act["all-to-all"]) / 15, rel=1e-6)
    cfg = Config(t=1, c=16, p=1, d=1, cp_attention="hybrid")
    rank = rank_profile(prof, H100, cfg)
    kv = rank.block.cp_gather_elems * rank.activation_bytes_per_elem   # the whole sequence's
    assert context_saved_kv_bytes(rank, H100, cfg) == kv / 16           # m − 1 = 1 of 16
    full = Config(t=1, c=16, p=1, d=1, cp_attention="hybrid", recompute="full")
    assert context_saved_kv_bytes(rank, H100, full) == 0.0
    # no inner degree (t = 8: one context rank a node): the all-gather's memory and cost
    ag8, hy8 = (predict(prof, H100, Config(t=8, c=2, p=1, d=1, cp_attention=how))
                for how in ("all-gather", "hybrid"))
    assert hy8.memory.activations_bytes == ag8.memory.activations_bytes


# ----- the hybrid with the ring across ---------------------------------------------
def test_hybrid_ring_is_the_ring_over_the_outer_ranks():
    """c = 16 over two 8-GPU nodes: the inner all-to-all of the hybrid, then ring attention
    over the m = 2 outer ranks on the inter-node link (one hop of the rank's own K/V size,
    heads/8 heads of its inner group's tokens) in place of the all-gather: across nodes it
    beats the all-gather, the ring and the all-to-all; it saves none of the other ranks' K/V
    (the all-to-all's activations); with no inner degree it is the ring over the c ranks."""
    prof = _model(131072, kv_heads=32)
    cost = _comm_s(prof, t=1, c=16)
    assert cost["hybrid-ring"] < 0.8 * min(cost["all-gather"], cost["ring"], cost["all-to-all"])
    cfg = Config(t=1, c=16, p=1, d=1, cp_attention="hybrid-ring")
    rank = rank_profile(prof, H100, cfg)
    hy = Config(t=1, c=16, p=1, d=1, cp_attention="hybrid")
    k = hybrid_degree(rank, H100, cfg)
    block = rank.block.cp_gather_elems * rank.activation_bytes_per_elem / 16   # own K/V
    ring_f, ring_b = ring_attention_s(rank, H100, cfg, block * 2, True, steps=16 // k)
    inner = context_comm_s(rank, H100, cfg)[0] - ring_f      # the all-to-alls and reorder
    gather = allgather_s(H100, block * 2, 2, True) + elementwise_time_s(H100, 4 * block)
    assert k == 8 and inner > 0 and ring_f != gather
    assert hybrid_attention_s(rank, H100, hy)[0] == pytest.approx(inner + gather)  # same inside
    assert context_comm_s(rank, H100, cfg)[1] == pytest.approx(2 * inner + ring_f + ring_b)
    assert context_saved_kv_bytes(rank, H100, cfg) == 0.0
    act = {how: predict(prof, H100, Config(t=1, c=16, p=1, d=1, cp_attention=how))
           .memory.activations_bytes for how in ("all-to-all", "hybrid", "hybrid-ring")}
    assert act["hybrid-ring"] == act["all-to-all"] < act["hybrid"]
    none = _comm_s(_model(131072, kv_heads=8), t=8, c=16)    # one context rank a node
    assert none["hybrid-ring"] == none["ring"]


def test_hybrid_ring_is_weighed_and_wins_at_long_sequences():
    """Weighed freely (rules.CP_ATTENTION) where its exchange costs no more than the hybrid's:
    at 131,072 tokens over two 8-GPU nodes it beats every pinned method (the outer hops hide
    under the ring steps' attention), and explain() names why the hybrid lost; its heads rule
    is the hybrid's, and pinned with c it is refused up front in one line."""
    from autopar.rules import CP_ATTENTION, CP_ATTENTION_PINNED
    assert "hybrid-ring" in CP_ATTENTION and CP_ATTENTION_PINNED == CP_ATTENTION
    prof = _model(131072, kv_heads=32)
    plan = solve(prof, H100, gpus=16, global_batch_size=1, t=1, c=16)
    assert plan.cp_attention == "hybrid-ring"
    for other in ("hybrid", "all-to-all", "all-gather", "ring"):
        pinned = solve(prof, H100, gpus=16, global_batch_size=1, t=1, c=16, cp_attention=other)
        assert plan.predicted.step_time_s < pinned.predicted.step_time_s, other
    line = next(x for x in plan.explain().splitlines()
                if x.lstrip().startswith("Context attention"))
    assert line.lstrip().startswith("Context attention hybrid-ring: ")
    assert "hybrid context attention costs no less than hybrid-ring" in line
    odd = _model(8192, kv_heads=8, heads=24, layers=2)
    assert cp_attention_rule(odd, "hybrid-ring", 4, 8) == cp_attention_rule(odd, "hybrid", 4, 8)
    for how in ("hybrid", "hybrid-ring"):   # pinned with c: refused in one line, up front
        with pytest.raises(ValueError, match=f"cp_attention='{how}': hybrid attention trades"):
            solve(odd, H100, gpus=32, global_batch_size=4, t=8, c=4, cp_attention=how)


def test_hybrid_ring_weighed_only_where_its_total_is_no_more_than_the_hybrids():
    """exchanges.hybrid_ring_weighed, the rule that weighs hybrid-ring freely beside the hybrid
    without growing the search (cost/families.py `_Exchanges`): c = 16 over two
    8-GPU nodes, at 131,072 tokens the outer hop hides under a ring step's attention and
    hybrid-ring's total is below the hybrid's (weighed); at 8,192 the short steps hide nothing
    and the ring's backward (two blocks a hop, the last one home) costs more than the
    all-gather's reduce-scatter (not weighed, though its forward is cheaper); without the
    hybrid beside it, always weighed."""
    from autopar.cost.exchanges import hybrid_ring_weighed

    def pair(seq: int) -> dict[str, tuple[float, float]]:
        out = {}
        for how in ("hybrid", "hybrid-ring"):
            cfg = Config(t=1, c=16, p=1, d=1, cp_attention=how)
            out[how] = context_comm_s(rank_profile(_model(seq, kv_heads=32), H100, cfg), H100,
                                      cfg)
        return out
    long, short = pair(131072), pair(8192)
    assert long["hybrid-ring"][1] < long["hybrid"][1] and hybrid_ring_weighed(long)
    assert short["hybrid-ring"][0] < short["hybrid"][0] < short["hybrid"][1] < \
        short["hybrid-ring"][1] and not hybrid_ring_weighed(short)
    assert hybrid_ring_weighed({"ring": (1.0, 3.0), "hybrid-ring": short["hybrid-ring"]})
    assert hybrid_ring_weighed({"hybrid": (1.0, 3.0), "hybrid-ring": (1.1, 3.0)})  # ties kept
