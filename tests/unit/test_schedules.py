"""Pure tests of the schedules-as-data module: golden strings, validator, round trips."""
import pytest

from autopar.schedules import (Action, SCHEDULE_NAMES, breadth_first, format_schedule, gpipe,
                               interleaved_1f1b, interleaved_zb, make_schedule, one_f_one_b,
                               parse_action,
                               parse_schedule, peak_inflight)
from autopar.schedule_checks import validate

# Golden strings, written from the definitions (module docstring) and checked by hand:
# compute order from the schedule's rule; each message placed where both ranks are between
# computes in the F=1, B=2 dataflow timeline; ties broken forward-messages first, then chunk.
GOLDEN = {
    ("1f1b", 2, 1, 3): """
rank 0: F0.0 sF0.0>1 F0.1 sF0.1>1 rB1.0<1 B0.0 F0.2 sF0.2>1 rB1.1<1 B0.1 rB1.2<1 B0.2
rank 1: rF0.0<0 F1.0 rF0.1<0 B1.0 sB1.0>0 F1.1 B1.1 rF0.2<0 sB1.1>0 F1.2 B1.2 sB1.2>0""",
    ("gpipe", 2, 1, 2): """
rank 0: F0.0 sF0.0>1 F0.1 sF0.1>1 rB1.0<1 B0.0 rB1.1<1 B0.1
rank 1: rF0.0<0 F1.0 rF0.1<0 F1.1 B1.0 sB1.0>0 B1.1 sB1.1>0""",
    ("interleaved-1f1b", 2, 2, 4): """
rank 0: F0.0 sF0.0>1 F0.1 sF0.1>1 rF1.0<1 F2.0 rF1.1<1 sF2.0>1 F2.1 sF2.1>1 F0.2 sF0.2>1 rB3.0<1 B2.0 F0.3 sF0.3>1 sB2.0>1 rB3.1<1 B2.1 rF1.2<1 F2.2 sF2.2>1 rB1.0<1 sB2.1>1 B0.0 rF1.3<1 F2.3 sF2.3>1 rB1.1<1 B0.1 rB3.2<1 B2.2 sB2.2>1 rB3.3<1 B2.3 rB1.2<1 sB2.3>1 B0.2 rB1.3<1 B0.3
rank 1: rF0.0<0 F1.0 rF0.1<0 sF1.0>0 F1.1 sF1.1>0 rF2.0<0 F3.0 rF2.1<0 B3.0 rF0.2<0 sB3.0>0 F3.1 B3.1 rF0.3<0 rB2.0<0 sB3.1>0 F1.2 sF1.2>0 B1.0 rF2.2<0 sB1.0>0 rB2.1<0 F1.3 sF1.3>0 B1.1 rF2.3<0 sB1.1>0 F3.2 B3.2 sB3.2>0 F3.3 B3.3 rB2.2<0 sB3.3>0 B1.2 sB1.2>0 rB2.3<0 B1.3 sB1.3>0""",
    ("breadth-first", 2, 2, 2): """
rank 0: F0.0 sF0.0>1 F0.1 sF0.1>1 rF1.0<1 F2.0 rF1.1<1 sF2.0>1 F2.1 sF2.1>1 rB3.0<1 B2.0 sB2.0>1 rB3.1<1 B2.1 R2 rB1.0<1 sB2.1>1 B0.0 rB1.1<1 B0.1 R0
rank 1: rF0.0<0 F1.0 rF0.1<0 sF1.0>0 F1.1 sF1.1>0 rF2.0<0 F3.0 rF2.1<0 F3.1 B3.0 sB3.0>0 B3.1 R3 rB2.0<0 sB3.1>0 B1.0 sB1.0>0 rB2.1<0 B1.1 R1 sB1.1>0""",
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: "-".join(map(str, k)))
def test_golden(key):
    assert format_schedule(make_schedule(*key)) == GOLDEN[key].strip()


def test_compute_order_by_definition():
    # strip communication: the pure compute orders of the papers
    def compute(s):
        return [" ".join(str(a) for a in acts if a.kind in ("F", "B")) for acts in s]
    assert compute(one_f_one_b(3, 4)) == [
        "F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3",
        "F1.0 F1.1 B1.0 F1.2 B1.1 F1.3 B1.2 B1.3",
        "F2.0 B2.0 F2.1 B2.1 F2.2 B2.2 F2.3 B2.3"]
    assert compute(breadth_first(2, 2, 3, reduce=False))[1] == \
        "F1.0 F1.1 F1.2 F3.0 F3.1 F3.2 B3.0 B3.1 B3.2 B1.0 B1.1 B1.2"
    # m = 5, p = 2 is not a multiple: one group of 5 (⌊5/2⌋ = 2 groups of 3 and 2 would leave the
    # second narrower, fine; groups are near-equal and larger first)
    assert compute(interleaved_1f1b(2, 2, 5))[1].startswith("F1.0 F1.1 F1.2 F3.0 B3.0")


def _ms(p):
    return sorted({p, p + 1, 2 * p + 1, 3 * p, 4 * p})  # ends, a multiple, non-multiples


CASES = [(n, p, v, m) for n in SCHEDULE_NAMES for p in range(1, 9)
         for v in ((1,) if n in ("gpipe", "1f1b") else (1, 2, 3, 4)) for m in _ms(p)]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_schedule_validates(name):
    """p ≤ 8, v ≤ 4, m from p to 4p (both ends, around multiples of p, and odd sizes)."""
    for n, p, v, m in CASES:
        if n == name:
            s = make_schedule(n, p, v, m)
            validate(s, p, v, m)
            assert parse_schedule(format_schedule(s)) == s


def test_no_comm_when_one_rank():
    s = interleaved_1f1b(1, 3, 2)
    assert all(a.kind in ("F", "B") for a in s[0])
    validate(s, 1, 3, 2)


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 9), (8, 8), (8, 20)])
def test_peak_inflight_1f1b(p, m):
    assert peak_inflight(one_f_one_b(p, m)) == [p - r for r in range(p)]
    assert peak_inflight(gpipe(p, m)) == [m] * p
    assert peak_inflight(breadth_first(p, 2, m)) == [2 * m] * p


def test_round_trip_and_actions():
    for text in ("F0.3", "B1.0", "sF0.3>1", "rF0.3<0", "sB2.1>1", "rB2.1<2", "R3"):
        assert str(parse_action(text)) == text
    assert parse_action("sF0.3>1") == Action("SEND_F", 0, 3, 1)
    with pytest.raises(ValueError, match="cannot parse"):
        parse_action("X1")
    with pytest.raises(ValueError, match="'>'"):
        parse_action("sF0.3<1")
    s = breadth_first(3, 2, 4)
    assert parse_schedule(format_schedule(s)) == s


def test_bad_dims():
    # the zero-bubble order needs a full pipeline (its W placement fills the steady state)
    with pytest.raises(ValueError, match="m=1 micro-batches < p=2"):
        interleaved_zb(2, 1, 1)
    with pytest.raises(ValueError, match="microbatch_group=3 .* N dividing m"):
        interleaved_1f1b(2, 2, 8, group=3)
    with pytest.raises(ValueError, match="microbatch_group=1 .* p <= N"):
        make_schedule("interleaved-zb", 2, 2, 8, group=1)
    with pytest.raises(ValueError, match="only the interleaved schedules"):
        make_schedule("breadth-first", 2, 2, 8, group=4)
    with pytest.raises(ValueError, match="one chunk per rank"):
        make_schedule("1f1b", 2, 2, 4)
    with pytest.raises(ValueError, match="must be one of"):
        make_schedule("zigzag", 2, 1, 4)


# ----- the validator catches each kind of error ------------------------------------------
def _broken(text):
    return parse_schedule(text)


GOOD = GOLDEN[("1f1b", 2, 1, 3)].strip()


def _edit(rank, old, new):
    lines = GOOD.splitlines()
    assert old in lines[rank]
    lines[rank] = lines[rank].replace(old, new, 1)
    return parse_schedule("\n".join(lines))


@pytest.mark.parametrize("rank,old,new,match", [
    (0, " B0.2", "", "missing action B0.2"),                                   # missing
    (0, "B0.2", "B0.2 B0.2", "duplicated action B0.2"),                       # duplicated
    (1, "sB1.2>0", "", r"needs both sB1.2>0 and rB1.2<1; found only rB1.2<1"), # unmatched recv
    (0, "sF0.2>1", "", "needs both sF0.2>1 and rF0.2<0; found only rF0.2<0"),  # unmatched send
    (1, "rF0.0<0 F1.0", "F1.0 rF0.0<0", "F1.0 runs before the forward of chunk 0 for micro-batch 0 has been received"),
    (0, "rB1.0<1 B0.0", "B0.0 rB1.0<1", "B0.0 runs before the backward of chunk 1"),
    (0, "F0.0 sF0.0>1", "sF0.0>1 F0.0", "sF0.0>1 runs before the F0.0 that produces it"),
    (0, "sF0.0>1", "sF0.0>0", "expected on rank 0 with peer 1"),                 # wrong peer
    (1, "F1.2 B1.2", "F2.2 B1.2", "chunk 2 outside 0..1"),
])
def test_validator_errors(rank, old, new, match):
    with pytest.raises(ValueError, match=match):
        validate(_edit(rank, old, new), 2, 1, 3)


def test_validator_backward_before_forward():
    s = parse_schedule("rank 0: B0.0 F0.0")
    with pytest.raises(ValueError, match="B0.0 runs before its forward F0.0"):
        validate(s, 1, 1, 1)


def test_validator_deadlock():
    # the classic 1F1B deadlock: rank 0 sends F0.2 while rank 1 sends B1.1, both blocking
    dead = _edit(1, "rF0.2<0 sB1.1>0", "sB1.1>0 rF0.2<0")
    with pytest.raises(ValueError, match=r"deadlock .*rank 0 waits at #7 sF0.2>1; "
                                         r"rank 1 waits at #7 sB1.1>0"):
        validate(dead, 2, 1, 3)
    # the same swap on both ranks pairs up again
    both = parse_schedule(GOOD.replace("sF0.2>1 rB1.1<1", "rB1.1<1 sF0.2>1")
                          .replace("rF0.2<0 sB1.1>0", "sB1.1>0 rF0.2<0"))
    validate(both, 2, 1, 3)


def test_validator_reduce():
    s = breadth_first(2, 2, 2)
    validate(s, 2, 2, 2)
    early = [[a for a in acts if a.kind != "REDUCE"] for acts in s]
    early[0].insert(0, Action("REDUCE", 0))
    early[0].append(Action("REDUCE", 2))
    early[1] += [Action("REDUCE", 1), Action("REDUCE", 3)]
    with pytest.raises(ValueError, match="chunk 0 still has 2 backward"):
        validate(early, 2, 2, 2)
    partial = [[a for a in acts if str(a) != "R0"] for acts in s]
    with pytest.raises(ValueError, match="REDUCE present for chunks"):
        validate(partial, 2, 2, 2)


# ----- fewer micro-batches than ranks; micro-batch groups ----------------------------------
@pytest.mark.parametrize("name,p,v,m", [
    ("gpipe", 4, 1, 2), ("1f1b", 4, 1, 3), ("interleaved-1f1b", 4, 2, 3),
    ("interleaved-1f1b", 8, 2, 1), ("breadth-first", 3, 3, 2)])
def test_fewer_microbatches_than_ranks_is_a_valid_schedule(name, p, v, m):
    """m < p: the pipeline never fills, but every micro-batch runs (torch.distributed.pipelining
    accepts it for GPipe, interleaved and looped BFS too)."""
    s = make_schedule(name, p, v, m)
    validate(s, p, v, m)
    assert sum(a.kind == "F" for acts in s for a in acts) == p * v * m


@pytest.mark.parametrize("p,v,m,N", [(2, 2, 8, 4), (2, 2, 8, 8), (4, 2, 16, 8), (3, 2, 12, 12)])
def test_microbatch_group_runs_n_consecutive_microbatches_per_chunk(p, v, m, N):
    """N micro-batches visit a chunk before the next chunk; rank 0 warms up with
    2(p−1) + (v−1)·N forwards and so holds that + 1 in flight (N = p: Megatron's order)."""
    s = interleaved_1f1b(p, v, m, group=N)
    validate(s, p, v, m)
    fwd0 = [(a.chunk, a.mb) for a in s[0] if a.kind == "F"]
    assert fwd0[:N] == [(0, i) for i in range(N)] and fwd0[N] == (p, 0)
    assert peak_inflight(s)[0] == min(2 * (p - 1) + (v - 1) * N + 1, m * v)
    assert interleaved_1f1b(p, v, m, group=p) == interleaved_1f1b(p, v, m)


@pytest.mark.parametrize("p,v,m,torch_bound", [(8, 2, 16, 16), (4, 2, 8, 8), (4, 3, 12, 12)])
def test_zero_bubble_holds_no_more_than_torchs_bound(p, v, m, torch_bound):
    """torch's ScheduleInterleavedZeroBubble keeps v·p micro-batches in flight on every rank
    (p=8 v=2 m=16: 16); interleaved-zb stays at or below it, p−1 fewer than interleaved
    1F1B's rank 0, at the same simulated step time as with the 1F1B warm-up (1:1:1 times)."""
    from autopar.cost.simulate import simulate
    zb = interleaved_zb(p, v, m)
    assert max(peak_inflight(zb)) <= torch_bound
    assert max(peak_inflight(interleaved_1f1b(p, v, m))) == torch_bound + p - 1
    C = p * v
    zb_s = simulate(zb, [1.0] * C, [2.0] * C, comm="async").makespan_s
    il_s = simulate(interleaved_1f1b(p, v, m), [1.0] * C, [2.0] * C, comm="async").makespan_s
    assert zb_s < il_s
