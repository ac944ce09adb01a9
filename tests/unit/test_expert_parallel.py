"""Expert parallelism (issue 17 item 1), the pure parts: the rank math of the expert and
expert-data groups, and the Plan field."""
from __future__ import annotations

import dataclasses
import json

import pytest

from autopar.plan import Plan
from autopar.runtime import groups as G


# ----- rank math: experts over the c·d ranks of each gradient group ---------------------------
def test_worked_example_t2_p1_d4_ep2():
    """Megatron-Core's order (tp-cp-ep-dp-pp): the expert group is ep consecutive ranks of the
    data group; the expert-data group the ranks holding the same experts."""
    t, p, d = 2, 1, 4
    assert G.data_groups(t, p, d) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert G.expert_groups(t, p, d, ep=2) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert G.expert_data_groups(t, p, d, ep=2) == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert [G.expert_rank(r, t, p, d, ep=2) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_worked_example_t2_c2_p2_d2_ep2():
    """With context parallelism the expert group is drawn from the c·d gradient group, context
    innermost: here ep=2 is the context group itself."""
    t, p, d, c = 2, 2, 2, 2
    assert G.expert_groups(t, p, d, c=c, ep=2) == [[0, 2], [4, 6], [1, 3], [5, 7], [8, 10],
                                                   [12, 14], [9, 11], [13, 15]]
    assert G.expert_data_groups(t, p, d, c=c, ep=2) == [[0, 4], [2, 6], [1, 5], [3, 7],
                                                        [8, 12], [10, 14], [9, 13], [11, 15]]
    assert G.expert_groups(t, p, d, c=c, ep=4) == G.gradient_groups(t, p, d, c=c)
    assert G.expert_data_groups(t, p, d, c=c, ep=4) == [[r] for g in G.gradient_groups(
        t, p, d, c=c) for r in g]


@pytest.mark.parametrize("t,p,d,c,ep", [(1, 1, 4, 1, 2), (2, 2, 2, 2, 4), (1, 3, 6, 1, 3),
                                        (2, 1, 4, 2, 8), (1, 1, 2, 1, 1)])
def test_expert_groups_partition_each_gradient_group(t, p, d, c, ep):
    n = G.world_size(t, p, d, c=c)
    eg, edg = G.expert_groups(t, p, d, c=c, ep=ep), G.expert_data_groups(t, p, d, c=c, ep=ep)
    for fam in (eg, edg):
        assert sorted(r for g in fam for r in g) == list(range(n))
    assert all(len(g) == ep for g in eg) and all(len(g) == c * d // ep for g in edg)
    for r in range(n):
        grad = set(G.group_of(r, G.gradient_groups(t, p, d, c=c)))
        e, ed = G.group_of(r, eg), G.group_of(r, edg)
        assert set(e) <= grad and set(ed) <= grad and set(e) & set(ed) == {r}
        # each expert group holds every expert-parallel position once; an expert-data group
        # holds one position only
        assert sorted(G.expert_rank(x, t, p, d, c=c, ep=ep) for x in e) == list(range(ep))
        assert {G.expert_rank(x, t, p, d, c=c, ep=ep) for x in ed} == {
            G.expert_rank(r, t, p, d, c=c, ep=ep)}
        assert e.index(r) == G.expert_rank(r, t, p, d, c=c, ep=ep)
    if ep == 1:
        assert edg == G.gradient_groups(t, p, d, c=c) and eg == [[r] for g in edg for r in g]


@pytest.mark.parametrize("kw, words", [
    (dict(ep=3, c=1, d=4), ["ep=3", "c·d = 1·4 = 4", "must divide 4"]),
    (dict(ep=0, c=1, d=4), ["ep=0", "positive int", "ep=1"]),
    (dict(ep=True, c=1, d=4), ["ep=True", "positive int"]),
    (dict(ep=4, c=1, d=4, experts=6), ["ep=4", "6 experts", "divide 6"]),
])
def test_expert_degree_errors_name_value_rule_and_fix(kw, words):
    with pytest.raises(ValueError) as e:
        G.check_expert_degree(**kw)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


# ----- the Plan field -------------------------------------------------------------------------
def _plan(**over) -> Plan:
    """A t=1 p=1 d=2 plan of a 4-layer model (one chunk)."""
    from autopar.plan import Prediction, Stage
    pred = Prediction(step_time_s=1.0, tflops_per_gpu=1.0, mfu=0.1, bubble_fraction=0.0,
                      memory_bytes_per_gpu=1e9, compute_s=1.0, tp_comm_s=0.0, pp_comm_s=0.0,
                      dp_comm_s=0.0, bubble_s=0.0)
    kw = dict(t=1, p=1, d=2, v=1, micro_batch_size=1, num_microbatches=2, schedule="1f1b",
              recompute="none", sequence_parallel=False, zero=0,
              stages=(Stage(chunk=0, rank=0, first_layer=0, last_layer=4, embedding=True,
                            head=True),), predicted=pred, global_batch_size=4, seq_len=16,
              cluster="local-cpu", num_layers=4)
    kw.update(over)
    return Plan(**kw)


def test_plan_ep_defaults_to_1_and_round_trips():
    plan = _plan()
    assert plan.ep == 1
    again = _plan(ep=2)
    assert Plan.from_json(again.to_json()).ep == 2
    old = json.loads(plan.to_json())
    del old["ep"]                                   # a plan.json written before ep
    assert Plan.from_dict(old).ep == 1


def test_plan_ep_must_divide_c_times_d():
    with pytest.raises(ValueError) as e:
        _plan(ep=3)
    msg = str(e.value)
    assert "\n" not in msg and "Plan.ep=3" in msg and "must divide 2" in msg, msg


# ----- the cost model and the solver ----------------------------------------------------------
def _moe(experts: int = 8, top_k: int = 2, layers: int = 8, hidden: int = 1024, seq: int = 1024):
    """A textbook profile whose block holds `experts` experts of FFN 4h (SwiGLU) each, top-k
    routed: the expert weights part of the split parameters, the dispatch tokens·k·hidden."""
    from autopar.cost.profile import transformer_profile
    prof = transformer_profile(num_layers=layers, hidden=hidden, heads=16, seq_len=seq,
                               vocab=32000, gated_mlp=True)
    expert_elems = experts * 3 * hidden * 4 * hidden
    blk = dataclasses.replace(prof.block, params_split_elems=prof.block.params_split_elems + expert_elems,
                     expert_params_elems=expert_elems, experts=experts,
                     expert_dispatch_elems=seq * top_k * hidden)
    return dataclasses.replace(prof, block=blk)


def test_ep_divides_the_expert_state_and_prices_four_all_to_alls_per_layer():
    from autopar.cost.hardware import get_cluster
    from autopar.cost.model import Config, alltoall_s, config_costs, expert_comm_s, predict
    a100 = get_cluster("dgx-a100-80gb")
    prof = _moe()
    base = Config(t=1, p=1, d=8, micro_batch_size=2, num_microbatches=4)
    one, two = config_costs(prof, a100, base), config_costs(prof, a100,
                                                            dataclasses.replace(base, ep=2))
    # weights + grads + Adam (2 + 4 + 12 bytes) of half the experts leave each rank
    held = lambda cc: sum(cc.mem_parts[0][:3])  # noqa: E731
    assert held(one) - held(two) == pytest.approx(18 * prof.block.expert_params_elems / 2)
    assert one.layer_ep_ns == 0 and predict(prof, a100, base).ep_comm_s == 0.0
    fwd, total = expert_comm_s(prof, a100, dataclasses.replace(base, ep=2))
    a2a = alltoall_s(a100, 2 * prof.block.expert_dispatch_elems * 2, 2, False)
    assert (fwd, total) == (pytest.approx(2 * a2a), pytest.approx(4 * a2a))
    full = dataclasses.replace(base, ep=2, recompute="full")
    assert expert_comm_s(prof, a100, full)[1] == pytest.approx(6 * a2a)
    pred = predict(prof, a100, dataclasses.replace(base, ep=2))
    assert pred.ep_comm_s > 0 and "expert-parallel comm" in pred.terms()
    # the expert group leaves the node when t·ep spans more than its 8 GPUs
    inside = expert_comm_s(prof, a100, Config(t=2, p=1, d=32, ep=4, micro_batch_size=2,
                                              num_microbatches=1))[0]
    across = expert_comm_s(prof, a100, Config(t=4, p=1, d=16, ep=4, micro_batch_size=2,
                                              num_microbatches=1))[0]
    assert across > inside > 0


def test_ep_gradients_reduced_over_the_expert_data_group_only():
    """With ep = c·d every rank holds its experts alone: their gradients are reduced nowhere,
    so the data-parallel reduction moves only the dense weights."""
    from autopar.cost.hardware import get_cluster
    from autopar.cost.model import Config, config_costs
    a100 = get_cluster("dgx-a100-80gb")
    prof = _moe()
    base = Config(t=1, p=1, d=8, micro_batch_size=2, num_microbatches=4)
    dp = [config_costs(prof, a100, dataclasses.replace(base, ep=ep)).dp_layer_ns
          for ep in (1, 2, 8)]
    assert dp[0] > dp[1] > dp[2] > 0


def test_solver_searches_ep_and_honours_a_pin():
    from autopar.cost.solver import solve
    prof = _moe(experts=8, layers=4, hidden=2048)
    free = solve(prof, "dgx-a100-80gb", gpus=16, global_batch_size=64)
    weighed = {a.config.get("ep") for a in free.alternatives if a.feasible}
    assert len(weighed) > 1, weighed                 # more than one ep was priced
    pinned = solve(prof, "dgx-a100-80gb", gpus=16, global_batch_size=64, ep=4)
    assert pinned.ep == 4 and (pinned.c * pinned.d) % 4 == 0
    assert "ep=4" in str(pinned) and "Expert parallelism ep=4" in pinned.explain()


def test_a_free_ep_is_chosen_with_every_zero_level():
    """ep and the ZeRO level are free together (ZeRO-2/3 shard the experts over the expert-data
    group, autopar/runtime/regimes/zero3.py): the configurations weighed include ep > 1 with
    zero 2 and 3, none rejected for combining them, and a plan pinned ep=4 zero=3 passes
    compile's checks."""
    from autopar.compile import check_program
    from autopar.cost.hardware import get_cluster
    from autopar.cost.solver import Pins, enumerate_configs, solve
    prof = _moe(experts=8, layers=4, hidden=2048)
    a100 = get_cluster("dgx-a100-80gb")
    configs, rejected = enumerate_configs(prof, a100, 16, 64, Pins())
    assert {(c.ep > 1, c.zero) for c in configs} >= {(True, 2), (True, 3)}
    assert not [r for r in rejected if "ep=" in r.reason and "zero=" in r.reason]
    assert any(c.t > 1 and c.ep > 1 for c in configs)              # experts over t and ep
    check_program(solve(prof, "dgx-a100-80gb", gpus=16, global_batch_size=64))
    plan = solve(prof, "dgx-a100-80gb", gpus=16, global_batch_size=64, ep=4, zero=3)
    assert (plan.ep, plan.zero) == (4, 3)
    check_program(plan)


def test_zero3_prices_the_experts_sharded_over_the_expert_data_group():
    """ZeRO-3 with ep: each rank holds E/ep experts, their fp32 shards and Adam states over the
    c·d/ep ranks holding them — at rest E/(c·d) of the experts' state whatever ep, as at ep = 1
    — but gathers only its E/ep experts (half the working set at ep = 2), and their
    all-gathers and reduce-scatters move (c·d/ep − 1)/(c·d/ep) of E/ep experts instead of
    (c·d − 1)/(c·d) of E."""
    from autopar.cost.hardware import get_cluster
    from autopar.cost.model import Config, config_costs, weight_gather_stats
    a100 = get_cluster("dgx-a100-80gb")
    prof = _moe()
    base = Config(t=1, p=1, d=8, micro_batch_size=2, num_microbatches=4, zero=3)
    one, two = (config_costs(prof, a100, dataclasses.replace(base, ep=ep)) for ep in (1, 2))
    (w1, g1, o1, _), (w2, g2, o2, _) = one.mem_parts[0], two.mem_parts[0]
    assert o1 == pytest.approx(o2)                            # Adam's m, v, master: E/(c·d)
    st = weight_gather_stats(base)
    half = prof.block.expert_params_elems / 2
    assert w1 - w2 == pytest.approx(2.0 * st.peak_gathered * half)          # 16-bit gathered
    assert g1 - g2 == pytest.approx(4.0 * (st.peak_pending + 1) * half)     # fp32 accumulation
    assert one.dp_layer_ns > two.dp_layer_ns > config_costs(
        prof, a100, dataclasses.replace(base, ep=8)).dp_layer_ns > 0


@pytest.mark.parametrize("kw, words", [
    (dict(ep=3), ["ep=3", "8 experts", "must divide 8"]),
    (dict(ep=0), ["ep=0", "positive integer"]),
])
def test_solver_ep_errors_are_one_line(kw, words):
    from autopar.cost.solver import solve
    with pytest.raises(ValueError) as e:
        solve(_moe(layers=4), "dgx-a100-80gb", gpus=16, global_batch_size=64, **kw)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_ep_on_a_model_without_experts_is_refused_in_one_line():
    from autopar.cost.profile import transformer_profile
    from autopar.cost.solver import solve
    prof = transformer_profile(num_layers=4, hidden=1024, heads=16, seq_len=1024, vocab=32000)
    with pytest.raises(ValueError, match=r"^solve: ep=2: the model has no mixture of experts"):
        solve(prof, "dgx-a100-80gb", gpus=16, global_batch_size=64, ep=2)
    assert solve(prof, "dgx-a100-80gb", gpus=16, global_batch_size=64).ep == 1
