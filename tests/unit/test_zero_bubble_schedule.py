"""Zero-bubble interleaved 1F1B ("interleaved-zb", 2401.10241's B/W split on Megatron's
interleaved order; v = 1: ZB-H1 on 1F1B): schedule data, validator, simulator, fit of a
measured timeline, cost model and planner."""
from __future__ import annotations

from dataclasses import replace

import pytest

from autopar.cost.hardware import get_cluster
from autopar.cost.layout import chunk_times_ms, chunk_times_s
from autopar.schedules import zb_weight_times
from autopar.cost.model import SCHEDULE_TRAITS, Config, config_costs, predict
from autopar.cost.step import rank_load_ns, step_scale
from autopar.cost.profile import transformer_profile
from autopar.cost.simulate import fit_measured, simulate
from autopar.cost.solver import AUTO_SCHEDULES, solve
from autopar.schedules import (Action, SCHEDULE_NAMES, first_group_size, format_schedule,
                               interleaved_1f1b,
                               interleaved_zb, make_schedule, one_f_one_b, parse_action,
                               parse_schedule, peak_inflight)
from autopar.schedule_checks import validate

A100 = get_cluster("dgx-a100-80gb")

# Checked by hand: each rank's forwards and backwards come in interleaved_1f1b's orders (v = 1:
# one_f_one_b's) with the shorter zero-bubble warm-up ((p−r−1) + (v−1)·p forwards: rank 0 of
# (2, 2, 4) runs 3 forwards before its first backward, not 4), every W c.i after its B c.i on
# rank c mod p, W's where the rank would wait for its next input or once it holds v·p un-W'ed
# micro-batches, the rest flushed at the end.
GOLDEN = {
    (2, 2, 4): """
rank 0: F0.0 sF0.0>1 F0.1 sF0.1>1 rF1.0<1 F2.0 rF1.1<1 sF2.0>1 F2.1 sF2.1>1 rB3.0<1 B2.0 sB2.0>1 W2.0 rB3.1<1 F0.2 sF0.2>1 B2.1 rF1.2<1 sB2.1>1 W2.1 rB1.0<1 F0.3 sF0.3>1 B0.0 rF1.3<1 W0.0 rB1.1<1 F2.2 sF2.2>1 B0.1 W0.1 rB3.2<1 F2.3 sF2.3>1 B2.2 sB2.2>1 W2.2 rB3.3<1 B2.3 rB1.2<1 sB2.3>1 B0.2 rB1.3<1 B0.3 W2.3 W0.2 W0.3
rank 1: rF0.0<0 F1.0 rF0.1<0 sF1.0>0 F1.1 sF1.1>0 rF2.0<0 F3.0 rF2.1<0 B3.0 sB3.0>0 F3.1 rB2.0<0 B3.1 sB3.1>0 W3.0 rF0.2<0 F1.2 sF1.2>0 rB2.1<0 B1.0 sB1.0>0 W3.1 rF0.3<0 F1.3 sF1.3>0 B1.1 sB1.1>0 W1.0 rF2.2<0 F3.2 B3.2 sB3.2>0 W1.1 rF2.3<0 F3.3 rB2.2<0 B3.3 sB3.3>0 B1.2 sB1.2>0 rB2.3<0 B1.3 sB1.3>0 W3.2 W3.3 W1.2 W1.3
""",
    (2, 1, 2): """
rank 0: F0.0 sF0.0>1 F0.1 sF0.1>1 rB1.0<1 B0.0 W0.0 rB1.1<1 B0.1 W0.1
rank 1: rF0.0<0 F1.0 rF0.1<0 B1.0 sB1.0>0 F1.1 B1.1 sB1.1>0 W1.0 W1.1
""",
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: "-".join(map(str, k)))
def test_golden(key):
    s = interleaved_zb(*key)
    assert format_schedule(s) == GOLDEN[key].strip()
    assert make_schedule("interleaved-zb", *key) == s
    assert parse_schedule(GOLDEN[key]) == s


def test_w_action_strings():
    assert str(Action("W", 3, 1)) == "W3.1"
    assert parse_action("W3.1") == Action("W", 3, 1)
    assert "interleaved-zb" in SCHEDULE_NAMES
    red = interleaved_zb(2, 1, 2, reduce=True)
    assert format_schedule(red).splitlines()[1].endswith("W1.0 W1.1 R1")  # after the last W


def _fb(s):
    return [[a for a in acts if a.kind in ("F", "B")] for acts in s]


def _cases():
    for p in range(1, 9):
        for v in range(1, 5):
            for m in sorted({p, p + 1, 2 * p + 1, 3 * p, 4 * p}):
                yield p, v, m


@pytest.mark.parametrize("p", range(1, 9))
def test_order_validates_and_bounds_memory(p):
    for _, v, m in (c for c in _cases() if c[0] == p):
        zb = interleaved_zb(p, v, m)
        validate(zb, p, v, m)
        base = interleaved_1f1b(p, v, m) if v > 1 else one_f_one_b(p, m)
        for kind in ("F", "B"):     # forwards and backwards each in the base order
            assert [[a for a in acts if a.kind == kind] for acts in zb] == \
                [[a for a in acts if a.kind == kind] for acts in base], (p, v, m, kind)
        for acts in zb:
            pos = {(a.kind, a.chunk, a.mb): n for n, a in enumerate(acts)}
            for (kind, c, i), n in pos.items():
                if kind == "B":
                    assert pos[("W", c, i)] > n         # every B has its W, later
        # the bound of torch's ScheduleInterleavedZeroBubble, (v−1)·g₀ + p (= v·p when p | m),
        # never more than the base order holds un-B'ed (the cost model's table says the same)
        g0 = first_group_size(p, m)
        bound = min((v - 1) * g0 + p, m * v)
        assert max(peak_inflight(zb)) == bound <= max(peak_inflight(base))
        assert [SCHEDULE_TRAITS["interleaved-zb"].inflight(p, v, m, r, g0)
                for r in range(p)] == [bound] * p


def test_peak_inflight_vs_interleaved_1f1b():
    assert peak_inflight(interleaved_1f1b(4, 2, 8)) == [11, 9, 7, 5]
    assert peak_inflight(interleaved_zb(4, 2, 8)) == [8, 8, 8, 8]      # torch's v·p
    assert peak_inflight(one_f_one_b(4, 8)) == [4, 3, 2, 1]
    assert peak_inflight(interleaved_zb(4, 1, 8)) == [4, 4, 4, 4]
    # a tighter bound per rank (the zero-bubble F/B order's own) is allowed, and kept
    tight = interleaved_zb(4, 2, 8, max_inflight=[8, 7, 6, 5])
    validate(tight, 4, 2, 8)
    assert peak_inflight(tight) == [8, 7, 6, 5]
    with pytest.raises(ValueError, match="below what its F/B order"):
        interleaved_zb(4, 2, 8, max_inflight=4)


def test_validator_w_errors():
    good = GOLDEN[(2, 1, 2)].strip()
    mixed = parse_schedule(good.replace(" W0.1", ""))
    with pytest.raises(ValueError, match="mixes backwards with and without"):
        validate(mixed, 2, 1, 2)
    early = parse_schedule(good.replace("B0.0 W0.0", "W0.0 B0.0"))
    with pytest.raises(ValueError, match="W0.0 runs before its input-gradient backward B0.0"):
        validate(early, 2, 1, 2)
    late_reduce = parse_schedule(good.replace("B0.1 W0.1", "B0.1 R0 W0.1")
                                 .replace("W1.1", "W1.1 R1"))
    with pytest.raises(ValueError, match="REDUCE must follow its last weight-gradient W"):
        validate(late_reduce, 2, 1, 2)


def _sim(name, p, v, m, comm, f=1.0, b=2.0, **kw):
    C = p * v
    return simulate(make_schedule(name, p, v, m, times_fb=(f, b)), [f] * C, [b] * C,
                    comm=comm, **kw)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (2, 1, 4), (4, 1, 8), (4, 4, 8),
                                   (8, 1, 16), (8, 2, 16), (3, 2, 7), (2, 3, 5)])
@pytest.mark.parametrize("comm", ["irecv", "blocking", "isend", "async"])
def test_bubble_is_a_third(p, v, m, comm):
    """F = B_in = W (bwd = 2·fwd, wgt = fwd): every rank idles (p−1)·(F + B − W) = (p−1)·F,
    ZB-H1's figure (2401.10241 §3), against (p−1)·(F + B + W) for the interleaved / 1F1B
    order: a third of the bubble, exactly, in every communication mode (no p2p time)."""
    base = "interleaved-1f1b" if v > 1 else "1f1b"
    zb, il = _sim("interleaved-zb", p, v, m, comm), _sim(base, p, v, m, comm)
    work = m * v * 3.0
    assert zb.makespan_s == pytest.approx(work + (p - 1) * 1.0)
    if comm != "blocking" or v == 1:  # interleaved 1F1B may lose more under rendezvous
        assert il.makespan_s == pytest.approx(work + (p - 1) * 3.0)
    assert zb.bubble_fraction < il.bubble_fraction
    assert zb.bubble_over_compute == pytest.approx((p - 1) / (3 * v * m))


@pytest.mark.parametrize("comm", ["irecv", "isend", "blocking"])
def test_smaller_bubble_with_p2p_and_other_ratios(comm):
    for p, v, m in [(2, 2, 4), (4, 2, 8), (4, 1, 8)]:
        for f, b in [(1.0, 2.0), (1.0, 3.0)]:
            if comm == "blocking" and b == 3.0:
                continue  # compute edges of neighbours no longer line up (see README)
            base = "interleaved-1f1b" if v > 1 else "1f1b"
            kw = dict(f=f, b=b, p2p_s=0.05, send_s=0.01)
            zb, il = _sim("interleaved-zb", p, v, m, comm, **kw), _sim(base, p, v, m, comm, **kw)
            assert zb.bubble_fraction < il.bubble_fraction, (p, v, m, f, b)


def test_simulate_w_times():
    s = interleaved_zb(2, 1, 2)
    r = simulate(s, [1.0, 1.0], [2.0, 2.0], comm="irecv", wgt_s=[0.5, 0.5])
    durs = {str(e.action): e.end_s - e.start_s for e in r.events if e.action.kind in "FBW"}
    assert durs["B0.0"] == pytest.approx(1.5) and durs["W0.0"] == pytest.approx(0.5)
    assert sum(r.busy_s) == pytest.approx(2 * 2 * 3.0)  # bwd_s stays the whole backward
    # default W = half the backward; without W actions wgt_s is ignored
    d = simulate(s, [1.0, 1.0], [2.0, 2.0])
    assert {e.end_s - e.start_s for e in d.events if e.action.kind in "BW"} == {1.0}
    plain = simulate(one_f_one_b(2, 2), [1.0] * 2, [2.0] * 2, wgt_s=[0.5, 0.5])
    assert plain.makespan_s == simulate(one_f_one_b(2, 2), [1.0] * 2, [2.0] * 2).makespan_s
    with pytest.raises(ValueError, match="exceeds bwd_s"):
        simulate(s, [1.0, 1.0], [2.0, 2.0], wgt_s=[3.0, 3.0])


@pytest.mark.parametrize("comm", ["irecv", "isend"])
def test_fit_measured_round_trip(comm):
    p, v, m = 2, 2, 4
    C = p * v
    fwd, bwd, wgt = [1.0, 1.2, 0.9, 1.1], [2.0, 2.6, 1.8, 2.2], [0.9, 1.3, 0.8, 1.0]
    acts = interleaved_zb(p, v, m)
    truth = simulate(acts, fwd, bwd, comm=comm, wgt_s=wgt, p2p_s=0.05, send_s=0.01)
    events = [(e.rank, str(e.action), e.start_s, e.end_s) for e in truth.events]
    assert any(a.startswith("W") for _, a, _, _ in events)
    fit = fit_measured(events, p, v, comm=comm)
    assert fit["wgt_s"] == pytest.approx(wgt)
    assert fit["bwd_s"] == pytest.approx(bwd)          # measured B + W
    assert fit["fwd_s"] == pytest.approx(fwd)
    again = simulate(acts, **fit, comm=comm)
    assert again.makespan_s == pytest.approx(truth.makespan_s, rel=0.02)
    assert "wgt_s" not in fit_measured(
        [(e.rank, str(e.action), e.start_s, e.end_s)
         for e in simulate(interleaved_1f1b(p, v, m), fwd, bwd, comm=comm).events], p, v, comm)
    assert len(fit["fwd_s"]) == C


@pytest.mark.parametrize("p,v,m", [(4, 1, 8), (4, 2, 8), (2, 4, 6), (8, 2, 16), (3, 1, 7)])
def test_cost_model_bubble_equals_simulator(p, v, m):
    """The step formula's zero-bubble term (Σ load − max load)/(3v) equals the simulated idle
    of interleaved_zb's lists for equal chunks at F : B : W = 1 : 1 : 1, and predict prices
    the larger of it and the runtime's lists simulated with predict's own per-chunk times
    (cost/model.py schedule_stall_ns; here F is 35% of a chunk, not a third, and chunk 0's W
    its whole backward: schedules.zb_weight_times)."""
    prof = transformer_profile(num_layers=p * v * 2, hidden=256, heads=4, seq_len=128,
                               vocab=128)
    cfg = Config(t=1, p=p, d=1, v=v, micro_batch_size=1, num_microbatches=m,
                 schedule="interleaved-zb")
    cc = replace(config_costs(prof, A100, cfg), embed_ns=0, head_ns=0, p2p_ns=0)
    pr = predict(prof, A100, cfg, costs=cc)
    base = predict(prof, A100, replace(cfg, schedule="interleaved-1f1b" if v > 1 else "1f1b"),
                   costs=replace(cc, cfg=replace(cfg, schedule="interleaved-1f1b"
                                                 if v > 1 else "1f1b")))
    loads = [rank_load_ns(cc, r, 2 * v) for r in range(p)]
    formula_s = (sum(loads) - max(loads)) / step_scale(cfg) / 1e9
    chunk = cc.layer_ns * 2 / 1e9               # 2 layers per chunk
    fwd = chunk / 3
    for comm in ("irecv", "blocking"):
        sim = simulate(make_schedule("interleaved-zb", p, v, m, times_fb=(1.0, 2.0)),
                       [fwd] * (p * v), [chunk - fwd] * (p * v), comm=comm,
                       wgt_s=[fwd] * (p * v))
        assert sim.bubble_over_compute == pytest.approx(formula_s / (m * v * chunk), rel=1e-6)
        assert sim.makespan_s == pytest.approx(m * v * chunk + formula_s, rel=1e-6)
    assert formula_s / (m * v * chunk) == pytest.approx((p - 1) / (3 * v * m), rel=1e-6)
    assert formula_s == pytest.approx(base.bubble_s / 3, rel=1e-6)
    f, b, _ = chunk_times_s(cc, [2] * (p * v))
    lists = make_schedule("interleaved-zb", p, v, m, times_fb=(f[0], b[0]),
                          chunk_times=chunk_times_ms(cc, [2] * (p * v)))   # the runtime's
    own = simulate(lists, f, b, comm="irecv",
                   wgt_s=zb_weight_times(f, b)).makespan_s - m * v * chunk
    assert pr.bubble_s == pytest.approx(max(formula_s, own), rel=1e-6)
    assert pr.step_time_s < base.step_time_s


def test_solver_picks_zero_bubble_where_faster_never_with_zero3():
    """interleaved-zb is searched with the rest (AUTO_SCHEDULES): it wins on its bubble where
    the pipeline is deep (p = 8 pinned), against the best plan without it. Priced with
    attention written out, as when this was set up. Left free the solver prefers a shallower
    interleaved pipeline with ZeRO-2 (zero-bubble cannot shard weights, and its deferred W's
    keep their recorded gradients: cost/model.py pending_weight_grads)."""
    prof = transformer_profile(name="40L", num_layers=40, hidden=5120, heads=40, seq_len=2048,
                               vocab=51200)
    A100 = replace(globals()["A100"], attention="materialized")
    assert "interleaved-zb" in AUTO_SCHEDULES
    free = solve(prof, A100, gpus=32, global_batch_size=512, p=8, max_alternatives=50)
    assert free.schedule == "interleaved-zb" and free.zero != 3
    il = solve(prof, A100, gpus=32, global_batch_size=512, p=8,
               schedules=tuple(s for s in AUTO_SCHEDULES if s != "interleaved-zb"))
    assert il.schedule != "interleaved-zb"
    assert free.predicted.step_time_s < il.predicted.step_time_s
    assert free.predicted.bubble_fraction < il.predicted.bubble_fraction
    reasons = [a.reason for a in free.alternatives]
    assert any("zero=2/3 not offered with interleaved-zb" in r for r in reasons)
    assert not any(a.feasible and a.config.get("schedule") == "interleaved-zb"
                   and a.config.get("zero") == 3 and a.config.get("d", 1) > 1
                   for a in free.alternatives)
    with pytest.raises(ValueError, match="zero=3 with schedule='interleaved-zb'"):
        solve(prof, A100, gpus=64, global_batch_size=512, schedule="interleaved-zb", zero=3,
              d=8)
    # same m % p rule as interleaved-1f1b for v > 1; v = 1 (ZB-H1) needs none
    pinned = solve(prof, A100, gpus=64, global_batch_size=512, schedule="interleaved-zb",
                   p=4, v=2)
    assert pinned.num_microbatches % 4 == 0


def test_timeline_draws_w(tmp_path):
    pytest.importorskip("matplotlib")
    from autopar.timeline import draw_timeline
    r = simulate(interleaved_zb(2, 2, 4), [1.0] * 4, [2.0] * 4, comm="irecv")
    path = draw_timeline(r.events, 2, str(tmp_path / "zb.png"), title="zb")
    assert (tmp_path / "zb.png").stat().st_size > 0 and path.endswith("zb.png")


def test_the_split_backward_is_priced_where_the_runtime_pays_it():
    """interleaved-zb's B/W split costs every forward op of a chunk the cluster's measured
    split_backward_op_s, per micro-batch, on an eager cluster (calibrated: its host work is
    the step's); a fused GPU stack's kernels hide it, like dispatch. One memo prices both
    schedules: the split is part of the loads' key."""
    from autopar.cost.compute import split_backward_s
    from autopar.cost.memo import CostMemo
    from autopar.cost.model import load_parts_s
    prof = transformer_profile(num_layers=8, hidden=256, heads=4, seq_len=128, vocab=1000)
    eager = replace(get_cluster("local-cpu"), elementwise="eager", split_backward_op_s=1e-5,
                    split_backward_s_per_byte=0.0)    # per saved byte: the next test
    common = dict(t=1, p=2, d=1, v=2, micro_batch_size=1, num_microbatches=4)
    zb, il = (Config(schedule=s, **common) for s in ("interleaved-zb", "interleaved-1f1b"))
    memo = CostMemo()
    il_parts, zb_parts = load_parts_s(prof, eager, il, memo), load_parts_s(prof, eager, zb, memo)
    blk = prof.block       # its ops: eager ones, GEMMs, fused attention calls for their GEMMs
    ops = blk.eager_ops + len(blk.gemms) + (
        len(blk.fused.calls) - len(blk.fused.gemm_indices) if blk.fused else 0)
    assert ops > 0
    assert zb_parts[0] - il_parts[0] == pytest.approx(ops * 1e-5)
    assert zb_parts[3] > il_parts[3]                          # the head's chunk is split too
    fused = replace(eager, elementwise="fused")
    assert load_parts_s(prof, fused, zb) == load_parts_s(prof, fused, il)
    slower = predict(prof, eager, zb).step_time_s - predict(prof, replace(
        eager, split_backward_op_s=0.0), zb).step_time_s
    assert slower > 0


def test_the_split_backward_s_bytes_are_priced_per_saved_byte():
    """Beyond its ops, the split costs the cluster's split_backward_s_per_byte × what a
    micro-batch saves in the region without recompute (the gradients B makes beside the
    retained graph: `layer_activation_bytes` at "none", whatever the plan recomputes), per
    layer and in the head; on a fused stack nothing."""
    from autopar.cost.memo import CostMemo
    from autopar.cost.memory import layer_activation_bytes
    from autopar.cost.model import load_parts_s
    prof = transformer_profile(num_layers=8, hidden=256, heads=4, seq_len=128, vocab=1000)
    eager = replace(get_cluster("local-cpu"), elementwise="eager", split_backward_op_s=0.0,
                    split_backward_s_per_byte=0.0)
    per_byte = replace(eager, split_backward_s_per_byte=1e-10)
    for b, recompute in ((1, "none"), (2, "none"), (2, "full")):
        zb = Config(t=1, p=2, d=1, v=2, micro_batch_size=b, num_microbatches=4,
                    schedule="interleaved-zb", recompute=recompute)
        plain, priced = (load_parts_s(prof, c, zb, CostMemo()) for c in (eager, per_byte))
        rank = CostMemo().rank_profile(prof, per_byte, zb)   # its attention as the CPU runs it
        assert priced[0] - plain[0] == pytest.approx(
            1e-10 * layer_activation_bytes(rank, 1, b, "none", False))
        assert priced[3] > plain[3]                              # the head's saved bytes
    fused = replace(per_byte, elementwise="fused")
    assert load_parts_s(prof, fused, zb) == load_parts_s(prof, replace(eager, elementwise="fused"),
                                                         zb)


# per chunk on the default GPT of benchmarks/plan_vs_measured.py at p = v = 2 (ms, measured on
# CPU): chunk 0 the embedding + a layer, chunk 3 a layer + the head; F, and B + W; and W alone
# (the embedding's dense weight gradient makes chunk 0's the longest)
_UNEVEN = [(1.7, 3.55), (1.8, 4.2), (1.7, 3.9), (2.5, 5.4)]
_UNEVEN_W = [3.5, 1.7, 1.5, 2.4]


def test_zero_bubble_places_its_ws_by_each_chunks_own_times():
    """With each chunk's times (a Plan's stages record them) interleaved-zb's W's fill the
    cool-down's waits that equal chunks would not have: rank 0 runs chunk 2's last W before
    chunk 0's backwards instead of after them, and the lists, still valid, run shorter on the
    measured times than the equal-chunk lists do (simulated 57.5 against 61.4 ms)."""
    from autopar.schedule_checks import validate
    from autopar.schedules import make_schedule, zb_chunk_times
    p, v, m, g = 2, 2, 4, 4
    even = make_schedule("interleaved-zb", p, v, m, group=g)
    own = make_schedule("interleaved-zb", p, v, m, group=g, chunk_times=_UNEVEN)
    validate(own, p, v, m)
    order = [str(a) for a in own[0] if str(a)[0] in "FBW"]
    assert order.index("W2.3") < order.index("B0.0")
    even_order = [str(a) for a in even[0] if str(a)[0] in "FBW"]
    assert even_order.index("W2.3") > even_order.index("B0.3")
    fwd = [f for f, _ in _UNEVEN]
    bwd = [b for _, b in _UNEVEN]
    assert len(zb_chunk_times(_UNEVEN)) == 4
    sim = {name: simulate(lists, fwd, bwd, 0.1, comm="irecv", wgt_s=_UNEVEN_W).makespan_s
           for name, lists in (("even", even), ("own", own))}
    assert sim["own"] < 0.97 * sim["even"]


def test_zb_chunk_times_take_w_as_the_forward_and_keep_every_time_positive():
    """W a chunk's forward time, chunk 0's its backward (its B has no input to return a
    gradient to: a stand-in a tenth of the least time), every time positive."""
    from autopar.schedules import zb_chunk_times
    got = zb_chunk_times([(1.0, 2.0), (3.0, 6.0), (2.0, 4.0)])
    want = [(1.0, 0.1, 1.9), (3.0, 3.0, 3.0), (2.0, 2.0, 2.0)]
    assert [x for t in got for x in t] == pytest.approx([x for t in want for x in t])
    out = zb_chunk_times([(1.0, 2.0), (0.0, 0.0), (2.0, 1.0)])   # none recorded; B < F
    assert all(x > 0 for t in out for x in t) and out[2][2] < 1.0


def test_a_solved_plan_records_each_chunks_times_and_a_file_keeps_them():
    """The solver's stages carry the cost model's per-chunk (forward, backward), embedding and
    head included, through plan.json; a plan without them (older, or by hand) records none."""
    from autopar.plan import Plan, recorded_chunk_times
    prof = transformer_profile(num_layers=4, hidden=256, heads=4, seq_len=128, vocab=50000)
    plan = solve(prof, A100, gpus=2, global_batch_size=8, p=2, v=2, micro_batch_size=1,
                 schedule="interleaved-zb")
    times = recorded_chunk_times(plan)
    assert times is not None and len(times) == 4 and all(f > 0 and b > f for f, b in times)
    assert recorded_chunk_times(Plan.from_json(plan.to_json())) == times
    bare = replace(plan, stages=tuple(replace(st, fwd_ms=0.0, bwd_ms=0.0)
                                      for st in plan.stages))
    assert recorded_chunk_times(bare) is None


def test_a_zb_plans_timeline_draws_the_lists_its_runtime_runs(tmp_path, monkeypatch):
    """`plan_timeline` simulates what autopar/compile.py builds: the lists placed by the
    stages' recorded times (equal chunks for a plan recording none), not lists of its own."""
    import autopar.timeline as timeline
    from autopar.plan import recorded_chunk_times
    from autopar.schedules import make_schedule
    prof = transformer_profile(num_layers=4, hidden=256, heads=4, seq_len=128, vocab=50000)
    plan = solve(prof, A100, gpus=2, global_batch_size=8, p=2, v=2, micro_batch_size=1,
                 schedule="interleaved-zb")
    bare = replace(plan, stages=tuple(replace(st, fwd_ms=0.0, bwd_ms=0.0)
                                      for st in plan.stages))
    seen = []
    real = timeline.simulate
    monkeypatch.setattr(timeline, "simulate",
                        lambda lists, *a, **k: seen.append(lists) or real(lists, *a, **k))
    for pl in (plan, bare):
        timeline.plan_timeline(pl, str(tmp_path / "zb.png"))
        assert seen[-1] == make_schedule(pl.schedule, pl.p, pl.v, pl.num_microbatches,
                                         group=pl.microbatch_group,
                                         chunk_times=recorded_chunk_times(pl))
