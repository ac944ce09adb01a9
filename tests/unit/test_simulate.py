"""Simulator tests: textbook bubbles from the same action lists the runtime executes."""
import pytest

from autopar.cost.simulate import simulate
from autopar.schedules import make_schedule
from autopar.timeline import draw_timeline


def _sim(name, p, v, m, f=1.0, b=2.0, blocking=True, **kw):
    C = p * v
    return simulate(make_schedule(name, p, v, m, times_fb=(f, b)), [f] * C, [b] * C,
                    blocking=blocking, **kw)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 3), (4, 4), (4, 7), (8, 8), (8, 20)])
@pytest.mark.parametrize("blocking", [True, False])
def test_bubble_gpipe_1f1b(name, p, m, blocking):
    r = _sim(name, p, 1, m, blocking=blocking)
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))   # of the makespan
    assert r.bubble_over_compute == pytest.approx((p - 1) / m)         # papers' t_pb / t_id
    assert r.makespan_s == pytest.approx((m + p - 1) * 3.0)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (8, 4, 16), (2, 3, 6), (8, 2, 16)])
@pytest.mark.parametrize("fb", [(1.0, 2.0), (1.0, 1.0)])
def test_bubble_interleaved_and_breadth_first(p, v, m, fb):
    for name in ("interleaved-1f1b", "breadth-first"):
        r = _sim(name, p, v, m, *fb, blocking=False)
        assert r.bubble_over_compute == pytest.approx((p - 1) / (v * m)), name
        assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1)), name
    # breadth-first keeps the textbook bubble under blocking (rendezvous) send/recv too;
    # interleaved can only lose to it
    bf = _sim("breadth-first", p, v, m, *fb)
    il = _sim("interleaved-1f1b", p, v, m, *fb)
    print(f"p={p} v={v} m={m} f:b={fb}: blocking bubble breadth-first "
          f"{bf.bubble_over_compute:.4f}, interleaved {il.bubble_over_compute:.4f}, "
          f"formula {(p - 1) / (v * m):.4f}")
    assert bf.bubble_over_compute == pytest.approx((p - 1) / (v * m))
    assert il.bubble_over_compute >= bf.bubble_over_compute - 1e-12


def test_interleaved_beats_1f1b():
    assert (_sim("interleaved-1f1b", 4, 2, 8, blocking=False).bubble_fraction
            < _sim("1f1b", 4, 1, 8).bubble_fraction)


def test_p2p_and_reduce():
    r0 = _sim("1f1b", 4, 1, 8)
    r1 = _sim("1f1b", 4, 1, 8, p2p_s=0.1)
    assert r1.makespan_s > r0.makespan_s
    assert all(x > 0 for x in r1.p2p_s)
    # breadth-first reductions overlap the remaining backward: only the last chunk's is exposed
    bf = _sim("breadth-first", 2, 2, 4, reduce_s=1.0)
    bf0 = _sim("breadth-first", 2, 2, 4)
    assert bf.makespan_s <= bf0.makespan_s + 1.0 + 1e-9
    assert sum(e.action.kind == "REDUCE" for e in bf.events) == 4


def test_events_and_timeline(tmp_path):
    r = _sim("interleaved-1f1b", 2, 2, 4, p2p_s=0.05)
    assert all(e.end_s >= e.start_s for e in r.events)
    assert sum(e.action.kind in ("F", "B") for e in r.events) == 2 * 4 * 4
    path = draw_timeline(r.events, 2, str(tmp_path / "t.png"), title="interleaved")
    assert (tmp_path / "t.png").stat().st_size > 1000 and path.endswith("t.png")
    # measured events from the runtime may carry action strings
    draw_timeline([(0, "F0.0", 0.0, 1.0), (1, "B1.0", 1.0, 3.0)], 2, str(tmp_path / "m.png"))


def test_bad_times():
    s = make_schedule("1f1b", 2, 1, 2)
    with pytest.raises(ValueError, match="fwd_s has 1 entries"):
        simulate(s, [1.0], [2.0, 2.0])


def test_plan_timeline(tmp_path):
    from autopar.plan import Plan, Prediction, Stage
    stages = tuple(Stage(chunk=c, rank=c % 2, first_layer=2 * c, last_layer=2 * c + 2,
                         embedding=c == 0, head=c == 3) for c in range(4))
    pred = Prediction(step_time_s=1.0, tflops_per_gpu=1.0, mfu=0.1, bubble_fraction=0.1,
                      memory_bytes_per_gpu=1.0, compute_s=0.9, tp_comm_s=0.0, pp_comm_s=0.0,
                      dp_comm_s=0.0, bubble_s=0.1)
    plan = Plan(t=1, p=2, d=1, v=2, micro_batch_size=1, num_microbatches=4,
                schedule="breadth-first", recompute="none", sequence_parallel=False, zero=0,
                stages=stages, predicted=pred, global_batch_size=4, seq_len=8, cluster="local-cpu")
    from autopar.timeline import plan_timeline
    out = plan_timeline(plan, str(tmp_path / "plan.png"))
    assert (tmp_path / "plan.png").stat().st_size > 1000 and out.endswith("plan.png")


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (2, 3, 6), (8, 2, 16)])
def test_textbook_bubbles_under_the_runtimes_irecv_model(p, v, m):
    """comm="irecv" (pre-posted receives, what the gloo executor does) with free transfers
    reaches the papers' bubble for every schedule, on the same lists."""
    C = p * v
    for name in ("interleaved-1f1b", "breadth-first"):
        r = simulate(make_schedule(name, p, v, m), [1.0] * C, [2.0] * C, comm="irecv")
        assert r.bubble_over_compute == pytest.approx((p - 1) / (v * m)), name
    for name in ("gpipe", "1f1b"):
        r = simulate(make_schedule(name, p, 1, m), [1.0] * p, [2.0] * p, comm="irecv")
        assert r.bubble_over_compute == pytest.approx((p - 1) / m), name


def test_timeline_is_bounded_and_its_legend_lists_what_is_drawn(tmp_path):
    """At 48 pipeline ranks the PNG stays bounded (≤ 24 × 12 in at 110 dpi), and the legend
    holds only the kinds drawn (no p2p / reduce when none takes time) plus the local-chunk
    shades when v > 1."""
    from matplotlib.patches import Patch
    from PIL import Image

    from autopar.schedules import make_schedule
    from autopar.timeline import _legend
    p, v = 48, 2
    per_rank = make_schedule("interleaved-1f1b", p, v, p)
    r = simulate(per_rank, [1.0] * (p * v), [2.0] * (p * v))
    path = draw_timeline(r.events, p, str(tmp_path / "big.png"))
    w, h = Image.open(path).size
    assert w <= 24 * 110 and h <= 12 * 110, (w, h)
    labels = [h.get_label() for h in _legend({"F", "B"}, v, Patch)]
    assert labels == ["forward", "backward", "local chunk 0", "local chunk 1"]
    assert "p2p" in [h.get_label() for h in _legend({"F", "P2P"}, 1, Patch)]


def _sends_after_computes(acts):
    """One rank's list with each SEND moved right after its compute."""
    sends = {a.message(): a for a in acts if a.kind.startswith("SEND")}
    out = []
    for a in acts:
        if not a.kind.startswith("SEND"):
            out.append(a)
            if a.kind in ("F", "B") and (a.kind, a.chunk, a.mb) in sends:
                out.append(sends[(a.kind, a.chunk, a.mb)])
    return out


def test_isend_modes_send_right_after_the_compute():
    """The executor issues a compute's isend right after it, wherever the list places the SEND
    (schedules.eager_sends); comm="isend"/"irecv" time that: the same makespan as the list with
    its sends moved there. On benchmarks/pipeline.py's uneven cut [1, 2, 4, 1] (a layer F 5.8 /
    B 12 ms, the head 45 ms) in torch's order a SEND trails its compute, and sending it at
    its place would cost the consumer the compute between."""
    from autopar.schedules import eager_sends, interleaved_1f1b
    acts = interleaved_1f1b(2, 2, 4)
    assert any(eager_sends(r) for r in acts)
    x = [1, 2, 4, 1]
    fwd = [5.8 * n + (15.0 if c == 3 else 0) + (1.3 if c == 0 else 0) for c, n in enumerate(x)]
    bwd = [12.0 * n + (30.1 if c == 3 else 0) + (2.6 if c == 0 else 0) for c, n in enumerate(x)]
    moved = [_sends_after_computes(r) for r in acts]
    assert not any(eager_sends(r) for r in moved)
    for comm in ("isend", "irecv"):
        got = simulate(acts, fwd, bwd, 0.1, comm=comm, send_s=1.0).makespan_s
        assert got == pytest.approx(
            simulate(moved, fwd, bwd, 0.1, comm=comm, send_s=1.0, check=False).makespan_s)
    # rendezvous keeps the list's places (a blocking send cannot move): slower here
    late = simulate(acts, fwd, bwd, 0.1, comm="blocking").makespan_s
    assert simulate(acts, fwd, bwd, 0.1, comm="irecv").makespan_s < late
