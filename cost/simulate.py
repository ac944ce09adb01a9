"""Time a pipeline schedule: the same per-rank action lists the runtime executes.

Semantics (the same as `autopar.schedules.validate` and the gloo runtime):
- each rank runs its list in order, one action at a time;
- F{c}.{i} / B{c}.{i} take fwd_s[c] / bwd_s[c] seconds and start as soon as the rank reaches
  them (their inputs were received by earlier actions of the same list);
- blocking=True (default; gloo's blocking send/recv, what the validator assumes): a send and
  its matching receive are a rendezvous: the transfer starts when both ranks have reached them,
  takes p2p_s, and both ranks are blocked until it ends;
- blocking=False (asynchronous isend, as NCCL runtimes do): a send never blocks; the data
  arrives p2p_s after the send is issued and the receive waits for that arrival. The papers'
  bubble formulas assume this; under rendezvous a rank may also wait for its peer to finish a
  compute (interleaved 1F1B loses some time this way when compute edges of neighbours never
  line up);
- R{c} (REDUCE) is asynchronous: it is queued on the rank's own communication stream when the
  rank reaches it, takes reduce_s, and never blocks compute; the step ends when the last
  compute, transfer or reduction ends.

Definitions in `SimResult`:
- busy_s[r]: compute (F and B) time of rank r; idle_s[r] = makespan_s − busy_s[r] (waiting
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


def _per_chunk(name: str, values: Sequence[float], C: int) -> list[float]:
    vals = list(values)
    if len(vals) != C:
        raise ValueError(f"simulate: {name} has {len(vals)} entries; the schedule has {C} chunks "
                         f"(p·v), one time per chunk is needed")
    if any(x < 0 for x in vals):
        raise ValueError(f"simulate: {name}={vals} has a negative time")
    return vals


def simulate(per_rank: Sequence[Sequence[Action]], fwd_s: Sequence[float],
             bwd_s: Sequence[float], p2p_s: float = 0.0, reduce_s: float = 0.0, *,
             blocking: bool = True) -> SimResult:
    """Event-simulate `per_rank` (validated first) with per-chunk micro-batch times."""
    p, v, m = infer_dims(per_rank)
    validate(per_rank, p, v, m)
    fwd, bwd = _per_chunk("fwd_s", fwd_s, p * v), _per_chunk("bwd_s", bwd_s, p * v)
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
                if a.kind in ("F", "B"):
                    dur = (fwd if a.kind == "F" else bwd)[a.chunk]
                    events.append(Event(r, a, clock[r], clock[r] + dur))
                    clock[r] += dur
                    busy[r] += dur
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
    makespan = max(clock + stream)
    idle = [makespan - b for b in busy]
    total_busy = sum(busy)
    return SimResult(
        makespan_s=makespan, busy_s=tuple(busy), idle_s=tuple(idle), p2p_s=tuple(comm),
        bubble_fraction=1.0 - total_busy / (p * makespan) if makespan else 0.0,
        bubble_over_compute=sum(idle) / total_busy if total_busy else 0.0,
        events=tuple(sorted(events, key=lambda e: (e.rank, e.start_s, e.end_s))))
