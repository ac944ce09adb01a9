"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it runs.

Chunks are numbered globally 0..C−1 (C = p·v) and chunk c lives on pipeline rank c mod p.
An action is one of (compact string in brackets, c = chunk, i = micro-batch, q = peer rank):

    F   forward of chunk c on micro-batch i                        [F{c}.{i}]
    B   backward of chunk c on micro-batch i                       [B{c}.{i}]
    W   weight-gradient part of that backward (zero-bubble lists)  [W{c}.{i}]
    SEND_F / RECV_F  chunk c's output activation of micro-batch i  [sF{c}.{i}>{q} / rF{c}.{i}<{q}]
    SEND_B / RECV_B  gradient w.r.t. chunk c's input, micro-batch i [sB{c}.{i}>{q} / rB{c}.{i}<{q}]
    REDUCE  start the data-parallel gradient reduction of chunk c   [R{c}]

A message is named by its producer on both sides: rank 0 runs `sF0.3>1` and rank 1 runs
`rF0.3<0` (chunk 0's output of micro-batch 3, consumed by chunk 1's forward). Chunks on the
same rank hand off locally (no action), which only happens for p = 1.

Zero-bubble lists (`interleaved_zb`, "interleaved-zb"; 2401.10241's B/W split): when a list
contains W actions, B{c}.{i} is only the gradient w.r.t. chunk c's input (what the previous
stage waits for) and W{c}.{i}, later on the same rank and without messages, computes the
weight gradients of chunk c for micro-batch i. Either every B of a schedule has its W or none
has (then B is the whole backward, as in every other schedule). A micro-batch of a chunk stays
in flight (its activations alive) until its W. `interleaved_zb` keeps interleaved_1f1b's F/B
order (1F1B's for v = 1: ZB-H1) and places each W by a list-scheduling simulation (where the
rank would otherwise wait, or when it holds as many un-W'ed micro-batches as rank 0 of the
F/B order ever holds; the rest at the end of the step). Its messages keep one global order
(deadlock-free as below) but are placed where the producing rank is free, which is what
asynchronous sends (cost.simulate comm="isend"/"irecv", the runtime) want; under fully blocking
send/recv with other than the ordering times the ranks can lose time to the rendezvous.

    >>> print(format_schedule(interleaved_zb(2, 1, 2)))
    rank 0: F0.0 sF0.0>1 F0.1 sF0.1>1 rB1.0<1 B0.0 W0.0 rB1.1<1 B0.1 W0.1
    rank 1: rF0.0<0 F1.0 rF0.1<0 B1.0 sB1.0>0 F1.1 B1.1 sB1.1>0 W1.0 W1.1

Blocking semantics (what `autopar.schedule_checks.validate` checks; the strictest a runtime
can impose): a send and its matching receive complete together (rendezvous); a rank blocked in
one of them does nothing else. The gloo runtime (autopar/runtime/executor.py) is looser: sends
are isends (issued right after their compute: `eager_sends`) and receives are irecvs posted
ahead of their RECV action and waited for by the consuming F/B, so every wait of the runtime
is also a wait under rendezvous and a list valid here cannot deadlock there; the RECV
positions then no longer cost time (cost.simulate comm="irecv" times exactly that). Computes
never block once their inputs were received. REDUCE is asynchronous (it is issued and
overlaps what follows). Every generator here orders each rank's sends/receives by one global
message order, so the lists are deadlock-free under rendezvous whatever the real compute
times are: the smallest unfinished message in that order always has both ends at their heads.
The global order comes from a dataflow simulation of the compute order with forward/backward
times `times_fb` (default 1 and 2 units): each message is placed at the instant in [producer
end, consumer start] where the rendezvous waits least (zero where neither rank is inside a
compute). With those times and zero p2p cost, gpipe, 1f1b and breadth-first then lose nothing
to the rendezvous; interleaved 1F1B can (its neighbours' compute edges need not line up), and
with asynchronous sends (cost.simulate blocking=False) every schedule reaches its dataflow
bubble when simulated with the same `times_fb`.

    >>> print(format_schedule(one_f_one_b(2, 2)))
    rank 0: F0.0 sF0.0>1 F0.1 sF0.1>1 rB1.0<1 B0.0 rB1.1<1 B0.1
    rank 1: rF0.0<0 F1.0 rF0.1<0 B1.0 sB1.0>0 F1.1 B1.1 sB1.1>0
"""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "breadth-first", "interleaved-zb")
# schedules whose backward is split into B (input gradients) and W (weight gradients)
SPLIT_BACKWARD = ("interleaved-zb",)
# schedules that run N consecutive micro-batches per chunk visit (Plan.microbatch_group)
GROUPED = ("interleaved-1f1b", "interleaved-zb")
COMPUTE = ("F", "B", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE + COMM + ("REDUCE",)

# Default durations used only to derive the global message order (backward ≈ 2× forward FLOPs,
# 2104.04473 §5.1); the order is deadlock-free for any real durations.
_ORDER_F, _ORDER_B = 1, 2


@dataclass(frozen=True, order=True)
class Action:
    """One step of a rank's program. `mb` is -1 and `peer` -1 where they do not apply."""
    kind: str
    chunk: int
    mb: int = -1
    peer: int = -1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action.kind={self.kind!r}: must be one of {KINDS}")

    def __str__(self) -> str:
        if self.kind in COMPUTE:
            return f"{self.kind}{self.chunk}.{self.mb}"
        if self.kind == "REDUCE":
            return f"R{self.chunk}"
        direction, kind = self.kind.split("_")
        arrow = ">" if direction == "SEND" else "<"
        return f"{direction[0].lower()}{kind}{self.chunk}.{self.mb}{arrow}{self.peer}"

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM

    def message(self) -> tuple[str, int, int]:
        """The message a send/recv carries: ('F' | 'B', producing chunk, micro-batch)."""
        return (self.kind[-1], self.chunk, self.mb)


_ACTION_RE = re.compile(r"^(?:([FBW])(\d+)\.(\d+)|R(\d+)|([sr])([FB])(\d+)\.(\d+)([<>])(\d+))$")


def parse_action(text: str) -> Action:
    """Inverse of `str(action)`: 'F0.3', 'B1.0', 'W1.0', 'sF0.3>1', 'rB2.0<0', 'R1'."""
    m = _ACTION_RE.match(text.strip())
    if not m:
        raise ValueError(f"cannot parse action {text!r}: expected F{{c}}.{{i}}, B{{c}}.{{i}}, "
                         f"W{{c}}.{{i}}, sF{{c}}.{{i}}>{{peer}}, rF{{c}}.{{i}}<{{peer}}, sB…, "
                         f"rB… or R{{c}}")
    g = m.groups()
    if g[0]:
        return Action(g[0], int(g[1]), int(g[2]))
    if g[3]:
        return Action("REDUCE", int(g[3]))
    direction = "SEND" if g[4] == "s" else "RECV"
    if (g[8] == ">") != (direction == "SEND"):
        raise ValueError(f"action {text!r}: sends point to their peer with '>', "
                         f"receives from their peer with '<'")
    return Action(f"{direction}_{g[5]}", int(g[6]), int(g[7]), int(g[9]))


def format_schedule(per_rank: Sequence[Sequence[Action]]) -> str:
    """One line per rank: 'rank r: A A A ...'. Round-trips through `parse_schedule`."""
    return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(per_rank))


def parse_schedule(text: str) -> list[list[Action]]:
    """Inverse of `format_schedule`; ranks must be listed as 0, 1, 2, ... in order."""
    out: list[list[Action]] = []
    for line in (ln for ln in text.strip().splitlines() if ln.strip()):
        head, _, body = line.partition(":")
        if not head.strip().startswith("rank") or head.split()[-1] != str(len(out)):
            raise ValueError(f"schedule line {line!r}: expected 'rank {len(out)}: ...'")
        out.append([parse_action(tok) for tok in body.split()])
    return out


# ----- compute orders (what each rank computes, in order) ---------------------------------
Op = tuple[str, int, int]  # ('F' | 'B' | 'W', chunk, micro-batch)


# schedules whose compute order is defined for fewer micro-batches than pipeline ranks (the
# pipeline never fills; torch.distributed.pipelining accepts it for GPipe, interleaved and looped
# BFS too)
FEWER_MICROBATCHES_THAN_RANKS = ("gpipe", "1f1b", "interleaved-1f1b", "breadth-first")


def _check_dims(p: int, v: int, m: int, name: str) -> None:
    for label, value in (("p", p), ("v", v), ("m", m)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {label}={value!r} must be a positive integer")
    if m < p and name not in FEWER_MICROBATCHES_THAN_RANKS:
        raise ValueError(f"{name}: m={m} micro-batches < p={p} pipeline ranks; this schedule "
                         f"needs the pipeline to fill. Use at least p micro-batches (raise the "
                         f"global batch or lower the micro-batch size), a smaller p, or one of "
                         f"{FEWER_MICROBATCHES_THAN_RANKS}")


def check_group(p: int, m: int, group: int | None, name: str = "interleaved-1f1b") -> None:
    """ValueError unless `group` (N, micro-batches per chunk visit) is None (the default: p) or
    p <= N <= m with N dividing m (Megatron-Core's microbatch_group_size_per_vp_stage rule)."""
    if group is None:
        return
    if not isinstance(group, int) or isinstance(group, bool) or not p <= group <= m \
            or m % group:
        raise ValueError(
            f"{name}: microbatch_group={group!r} with p={p}, m={m}: a group of N consecutive "
            f"micro-batches per chunk needs p <= N <= m and N dividing m (each group must fill "
            f"the pipeline; groups are equal); use a divisor of {m} in [{p}, {m}], e.g. "
            f"{min(d for d in range(max(p, 1), m + 1) if m % d == 0) if p <= m else m}, or None "
            f"(N = p, Megatron's order)")


def _gpipe_ops(p: int, m: int, ranks: Iterable[int] | None = None) -> list[list[Op]]:
    return [[("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
            for r in (range(p) if ranks is None else ranks)]


def _one_f_one_b_ops(p: int, m: int, ranks: Iterable[int] | None = None) -> list[list[Op]]:
    out = []
    for r in (range(p) if ranks is None else ranks):
        warmup = min(p - r - 1, m)
        ops = [("F", r, i) for i in range(warmup)]
        for k in range(m - warmup):  # steady state: one forward, one backward
            ops += [("F", r, warmup + k), ("B", r, k)]
        ops += [("B", r, i) for i in range(m - warmup, m)]
        out.append(ops)
    return out


def _microbatch_groups(p: int, m: int, group: int | None = None) -> list[range]:
    """Split micro-batches 0..m−1 into the consecutive groups that visit one chunk together.

    group = N: m/N groups of N (check_group: p <= N <= m, N | m). N = p is Megatron-Core's
    interleaved order, N = m runs every micro-batch on a chunk before the next chunk (the
    breadth-first end of the family, Llama 3's tunable N in between).
    group = None: Megatron's order for any m: ⌊m/p⌋ near-equal groups (larger first; one group
    of m when m < p). Megatron-Core needs m % p == 0 (groups of exactly p). For other m, each
    group must stay at least p wide (so the pipeline fills: a chunk's first micro-batch comes
    back from rank p−1 in time) and no later group may be wider than the first (the warmup
    (v−1)·g₀ must cover every group's lag between a micro-batch's forward and backward on the
    last chunk). Near-equal groups meet both; a short last group (Megatron-Core's table for
    m % p ≠ 0) or one absorbing the remainder does not: both fail the validator for some
    (p, v, m). For m % p == 0 this is Megatron's order exactly.
    """
    if group is not None:
        return [range(k, k + group) for k in range(0, m, group)]
    n = max(1, m // p)
    base, extra = divmod(m, n)
    bounds = [0]
    for k in range(n):
        bounds.append(bounds[-1] + base + (k < extra))
    return [range(bounds[k], bounds[k + 1]) for k in range(n)]


def first_group_size(p: int, m: int, group: int | None = None) -> int:
    """g₀, the size of the first micro-batch group of the interleaved orders: what their
    warm-up (and so the micro-batches a rank holds) is made of (`_microbatch_groups`' first,
    in closed form: the cost model asks for it per rank of every configuration it prices)."""
    if m < 1:
        return len(_microbatch_groups(p, m, group)[0])
    if group is not None:
        return group
    base, extra = divmod(m, max(1, m // p))
    return base + (extra > 0)


def _interleaved_ops(p: int, v: int, m: int, group: int | None = None, hop: int = 2,
                     ranks: Iterable[int] | None = None) -> list[list[Op]]:
    """Megatron-Core's interleaved order: forwards visit local chunks group by group, backwards
    in reverse; rank r warms up with hop·(p−r−1) + (v−1)·g₀ forwards (g₀: the first group's
    size), capped at m·v, then alternates forward and backward. hop = 2 for interleaved 1F1B;
    hop = 1 for the zero-bubble order (torch's ScheduleInterleavedZeroBubble: the W's fill
    what the shorter warm-up leaves idle, so ranks hold fewer micro-batches)."""
    groups = _microbatch_groups(p, m, group)
    fwd_table = [(k, i) for g in groups for k in range(v) for i in g]        # (local chunk, mb)
    bwd_table = [(v - 1 - k, i) for k, i in fwd_table]
    total = m * v
    out = []
    for r in (range(p) if ranks is None else ranks):
        warmup = min((p - r - 1) * hop + (v - 1) * len(groups[0]), total)
        fwd = [("F", k * p + r, i) for k, i in fwd_table]
        bwd = [("B", k * p + r, i) for k, i in bwd_table]
        ops = fwd[:warmup]
        for k in range(total - warmup):
            ops += [fwd[warmup + k], bwd[k]]
        ops += bwd[total - warmup:]
        out.append(ops)
    return out


def _place_weight_grads(ops: list[list[Op]], C: int, times: Sequence[Sequence[float]],
                        bound: Sequence[int]) -> list[list[Op]]:
    """Insert W c.i after each B c.i of the F/B orders `ops` (zero-bubble, 2401.10241) by a
    list-scheduling simulation with durations `times[c]` = (F, input-gradient B, W) of chunk
    c (equal chunks: one triple repeated).

    At each instant a free rank, in this priority: (1) runs its oldest deferred W if its next
    action is an F and it holds bound[r] chunk-micro-batches whose W has not run (the memory
    bound: F's run minus W's run never exceeds bound[r]); (2) runs its next F/B if that
    action's inputs are there; (3) otherwise runs its oldest deferred W (filling the wait);
    (4) otherwise waits. After its last F/B it flushes the remaining W's. A deferred W always
    exists in case (1): the F/B order keeps F's minus B's below bound[r] before each F.
    """
    dur = [_durations(t) for t in times]
    p = len(ops)
    end: dict[Op, float] = {}
    free = [0.0] * p
    pos = [0] * p
    live = [0] * p                          # F's run − W's run on the rank
    pending: list[list[Op]] = [[] for _ in range(p)]
    out: list[list[Op]] = [[] for _ in range(p)]
    t = 0.0
    while any(pos[r] < len(ops[r]) or pending[r] for r in range(p)):
        for r in range(p):
            if free[r] > t:
                continue
            nxt = ops[r][pos[r]] if pos[r] < len(ops[r]) else None
            ready = nxt is not None and all(end.get(d, float("inf")) <= t for d in _deps(nxt, C))
            if nxt is not None and nxt[0] == "F" and live[r] >= bound[r]:
                if not pending[r]:
                    raise AssertionError(f"rank {r}: in-flight bound {bound[r]} reached with "
                                         f"no deferred W before {nxt}")
                op = pending[r].pop(0)
            elif ready:
                op = nxt
                pos[r] += 1
            elif pending[r]:
                op = pending[r].pop(0)
            else:
                continue  # waits for data
            end[op] = free[r] = t + dur[op[1]][op[0]]
            out[r].append(op)
            if op[0] == "F":
                live[r] += 1
            elif op[0] == "B":
                pending[r].append(("W",) + op[1:])
            else:
                live[r] -= 1
        later = [x for x in free if x > t]   # every end after t is a rank's free time
        if not later:
            if any(pos[r] < len(ops[r]) or pending[r] for r in range(p)):
                raise ValueError(f"compute order cannot make progress at t={t}")
            break
        t = min(later)
    return out


def _breadth_first_ops(p: int, v: int, m: int,
                       ranks: Iterable[int] | None = None) -> list[list[Op]]:
    out = []
    for r in (range(p) if ranks is None else ranks):
        chunks = [k * p + r for k in range(v)]
        ops = [("F", c, i) for c in chunks for i in range(m)]
        ops += [("B", c, i) for c in reversed(chunks) for i in range(m)]
        out.append(ops)
    return out


# ----- communication placement ------------------------------------------------------------
def _deps(op: Op, C: int) -> list[Op]:
    kind, c, i = op
    if kind == "F":
        return [("F", c - 1, i)] if c > 0 else []
    if kind == "W":
        return [("B", c, i)]
    return [("F", c, i)] + ([("B", c + 1, i)] if c < C - 1 else [])


def _durations(times: Sequence[float]) -> dict[str, float]:
    """(F, B) or (F, B, W) durations by kind; B is the input-gradient part when W is given."""
    if not (len(times) in (2, 3) and all(x > 0 for x in times)):
        raise ValueError(f"times={tuple(times)!r}: expected (forward, backward) or (forward, "
                         f"input-gradient backward, weight-gradient backward) durations > 0")
    return dict(zip("FBW", times))


def dataflow_times(ops: list[list[Op]], C: int,
                   times_fb: Sequence[float] = (_ORDER_F, _ORDER_B)) -> dict[Op, tuple]:
    """{op: (start, end)} of every compute when each rank runs its `ops` (per rank, the
    compute order as (kind, chunk, micro-batch) tuples) in order, waiting only for its data
    (no message costs); durations `times_fb`: (F, B) or (F, B, W). C is the chunk count p·v.
    The largest end is the dataflow bound of that compute order."""
    dur = _durations(times_fb)
    times: dict[Op, tuple[int, int]] = {}
    pos, clock = [0] * len(ops), [0] * len(ops)
    progressed = True
    while progressed:
        progressed = False
        for r, rank_ops in enumerate(ops):
            while pos[r] < len(rank_ops):
                op = rank_ops[pos[r]]
                deps = _deps(op, C)
                if any(d not in times for d in deps):
                    break
                start = max([clock[r]] + [times[d][1] for d in deps])
                end = start + dur[op[0]]
                times[op], clock[r], pos[r] = (start, end), end, pos[r] + 1
                progressed = True
    stuck = {r: rank_ops[pos[r]] for r, rank_ops in enumerate(ops) if pos[r] < len(rank_ops)}
    if stuck:
        raise ValueError(f"compute order cannot make progress; ranks wait at {stuck}")
    return times


class _Busy:
    """Compute intervals of one rank, to ask 'is this rank inside a compute at time t?'."""

    def __init__(self, intervals: Iterable[tuple[int, int]]):
        iv = sorted(intervals)
        self.starts = [s for s, _ in iv]
        self.ends = [e for _, e in iv]

    def wait(self, t: int) -> int:
        """How long a rendezvous at t waits for this rank to finish the compute it is in."""
        k = bisect.bisect_left(self.starts, t) - 1  # last interval starting strictly before t
        return max(0, self.ends[k] - t) if k >= 0 else 0

    def boundaries(self, lo: int, hi: int) -> list[int]:
        a, b = bisect.bisect_left(self.starts, lo), bisect.bisect_right(self.starts, hi)
        c, d = bisect.bisect_left(self.ends, lo), bisect.bisect_right(self.ends, hi)
        return self.starts[a:b] + self.ends[c:d]


def _with_comms(ops: list[list[Op]], p: int, v: int, reduce: bool,
                times_fb: Sequence[float]) -> list[list[Action]]:
    """Actions of the compute orders `ops` with their messages (one global, deadlock-free
    order, see the module docstring). times_fb: (F, B) durations, or (F, B, W) for lists
    with W actions (B then the input-gradient part)."""
    C = p * v
    has_w = any(op[0] == "W" for rank_ops in ops for op in rank_ops)
    if len(_durations(times_fb)) != (3 if has_w else 2):
        raise ValueError(f"times_fb={tuple(times_fb)!r}: expected (forward, backward) durations"
                         f"{', and the weight-gradient one for W actions' if has_w else ''}")
    times = dataflow_times(ops, C, tuple(times_fb))
    busy = [_Busy(times[op] for op in rank_ops) for rank_ops in ops]
    keyed: list[list[tuple]] = [[] for _ in range(p)]
    for r, rank_ops in enumerate(ops):
        for op in rank_ops:
            keyed[r].append((times[op][0], 1, 0, 0, 0, Action(*op)))
    if p > 1:
        for (kind, c, i), (_, prod_end) in times.items():
            if kind == "W":
                continue  # weight gradients stay on their rank
            dst_chunk = c + 1 if kind == "F" else c - 1
            if not 0 <= dst_chunk < C:
                continue
            src, dst = c % p, dst_chunk % p
            consumer = ("F", dst_chunk, i) if kind == "F" else ("B", dst_chunk, i)
            cons_start = times[consumer][0]
            cands = sorted({prod_end, cons_start, *busy[src].boundaries(prod_end, cons_start),
                            *busy[dst].boundaries(prod_end, cons_start)})
            # the instant where the rendezvous waits least (0 where both ranks are between
            # computes); blocking send/recv cannot always reach 0 when compute edges interleave
            # zero-bubble lists (W fills the gaps, so both ranks are rarely idle at once):
            # first never let the send land after the consumer's start (a send placed inside
            # one of the producer's computes goes out at that compute's end), then wait least
            at, best = cons_start, None
            for t in cands:  # sorted: the first zero-wait instant wins
                ws, wd = busy[src].wait(t), busy[dst].wait(t)
                w = ((ws, wd) if has_w else (0, ws + wd))
                if best is None or w < best:
                    at, best = t, w
                    if w == (0, 0):
                        break
            order = (at, 0, 0 if kind == "F" else 1, c, i)  # one global order of messages
            keyed[src].append(order + (Action("SEND_" + kind, c, i, dst),))
            keyed[dst].append(order + (Action("RECV_" + kind, c, i, src),))
    per_rank = [[k[-1] for k in sorted(keyed[r], key=lambda k: k[:-1])] for r in range(p)]
    return [_add_reduces(acts) for acts in per_rank] if reduce else per_rank


def _add_reduces(acts: list[Action]) -> list[Action]:
    """R{c} right after chunk c's last B (its last W in a zero-bubble list: the gradients of
    chunk c are final only then)."""
    last = "W" if any(a.kind == "W" for a in acts) else "B"
    last_b = {a.chunk: n for n, a in enumerate(acts) if a.kind == last}
    after = {n: c for c, n in last_b.items()}
    out = []
    for n, a in enumerate(acts):
        out.append(a)
        if n in after:
            out.append(Action("REDUCE", after[n]))
    return out


# ----- public generators ------------------------------------------------------------------
def gpipe(p: int, m: int, *, reduce: bool = False,
          times_fb: tuple[float, float] = (_ORDER_F, _ORDER_B)) -> list[list[Action]]:
    """GPipe: all forwards (micro-batches 0..m−1), then all backwards in the same order."""
    _check_dims(p, 1, m, "gpipe")
    return _with_comms(_gpipe_ops(p, m), p, 1, reduce, times_fb)


def one_f_one_b(p: int, m: int, *, reduce: bool = False,
          times_fb: tuple[float, float] = (_ORDER_F, _ORDER_B)) -> list[list[Action]]:
    """1F1B (PipeDream-Flush, 2104.04473 §2.2.1): rank r warms up with p−r−1 forwards, then
    alternates one forward and one backward, then drains the remaining backwards."""
    _check_dims(p, 1, m, "1f1b")
    return _with_comms(_one_f_one_b_ops(p, m), p, 1, reduce, times_fb)


def interleaved_1f1b(p: int, v: int, m: int, *, group: int | None = None,
                     reduce: bool = False,
                     times_fb: tuple[float, float] = (_ORDER_F, _ORDER_B)) -> list[list[Action]]:
    """Interleaved 1F1B (2104.04473 §2.2.2) in Megatron-Core's order: micro-batches in groups
    of N (`group`; default p) run on one local chunk, then the next; backward visits local
    chunks in reverse. Rank r warms up with 2(p−r−1) + (v−1)·g₀ forwards (g₀ = size of the
    first group: N, or p when p | m), capped at m·v, then alternates forward/backward. A larger
    N keeps more micro-batches in flight (rank 0: 2(p−1) + (v−1)·N + 1) and leaves more time
    between a message's send and its use (Llama 3's tunable N; N = m is the breadth-first end).
    Without a group, m need not divide by p: the micro-batches form ⌊m/p⌋ near-equal groups
    (see `_microbatch_groups`); m < p is allowed (the pipeline never fills)."""
    _check_dims(p, v, m, "interleaved-1f1b")
    check_group(p, m, group)
    return _with_comms(_interleaved_ops(p, v, m, group), p, v, reduce, times_fb)


def interleaved_zb(p: int, v: int, m: int, *, group: int | None = None, reduce: bool = False,
                   times: Sequence[Any] = (_ORDER_F, _ORDER_B / 2, _ORDER_B / 2),
                   max_inflight: Sequence[int] | int | None = None) -> list[list[Action]]:
    """Zero-bubble interleaved 1F1B: 2401.10241's split of each backward into B (input
    gradient, what the previous stage waits for) and W (weight gradient, which nothing waits
    for) on the interleaved order (v = 1: 1F1B's order, i.e. ZB-H1).

    F/B order: `interleaved_1f1b`'s table (groups of `group` micro-batches per chunk) with the
    warm-up of torch's ScheduleInterleavedZeroBubble, (p−r−1) + (v−1)·g₀ forwards instead of
    2(p−r−1) + (v−1)·g₀: the W's fill what the shorter warm-up leaves idle. Each W c.i comes
    after its B c.i, placed by `_place_weight_grads` with durations `times` = (F, B, W)
    (default 1, 1, 1 as in the paper: the dX and dW GEMMs have equal FLOPs): a W runs where the
    rank would otherwise wait for its next input (warm-up gaps, the cool-down) or when the
    rank reaches its in-flight bound; the rest are flushed at the end.
    Memory: a chunk-micro-batch is in flight from its F to its W, and the bound `max_inflight`
    (per rank or one number; default: the most this F/B order itself keeps between F and B on
    any rank, (v−1)·g₀ + p = v·p for g₀ = p — torch's bound) is never exceeded: p−1 fewer than
    interleaved 1F1B's rank 0 holds (2(p−1) + (v−1)·p + 1). With `reduce`, R{c} follows chunk
    c's last W."""
    _check_dims(p, v, m, "interleaved-zb")
    check_group(p, m, group, "interleaved-zb")
    per_chunk = _per_chunk_triples(times, p * v)
    ops = _interleaved_ops(p, v, m, group, hop=1) if v > 1 else _one_f_one_b_ops(p, m)
    floor = [_peak_live(rank_ops, "B") for rank_ops in ops]
    if max_inflight is None:
        bound = [max(floor)] * p
    elif isinstance(max_inflight, int):
        bound = [max_inflight] * p
    else:
        bound = list(max_inflight)
    if len(bound) != p or any(not isinstance(b, int) or b < 1 for b in bound):
        raise ValueError(f"interleaved-zb: max_inflight={max_inflight!r}: one positive "
                         f"integer or one per rank (p={p})")
    if any(b < f for b, f in zip(bound, floor)):
        raise ValueError(f"interleaved-zb: max_inflight={bound} is below what its F/B order "
                         f"itself keeps in flight ({floor})")
    zb = _place_weight_grads(ops, p * v, per_chunk, bound)
    # the messages are ordered by one chunk's times (the heaviest forward's)
    return _with_comms(zb, p, v, reduce, max(per_chunk, key=lambda x: x[0]))


def _per_chunk_triples(times: Sequence[Any], C: int) -> list[tuple[float, float, float]]:
    """interleaved_zb's `times`: one (F, B, W) triple for every chunk, or one per chunk (C of
    them: uneven chunks, an embedding-only first one, a heavy head)."""
    per_chunk = [tuple(times)] if times and not isinstance(times[0], Sequence) \
        else [tuple(t) for t in times]
    if len(per_chunk) == 1:
        per_chunk = per_chunk * C
    if len(per_chunk) != C or any(len(_durations(t)) != 3 for t in per_chunk):
        raise ValueError(f"interleaved-zb: times={tuple(times)!r}: expected (forward, "
                         f"input-gradient backward, weight-gradient backward) durations, one "
                         f"triple or one per chunk ({C})")
    return per_chunk


def breadth_first(p: int, v: int, m: int, *, reduce: bool = True,
                  times_fb: tuple[float, float] = (_ORDER_F, _ORDER_B)) -> list[list[Action]]:
    """Breadth-first / layered gradient accumulation (2106.02679, 2211.05953): each rank runs a
    chunk's forward for all micro-batches before its next chunk, and in backward all
    micro-batches of a chunk before the chunk below. With `reduce`, R{c} follows chunk c's last
    backward so its data-parallel reduction overlaps the rest of the backward."""
    _check_dims(p, v, m, "breadth-first")
    return _with_comms(_breadth_first_ops(p, v, m), p, v, reduce, times_fb)


def _check_schedule(name: str, p: int, v: int, group: int | None) -> None:
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"schedule {name!r}: must be one of {SCHEDULE_NAMES}")
    if name in ("gpipe", "1f1b") and v != 1:
        raise ValueError(f"schedule {name!r} with v={v}: one chunk per rank only; use "
                         f"'interleaved-1f1b', 'interleaved-zb' or 'breadth-first' for v > 1, "
                         f"or set v=1")
    if group is not None and name not in GROUPED:
        raise ValueError(f"schedule {name!r} with microbatch_group={group}: only the "
                         f"interleaved schedules {GROUPED} take a micro-batch group; set it "
                         f"to None")


def zb_weight_times(fwd: Sequence[float], bwd: Sequence[float]) -> list[float]:
    """W of every chunk from its forward and backward: the forward's time (the weight-gradient
    GEMMs have the forward's FLOPs; cost/step.py's bubble_div), at most the backward; chunk 0's
    whole backward — it receives no input to send a gradient back for, so its B does nothing
    and its W runs all of it (autopar.runtime.split_backward)."""
    return [b if c == 0 else min(f, b) for c, (f, b) in enumerate(zip(fwd, bwd))]


def zb_chunk_times(chunk_times: Sequence[tuple[float, float]]
                   ) -> list[tuple[float, float, float]]:
    """(F, B, W) per chunk from (forward, backward): W as `zb_weight_times`, B the rest of the
    backward; a time recorded as 0, or a B left empty, gets a positive stand-in (a tenth of
    the least positive time)."""
    least = min((x for fb in chunk_times for x in fb if x > 0), default=1.0) / 10
    fwd = [max(f, least) for f, _ in chunk_times]
    bwd = [max(b, 2 * least) for _, b in chunk_times]
    return [(f, max(b - w, least), max(min(w, b - least), least))
            for f, b, w in zip(fwd, bwd, zb_weight_times(fwd, bwd))]


def make_schedule(name: str, p: int, v: int, m: int, *, group: int | None = None,
                  reduce: bool | None = None,
                  times_fb: tuple[float, float] = (_ORDER_F, _ORDER_B),
                  chunk_times: Sequence[tuple[float, float]] | None = None
                  ) -> list[list[Action]]:
    """Dispatch on a Plan schedule name. `group`: N micro-batches per chunk visit, for the
    interleaved schedules only (None: p). `reduce=None` emits R{c} only for breadth-first.
    `times_fb`: (forward, backward) time of a chunk, only used to order the messages (and,
    for interleaved-zb, to place the W's: B and W each take half the backward).
    `chunk_times`: (forward, backward) of every chunk (`zb_chunk_times`: a Plan's stages
    record them), by which interleaved-zb places its W's instead — W the forward's time, as
    the step formula prices it — so that they fill the waits uneven chunks leave (an
    embedding-only first chunk's cool-down); the other schedules ignore it."""
    _check_schedule(name, p, v, group)
    red = (name == "breadth-first") if reduce is None else reduce
    if name == "gpipe":
        return gpipe(p, m, reduce=red, times_fb=times_fb)
    if name == "1f1b":
        return one_f_one_b(p, m, reduce=red, times_fb=times_fb)
    if name == "interleaved-1f1b":
        return interleaved_1f1b(p, v, m, group=group, reduce=red, times_fb=times_fb)
    if name in SPLIT_BACKWARD:  # input-gradient and weight-gradient halves of the backward
        if chunk_times is not None:
            return interleaved_zb(p, v, m, group=group, reduce=red,
                                  times=zb_chunk_times(chunk_times))
        f, b = times_fb
        return interleaved_zb(p, v, m, group=group, reduce=red, times=(f, b / 2, b / 2))
    return breadth_first(p, v, m, reduce=red, times_fb=times_fb)


def eager_sends(actions: Sequence[Action]) -> dict[int, int]:
    """For each F / B of one rank's list whose SEND comes later in the list, the SEND's
    position: where a runtime whose sends never block (isend) issues that send right after its
    compute instead (autopar/runtime/executor.py; cost.simulate's "isend" / "irecv"). The
    lists place each message for rendezvous semantics by a dataflow of equal chunk times
    (`_with_comms`), so on an uneven cut a SEND can trail its compute by another compute."""
    at = {}
    for n, a in enumerate(actions):
        if a.kind in ("F", "B"):
            at[(a.kind, a.chunk, a.mb)] = n
    out = {}
    for n, a in enumerate(actions):
        if a.kind in ("SEND_F", "SEND_B"):
            src = at.get(a.message())
            if src is not None and src < n - 1:
                out[src] = n
    return out


def compute_order(name: str, p: int, v: int, m: int, *, group: int | None = None,
                  ranks: Sequence[int] | None = None,
                  chunk_times: Sequence[tuple[float, float]] | None = None
                  ) -> list[list[Action]]:
    """Each rank's computes in the order `make_schedule`'s lists run them, without the
    messages (cheap: no dataflow placement), for analyses of what a rank computes when (the
    weight-gather plan the cost model counts, autopar.weight_gathers). `ranks`: only these
    pipeline ranks' lists, in that order (default: all). `chunk_times`: as `make_schedule`'s
    (interleaved-zb places its W's by them, as the runtime does from a Plan's stages)."""
    _check_schedule(name, p, v, group)
    _check_dims(p, v, m, name)
    ranks = list(range(p) if ranks is None else ranks)
    if name in SPLIT_BACKWARD:      # W placement needs the list-scheduling simulation
        acts = make_schedule(name, p, v, m, group=group, chunk_times=chunk_times)
        return [[a for a in acts[r] if a.kind in COMPUTE] for r in ranks]
    return [[Action(*op) for op in rank_ops]
            for rank_ops in compute_ops(name, p, v, m, group=group, ranks=ranks)]


def compute_ops(name: str, p: int, v: int, m: int, *, group: int | None = None,
                ranks: Sequence[int] | None = None) -> list[list[Op]]:
    """`compute_order` as (kind, chunk, micro-batch) tuples, for the schedules whose F/B order
    needs no simulation (not SPLIT_BACKWARD): what the cost model's weight-gather statistics
    walk per priced configuration, without building an Action per compute."""
    _check_schedule(name, p, v, group)
    _check_dims(p, v, m, name)
    if name in SPLIT_BACKWARD:
        raise ValueError(f"compute_ops: schedule {name!r} places its W's by simulation; use "
                         f"compute_order for it")
    ranks = list(range(p) if ranks is None else ranks)
    check_group(p, m, group)
    return {"gpipe": lambda: _gpipe_ops(p, m, ranks),
            "1f1b": lambda: _one_f_one_b_ops(p, m, ranks),
            "interleaved-1f1b": lambda: _interleaved_ops(p, v, m, group, ranks=ranks),
            "breadth-first": lambda: _breadth_first_ops(p, v, m, ranks)}[name]()


# ----- memory in flight ---------------------------------------------------------------
def _peak_live(ops: Iterable, until: str, weight: Callable[[int], float] = lambda c: 1,
               pending: Callable[[int], float] = lambda c: 0) -> float:
    """The most of Σ weight(c) over the pairs F run and `until` not yet, plus (until = "W")
    Σ pending(c) over the pairs B run and W not yet."""
    live = peak = 0
    for op in ops:
        kind, chunk = (op.kind, op.chunk) if isinstance(op, Action) else (op[0], op[1])
        if kind == "F":
            live += weight(chunk)
        elif kind == until:
            live -= weight(chunk) + (pending(chunk) if until == "W" else 0)
        elif kind == "B":                   # until = "W": the pair's W is still to come
            live += pending(chunk)
        peak = max(peak, live)
    return peak


def peak_inflight(per_rank: Sequence[Sequence[Action]]) -> list[int]:
    """Per rank, the most (chunk, micro-batch) pairs whose forward has run and backward not —
    the number of chunk activations held at once (for v = 1: micro-batches; 1F1B: p − r).
    In a list with W actions a pair stays in flight until its W (the weight gradient still
    needs the saved inputs)."""
    has_w = any(a.kind == "W" for acts in per_rank for a in acts)
    return [_peak_live(acts, "W" if has_w else "B") for acts in per_rank]


def peak_held(per_rank: Sequence[Sequence[Action]], chunk_weight: Sequence[float],
              pending_weight: Sequence[float] | None = None) -> list[float]:
    """Per rank, the most of Σ chunk_weight[c] over the (chunk c, micro-batch) pairs held at
    once (held as in `peak_inflight`: from the F until the B, or the W in a list with W's),
    plus, in a list with W's, Σ pending_weight[c] over the pairs whose B has run and W not
    (what the deferred weight gradient keeps besides the forward's activations). With
    chunk_weight[c] = the activation bytes chunk c saves per micro-batch this is the rank's
    activation peak under the schedule, chunks of unequal size included; with all weights 1
    and no pending weights it is `peak_inflight`."""
    has_w = any(a.kind == "W" for acts in per_rank for a in acts)
    pending = (pending_weight or [0.0] * len(chunk_weight)).__getitem__
    return [_peak_live(acts, "W" if has_w else "B", chunk_weight.__getitem__, pending)
            for acts in per_rank]
