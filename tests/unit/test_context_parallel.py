"""Context parallelism (issue 15), the pure parts: rank math, the Plan field, the cost model's
per-context-rank profile and the K/V exchange, and the solver's search over c."""
from __future__ import annotations

import dataclasses
import json

import pytest

from autopar.cost.context import context_rank_profile
from autopar.cost.hardware import get_cluster
from autopar.cost.model import Config, config_costs, context_comm_s, predict, rank_profile
from autopar.cost.profile import transformer_profile
from autopar.cost.solver import solve
from autopar.plan import Plan
from autopar.runtime import groups as G

H100 = get_cluster("dgx-h100-80gb")


# ----- rank math: tensor innermost, then context, then data, pipeline outermost -----------------
def test_worked_example_t2_c2_p2_d2():
    t, p, d, c = 2, 2, 2, 2
    assert G.world_size(t, p, d, c=c) == 16
    assert G.tensor_groups(t, p, d, c=c) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11],
                                             [12, 13], [14, 15]]
    assert G.context_groups(t, p, d, c=c) == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11],
                                              [12, 14], [13, 15]]
    assert G.data_groups(t, p, d, c=c) == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13],
                                           [10, 14], [11, 15]]
    assert G.gradient_groups(t, p, d, c=c) == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14],
                                               [9, 11, 13, 15]]
    assert G.pipeline_groups(t, p, d, c=c) == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12],
                                               [5, 13], [6, 14], [7, 15]]
    assert G.model_parallel_groups(t, p, d, c=c) == [[0, 1, 8, 9], [2, 3, 10, 11],
                                                     [4, 5, 12, 13], [6, 7, 14, 15]]
    assert G.coords_rank(1, 0, 1, t, p, d, cp=1, c=c) == 11
    assert G.rank_coords4(11, t, p, d, c=c) == (1, 1, 0, 1)
    assert G.context_rank(11, t, p, d, c=c) == 1
    assert G.pipeline_neighbours(11, t, p, d, c=c) == (3, 3)


@pytest.mark.parametrize("t,p,d,c", [(1, 1, 1, 4), (2, 3, 1, 2), (4, 2, 2, 2), (1, 2, 3, 3)])
def test_every_family_partitions_the_world_and_coords_invert(t, p, d, c):
    n = G.world_size(t, p, d, c=c)
    for fam in (G.tensor_groups, G.context_groups, G.data_groups, G.gradient_groups,
                G.pipeline_groups, G.model_parallel_groups):
        groups = fam(t, p, d, c=c)
        assert sorted(r for g in groups for r in g) == list(range(n)), fam.__name__
    for r in range(n):
        tp, cp, dp, pp = G.rank_coords4(r, t, p, d, c=c)
        assert G.coords_rank(tp, dp, pp, t, p, d, cp=cp, c=c) == r
    # the gradient group is the data group joined with the context group
    for g in G.gradient_groups(t, p, d, c=c):
        r = g[0]
        assert set(g) == {x for y in G.group_of(r, G.context_groups(t, p, d, c=c))
                          for x in G.group_of(y, G.data_groups(t, p, d, c=c))}


@pytest.mark.parametrize("t,p,d", [(2, 2, 2), (2, 4, 2), (1, 3, 2)])
def test_c1_changes_nothing(t, p, d):
    for fam in ("tensor_groups", "data_groups", "pipeline_groups", "model_parallel_groups",
                "embedding_groups"):
        assert getattr(G, fam)(t, p, d) == getattr(G, fam)(t, p, d, c=1)
    assert G.gradient_groups(t, p, d) == G.data_groups(t, p, d)
    assert G.context_groups(t, p, d) == [[r] for r in range(t * p * d)]


def test_sequence_chunks_balance_causal_work():
    assert G.sequence_chunks(0, 2) == (0, 3) and G.sequence_chunks(1, 2) == (1, 2)
    assert G.sequence_positions(8, 0, 2) == [0, 1, 6, 7]
    assert G.sequence_positions(8, 1, 2) == [2, 3, 4, 5]
    for c in (1, 2, 3, 4):
        s = 8 * c
        pos = [G.sequence_positions(s, i, c) for i in range(c)]
        assert sorted(x for q in pos for x in q) == list(range(s))
        # causal (query, key) pairs per rank: sum over its queries of position + 1
        work = {sum(q + 1 for q in mine) for mine in pos}
        assert len(work) == 1, (c, work)


def test_sequence_not_divisible_by_2c_one_line():
    with pytest.raises(ValueError, match=r"seq_len=10 with c=2: .*2c = 4.*divisible by 4"):
        G.check_sequence(10, 2)
    with pytest.raises(ValueError, match=r"c=0: .*context"):
        G.sequence_chunks(0, 0)


# ----- the Plan field ------------------------------------------------------------------------
def _plan(**over):
    from programs import make_plan         # t=1, p=1, d=1, seq 8, global batch 4
    base = make_plan(t=2, p=2, d=2).to_dict()
    return Plan.from_dict({**base, **over})


def test_plan_c_defaults_to_1_and_old_json_loads():
    plan = _plan()
    assert plan.c == 1 and plan.gpus == 8
    old = json.loads(plan.to_json())
    del old["c"]
    del old["predicted"]["cp_comm_s"]
    assert Plan.from_dict(old) == plan
    cp = _plan(c=2, t=1)
    assert cp.gpus == 8 and Plan.from_json(cp.to_json()) == cp
    assert "c=2 (context" in str(cp) and "c=" not in str(plan).split("degrees")[1].split("\n")[0]


def test_plan_c_validation():
    with pytest.raises(ValueError, match=r"Plan.c=3 with seq_len=8: .*2c = 6.*divisible by 6"):
        _plan(c=3)
    with pytest.raises(ValueError, match=r"Plan.c=0"):
        _plan(c=0)


def test_sequence_parallel_needs_the_context_rank_tokens_divisible_by_t():
    from autopar.compile import check_program
    check_program(_plan(c=2, t=2, sequence_parallel=True))        # 8/2 = 4 tokens, t = 2
    with pytest.raises(ValueError, match=r"plan.c=2 with sequence_parallel=True \(t=4\): .*"
                                         r"12/2 = 6 tokens.*divisible by c·t = 8") as err:
        check_program(_plan(c=2, t=4, seq_len=12, sequence_parallel=True))
    assert "\n" not in str(err.value)


# ----- cost model ----------------------------------------------------------------------------
def _llama(seq: int = 32768, layers: int = 4):
    return transformer_profile(name="llama", num_layers=layers, hidden=4096, heads=32,
                               kv_heads=8, seq_len=seq, vocab=128256, ffn=14336,
                               gated_mlp=True, tied_embeddings=False)


def test_context_rank_profile_divides_tokens_and_keeps_attention_keys_whole():
    prof = _llama().with_attention("flash")
    cp = context_rank_profile(prof, 4)
    assert cp.seq_len == prof.seq_len // 4 and cp.context == 4
    assert context_rank_profile(cp, 4) is cp and context_rank_profile(prof, 1) is prof
    # every GEMM (projections and attention) is 1/c of the whole sequence's FLOPs
    assert cp.block.fwd_flops * 4 == prof.block.fwd_flops
    call, whole = cp.block.fused.calls[0], prof.block.fused.calls[0]
    assert (call.q_len, call.kv_len) == (whole.q_len // 4, whole.kv_len)
    assert call.fwd_flops * 4 == pytest.approx(whole.fwd_flops)   # balanced causal split
    # the K/V exchange: all kv heads at full length; the other ranks' 3/4 saved for backward
    kv = 8 * prof.seq_len * 2 * 128
    assert cp.block.cp_gather_elems == kv
    assert cp.block.act_split_bytes == -(-prof.block.act_split_bytes // 4) + (kv - kv // 4) * 2
    assert cp.block.input_bytes * 4 == prof.block.input_bytes
    with pytest.raises(ValueError, match=r"c=3 with seq_len=32768.*divisible by 6"):
        context_rank_profile(prof, 3)


def test_c1_costs_are_unchanged():
    prof = _llama(seq=4096)
    cfg = Config(t=2, p=2, d=2, v=1, micro_batch_size=1, num_microbatches=4)
    a = config_costs(prof, H100, cfg)
    b = config_costs(prof, H100, dataclasses.replace(cfg, c=1))
    assert a == b and a.layer_cp_ns == 0
    assert predict(prof, H100, cfg).cp_comm_s == 0.0


def test_kv_allgather_exposed_inside_a_node_cheaper_than_across():
    prof = _llama()
    inside = Config(t=2, c=4, p=1, d=2)              # t·c = 8: the context group in a node
    across = Config(t=8, c=4, p=1, d=1)              # t·c = 32: strided over 4 nodes
    f_in, all_in = context_comm_s(rank_profile(prof, H100, inside), H100, inside)
    f_out, all_out = context_comm_s(rank_profile(prof, H100, across), H100, across)
    assert f_in > 0 and all_in == pytest.approx(2 * f_in)      # all-gather + reduce-scatter
    full = dataclasses.replace(inside, recompute="full")
    assert context_comm_s(rank_profile(prof, H100, full), H100, full)[1] == \
        pytest.approx(3 * f_in)
    # per byte, the inter-node link is slower (across moves 1/4 of the bytes: 8 kv heads / t=8)
    assert f_out * 4 > f_in
    pr = predict(prof, H100, inside)
    assert pr.cp_comm_s > 0
    assert sum(pr.terms().values()) == pytest.approx(pr.step_time_s, rel=1e-9)


def test_activations_divide_by_c_and_gradients_reduce_over_c_times_d():
    prof = _llama()
    one = predict(prof, H100, Config(t=1, c=1, p=1, d=1))
    two = predict(prof, H100, Config(t=1, c=2, p=1, d=1))
    assert two.memory.activations_bytes < 0.6 * one.memory.activations_bytes
    assert one.dp_comm_s == 0 and two.dp_comm_s > 0          # c = 2, d = 1: reduced over 2
    z1 = predict(prof, H100, Config(t=1, c=2, p=1, d=2, zero=1))
    z1d = predict(prof, H100, Config(t=1, c=1, p=1, d=4, zero=1))
    assert z1.memory.optimizer_bytes == pytest.approx(z1d.memory.optimizer_bytes)  # 1/(c·d)


def test_solver_picks_c_for_long_sequences_and_not_for_short():
    long = _llama(seq=131072, layers=8)
    plan = solve(long, H100, gpus=16, global_batch_size=2)
    assert plan.c > 1, plan
    assert f"Context parallelism c={plan.c}" in plan.explain()
    short = _llama(seq=2048, layers=8)
    plan = solve(short, H100, gpus=16, global_batch_size=64)
    assert plan.c == 1
    assert "Context parallelism c=1: the best plan with c=" in plan.explain()


def test_solver_pins_c_and_rejects_bad_c_in_one_line():
    prof = _llama(seq=8192, layers=4)
    plan = solve(prof, H100, gpus=8, global_batch_size=8, c=2, t=4)
    assert (plan.c, plan.t) == (2, 4) and plan.gpus == 8
    with pytest.raises(ValueError, match=r"c=3: .*divisible by 2c=6.*pad the sequence"):
        solve(prof, H100, gpus=6, global_batch_size=6, c=3)
    with pytest.raises(ValueError, match=r"t=2·c=2·p=1·d=1 multiply to 4, not gpus=8; "
                                         r"t·c·p·d must equal"):
        solve(prof, H100, gpus=8, global_batch_size=8, t=2, c=2, p=1, d=1)
