"""Time a pipeline schedule: the same per-rank action lists the runtime executes.

Semantics (the same as `autopar.schedule_checks.validate` and the gloo runtime):
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
  posts an isend right after the compute that produced the message (wherever the list places
  its SEND: `autopar.schedules.eager_sends`), is busy for send_s seconds (copy + enqueue) and
  goes on; gloo moves the bytes
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

One event loop (`_run`) times every mode: it runs each rank down its list until it must
wait on a message, times computes and reductions itself, and leaves the rest to the mode's
rule (a `_CommRule`): the dispatch gap before an action, what a SEND and a RECV do (or that
the rank must wait there), and when a compute's input has arrived.

Events are `Event(rank, action, start_s, end_s)`, one per action (a transfer appears on both
ranks with the same interval); `autopar.timeline.draw_timeline` draws them, and the runtime
records measured events in the same form.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from autopar.schedule_checks import infer_dims, validate
from autopar.schedules import Action, eager_sends, parse_action


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

    comm: "blocking" | "async" | "isend" | "irecv" (see the module docstring); None takes it
    from `blocking` ("blocking" when True, "async" when False). send_s and overhead_s apply to
    "isend" and "irecv", prefetch to "irecv" only. wgt_s: per chunk, the weight-gradient part
    of bwd_s (used only by lists with W actions; default bwd_s / 2). check=False skips the
    validation (autopar.schedule_checks.validate) for lists already validated, e.g. the same lists
    timed with many different chunk times (cost/layout.py); an invalid list is then not caught
    and simulates to nonsense (the simulation still ends). Why this size: the lists and the
    per-chunk times, then one keyword per communication model knob (keyword-only, defaulted).
    """
    if check:
        validate(per_rank, *infer_dims(per_rank))
    if comm is None:
        comm = "blocking" if blocking else "async"
    if comm not in COMM_MODES:
        raise ValueError(f"simulate: comm={comm!r} is not one of {COMM_MODES}; use 'isend' for "
                         f"the gloo runtime (async send, blocking receive)")
    p, v, _ = infer_dims(per_rank)
    dur = _compute_times(per_rank, fwd_s, bwd_s, wgt_s, p * v)
    rule = _comm_rule(comm, per_rank, p * v, p2p_s=p2p_s, reduce_s=reduce_s, send_s=send_s,
                      overhead_s=overhead_s, prefetch=prefetch)
    return _run(per_rank, dur, reduce_s, rule)


# ----- the event loop and the communication rules it is run with ---------------------------
@dataclass
class _Ranks:
    """Where each rank is: its position in its list, its clock, the end of its reduction
    stream, its compute (busy) and transfer (comm) seconds so far; the events so far."""
    pos: list[int]
    clock: list[float]
    stream: list[float]
    busy: list[float]
    comm: list[float]
    events: list[Event]

    @classmethod
    def at_start(cls, p: int) -> "_Ranks":
        return cls([0] * p, [0.0] * p, [0.0] * p, [0.0] * p, [0.0] * p, [])


def _run(per_rank: Sequence[Sequence[Action]], dur: dict[str, list[float]], reduce_s: float,
         rule: "_CommRule") -> SimResult:
    """Run every rank down its list, each as far as it can before it waits on a message, until
    no rank moves. Computes and reductions are timed here; sends, receives and the wait of a
    compute for its input by `rule`."""
    p = len(per_rank)
    st = _Ranks.at_start(p)
    pos, clock, stream, busy, events = st.pos, st.clock, st.stream, st.busy, st.events
    reached, gap_s, input_ready_s = rule.reached, rule.gap_s, rule.input_ready_s  # (hot loop)
    eager = rule.eager
    early = [set(e.values()) for e in eager]
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            acts = per_rank[r]
            while pos[r] < len(acts):
                n, a = pos[r], acts[pos[r]]
                reached(st, r, n)
                if n in early[r]:  # sent right after its compute (eager_sends)
                    pos[r] += 1
                    continue
                start = clock[r] + gap_s(n, a)
                if a.kind in dur:
                    start = input_ready_s(st, r, a, start)
                    if start is None:
                        break  # its input has not been sent yet
                    d = dur[a.kind][a.chunk]
                    clock[r] = start + d
                    busy[r] += d
                    events.append(Event(r, a, start, clock[r]))
                    if n in eager[r]:
                        send = acts[eager[r][n]]
                        rule.send(st, r, send, clock[r] + gap_s(eager[r][n], send))
                elif a.kind == "REDUCE":  # queued on the rank's own stream: never blocks
                    begin = max(start, stream[r])
                    stream[r] = begin + reduce_s
                    clock[r] = start  # the rank pays only its dispatch gap
                    events.append(Event(r, a, begin, stream[r]))
                elif not (rule.send if a.kind.startswith("SEND") else rule.recv)(st, r, a, start):
                    break  # the peer has not got to its side of the message yet
                pos[r] += 1
                progressed = True
    return _result(st)


class _CommRule:
    """How one comm mode times a rank's sends and receives (send / recv: False while the rank
    must wait for its peer, else it moves the clocks and records the events). The defaults:
    no dispatch gap between actions, and a compute never waits for its input (the RECV before
    it did)."""

    def __init__(self, per_rank: Sequence[Sequence[Action]], p2p_s: float) -> None:
        self.per_rank, self.p2p_s = per_rank, p2p_s
        # per rank: compute position -> its later SEND's, sent at the compute's end (modes
        # whose sends never block and are issued by the executor right after the compute)
        self.eager: list[dict[int, int]] = [{} for _ in per_rank]

    def gap_s(self, n: int, a: Action) -> float:
        """Dispatch time between a rank's action n - 1 and action n (`a`)."""
        return 0.0

    def reached(self, st: _Ranks, r: int, n: int) -> None:
        """Rank r is at its action n (again, while it waits there)."""

    def input_ready_s(self, st: _Ranks, r: int, a: Action, start: float) -> float | None:
        """When compute `a`, ready at `start`, may begin; None while its input is unsent."""
        return start

    def send(self, st: _Ranks, r: int, a: Action, start: float) -> bool:
        raise NotImplementedError

    def recv(self, st: _Ranks, r: int, a: Action, start: float) -> bool:
        raise NotImplementedError


class _Rendezvous(_CommRule):
    """comm="blocking": a send and its receive start when both ranks have reached them, take
    p2p_s, and block both ranks until they end."""

    def send(self, st: _Ranks, r: int, a: Action, start: float) -> bool:
        q = a.peer
        acts = self.per_rank[q]
        b = acts[st.pos[q]] if st.pos[q] < len(acts) else None
        if b is None or not b.is_comm or b.peer != r or b.message() != a.message():
            return False
        begin = max(st.clock[r], st.clock[q])
        st.clock[r] = st.clock[q] = begin + self.p2p_s
        st.comm[r] += self.p2p_s
        st.comm[q] += self.p2p_s
        st.events += [Event(r, a, begin, st.clock[r]), Event(q, b, begin, st.clock[q])]
        st.pos[q] += 1  # the peer's side is done too
        return True

    recv = send


class _AsyncSend(_CommRule):
    """comm="async": a send never blocks and its data arrives p2p_s after it is issued; the
    receive waits for that arrival."""

    def __init__(self, per_rank: Sequence[Sequence[Action]], p2p_s: float) -> None:
        super().__init__(per_rank, p2p_s)
        self.arrival: dict[tuple[str, int, int], float] = {}

    def send(self, st: _Ranks, r: int, a: Action, start: float) -> bool:
        self.arrival[a.message()] = start + self.p2p_s
        st.events.append(Event(r, a, start, self.arrival[a.message()]))
        return True

    def recv(self, st: _Ranks, r: int, a: Action, start: float) -> bool:
        arrive = self.arrival.get(a.message())
        if arrive is None:
            return False
        begin = max(start, arrive - self.p2p_s)
        st.comm[r] += max(0.0, arrive - begin)
        st.clock[r] = max(start, arrive)
        st.events.append(Event(r, a, begin, st.clock[r]))
        return True


class _PostedSend(_CommRule):
    """comm="isend": the sender is busy send_s posting its isend and goes on; the receive ends
    p2p_s after both the receive and the send are posted. overhead_s before every action but
    a rank's first."""

    def __init__(self, per_rank: Sequence[Sequence[Action]], p2p_s: float, send_s: float,
                 overhead_s: float) -> None:
        super().__init__(per_rank, p2p_s)
        self.send_s, self.overhead_s = send_s, overhead_s
        self.sent: dict[tuple[str, int, int], float] = {}  # message -> its isend was posted
        self.eager = [eager_sends(acts) for acts in per_rank]

    def gap_s(self, n: int, a: Action) -> float:
        return self.overhead_s if n else 0.0

    def send(self, st: _Ranks, r: int, a: Action, start: float) -> bool:
        st.clock[r] = start + self.send_s
        self.sent[a.message()] = st.clock[r]
        st.comm[r] += self.send_s
        st.events.append(Event(r, a, start, st.clock[r]))
        return True

    def recv(self, st: _Ranks, r: int, a: Action, start: float) -> bool:
        sent = self.sent.get(a.message())
        if sent is None:
            return False
        st.clock[r] = max(start, sent) + self.p2p_s
        st.comm[r] += st.clock[r] - start
        st.events.append(Event(r, a, start, st.clock[r]))
        return True


# the actions the executor dispatches from Python under comm="irecv" (its RECVs were posted
# earlier, its REDUCEs are queued on another stream)
_DISPATCHED = ("F", "B", "W", "SEND_F", "SEND_B")


class _PrepostedRecv(_PostedSend):
    """comm="irecv": sends as in "isend"; each receive is posted `prefetch` actions ahead of
    its RECV (None: all at the start) and costs nothing there; the compute that consumes it
    waits until max(recv posted, send posted) + p2p_s. overhead_s before dispatched actions."""

    def __init__(self, per_rank: Sequence[Sequence[Action]], p2p_s: float, send_s: float,
                 overhead_s: float, prefetch: int | None, num_chunks: int) -> None:
        super().__init__(per_rank, p2p_s, send_s, overhead_s)
        self.prefetch, self.num_chunks = prefetch, num_chunks
        self.recvs = [[n for n, a in enumerate(acts) if a.kind.startswith("RECV")]
                      for acts in per_rank]
        self.remote = [{acts[n].message(): acts[n] for n in mine}
                       for acts, mine in zip(per_rank, self.recvs)]
        self.next = [0] * len(per_rank)                      # per rank: next receive to post
        self.posted: dict[tuple[str, int, int], float] = {}  # message -> its irecv was posted

    def gap_s(self, n: int, a: Action) -> float:
        return self.overhead_s if n and a.kind in _DISPATCHED else 0.0

    def reached(self, st: _Ranks, r: int, n: int) -> None:
        acts, mine = self.per_rank[r], self.recvs[r]
        ahead = len(acts) if self.prefetch is None else self.prefetch
        while self.next[r] < len(mine) and mine[self.next[r]] <= n + ahead:
            self.posted.setdefault(acts[mine[self.next[r]]].message(), st.clock[r])
            self.next[r] += 1

    def input_ready_s(self, st: _Ranks, r: int, a: Action, start: float) -> float | None:
        if a.kind == "W":  # its input is the rank's own B
            return start
        need = ("F", a.chunk - 1, a.mb) if a.kind == "F" else ("B", a.chunk + 1, a.mb)
        if need not in self.remote[r] or not 0 <= need[1] < self.num_chunks:
            return start  # produced on this rank (or the first / last chunk's own input)
        if need not in self.sent:
            return None
        arrive = max(self.posted[need], self.sent[need]) + self.p2p_s
        begin = max(start, arrive)
        st.comm[r] += begin - start
        st.events.append(Event(r, self.remote[r][need], start, begin))  # the wait, as its RECV
        return begin

    def recv(self, st: _Ranks, r: int, a: Action, start: float) -> bool:
        return True  # posted by `reached`; the consuming compute waits for it


def _comm_rule(comm: str, per_rank: Sequence[Sequence[Action]], num_chunks: int, *,
               p2p_s: float, reduce_s: float, send_s: float, overhead_s: float,
               prefetch: int | None) -> _CommRule:
    """The rule of mode `comm`, its times checked (those it uses, with reduce_s)."""
    if comm in ("blocking", "async"):
        _check_non_negative(p2p_s=p2p_s, reduce_s=reduce_s)
        return (_Rendezvous if comm == "blocking" else _AsyncSend)(per_rank, p2p_s)
    _check_non_negative(p2p_s=p2p_s, reduce_s=reduce_s, send_s=send_s, overhead_s=overhead_s)
    if comm == "isend":
        return _PostedSend(per_rank, p2p_s, send_s, overhead_s)
    if prefetch is not None and prefetch < 0:
        raise ValueError(f"simulate: prefetch={prefetch} must be ≥ 0 or None (post all)")
    return _PrepostedRecv(per_rank, p2p_s, send_s, overhead_s, prefetch, num_chunks)


def _check_non_negative(**times: float) -> None:
    if min(times.values()) < 0:
        listed = ", ".join(f"{name}={value}" for name, value in times.items())
        raise ValueError(f"simulate: {listed} must {'all ' if len(times) > 2 else ''}be ≥ 0")


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


def _result(st: _Ranks) -> SimResult:
    """The step ends when the last rank's compute or reduction stream does; idle = the rest."""
    p, busy = len(st.pos), st.busy
    makespan = max(st.clock + st.stream)
    idle = [makespan - b for b in busy]
    total_busy = sum(busy)
    return SimResult(
        makespan_s=makespan, busy_s=tuple(busy), idle_s=tuple(idle), p2p_s=tuple(st.comm),
        bubble_fraction=1.0 - total_busy / (p * makespan) if makespan else 0.0,
        bubble_over_compute=sum(idle) / total_busy if total_busy else 0.0,
        events=tuple(sorted(st.events, key=lambda e: (e.rank, e.start_s, e.end_s))))
