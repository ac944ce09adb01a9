"""ZeRO-3 for breadth-first (issue 6), pure: the gather/release/reduce-scatter plan on schedule
lists (golden strings, per-chunk counts independent of m, prefetch, why not depth-first). The
gloo numerics of a stack driven by this plan are in tests/numerics/test_zero3.py."""
import pytest

from autopar.runtime.zero3 import (GATHER, REDUCE_SCATTER, RELEASE, format_with_gathers,
                                   max_gathered, plan_gathers)
from autopar.schedules import breadth_first, interleaved_1f1b

DIMS = [(1, 4, 3), (2, 2, 2), (2, 2, 5), (2, 4, 3), (4, 2, 4)]


# ---- pure: the plan ----------------------------------------------------------------------
def test_golden_one_rank():
    assert format_with_gathers(breadth_first(1, 2, 2)[0]) == (
        "AG0 F0.0 AG1 F0.1 FREE0 F1.0 F1.1 FREE1 AG1 B1.0 AG0 B1.1 RS1 FREE1 R1 "
        "B0.0 B0.1 RS0 FREE0 R0")
    assert format_with_gathers(breadth_first(1, 2, 2)[0], keep_turn=True) == (
        "AG0 F0.0 AG1 F0.1 FREE0 F1.0 F1.1 B1.0 AG0 B1.1 RS1 FREE1 R1 B0.0 B0.1 RS0 FREE0 R0")


def test_golden_two_ranks():
    sched = breadth_first(2, 2, 2)
    assert format_with_gathers(sched[1]) == (
        "AG1 rF0.0<0 F1.0 rF0.1<0 sF1.0>0 AG3 F1.1 FREE1 sF1.1>0 rF2.0<0 F3.0 rF2.1<0 F3.1 "
        "FREE3 AG3 B3.0 sB3.0>0 AG1 B3.1 RS3 FREE3 R3 rB2.0<0 sB3.1>0 B1.0 sB1.0>0 rB2.1<0 "
        "B1.1 RS1 FREE1 R1 sB1.1>0")


def _simulate(actions, plan):
    """Walk the merged program: every compute finds its chunk gathered, no double gathers,
    reduce-scatters only after the chunk's last backward. Returns per-chunk op counts."""
    at: dict[int, list] = {}
    for i, op, c in plan:
        at.setdefault(i, []).append((op, c))
    live, counts, done_b = set(), {}, {}
    last_b = {a.chunk: n for n, a in enumerate(actions) if a.kind == "B"}
    for n in range(len(actions) + 1):
        for op, c in at.get(n, []):
            counts[(op, c)] = counts.get((op, c), 0) + 1
            if op == GATHER:
                assert c not in live, f"double gather of {c} before #{n}"
                live.add(c)
            elif op == RELEASE:
                assert c in live, f"release of ungathered {c} before #{n}"
                live.discard(c)
            else:
                assert done_b.get(c) == last_b[c], f"RS{c} before its last backward"
        if n < len(actions) and actions[n].kind in ("F", "B"):
            assert actions[n].chunk in live, f"{actions[n]} runs on released weights"
            if actions[n].kind == "B":
                done_b[actions[n].chunk] = n
    assert not live, f"chunks {live} still gathered at the end of the step"
    return counts


@pytest.mark.parametrize("p,v,m", DIMS)
@pytest.mark.parametrize("keep_turn", [False, True])
def test_plan_counts(p, v, m, keep_turn):
    for r, acts in enumerate(breadth_first(p, v, m)):
        plan = plan_gathers(acts, keep_turn=keep_turn)
        counts = _simulate(acts, plan)
        chunks = [k * p + r for k in range(v)]
        top = chunks[-1]
        for c in chunks:   # one gather per pass (the turn chunk's kept with keep_turn)
            want = 1 if keep_turn and c == top else 2
            assert counts[(GATHER, c)] == want and counts[(RELEASE, c)] == want
            assert counts[(REDUCE_SCATTER, c)] == 1
        assert sum(counts.values()) == (5 * v - 2 * keep_turn)
        assert max_gathered(acts, plan) <= 2
        # independent of m: the same plan ops for twice the micro-batches
        ops2 = [(op, c) for _, op, c in plan_gathers(breadth_first(p, v, 2 * m)[r],
                                                      keep_turn=keep_turn)]
        assert ops2 == [(op, c) for _, op, c in plan]


def test_prefetch_overlaps_one_compute():
    acts = breadth_first(1, 3, 4)[0]
    for i, op, c in plan_gathers(acts):
        if op != GATHER or i == 0:
            continue
        nxt = next(a for a in acts[i:] if a.kind in ("F", "B"))
        # a prefetch is issued before the previous pass's last compute (or, at the top
        # chunk's turn, right at its own pass start)
        assert nxt.chunk != c or acts[i - 1].kind == "F" and acts[i - 1].chunk == c


def test_depth_first_gathers_per_visit():
    """The same plan on an interleaved list gathers a chunk once per micro-batch group visit:
    why ZeRO-3 goes with breadth-first (2106.02679 §4.2)."""
    p, v, m = 2, 2, 8
    bf = plan_gathers(breadth_first(p, v, m)[0])
    il = plan_gathers(interleaved_1f1b(p, v, m)[0])
    gathers = lambda plan: sum(op == GATHER for _, op, _ in plan)  # noqa: E731
    assert gathers(bf) == 2 * v
    assert gathers(il) > 2 * gathers(bf)
