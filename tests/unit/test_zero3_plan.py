"""Sharded weights (ZeRO-3 / FSDP), pure: the gather/release/reduce-scatter plan of
autopar.weight_gathers on schedule lists (breadth-first, interleaved with micro-batch groups,
1F1B): golden strings, a walk that checks every compute finds its weights, per-chunk counts,
prefetch leads. The gloo numerics of a stack driven by this plan are in
tests/numerics/test_zero3.py."""
import pytest

from autopar.schedules import breadth_first, interleaved_1f1b, one_f_one_b
from autopar.weight_gathers import (GATHER, REDUCE_SCATTER, RELEASE, format_with_gathers,
                                    gather_stats, plan_gathers)

DIMS = [(1, 4, 3), (2, 2, 2), (2, 2, 5), (2, 4, 3), (4, 2, 4)]


def test_golden_one_rank():
    # two chunks fit the two slots: each gathered once, the second prefetched under the first
    assert format_with_gathers(breadth_first(1, 2, 2)[0]) == (
        "AG0 AG1 F0.0 F0.1 F1.0 F1.1 B1.0 B1.1 RS1 FREE1 R1 B0.0 B0.1 RS0 FREE0 R0")
    # one slot: chunk 0 is released after its forward pass and gathered again for its backward
    assert format_with_gathers(breadth_first(1, 2, 2)[0], keep=1) == (
        "AG0 F0.0 F0.1 FREE0 AG1 F1.0 F1.1 B1.0 B1.1 RS1 FREE1 R1 AG0 B0.0 B0.1 RS0 FREE0 R0")


def test_golden_two_ranks():
    sched = breadth_first(2, 2, 2)
    assert format_with_gathers(sched[1]) == (
        "rF0.0<0 AG1 AG3 F1.0 rF0.1<0 sF1.0>0 F1.1 sF1.1>0 rF2.0<0 F3.0 rF2.1<0 F3.1 B3.0 "
        "sB3.0>0 B3.1 RS3 FREE3 R3 rB2.0<0 sB3.1>0 B1.0 sB1.0>0 rB2.1<0 B1.1 RS1 FREE1 R1 "
        "sB1.1>0")


def _simulate(actions, plan, keep):
    """Walk the merged program: every compute finds its chunk gathered, no double gathers, at
    most `keep` gathered at once, a chunk released after backward computes is reduced first,
    every backward's gradients are reduced by the end. Returns per-chunk op counts."""
    at: dict[int, list] = {}
    for i, op, c in plan:
        at.setdefault(i, []).append((op, c))
    live, counts, pending = set(), {}, set()
    for n in range(len(actions) + 1):
        for op, c in at.get(n, []):
            counts[(op, c)] = counts.get((op, c), 0) + 1
            if op == GATHER:
                assert c not in live, f"double gather of {c} before #{n}"
                live.add(c)
                assert len(live) <= keep, f"{sorted(live)} gathered at once before #{n}"
            elif op == RELEASE:
                assert c in live, f"release of ungathered {c} before #{n}"
                assert c not in pending, f"FREE{c} before #{n} drops unreduced gradients"
                live.discard(c)
            else:
                assert c in pending, f"RS{c} before #{n} with no new gradients"
                pending.discard(c)
        if n < len(actions) and actions[n].kind in ("F", "B"):
            assert actions[n].chunk in live, f"{actions[n]} runs on released weights"
            if actions[n].kind == "B":
                pending.add(actions[n].chunk)
    assert not live, f"chunks {live} still gathered at the end of the step"
    assert not pending, f"chunks {pending} end the step with unreduced gradients"
    return counts


@pytest.mark.parametrize("p,v,m", DIMS)
@pytest.mark.parametrize("keep", [1, 2, 4])
def test_breadth_first_plan_counts(p, v, m, keep):
    """Breadth-first: each chunk once per pass, except what the slots keep across the
    forward→backward turn (keep 2: the two top chunks, 2v − 2 gathers for v >= 2; keep >= v:
    every chunk once); one reduce-scatter per chunk; the same plan for any m."""
    for r, acts in enumerate(breadth_first(p, v, m)):
        plan = plan_gathers(acts, keep=keep)
        counts = _simulate(acts, plan, keep)
        chunks = [k * p + r for k in range(v)]
        gathers = sum(counts.get((GATHER, c), 0) for c in chunks)
        assert gathers == (v if keep >= v else 2 * v - min(keep, v))
        assert all(counts[(REDUCE_SCATTER, c)] == 1 for c in chunks)
        ops2 = [(op, c) for _, op, c in plan_gathers(breadth_first(p, v, 2 * m)[r], keep=keep)]
        assert ops2 == [(op, c) for _, op, c in plan]


def test_prefetch_overlaps_the_previous_pass():
    """A breadth-first chunk's gather is issued a whole pass (m computes) before its first
    compute, except the step's first one (and none for the chunks the turn keeps)."""
    st = gather_stats(breadth_first(1, 4, 6)[0])
    assert st.gather_leads == (0, 6, 6, 6, 6, 6)
    assert st.reduce_leads == (6, 6, 6, 0)    # each under the next chunk's pass, last exposed
    assert (st.peak_gathered, st.peak_pending) == (2, 1)


@pytest.mark.parametrize("p,v,m", [(2, 2, 8), (4, 2, 16), (2, 3, 6), (2, 4, 16)])
def test_interleaved_gathers_per_group_visit(p, v, m):
    """Interleaved orders (ZeRO-3 under 1F1B-style schedules): a chunk is gathered once per
    visit of a group of N micro-batches, so a wider group gathers less; the plan stays valid
    (the walk above) at two slots; with every chunk kept (zero=2) one gather per chunk."""
    counts = []
    for group in [None] + [n for n in (2 * p, m) if m % n == 0 and n > p]:
        for r, acts in enumerate(interleaved_1f1b(p, v, m, group=group)):
            _simulate(acts, plan_gathers(acts), 2)
            keep_all = plan_gathers(acts, keep=v)
            c = _simulate(acts, keep_all, v)
            assert all(c[(GATHER, k * p + r)] == 1 for k in range(v))
        counts.append(gather_stats(interleaved_1f1b(p, v, m, group=group)[0]).gathers)
        assert counts[-1] <= 2 * v * m // (group or p) + v
    assert counts == sorted(counts, reverse=True)
    assert gather_stats(one_f_one_b(4, 8)[0]).gathers == 1      # one chunk: kept all step


def _stats_from_plan(actions, plan):
    """GatherStats read off a plan's list (how gather_stats read them before it counted them
    during the walk): each gather's lead to its chunk's next compute, each reduce-scatter's
    computes until the next, the most chunks gathered and holding unreduced gradients."""
    done = [0]
    for a in actions:
        done.append(done[-1] + (a.kind in ("F", "B")))
    gathers, reduces, live, most, pending, peak = [], [], set(), 0, set(), 0
    for n, op, c in plan:
        if op == GATHER:
            use = next(i for i in range(n, len(actions))
                       if actions[i].kind in ("F", "B") and actions[i].chunk == c)
            gathers.append(done[use] - done[n])
            live.add(c)
            most = max(most, len(live))
        elif op == RELEASE:
            live.discard(c)
        else:
            reduces.append(n)
    at = {}
    for n, op, c in plan:
        at.setdefault(n, []).append((op, c))
    for n in range(len(actions) + 1):
        pending -= {c for op, c in at.get(n, ()) if op == REDUCE_SCATTER}
        if n < len(actions) and actions[n].kind == "B":
            pending.add(actions[n].chunk)
            peak = max(peak, len(pending))
    leads = [done[b] - done[a] for a, b in zip(reduces, reduces[1:] + [len(actions)])]
    return tuple(gathers), tuple(leads), most, peak


@pytest.mark.parametrize("name, p, v, m, group", [
    ("breadth-first", 2, 3, 4, None), ("interleaved-1f1b", 2, 3, 4, None),
    ("interleaved-1f1b", 2, 2, 8, 4), ("interleaved-1f1b", 3, 4, 6, None), ("1f1b", 4, 1, 6, None)])
def test_counted_stats_match_the_plan(name, p, v, m, group):
    """The cost model's path (compute_gather_stats on compute_ops tuples, counted during the
    walk) gives what the plan's list says, on full action lists (messages included) and for
    every slot count."""
    from autopar.schedules import compute_ops, make_schedule
    from autopar.weight_gathers import compute_gather_stats
    ops = compute_ops(name, p, v, m, group=group)
    for r, acts in enumerate(make_schedule(name, p, v, m, group=group)):
        for keep in (1, 2, v + 1):
            st = compute_gather_stats([o[1] for o in ops[r]], [o[0] for o in ops[r]], keep=keep)
            want = _stats_from_plan(acts, plan_gathers(acts, keep=keep))
            assert (st.gather_leads, st.reduce_leads, st.peak_gathered, st.peak_pending) == want
            assert gather_stats(acts, keep=keep) == st


@pytest.mark.parametrize("name, p, v, group", [
    ("1f1b", 4, 1, None), ("interleaved-1f1b", 2, 3, None), ("interleaved-1f1b", 4, 2, 4),
    ("breadth-first", 2, 3, None), ("interleaved-zb", 2, 2, None), ("gpipe", 2, 1, None)])
def test_long_schedules_extrapolated_exactly(name, p, v, group):
    """The cost model's gather counts of a long schedule, extrapolated from three short walks
    (weight_gathers.extrapolated), equal the whole walk's, at every ZeRO slot count; below
    four periods past the start it walks."""
    from dataclasses import replace as dc_replace
    from autopar.cost.dp_terms import _walked_counts, weight_gather_stats
    from autopar.weight_gathers import extrapolated
    cfg = _config(name, p, v, group)
    period = p * (group or 1)
    for zero in (2, 3):
        for m in (period * 40, period * 40 + period * 13, period * 97):
            c = dc_replace(cfg, zero=zero, num_microbatches=m)
            walked = _walked_counts(c, m)
            calls = []
            got = extrapolated(lambda k: calls.append(k) or _walked_counts(c, k), m, period,
                               64 + period)
            assert got == walked == weight_gather_stats(c), (zero, m)
            assert len(calls) == 3 and max(calls) < m
    c = dc_replace(cfg, num_microbatches=4 * period)
    assert extrapolated(lambda k: _walked_counts(c, k), 4 * period, period, 64 + period) is None


def _config(name, p, v, group):
    from autopar.cost.config import Config
    return Config(t=1, p=p, d=2, v=v, micro_batch_size=1, num_microbatches=8 * p,
                  schedule=name, recompute="none", zero=3, microbatch_group=group)


@pytest.mark.parametrize("name, p, v, group", [
    ("interleaved-1f1b", 2, 3, None), ("interleaved-1f1b", 4, 2, 4), ("breadth-first", 2, 3, None),
    ("interleaved-zb", 2, 2, None)])
def test_long_schedules_activation_peaks_extrapolated(name, p, v, group):
    """The activation peak of a long schedule from three short walks (cost/memory.py
    _extrapolated_peaks) equals the whole walk's: constant after a depth-first warm-up,
    growing with m breadth-first."""
    from autopar.cost.memory import _extrapolated_peaks
    from autopar.schedules import compute_order, peak_held
    weight, pending = [1.5 + c for c in range(p * v)], [0.25 * c for c in range(p * v)]
    period = p * (group or 1)

    def peaks(m):
        return peak_held(compute_order(name, p, v, m, group=group), weight, pending)
    for m in (period * 40, period * 53):
        got = _extrapolated_peaks(peaks, m, period, 64 + period)
        assert got == pytest.approx(peaks(m), rel=1e-12), m
