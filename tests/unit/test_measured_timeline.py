"""The simulator's comm="isend" mode (the gloo executor's async send + blocking receive) and the
measured-timeline helpers, on synthetic event data (timing goals live in benchmarks/)."""
from __future__ import annotations

import pytest

from autopar.cost.simulate import fit_measured, measured_idle_fraction, simulate
from autopar.schedules import make_schedule


def _ends(res):
    return {(e.rank, str(e.action)): (round(e.start_s, 6), round(e.end_s, 6)) for e in res.events}


def test_isend_semantics_by_hand():
    # gpipe p=2 m=2, F=1 B=2, p2p 0.5, sender busy 0.1 per isend (worked out in the comments)
    per_rank = make_schedule("gpipe", 2, 1, 2)
    res = simulate(per_rank, [1.0, 1.0], [2.0, 2.0], p2p_s=0.5, comm="isend", send_s=0.1)
    ev = _ends(res)
    assert ev[(0, "sF0.0>1")] == (1.0, 1.1)        # the sender only pays the post
    assert ev[(0, "F0.1")] == (1.1, 2.1)           # ... and goes on at once
    assert ev[(1, "rF0.0<0")] == (0.0, 1.6)        # posted at 1.1, + p2p
    # rF0.1 is posted at 2.2 and the receive starts at 2.6: it still pays p2p (gloo moves the
    # bytes only once the receive is posted)
    assert ev[(1, "rF0.1<0")] == (2.6, 3.1)
    assert ev[(0, "rB1.0<1")] == (2.2, 6.7)        # B1.0 ends 6.1, posted 6.2, + 0.5
    assert res.makespan_s == pytest.approx(11.2)
    assert res.idle_fraction == pytest.approx(((11.2 - 6) / 11.2,) * 2)
    asy = simulate(per_rank, [1.0, 1.0], [2.0, 2.0], p2p_s=0.5, blocking=False)
    # "async" (no send cost): F0.1 ends 2.0, arrives 2.5 while rank 1 ends F1.0 at 2.5: free
    assert _ends(asy)[(1, "rF0.1<0")] == (2.5, 2.5)
    assert asy.makespan_s < res.makespan_s


def test_isend_equals_async_without_transfer_costs_and_is_deadlock_free():
    for name, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("gpipe", 1)):
        per_rank = make_schedule(name, 2, v, 4)
        f, b = [1.0] * (2 * v), [2.0] * (2 * v)
        a = simulate(per_rank, f, b, comm="isend")
        assert a.makespan_s == pytest.approx(simulate(per_rank, f, b, blocking=False).makespan_s)
        assert len(a.events) == sum(len(r) for r in per_rank)   # every action ran


def test_overhead_adds_dispatch_gaps():
    per_rank = make_schedule("1f1b", 2, 1, 2)
    base = simulate(per_rank, [1.0, 1.0], [2.0, 2.0], comm="isend")
    slow = simulate(per_rank, [1.0, 1.0], [2.0, 2.0], comm="isend", overhead_s=0.01)
    assert slow.makespan_s > base.makespan_s
    assert slow.busy_s == base.busy_s


def test_fit_recovers_a_synthetic_runtime_timeline():
    """A timeline shaped like the runtime's recording (string actions, absolute clock, uneven
    chunks, rank 1 starting late) is fitted and re-simulated to the same idle fractions."""
    per_rank = make_schedule("interleaved-1f1b", 2, 2, 4)
    fwd, bwd = [0.007, 0.006, 0.008, 0.009], [0.015, 0.013, 0.016, 0.018]
    truth = simulate(per_rank, fwd, bwd, p2p_s=4e-4, comm="isend", send_s=2e-4)
    t0 = 1000.0  # an absolute clock, as recorded
    events = [(e.rank, str(e.action), t0 + e.start_s, t0 + e.end_s) for e in truth.events]
    fit = fit_measured(events, 2, 2)
    assert fit["fwd_s"] == pytest.approx(fwd) and fit["bwd_s"] == pytest.approx(bwd)
    assert fit["p2p_s"] == pytest.approx(4e-4, rel=1e-3)
    assert fit["send_s"] == pytest.approx(2e-4, rel=1e-3)
    measured = measured_idle_fraction(events, 2)
    assert measured == pytest.approx(truth.idle_fraction, rel=1e-6)
    resim = simulate(per_rank, **fit, comm="isend")
    assert resim.idle_fraction == pytest.approx(measured, rel=1e-3)
    # the rendezvous model of the same measurements disagrees: the mode matters
    blocking = simulate(per_rank, fwd, bwd, p2p_s=4e-4, blocking=True)
    assert blocking.idle_fraction != pytest.approx(measured, rel=1e-3)


def test_measured_events_draw(tmp_path):
    pytest.importorskip("matplotlib")
    from autopar.timeline import draw_timeline
    per_rank = make_schedule("1f1b", 2, 1, 2)
    res = simulate(per_rank, [1.0, 1.0], [2.0, 2.0], p2p_s=0.1, comm="isend")
    events = [(e.rank, str(e.action), 100 + e.start_s, 100 + e.end_s) for e in res.events]
    t0 = min(e[2] for e in events)
    path = draw_timeline([(r, a, s - t0, e - t0) for r, a, s, e in events], 2,
                         str(tmp_path / "measured.png"))
    assert (tmp_path / "measured.png").stat().st_size > 1000 and path.endswith(".png")


def test_bad_comm_mode_and_missing_chunk_are_clear_errors():
    per_rank = make_schedule("1f1b", 2, 1, 2)
    with pytest.raises(ValueError, match="comm='nccl'.*isend"):
        simulate(per_rank, [1.0, 1.0], [2.0, 2.0], comm="nccl")
    with pytest.raises(ValueError, match="no B event of chunk 1"):
        fit_measured([(0, "F0.0", 0.0, 1.0), (1, "F1.0", 1.0, 2.0), (0, "B0.0", 2.0, 3.0)], 2, 1)


def test_irecv_semantics_by_hand():
    # gpipe p=2 m=2, F=1 B=2, p2p 0.5, send 0.1; all receives posted at step start
    per_rank = make_schedule("gpipe", 2, 1, 2)
    res = simulate(per_rank, [1.0, 1.0], [2.0, 2.0], p2p_s=0.5, comm="irecv", send_s=0.1)
    ev = _ends(res)
    assert ev[(0, "sF0.0>1")] == (1.0, 1.1)
    assert ev[(1, "rF0.0<0")] == (0.0, 1.6)        # the wait, right before F1.0
    assert ev[(1, "F1.0")] == (1.6, 2.6)
    # sF0.1 posted at 2.2 (F0.1 ends 2.1), the bytes move while rank 1 runs F1.0: arrives 2.7
    assert ev[(0, "sF0.1>1")] == (2.1, 2.2)
    assert ev[(1, "rF0.1<0")] == (2.6, 2.7)
    # the isend model makes the same receive pay p2p after rank 1 reaches it
    assert _ends(simulate(per_rank, [1.0, 1.0], [2.0, 2.0], p2p_s=0.5, comm="isend",
                          send_s=0.1))[(1, "rF0.1<0")] == (2.6, 3.1)
    # F1.1 [2.7, 3.7], B1.0 [3.7, 5.7], sB1.0 to 5.8, arrives 6.3; B0.0 waits for it from 2.2
    assert ev[(0, "rB1.0<1")] == (2.2, 6.3)
    # B1.1 [5.8, 7.8], sB1.1 to 7.9, arrives 8.4 while B0.0 runs [6.3, 8.3]; B0.1 [8.4, 10.4]
    assert ev[(0, "rB1.1<1")] == (8.3, 8.4)
    assert res.makespan_s == pytest.approx(10.4)
    # a receive posted only when its RECV action is reached (prefetch 0) pays the transfer
    # from there: the gpipe list has rF0.1 after F1.0, so it posts at 2.6 and arrives 3.1
    late = simulate(per_rank, [1.0, 1.0], [2.0, 2.0], p2p_s=0.5, comm="irecv", send_s=0.1,
                    prefetch=0)
    assert _ends(late)[(1, "rF0.1<0")] == (2.6, 3.1)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                                    ("breadth-first", 2)])
def test_irecv_without_transfer_costs_reaches_the_dataflow_bound(name, v):
    """Nothing waits on a receive's position: with free transfers every compute starts when
    its rank is free and its input exists, so the makespan is the dataflow one."""
    from autopar.schedules import dataflow_times
    per_rank = make_schedule(name, 2, v, 5)
    f, b = [1.0] * (2 * v), [2.0] * (2 * v)
    res = simulate(per_rank, f, b, comm="irecv")
    ops = [[(a.kind, a.chunk, a.mb) for a in acts if a.kind in ("F", "B")] for acts in per_rank]
    bound = max(e for _, e in dataflow_times(ops, 2 * v, (1.0, 2.0)).values())
    assert res.makespan_s == pytest.approx(bound)
    assert res.makespan_s <= simulate(per_rank, f, b, blocking=False).makespan_s + 1e-9
    assert len(res.events) == sum(len(r) for r in per_rank)   # every action appears once


def test_fit_recovers_a_synthetic_irecv_timeline():
    per_rank = make_schedule("interleaved-1f1b", 2, 2, 4)
    fwd, bwd = [0.007, 0.006, 0.008, 0.009], [0.015, 0.013, 0.016, 0.018]
    truth = simulate(per_rank, fwd, bwd, p2p_s=4e-4, comm="irecv", send_s=2e-4)
    events = [(e.rank, str(e.action), 50.0 + e.start_s, 50.0 + e.end_s) for e in truth.events]
    fit = fit_measured(events, 2, 2, comm="irecv")
    assert fit["fwd_s"] == pytest.approx(fwd) and fit["bwd_s"] == pytest.approx(bwd)
    assert fit["p2p_s"] == pytest.approx(4e-4, rel=1e-3)
    resim = simulate(per_rank, **fit, comm="irecv")
    assert resim.idle_fraction == pytest.approx(measured_idle_fraction(events, 2), rel=1e-3)
    with pytest.raises(ValueError, match="comm='nccl'"):
        fit_measured(events, 2, 2, comm="nccl")
