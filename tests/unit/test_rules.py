"""The planning request as data (autopar/request.py) under the rules stated once
(autopar/rules.py): every bad value is one ValueError line naming the value, the rule and the
fix, raised when the request is built — the same for parallelize, the CLI, the solver and the
Plan; the rules agree with the cost model's schedule and ZeRO tables."""
from __future__ import annotations

import argparse

import pytest
import torch

import autopar
from autopar import rules
from autopar.cost.model import SCHEDULE_TRAITS, ZERO_TRAITS
from autopar.request import Pins, PlanRequest
from autopar.schedules import SCHEDULE_NAMES


def test_the_rules_agree_with_the_cost_models_tables():
    assert set(SCHEDULE_TRAITS) == set(SCHEDULE_NAMES)
    assert set(rules.MULTI_CHUNK) == {s for s, tr in SCHEDULE_TRAITS.items() if tr.multi_chunk}
    assert set(ZERO_TRAITS) == set(rules.ZERO_LEVELS)
    for schedule, traits in SCHEDULE_TRAITS.items():   # the ZeRO levels a schedule runs
        assert set(traits.zero_levels) == {z for z in rules.ZERO_LEVELS
                                           if rules.zero_refusal(z, schedule) is None}
    assert autopar.plan.CP_ATTENTION is rules.CP_ATTENTION   # one tuple, re-exported
    # the hybrid context method: weighed by the free solver like the others
    assert "hybrid" in rules.CP_ATTENTION   # and the hybrid with the ring across, pin-only
    assert rules.CP_ATTENTION_PINNED == rules.CP_ATTENTION
    assert rules.knob_refusal("cp_attention", "hybrid") is None


def test_the_cli_pins_the_hybrid():
    from autopar.cli import build_parser
    args = build_parser().parse_args(["plan", "gpt3-175b", "--gpus", "8", "--c", "4",
                                      "--cp-attention", "hybrid"])
    assert args.cp_attention == "hybrid"


@pytest.mark.parametrize("pins, words", [
    (dict(t=0), ["t=0", "positive integer", "t=1 or more"]),
    (dict(d=True), ["d=True", "positive integer"]),
    (dict(schedule="zigzag"), ["schedule='zigzag'", "must be one of", "1f1b"]),
    (dict(zero=4), ["zero=4", "(0, 1, 2, 3)"]),
    (dict(cp_attention="rings"), ["cp_attention='rings'", "all-to-all"]),
    (dict(sequence_parallel=1), ["sequence_parallel=1", "True or False"]),
    (dict(v=2, schedule="1f1b"), ["v=2", "'1f1b'", "set v=1"]),
    (dict(microbatch_group=4, schedule="gpipe"), ["microbatch_group=4", "interleaved"]),
    (dict(ep=3, c=1, d=4), ["ep=3", "must divide 4"]),
    (dict(c=2, cp_attention="hybrid"), ["cp_attention='hybrid' with c=2", "1 < k < c",
                                        "pin cp_attention='all-to-all'"]),
    (dict(zero=2, schedule="interleaved-zb"), [
        "zero=2 with schedule='interleaved-zb'", "weight-gradient halves", "use zero=0 or 1"]),
    (dict(recompute="op", schedule="interleaved-zb"), [
        "recompute='op' with schedule='interleaved-zb'", "run once", "use recompute 'full'"]),
])
def test_bad_pins_are_one_line_naming_value_rule_and_fix(pins, words):
    with pytest.raises(ValueError) as err:
        Pins(**pins)
    msg = str(err.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_a_request_checks_the_pins_against_the_gpus_and_the_budget():
    with pytest.raises(ValueError, match=r"^pins t=2·c=2·p=1·d=1 multiply to 4, not gpus=8"):
        PlanRequest(gpus=8, pins=Pins(t=2, c=2, p=1, d=1))
    with pytest.raises(ValueError, match=r"^pins t=3 multiply to 3, which does not divide"):
        PlanRequest(gpus=8, pins={"t": 3})
    with pytest.raises(ValueError, match=r"^gpus=0 must be a positive integer"):
        PlanRequest(gpus=0)
    with pytest.raises(ValueError, match=r"critical_batch_tokens=.* without tokens="):
        PlanRequest(gpus=8, critical_batch_tokens=1e6)
    with pytest.raises(ValueError, match=r"^precision='fp4': must be one of"):
        PlanRequest(gpus=8, precision="fp4")
    with pytest.raises(ValueError, match=r"^launch: unknown knob\(s\) \['tt'\]; the knobs are"):
        Pins.of({"tt": 2}, "launch")
    request = PlanRequest(gpus=8, pins={"t": 2, "zero": 1})
    assert request.pins == Pins(t=2, zero=1) and request.pins.as_dict() == {"t": 2, "zero": 1}
    assert request.pins.without("t") == Pins(zero=1)
    with pytest.raises(Exception):    # frozen
        request.pins.t = 4


def test_ep_combines_with_every_zero_level():
    """ep runs with every ZeRO level (ZeRO-2/3 shard the experts over the expert-data group,
    autopar/runtime/regimes/zero3.py): no rule refuses the pair."""
    for zero in (0, 1, 2, 3):
        assert Pins(ep=2, zero=zero).as_dict() == {"ep": 2, "zero": zero}
    assert not hasattr(rules, "expert_parallel_refusal")


def test_parallelize_and_the_cli_build_the_same_request_and_refuse_before_capturing():
    ids = torch.zeros(1, 8, dtype=torch.long)

    class Unused(torch.nn.Module):    # never captured: the request is refused first
        def forward(self, x):
            raise AssertionError("captured")

    for kw, words in [(dict(tt=2), ["parallelize: unknown knob(s) ['tt']"]),
                      (dict(t=0), ["parallelize: t=0: must be a positive integer"]),
                      (dict(c=3), ["parallelize: c=3 with sequence length 8", "2c = 6"])]:
        with pytest.raises(ValueError) as err:
            autopar.parallelize(Unused(), gpus=6, example_inputs=(ids,), **kw)
        assert all(w in str(err.value) for w in words), str(err.value)
    from autopar.cli import _pins_from_args
    args = argparse.Namespace(t=2, c=None, cp_attention=None, ep=None, p=None, d=None, v=None,
                              schedule="1f1b", recompute=None, zero=1, micro_batch=4)
    assert _pins_from_args(args) == Pins(t=2, schedule="1f1b", zero=1, micro_batch_size=4)


def test_op_recompute_is_never_planned_with_a_split_backward():
    """The solver skips op with the zero-bubble schedules (rules.recompute_refusal) while it
    searches op with every other schedule, and a Plan holding the pair is refused."""
    import dataclasses
    from autopar.cost.families import Pins as SolverPins
    from autopar.cost.families import enumerate_families
    from autopar.cost.hardware import get_cluster
    from autopar.cost.profile import transformer_profile
    from autopar.cost.solver import AUTO_SCHEDULES
    from programs import make_plan
    prof = transformer_profile(num_layers=8, hidden=256, heads=4, seq_len=256, vocab=1024)
    fams, _ = enumerate_families(prof, get_cluster("dgx-a100-80gb"), 8, 32,
                                 SolverPins(schedules=AUTO_SCHEDULES + ("interleaved-zb",)))
    pairs = {(f.recompute, row[1]) for f in fams for row in f.rows}
    assert ("op", "interleaved-1f1b") in pairs and ("full", "interleaved-zb") in pairs
    assert ("op", "interleaved-zb") not in pairs
    with pytest.raises(ValueError, match=r"^Plan.recompute='op' with schedule='interleaved-zb'"):
        dataclasses.replace(make_plan(p=2, v=2, m=2, layers=4, schedule="interleaved-zb"),
                            recompute="op")


def test_zero_levels_follow_the_context_ranks_and_the_schedule_rule():
    """ZeRO shards over the c·d ranks holding the same weights: at c = 2, d = 1 the solver
    offers every level (it used to plan ZeRO-0 only, reading d), and a pinned zero=2 with the
    schedule free never comes back with a split backward, which the runtime cannot run (the
    planner once returned zero=2 with interleaved-zb at c = 2, d = 1; compile refused it)."""
    from autopar.cost.families import Pins as SolverPins
    from autopar.cost.families import enumerate_families
    from autopar.cost.hardware import get_cluster
    from autopar.cost.profile import transformer_profile
    from autopar.cost.solver import AUTO_SCHEDULES
    prof = transformer_profile(num_layers=8, hidden=256, heads=4, seq_len=256, vocab=1024)
    a100 = get_cluster("dgx-a100-80gb")
    fams, _ = enumerate_families(prof, a100, 4, 32, SolverPins(
        c=2, d=1, p=2, t=1, schedules=AUTO_SCHEDULES))
    levels = {(row[1], z) for f in fams for row in f.rows for _, z in row[4]}
    assert {z for s, z in levels if s == "1f1b"} == {0, 1, 2, 3}
    assert {z for s, z in levels if s == "interleaved-zb"} == {0, 1}
    fams, _ = enumerate_families(prof, a100, 4, 32, SolverPins(
        c=2, d=1, p=2, t=1, zero=2, schedules=AUTO_SCHEDULES))
    rows = {row[1] for f in fams for row in f.rows}
    assert "interleaved-zb" not in rows and "1f1b" in rows
    for c, d in ((1, 1), (2, 1)):     # one replica or two: never zb with a pinned zero=2
        fams, _ = enumerate_families(prof, a100, 2 * c * d, 32, SolverPins(
            c=c, d=d, p=2, t=1, zero=3, schedules=AUTO_SCHEDULES))
        assert fams and not any(row[1] == "interleaved-zb" for f in fams for row in f.rows)
