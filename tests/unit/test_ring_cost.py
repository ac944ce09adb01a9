"""Ring attention in the cost model and the solver (issue 15's optional part): the ring's
transfers are exposed only where they outlast the attention step they overlap; against the
exposed all-gather it wins for multi-head attention at long sequences across nodes and loses
for grouped-query attention with few kv heads (little to gather, and the ring's own overheads:
short-key kernels, launches, merges); it saves no gathered K/V; the solver picks the cheaper by
the same formulas and explain() says which and why."""
from __future__ import annotations

import pytest

from autopar.cost.hardware import get_cluster
from autopar.cost.model import (Config, config_costs, context_comm_s, predict, rank_profile,
                                ring_exposed_s)
from autopar.cost.profile import transformer_profile
from autopar.cost.solver import solve
from autopar.plan import Plan

H100 = get_cluster("dgx-h100-80gb")


def _model(seq: int, kv_heads: int, layers: int = 4):
    return transformer_profile(name="m", num_layers=layers, hidden=4096, heads=32,
                               kv_heads=kv_heads, seq_len=seq, vocab=32000, ffn=16384,
                               gated_mlp=True, tied_embeddings=False)


def _comm_s(prof, **cfg) -> dict[str, float]:
    """Per layer per micro-batch forward + backward seconds of each method."""
    out = {}
    for how in ("all-gather", "ring"):
        c = Config(p=1, d=1, cp_attention=how, **cfg)
        out[how] = context_comm_s(rank_profile(prof, H100, c), H100, c)[1]
    return out


def test_ring_exposes_only_what_outlasts_each_step():
    assert ring_exposed_s(hop_s=1.0, step_s=2.0, steps=3) == 0.0
    assert ring_exposed_s(hop_s=2.0, step_s=0.5, steps=3) == pytest.approx(4.5)
    # where ranks fill every core nothing moves the data beside the attention
    # (Cluster.comm_overlap ~0, measured by `autopar calibrate`): every hop costs its time
    assert ring_exposed_s(hop_s=1.0, step_s=2.0, steps=3, overlap=0.0) == pytest.approx(3.0)
    assert ring_exposed_s(hop_s=1.0, step_s=2.0, steps=3, overlap=0.5) == pytest.approx(1.5)


def test_ring_wins_for_multi_head_attention_at_long_sequence_across_nodes():
    """MHA (32 kv heads) at 131,072 tokens, t=8 c=4: the context group spans 4 nodes; each
    block's transfer hides under a step's attention, the all-gather's does not."""
    cost = _comm_s(_model(131072, kv_heads=32), t=8, c=4)
    assert cost["ring"] < 0.5 * cost["all-gather"], cost


def test_all_gather_wins_for_grouped_query_attention_with_few_kv_heads():
    """GQA (8 kv heads: one per tensor rank at t=8) at 4,096 tokens, c=2 in a node: K/V is
    small and the all-gather fast; the ring's overheads cost more than it hides. (At 8,192
    the two now tie: the all-gather is priced as the runtime runs it, K and V gathered and
    their gradients reduce-scattered in a call each, four latencies a layer.)"""
    cost = _comm_s(_model(4096, kv_heads=8), t=8, c=2)
    assert cost["all-gather"] < cost["ring"], cost


def test_ring_prices_its_own_ops_where_ops_are_dispatched_one_by_one():
    """elementwise "eager" (a CPU's runtime): RING_OPS_PER_STEP ops a step each way at
    kernel_launch_s beyond the fused stack's price; the presets (fused) are unchanged."""
    import dataclasses

    from autopar.cost.exchanges import RING_OPS_PER_STEP
    prof = _model(4096, kv_heads=8)
    eager = dataclasses.replace(H100, elementwise="eager")
    for c in (2, 4):
        cfg = Config(t=1, c=c, p=1, d=1, cp_attention="ring")
        fused = context_comm_s(rank_profile(prof, H100, cfg), H100, cfg)
        both = context_comm_s(rank_profile(prof, eager, cfg), eager, cfg)
        ops_s = c * RING_OPS_PER_STEP * H100.kernel_launch_s
        assert both[0] - fused[0] == pytest.approx(ops_s, rel=1e-6)
        assert both[1] - fused[1] == pytest.approx(2 * ops_s, rel=1e-6)


def test_ring_keeps_no_gathered_kv():
    prof = _model(32768, kv_heads=8)
    ag = predict(prof, H100, Config(t=8, c=4, p=1, d=1))
    ring = predict(prof, H100, Config(t=8, c=4, p=1, d=1, cp_attention="ring"))
    assert ring.memory.activations_bytes < ag.memory.activations_bytes
    assert Config.of_plan(Plan.from_dict({**_plan_dict(), "cp_attention": "ring"})
                          ).cp_attention == "ring"


def _plan_dict():
    plan = solve(_model(8192, kv_heads=8, layers=2), H100, gpus=8, global_batch_size=8, c=2,
                 t=4, cp_attention="all-gather")
    return plan.to_dict()


def test_solver_picks_ring_across_nodes_for_long_mha_and_explains():
    plan = solve(_model(131072, kv_heads=32), H100, gpus=32, global_batch_size=1, t=8, c=4)
    assert plan.cp_attention == "ring"
    text = plan.explain()
    assert "Context attention ring:" in text and "with all-gather" in text
    assert "K/V by ring" in str(plan)
    cc = config_costs(_model(131072, kv_heads=32), H100, Config.of_plan(plan))
    assert cc.layer_cp_ns > 0


def test_solver_keeps_all_gather_for_short_gqa_and_explains():
    plan = solve(_model(8192, kv_heads=8), H100, gpus=16, global_batch_size=2, t=8, c=2)
    assert plan.cp_attention == "all-gather"
    assert "Context attention all-gather:" in plan.explain() and "with ring" in plan.explain()


def test_pins_and_bad_values_one_line():
    prof = _model(8192, kv_heads=8, layers=2)
    plan = solve(prof, H100, gpus=8, global_batch_size=8, c=2, t=4, cp_attention="ring")
    assert plan.cp_attention == "ring"
    with pytest.raises(ValueError, match=r"^solve: cp_attention='rings': must be one of"):
        solve(prof, H100, gpus=8, global_batch_size=8, cp_attention="rings")
    with pytest.raises(ValueError, match=r"^Plan.cp_attention='x': must be one of"):
        Plan.from_dict({**plan.to_dict(), "cp_attention": "x"})
    with pytest.raises(ValueError, match=r"^Config.cp_attention='x'"):
        Config(t=1, p=1, d=1, cp_attention="x")
    old = plan.to_dict()
    del old["cp_attention"]                       # a plan.json written before ring attention
    assert Plan.from_dict(old).cp_attention == "all-gather"
