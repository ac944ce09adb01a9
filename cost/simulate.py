"""Time a pipeline schedule: the same per-rank action lists the runtime executes.

Semantics (the same as `autopar.schedules.validate` and the gloo runtime):
- each rank runs its list in order, one action at a time;
- F{c}.{i} / B{c}.{i} take fwd_s[c] / bwd_s[c] seconds and start as soon as the rank reaches
  them (their inputs were received by earlier actions of the same list);
- zero-bubble lists (with W actions, autopar.schedules.interleaved_zb): W{c}.{i} takes
  wgt_s[c] (default bwd_s[c] / 2: the weight-gradient GEMMs have the FLOPs of the
  input-gradient ones) and B{c}.{i} the rest of the backward, bwd_s[c] − wgt_s[c], so bwd_s is
  the whole backward for every schedule. Lists without W ignore wgt_s;
- blocking=True (default; gloo's blocking send/recv, what the validator assumes): a send and
  its matching receive are a rendezvous: the transfer starts when both ranks have reached them,
  takes p2p_s, and both ranks are blocked until it ends;
- blocking=False (asynchronous isend, as NCCL runtimes do): a send never blocks; the data
  arrives p2p_s after the send is issued and the receive waits for that arrival. The papers'
  bubble formulas assume this; under rendezvous a rank may also wait for its peer to finish a
  compute (interleaved 1F1B loses some time this way when compute edges of neighbours never
  line up);
- comm="isend" (what the gloo runtime, autopar/runtime/executor.py, really does): the sender
  posts an isend, is busy for send_s seconds (copy + enqueue) and goes on; gloo moves the bytes
  only once the receiver has posted its blocking recv (a rendezvous on the wire, not on the
  sender), so a receive ends at max(recv posted, send posted + send_s) + p2p_s: p2p_s is paid
  by every receive, even when the message was sent long before. Deadlock-free wherever
  blocking=True is (the sender never waits);
- comm="irecv" (the executor's default, async_recv=True): sends as in "isend"; every receive
  is an irecv posted `prefetch` actions before its RECV action (None: all of them when the step
  starts), so gloo moves the bytes while both ranks compute: the message arrives at
  max(recv posted, send posted + send_s) + p2p_s. The RECV action itself costs nothing; the
  wait (its event) happens right before the F/B that consumes the message, which starts at
  max(ready, arrival). Deadlock-free wherever blocking=True is (nothing waits on a receive
  being reached);
- overhead_s: Python dispatch time between consecutive actions of a rank (each action starts
  overhead_s after the previous one ends), for comparing with a measured timeline;
- R{c} (REDUCE) is asynchronous: it is queued on the rank's own communication stream when the
  rank reaches it, takes reduce_s, and never blocks compute; the step ends when the last
  compute, transfer or reduction ends.

Definitions in `SimResult`:
- busy_s[r]: compute (F, B and W) time of rank r; idle_s[r] = makespan_s − busy_s[r] (waiting
  and p2p transfers both count as idle);
- bubble_fraction = Σ idle / (p · makespan) = 1 − Σ busy / (p · makespan): the share of the
  step the ranks do not compute. GPipe/1F1B with equal chunks, p2p 0: (p−1)/(m+p−1);
- bubble_over_compute = Σ idle / Σ busy: the papers' bubble time fraction t_pb / t_id
  (2104.04473 §2.2): (p−1)/m for GPipe/1F1B, (p−1)/(v·m) for interleaved.

Events are `Event(rank, action, start_s, end_s)`, one per action (a transfer appears on both
ranks with the same interval); `autopar.timeline.draw_timeline` draws them, and the runtime
records measured events in the same form.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from autopar.schedules import Action, infer_dims, validate


class Event(NamedTuple):
    rank: int
    action: Action
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimResult:
    makespan_s: float
    busy_s: tuple[float, ...]
    idle_s: tuple[float, ...]
    p2p_s: tuple[float, ...]          # time each rank spent inside transfers (part of idle)
    bubble_fraction: float            # Σ idle / (p · makespan)
    bubble_over_compute: float        # Σ idle / Σ busy (the papers' t_pb / t_id)
    events: tuple[Event, ...]

    @property
    def idle_fraction(self) -> tuple[float, ...]:
        """Per rank: idle / makespan (what the runtime's measured timeline is compared with)."""
        return tuple(i / self.makespan_s if self.makespan_s else 0.0 for i in self.idle_s)


COMM_MODES = ("blocking", "async", "isend", "irecv")


def _per_chunk(name: str, values: Sequence[float], C: int) -> list[float]:
    vals = list(values)
    if len(vals) != C:
        raise ValueError(f"simulate: {name} has {len(vals)} entries; the schedule has {C} chunks "
                         f"(p·v), one time per chunk is needed")
    if any(x < 0 for x in vals):
        raise ValueError(f"simulate: {name}={vals} has a negative time")
    return vals


def _compute_times(per_rank: Sequence[Sequence[Action]], fwd_s, bwd_s, wgt_s,
                   C: int) -> dict[str, list[float]]:
    """Per kind ('F', 'B', 'W'), per chunk: the duration of that compute in `per_rank`."""
    fwd, bwd = _per_chunk("fwd_s", fwd_s, C), _per_chunk("bwd_s", bwd_s, C)
    if not any(a.kind == "W" for acts in per_rank for a in acts):
        return {"F": fwd, "B": bwd}
    if wgt_s is None:
        wgt = [b / 2 for b in bwd]
    elif isinstance(wgt_s, (int, float)):
        wgt = _per_chunk("wgt_s", [float(wgt_s)] * C, C)
    else:
        wgt = _per_chunk("wgt_s", wgt_s, C)
    if any(w > b for w, b in zip(wgt, bwd)):
        raise ValueError(f"simulate: wgt_s={wgt} exceeds bwd_s={bwd} for some chunk; bwd_s is "
                         f"the whole backward (B + W), wgt_s its weight-gradient part")
    return {"F": fwd, "B": [b - w for b, w in zip(bwd, wgt)], "W": wgt}


def simulate(per_rank: Sequence[Sequence[Action]], fwd_s: Sequence[float],
             bwd_s: Sequence[float], p2p_s: float = 0.0, reduce_s: float = 0.0, *,
             blocking: bool = True, comm: str | None = None, send_s: float = 0.0,
             overhead_s: float = 0.0, prefetch: int | None = None,
             wgt_s: Sequence[float] | None = None, check: bool = True) -> SimResult:
    """Event-simulate `per_rank` (validated first) with per-chunk micro-batch times.

    comm: "blocking" | "async" | "isend" (see the module docstring); None takes it from
    `blocking` ("blocking" when True, "async" when False). send_s applies to "isend" and
    "irecv", prefetch to "irecv" only. wgt_s: per chunk, the weight-gradient part of bwd_s
    (used only by lists with W actions; default bwd_s / 2). check=False skips the validation
    (autopar.schedules.validate) for lists already validated, e.g. the same lists timed with
    many different chunk times (cost/layout.py); an invalid list is then not caught and
    simulates to nonsense (the simulation still ends).
    """
    if check:
        validate(per_rank, *infer_dims(per_rank))
    if comm is None:
        comm = "blocking" if blocking else "async"
    if comm not in COMM_MODES:
        raise ValueError(f"simulate: comm={comm!r} is not one of {COMM_MODES}; use 'isend' for "
                         f"the gloo runtime (async send, blocking receive)")
    if comm == "irecv":
        return _simulate_irecv(per_rank, fwd_s, bwd_s, p2p_s, reduce_s, send_s, overhead_s,
                               prefetch, wgt_s)
    if comm == "isend":
        return _simulate_isend(per_rank, fwd_s, bwd_s, p2p_s, reduce_s, send_s, overhead_s,
                               wgt_s)
    blocking = comm == "blocking"
    p, v, m = infer_dims(per_rank)
    dur = _compute_times(per_rank, fwd_s, bwd_s, wgt_s, p * v)
    if p2p_s < 0 or reduce_s < 0:
        raise ValueError(f"simulate: p2p_s={p2p_s}, reduce_s={reduce_s} must be ≥ 0")
    pos, clock, stream = [0] * p, [0.0] * p, [0.0] * p
    busy, comm = [0.0] * p, [0.0] * p
    events: list[Event] = []
    arrival: dict[tuple[str, int, int], float] = {}
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while pos[r] < len(per_rank[r]):
                a = per_rank[r][pos[r]]
                if a.kind in dur:
                    d = dur[a.kind][a.chunk]
                    events.append(Event(r, a, clock[r], clock[r] + d))
                    clock[r] += d
                    busy[r] += d
                elif a.kind == "REDUCE":
                    start = max(clock[r], stream[r])
                    stream[r] = start + reduce_s
                    events.append(Event(r, a, start, stream[r]))
                elif not blocking:
                    key = a.message()
                    if a.kind.startswith("SEND"):
                        arrival[key] = clock[r] + p2p_s
                        events.append(Event(r, a, clock[r], arrival[key]))
                    elif key not in arrival:
                        break  # not sent yet
                    else:
                        start = max(clock[r], arrival[key] - p2p_s)
                        comm[r] += max(0.0, arrival[key] - start)
                        clock[r] = max(clock[r], arrival[key])
                        events.append(Event(r, a, start, clock[r]))
                else:
                    q = a.peer
                    b = per_rank[q][pos[q]] if pos[q] < len(per_rank[q]) else None
                    if b is None or not b.is_comm or b.peer != r or b.message() != a.message():
                        break  # the peer has not reached the matching action yet
                    start = max(clock[r], clock[q])
                    clock[r] = clock[q] = start + p2p_s
                    comm[r] += p2p_s
                    comm[q] += p2p_s
                    events += [Event(r, a, start, clock[r]), Event(q, b, start, clock[q])]
                    pos[q] += 1
                pos[r] += 1
                progressed = True
    return _result(p, clock, stream, busy, comm, events)


def _simulate_isend(per_rank: Sequence[Sequence[Action]], fwd_s: Sequence[float],
                    bwd_s: Sequence[float], p2p_s: float, reduce_s: float, send_s: float,
                    overhead_s: float, wgt_s: Sequence[float] | None = None) -> SimResult:
    """comm="isend": non-blocking sender (busy send_s), receive = rendezvous + p2p_s."""
    p, v, m = infer_dims(per_rank)
    dur = _compute_times(per_rank, fwd_s, bwd_s, wgt_s, p * v)
    if min(p2p_s, reduce_s, send_s, overhead_s) < 0:
        raise ValueError(f"simulate: p2p_s={p2p_s}, reduce_s={reduce_s}, send_s={send_s}, "
                         f"overhead_s={overhead_s} must all be ≥ 0")
    pos, clock, stream = [0] * p, [0.0] * p, [0.0] * p
    busy, comm = [0.0] * p, [0.0] * p
    events: list[Event] = []
    posted: dict[tuple[str, int, int], float] = {}   # message -> time its isend was posted
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while pos[r] < len(per_rank[r]):
                a = per_rank[r][pos[r]]
                start = clock[r] + (overhead_s if pos[r] else 0.0)
                if a.kind in dur:
                    d = dur[a.kind][a.chunk]
                    clock[r] = start + d
                    busy[r] += d
                elif a.kind == "REDUCE":
                    s0 = max(start, stream[r])
                    stream[r] = s0 + reduce_s
                    clock[r] = start
                    events.append(Event(r, a, s0, stream[r]))
                    pos[r] += 1
                    progressed = True
                    continue
                elif a.kind.startswith("SEND"):
                    clock[r] = start + send_s
                    posted[a.message()] = clock[r]
                    comm[r] += send_s
                else:
                    key = a.message()
                    if key not in posted:
                        break  # the peer has not posted the send yet
                    clock[r] = max(start, posted[key]) + p2p_s
                    comm[r] += clock[r] - start
                events.append(Event(r, a, start, clock[r]))
                pos[r] += 1
                progressed = True
    return _result(p, clock, stream, busy, comm, events)


def _simulate_irecv(per_rank: Sequence[Sequence[Action]], fwd_s: Sequence[float],
                    bwd_s: Sequence[float], p2p_s: float, reduce_s: float, send_s: float,
                    overhead_s: float, prefetch: int | None,
                    wgt_s: Sequence[float] | None = None) -> SimResult:
    """comm="irecv": non-blocking sender (busy send_s); receives pre-posted, waited for by
    the consuming compute."""
    p, v, m = infer_dims(per_rank)
    dur = _compute_times(per_rank, fwd_s, bwd_s, wgt_s, p * v)
    if min(p2p_s, reduce_s, send_s, overhead_s) < 0:
        raise ValueError(f"simulate: p2p_s={p2p_s}, reduce_s={reduce_s}, send_s={send_s}, "
                         f"overhead_s={overhead_s} must all be ≥ 0")
    if prefetch is not None and prefetch < 0:
        raise ValueError(f"simulate: prefetch={prefetch} must be ≥ 0 or None (post all)")
    C = p * v
    recvs = [[n for n, a in enumerate(acts) if a.kind.startswith("RECV")] for acts in per_rank]
    remote = [{per_rank[r][n].message(): per_rank[r][n] for n in recvs[r]} for r in range(p)]
    pos, clock, stream, nxt = [0] * p, [0.0] * p, [0.0] * p, [0] * p
    busy, comm = [0.0] * p, [0.0] * p
    events: list[Event] = []
    sent: dict[tuple[str, int, int], float] = {}     # message -> its isend was posted
    post: dict[tuple[str, int, int], float] = {}     # message -> its irecv was posted
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            acts = per_rank[r]
            while pos[r] < len(acts):
                n, a = pos[r], acts[pos[r]]
                reach = clock[r] + (overhead_s if n and a.kind in ("F", "B", "W", "SEND_F",
                                                                   "SEND_B") else 0.0)
                ahead = len(acts) if prefetch is None else prefetch
                while nxt[r] < len(recvs[r]) and recvs[r][nxt[r]] <= n + ahead:
                    post.setdefault(acts[recvs[r][nxt[r]]].message(), clock[r])
                    nxt[r] += 1
                if a.kind in dur:
                    need = ("F", a.chunk - 1, a.mb) if a.kind == "F" else ("B", a.chunk + 1,
                                                                            a.mb)
                    start = reach
                    if a.kind != "W" and need in remote[r] and 0 <= need[1] < C:
                        if need not in sent:
                            break  # the peer has not posted the send yet
                        arrive = max(post[need], sent[need]) + p2p_s
                        start = max(reach, arrive)
                        comm[r] += start - reach
                        events.append(Event(r, remote[r][need], reach, start))
                    d = dur[a.kind][a.chunk]
                    clock[r] = start + d
                    busy[r] += d
                    events.append(Event(r, a, start, clock[r]))
                elif a.kind == "REDUCE":
                    s0 = max(reach, stream[r])
                    stream[r] = s0 + reduce_s
                    events.append(Event(r, a, s0, stream[r]))
                elif a.kind.startswith("SEND"):
                    clock[r] = reach + send_s
                    sent[a.message()] = clock[r]
                    comm[r] += send_s
                    events.append(Event(r, a, reach, clock[r]))
                # RECV: posted above (at the latest now); its wait belongs to the consumer
                pos[r] += 1
                progressed = True
    return _result(p, clock, stream, busy, comm, events)


def fit_measured(events: Sequence[Sequence], p: int, v: int, comm: str = "isend") -> dict:
    """Per-chunk mean forward/backward seconds, p2p_s, send_s and overhead_s from a measured
    timeline (`(rank, action, start_s, end_s)` as the runtime records), for
    `simulate(..., comm=comm, **fit)`. A zero-bubble timeline (W events) also gives wgt_s (mean
    W per chunk), and bwd_s is then the mean B + mean W (simulate's whole backward).

    comm="irecv" (pre-posted receives; a RECV event is the consumer's wait): p2p_s is the
    median of (wait end − matching send end) over the waits that began before their send had
    ended (the latency a rank waiting for a message sees); 0 if no receive ever waited.

    p2p_s is the median duration of the receives that did not wait (the sender's recorded send
    had ended before the receive began; the quickest receive if none), send_s the mean send
    duration, overhead_s the mean gap between consecutive actions of a rank.
    """
    from autopar.schedules import parse_action
    evs = [(int(r), a if isinstance(a, Action) else parse_action(str(a)), float(s), float(e))
           for r, a, s, e in events]
    C = p * v
    fwd, bwd, wgt = [], [], []
    has_w = any(a.kind == "W" for _, a, _, _ in evs)
    for c in range(C):
        for kind, out in (("F", fwd), ("B", bwd)) + ((("W", wgt),) if has_w else ()):
            d = [e - s for _, a, s, e in evs if a.kind == kind and a.chunk == c]
            if not d:
                raise ValueError(f"fit_measured: no {kind} event of chunk {c}; the timeline "
                                 f"does not cover the p·v={C} chunks")
            out.append(sum(d) / len(d))
    if has_w:  # bwd_s is the whole backward (B + W) for simulate
        bwd = [b + w for b, w in zip(bwd, wgt)]
    sent = {a.message(): e for _, a, s, e in evs if a.kind.startswith("SEND")}
    if comm not in ("isend", "irecv"):
        raise ValueError(f"fit_measured: comm={comm!r}; the runtime records 'isend' "
                         f"(async_recv=False) or 'irecv' (its default) timelines")
    ready = sorted(e - s for _, a, s, e in evs
                   if a.kind.startswith("RECV") and sent.get(a.message(), float("inf")) <= s)
    allr = sorted(e - s for _, a, s, e in evs if a.kind.startswith("RECV"))
    # no receive found its message already there: the quickest receive bounds the transfer
    p2p = ready[len(ready) // 2] if ready else (allr[0] if allr else 0.0)
    if comm == "irecv":
        lat = sorted(max(0.0, e - sent[a.message()]) for _, a, s, e in evs
                     if a.kind.startswith("RECV") and a.message() in sent
                     and s < sent[a.message()])
        p2p = lat[len(lat) // 2] if lat else 0.0
    sends = [e - s for _, a, s, e in evs if a.kind.startswith("SEND")]
    gaps = []
    for r in range(p):
        mine = sorted((s, e) for rr, _, s, e in evs if rr == r)
        gaps += [max(0.0, b[0] - a[1]) for a, b in zip(mine, mine[1:])]
    fit = {"fwd_s": fwd, "bwd_s": bwd, "p2p_s": p2p,
           "send_s": sum(sends) / len(sends) if sends else 0.0,
           "overhead_s": sum(gaps) / len(gaps) if gaps else 0.0}
    if has_w:
        fit["wgt_s"] = wgt
    return fit


def measured_idle_fraction(events: Sequence[Sequence], p: int) -> tuple[float, ...]:
    """Per rank: 1 − (its F/B/W time) / (the step's span, first start to last end over all
    ranks) — the measured counterpart of SimResult.idle_fraction."""
    evs = [(int(r), str(a), float(s), float(e)) for r, a, s, e in events]
    t0 = min(s for _, _, s, _ in evs)
    span = max(e for *_, e in evs) - t0
    busy = [0.0] * p
    for r, a, s, e in evs:
        if a[0] in "FBW":
            busy[r] += e - s
    return tuple(1.0 - b / span if span else 0.0 for b in busy)


def _result(p: int, clock: list[float], stream: list[float], busy: list[float],
            comm: list[float], events: list[Event]) -> SimResult:
    """The step ends when the last rank's compute or reduction stream does; idle = the rest."""
    makespan = max(clock + stream)
    idle = [makespan - b for b in busy]
    total_busy = sum(busy)
    return SimResult(
        makespan_s=makespan, busy_s=tuple(busy), idle_s=tuple(idle), p2p_s=tuple(comm),
        bubble_fraction=1.0 - total_busy / (p * makespan) if makespan else 0.0,
        bubble_over_compute=sum(idle) / total_busy if total_busy else 0.0,
        events=tuple(sorted(events, key=lambda e: (e.rank, e.start_s, e.end_s))))
