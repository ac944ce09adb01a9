"""Expert parallelism (issue 17 item 1), the pure parts: the rank math of the expert and
expert-data groups, and the Plan field."""
from __future__ import annotations

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
